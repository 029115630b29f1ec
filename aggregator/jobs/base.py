"""The coordinator side of a job kind, and the context a job runs in.

A job kind is a plug-in: a :class:`JobType` validates an analyst's parameters and runs one or
more rounds through :meth:`JobContext.dispatch`, which sends the same task (same task id) to
every eligible site, enforces deadlines, resends to a site that reconnects within the
deadline (its ledger replays instead of charging twice), records each site's outcome, and
enforces the quorum. The job then combines the releases -- post-processing only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from dpfed.aggregator.federation import Federation
from dpfed.aggregator.registry import SiteDisconnected, SiteRegistry, SiteSession
from dpfed.common.errors import ProtocolError, QuorumError
from dpfed.common.privacy.accounting import zcdp_to_epsilon
from dpfed.common.transport.protocol import JobSpec, Refusal, SiteOutcome, Task, TaskResult
from dpfed.common.transport.wire import task_to_bytes

log = logging.getLogger(__name__)

#: Extra seconds the coordinator waits past a task's deadline for a result in flight (a site
#: never charges a task whose deadline has passed, so this only covers the transfer).
DEADLINE_GRACE_S = 0.5
#: Default cap on one site's answer to one task when the job kind does not give a tighter one.
DEFAULT_MAX_RESULT_BYTES = 64 << 20


@dataclass(frozen=True)
class JobOutput:
    """What a job produces: arrays and metadata for the result file, and a short summary."""

    arrays: Mapping[str, np.ndarray]
    metadata: Mapping[str, Any]
    summary: Mapping[str, Any] = field(default_factory=dict)


#: How the reason of a site left out before a job's first round begins (see
#: :meth:`JobContext.refuse_over_budget`).
_LEFT_OUT_FOR_BUDGET = "budget_exceeded: the job needs"


class JobContext:
    """Everything a running job may use; created by the job manager."""

    def __init__(self, *, job_id: str, spec: JobSpec, params: Mapping[str, Any],
                 federation: Federation, registry: SiteRegistry,
                 emit: Callable[[str, str, float], None], wait_for_quorum_s: float = 0.0,
                 resumed: bool = False,
                 analyst_id: str = "",
                 earlier_outcomes: Collection[SiteOutcome] = (),
                 save_outcomes: Callable[[tuple[SiteOutcome, ...]], object] | None = None
                 ) -> None:
        self.job_id = job_id
        self.spec = spec
        self.params = params
        self.federation = federation
        self.registry = registry
        self.emit = emit
        self.outcomes: dict[str, SiteOutcome] = {}
        self.wait_for_quorum_s = wait_for_quorum_s
        self.resumed = resumed
        self._left_out: set[str] = set()
        self._required_accountant: tuple[str, str] | None = None
        #: The submitting analyst's id (from their certificate); sent with every task.
        self.analyst_id = analyst_id
        #: Targets of the current round that are disconnected and awaited back.
        self._absent: set[str] = set()
        self._changed = asyncio.Event()
        #: The site outcomes the store held for a resumed job (what its first run decided).
        self._earlier = tuple(earlier_outcomes)
        #: Writes the outcomes to the job store at once (decisions a resumed job must keep).
        self._save_outcomes = save_outcomes

    @property
    def min_sites(self) -> int:
        """The job's quorum."""
        return self.spec.min_sites or self.federation.min_sites

    @property
    def deadline_s(self) -> float:
        """Per-task deadline in seconds."""
        return self.spec.deadline_seconds or self.federation.task_deadline_s

    def refuse_over_budget(self, rho: float | None = None) -> None:
        """Before a multi-round job's first round, leave out sites that cannot pay for all of it.

        A site whose last reported budget has too little left for the whole job would refuse
        a later round after paying for the earlier ones (under secure aggregation, after its
        peers paid for the aborted sum too); it is recorded as refused now and sent no round.
        A ``basic`` site needs the job's (epsilon, delta) left. A ``zcdp`` site is checked when
        the job states ``rho``, an upper bound on the rho all its rounds charge together: its
        spent rho plus ``rho``, converted at its delta cap, must stay within its epsilon cap.
        The decision is written to the job store before the first round, and a resumed job
        re-applies it instead of deciding again (its other sites already paid for the rounds it
        replays, and a secure sum re-sent with a different set of participants would be refused
        as a changed task). The site's ledger stays the authority.
        """
        if self.resumed:
            for o in self._earlier:
                if o.status == "refused" and o.reason.startswith(_LEFT_OUT_FOR_BUDGET):
                    self._left_out.add(o.site_id)
                    self.outcomes[o.site_id] = o
            return
        eps, delta = self.spec.epsilon, self.spec.delta
        for s in self.registry.connected():
            b = s.hello.budget
            reason = None
            if b is None:
                continue
            if b.accountant == "basic" and (eps > b.epsilon_remaining * (1 + 1e-9)
                                            or delta > b.delta_remaining * (1 + 1e-9)):
                reason = (f"{_LEFT_OUT_FOR_BUDGET} epsilon={eps:g}, delta={delta:g} "
                          f"over all its rounds; the site reports {b.epsilon_remaining:g}, "
                          f"{b.delta_remaining:g} left")
            elif b.accountant == "zcdp" and rho is not None:
                after = zcdp_to_epsilon(b.rho_spent + rho, b.delta_cap)
                if after > b.epsilon_cap * (1 + 1e-9):
                    reason = (f"{_LEFT_OUT_FOR_BUDGET} rho={rho:.4g} over all its "
                              f"rounds; with the site's rho {b.rho_spent:.4g} already spent "
                              f"that is epsilon {after:.4g} at delta {b.delta_cap:g}, above its "
                              f"cap {b.epsilon_cap:g}")
            if reason is not None:
                self._left_out.add(s.site_id)
                self.outcomes[s.site_id] = SiteOutcome(s.site_id, "refused", reason,
                                                       row_count=s.hello.row_count)
        if self._left_out and self._save_outcomes is not None:
            self._save_outcomes(tuple(self.outcomes[s] for s in sorted(self.outcomes)))

    def require_accountant(self, accountant: str, why: str) -> None:
        """Send this job's rounds only to sites whose ledger uses ``accountant``.

        For a job whose calibration is only economical under one accountant (a ``zcdp``
        composed synth job would charge a ``basic`` site the sum of its rounds' epsilons).
        Checked whenever a round picks its sites, so a site that connects late or after a
        coordinator restart is checked too: it is recorded as refused (naming ``why``), sent
        nothing and charged nothing.
        """
        self._required_accountant = (accountant, why)

    def _skipped(self, s: SiteSession, only: Collection[str] | None) -> bool:
        """Whether a connected site is simply not part of this round (nothing to record)."""
        if (self.spec.sites and s.site_id not in self.spec.sites) or s.site_id in self._left_out:
            return True
        earlier = self.outcomes.get(s.site_id)
        if earlier is not None and earlier.status != "ok":
            return True  # failed an earlier round of this job: later rounds go without it
        return only is not None and s.site_id not in only

    def _refusal(self, s: SiteSession, kind: str | None) -> str | None:
        """Why this job cannot send the site a ``kind`` task (None: it can)."""
        if self._required_accountant is not None:
            accountant, why = self._required_accountant
            b = s.hello.budget
            if b is None or b.accountant != accountant:
                reported = "no budget" if b is None else f"a {b.accountant!r} accountant"
                return (f"this job needs sites whose ledger uses the {accountant!r} "
                        f"accountant ({why}); the site reports {reported}")
        if kind is not None and kind not in s.hello.allowed_kinds:
            return f"the site's policy does not allow {kind!r} jobs"
        return None

    def _targets(self, kind: str, only: Collection[str] | None = None) -> list[str]:
        targets = []
        for s in self.registry.connected():
            if self._skipped(s, only):
                continue
            reason = self._refusal(s, kind)
            if reason is not None:
                self.outcomes[s.site_id] = SiteOutcome(s.site_id, "refused", reason,
                                                       row_count=s.hello.row_count)
                continue
            targets.append(s.site_id)
        return targets

    async def wait_for_sites(self, kind: str | None = None,
                             only: Collection[str] | None = None) -> None:
        """For a resumed job, wait (up to the resume wait) until the quorum has reconnected.

        A fresh job starts with the sites that are connected; a job resumed after a
        coordinator restart gives them ``resume_wait_s`` to dial back in first. Only sites
        the round could use count towards the quorum (a site this job refuses, e.g. for its
        accountant, does not).
        """
        if self.wait_for_quorum_s > 0:
            await self.registry.wait_for_count(
                self.min_sites, self.wait_for_quorum_s,
                eligible=lambda s: not self._skipped(s, only) and self._refusal(s, kind) is None)

    async def dispatch(self, kind: str, params: Mapping[str, Any], *, round_name: str,
                       arrays: Mapping[str, np.ndarray] | None = None,
                       check_result: Callable[[TaskResult], None] | None = None,
                       progress: tuple[float, float] = (0.0, 0.9),
                       epsilon: float | None = None, delta: float | None = None,
                       only: Collection[str] | None = None,
                       max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
                       quorum: int | None = None,
                       ) -> dict[str, TaskResult]:
        """Run one round: the same task at every eligible site; return the ok results.

        ``epsilon`` / ``delta`` are this round's share of the job's budget (default: all of
        it, for one-round jobs); a site's reported spend is checked against them. The task
        id is ``<job id>/<round_name>``, so a resumed job re-sends the same ids and every site
        replays its ledger's stored answer instead of charging again. A site that did not
        answer an earlier round of this job successfully (or was left out by
        :meth:`refuse_over_budget`) is not sent later rounds; each site's outcome accumulates
        its spend over the job's rounds. ``only`` restricts the round to these sites (e.g. the
        participants of a secure sum). ``max_result_bytes`` caps each site's serialized answer
        (give the kind's expected size plus a margin). ``quorum`` overrides ``min_sites`` for
        a round whose answers are each site's own (e.g. an optional per-site summary), so
        that what the answering sites paid for is not discarded. ``check_result`` raises
        :class:`ProtocolError` for a release no honest site could have sent (see
        ``dpfed.aggregator.jobs.validators``); that site's outcome is "error".

        The round ends when every target answered, when the deadline (plus a short grace for
        a transfer in flight) passed, or at once when the quorum is met and every target still
        outstanding is disconnected (a dead site is not awaited until the deadline).

        Raises
        ------
        QuorumError
            When fewer than ``min_sites`` sites are eligible, or answered successfully.
        """
        min_sites = self.min_sites if quorum is None else quorum
        if quorum is None:
            await self.wait_for_sites(kind, only)
        targets = self._targets(kind, only)
        if len(targets) < min_sites:
            refused = "; ".join(f"{o.site_id}: {o.reason}" for o in self.outcomes.values()
                                if o.status == "refused")
            raise QuorumError(
                f"{len(targets)} eligible site(s) connected ({', '.join(targets) or 'none'}); "
                f"this job needs min_sites={min_sites}" + (f". {refused}" if refused else ""))
        round_eps = self.spec.epsilon if epsilon is None else epsilon
        round_delta = self.spec.delta if delta is None else delta
        task = Task(f"{self.job_id}/{round_name}", self.job_id, kind, round_eps,
                    round_delta, dict(params), dict(arrays or {}), self.analyst_id)
        payload = task_to_bytes(task)
        started, deadline = time.monotonic(), time.time() + self.deadline_s
        lo, hi = progress
        self.emit("dispatch", f"round {round_name!r}: task sent to {len(targets)} site(s) "
                  f"({', '.join(targets)}); deadline {self.deadline_s:g}s", lo)
        done = 0
        results: dict[str, TaskResult] = {}

        def record(outcome: SiteOutcome, result: TaskResult | None) -> None:
            nonlocal done
            self.outcomes[outcome.site_id] = _with_earlier_spend(
                outcome, self.outcomes.get(outcome.site_id))
            if result is not None:
                results[outcome.site_id] = result
            done += 1
            log.info("[JobContext.dispatch] job=%s task=%s site=%s outcome=%s %s", self.job_id,
                     task.task_id, outcome.site_id, outcome.status, outcome.reason)
            detail = ("result received" if outcome.status == "ok"
                      else f"{outcome.status}: {outcome.reason}")
            self.emit("site", f"site {outcome.site_id}: {detail} ({done}/{len(targets)})",
                      lo + (hi - lo) * done / len(targets))

        async def one(site_id: str) -> None:
            outcome = await self._run_at_site(site_id, task, payload, deadline, check_result,
                                              max_result_bytes)
            record(*outcome)

        running = {asyncio.ensure_future(one(s)): s for s in targets}
        pending = set(running)
        self._absent.clear()
        try:
            while pending:
                self._changed.clear()
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    finished, _ = await asyncio.wait({*pending, changed},
                                                     return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
                pending -= finished
                for t in finished & set(running):
                    t.result()  # re-raise a bug in one() instead of hiding it
                waiting = {running[t] for t in pending}
                if pending and len(results) >= min_sites and waiting <= self._absent:
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    for site_id in sorted(waiting):
                        record(SiteOutcome(site_id, "disconnected",
                                           "the site disconnected; the round completed without "
                                           "it (every other site had answered)",
                                           row_count=self.outcomes.get(site_id, SiteOutcome(
                                               site_id, "")).row_count), None)
                    pending = set()
        finally:
            for t in pending:
                t.cancel()
        self.registry.metrics.observe_round(kind, time.monotonic() - started,
                                            ok=len(results) >= min_sites)
        if len(results) < min_sites:
            failed = "; ".join(f"{o.site_id}: {o.status} ({o.reason})"
                               for o in self.outcomes.values() if o.status != "ok")
            raise QuorumError(f"only {len(results)} site(s) answered round {round_name!r}; "
                              f"this job needs min_sites={min_sites}. {failed}")
        return results

    async def _wait_for_return(self, site_id: str, remaining: float) -> SiteSession | None:
        """Wait for a disconnected target to come back, marked absent meanwhile."""
        self._absent.add(site_id)
        self._changed.set()
        try:
            return await self.registry.wait_for_site(site_id, remaining)
        finally:
            self._absent.discard(site_id)

    async def _run_at_site(self, site_id: str, task: Task, payload: bytes, deadline: float,
                           check_result: Callable[[TaskResult], None] | None,
                           max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
                           ) -> tuple[SiteOutcome, TaskResult | None]:
        task_id = task.task_id
        rows = 0
        while True:
            remaining = deadline + DEADLINE_GRACE_S - time.time()
            if remaining <= 0:
                return SiteOutcome(site_id, "timeout", "no answer before the deadline",
                                   row_count=rows), None
            session = self.registry.get(site_id)
            if session is None:
                session = await self._wait_for_return(site_id, remaining)
                if session is None:
                    return SiteOutcome(site_id, "disconnected",
                                       "the site disconnected and did not come back before the "
                                       "deadline", row_count=rows), None
            rows = session.hello.row_count
            try:
                answer = await asyncio.wait_for(
                    session.submit(task_id, payload, deadline, max_result_bytes=max_result_bytes),
                    remaining)
            except TimeoutError:
                return SiteOutcome(site_id, "timeout", "no answer before the deadline",
                                   row_count=rows), None
            except SiteDisconnected:
                log.info("[JobContext] site=%s disconnected during %s; will resend if it returns",
                         site_id, task_id)
                continue
            except ProtocolError as exc:
                log.warning("[JobContext] site=%s misbehaved on %s: %s", site_id, task_id, exc)
                return SiteOutcome(site_id, "error", f"invalid result: {exc}",
                                   row_count=rows), None
            if isinstance(answer, Refusal):
                return SiteOutcome(site_id, "refused", f"{answer.code}: {answer.reason}",
                                   row_count=rows), None
            try:
                if answer.task_id != task_id:
                    raise ProtocolError(f"answer for task {answer.task_id!r}, expected {task_id!r}")
                if answer.spend.epsilon > task.epsilon * (1 + 1e-9) or (
                        answer.spend.delta > task.delta * (1 + 1e-9)):
                    raise ProtocolError("the site reports spending more than the task asked for")
                if check_result is not None:
                    check_result(answer)
            except ProtocolError as exc:
                log.warning("[JobContext] site=%s sent an invalid result: %s", site_id, exc)
                return SiteOutcome(site_id, "error", f"invalid result: {exc}",
                                   answer.spend, rows), None
            n = answer.metadata.get("n_rows", rows)
            return SiteOutcome(site_id, "ok", "", answer.spend,
                               int(n) if isinstance(n, int) else rows), answer


def _with_earlier_spend(outcome: SiteOutcome, earlier: SiteOutcome | None) -> SiteOutcome:
    """Return ``outcome`` with the site's spend over all of the job's rounds so far."""
    if earlier is None or earlier.spend is None:
        return outcome
    if outcome.spend is None:
        return dataclasses.replace(outcome, spend=earlier.spend)
    return dataclasses.replace(outcome, spend=earlier.spend + outcome.spend)


class JobType(ABC):
    """One job kind's coordinator side."""

    kind: ClassVar[str]
    #: True when the job may run with delta = 0 (pure epsilon-DP releases, e.g. Laplace, SVT).
    pure_epsilon: ClassVar[bool] = False

    @abstractmethod
    def validate(self, spec: JobSpec, federation: Federation) -> dict[str, Any]:
        """Check an analyst's spec; return the canonical parameters (raises ValidationError)."""

    @abstractmethod
    async def run(self, ctx: JobContext) -> JobOutput:
        """Run the job's rounds and combine the releases (post-processing only)."""
