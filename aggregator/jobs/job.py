"""A running job: the dispatcher every job kind's run asks for releases.

:meth:`Job.release` runs one round and returns one :class:`Pooled` record. Whether the round
travels as per-site noisy answers or as a secure sum is decided here, from the job's
``aggregation`` and the round's kind; a kind's run never tests it. A site-level round sends
the same task (same task id ``<job id>/<round>``) to every eligible site, enforces deadlines,
resends to a site that reconnects within the deadline (its ledger replays instead of
charging twice), checks every answer and enforces the quorum. Before the first charge every
site is checked against every round of the plan (:mod:`dpfed.common.jobs.eligibility`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from dpfed.aggregator.federation import Federation
from dpfed.aggregator.jobs.outgoing import OutgoingTask
from dpfed.aggregator.jobs.secure_rounds import secure_release
from dpfed.aggregator.registry import SiteDisconnected, SiteRegistry, SiteSession
from dpfed.common.errors import ProtocolError, QuorumError
from dpfed.common.jobs.contract import (
    Ask,
    Budget,
    JobKind,
    PlannedRound,
    Pooled,
    Round,
    SumRound,
)
from dpfed.common.jobs.eligibility import exclusion, secure_policy, secure_quorum
from dpfed.common.jobs.params import Params
from dpfed.common.transport.protocol import (
    JobSpec,
    Refusal,
    RefusalCode,
    SiteOutcome,
    SiteStatus,
    Task,
    TaskResult,
)
from dpfed.common.transport.wire import task_to_bytes

log = logging.getLogger(__name__)

P = TypeVar("P", bound=Params)
I = TypeVar("I")  # noqa: E741
V = TypeVar("V")

#: Extra seconds the coordinator waits past a task's deadline for a result in flight (a site
#: never charges a task whose deadline has passed, so this only covers the transfer).
DEADLINE_GRACE_S = 0.5
#: A site holding a task for its data steward's approval is asked again after this many
#: seconds, doubling up to :data:`APPROVAL_POLL_MAX_S`, until it answers or the deadline passes.
APPROVAL_POLL_S = 1.0
APPROVAL_POLL_MAX_S = 10.0
#: The share of a job's progress its rounds take (the rest: start-up and the final combine).
_ROUNDS_START, _ROUNDS_END = 0.05, 0.9


@dataclass(frozen=True)
class JobOutput:
    """What a job produces: arrays and metadata for the result file, and a short summary."""

    arrays: Mapping[str, np.ndarray]
    metadata: Mapping[str, Any]
    summary: Mapping[str, Any] = field(default_factory=dict)


class Job(Generic[P]):
    """Everything a running job may use; created by the job manager.

    A job whose params require an accountant (a job composed in zCDP) runs only at sites
    whose ledger uses it: the others are left out before anything runs, named and uncharged.
    """

    def __init__(self, *, job_id: str, spec: JobSpec, kind: JobKind[P], params: P,
                 federation: Federation, registry: SiteRegistry,
                 emit: Callable[[str, str, float], None], wait_for_quorum_s: float = 0.0,
                 resumed: bool = False, analyst_id: str = "",
                 earlier_outcomes: Collection[SiteOutcome] = (),
                 save_outcomes: Callable[[tuple[SiteOutcome, ...]], object] | None = None
                 ) -> None:
        self.job_id = job_id
        self.spec = spec
        self.kind = kind
        self.params = params
        self.federation = federation
        self.registry = registry
        self._emit = emit
        self.outcomes: dict[str, SiteOutcome] = {}
        self.wait_for_quorum_s = wait_for_quorum_s
        self.resumed = resumed
        #: The submitting analyst's id (from their certificate); sent with every task.
        self.analyst_id = analyst_id
        self.plan: tuple[PlannedRound, ...] = kind.plan(params, spec.epsilon, spec.delta)
        self._accountant = params.required_accountant(spec.epsilon, spec.delta)
        self._left_out: set[str] = set()
        self._admitted: set[str] = set()
        self._started = False
        self._progress = _ROUNDS_START
        #: Targets of the current round that are disconnected and awaited back.
        self._absent: set[str] = set()
        self._changed = asyncio.Event()
        #: The site outcomes the store held for a resumed job (what its first run decided).
        self._earlier = tuple(earlier_outcomes)
        #: Writes the outcomes to the job store at once (decisions a resumed job must keep).
        self._save_outcomes = save_outcomes

    # ------------------------------------------------------------------ facts
    @property
    def min_sites(self) -> int:
        """The job's quorum."""
        return self.spec.min_sites or self.federation.min_sites

    @property
    def deadline_s(self) -> float:
        """Per-task deadline in seconds."""
        return self.spec.deadline_seconds or self.federation.task_deadline_s

    def planned(self, name: str) -> PlannedRound:
        """Return the plan's entry for round ``name``."""
        for r in self.plan:
            if r.name == name:
                return r
        raise KeyError(f"round {name!r} is not in this job's plan")

    def budget(self, name: str) -> Budget:
        """Return what round ``name``'s task carries."""
        r = self.planned(name)
        return Budget(r.epsilon, r.delta, r.rho if r.secure and self.params.zcdp else None)

    def emit(self, stage: str, message: str, progress: float | None = None) -> None:
        """Report progress (``progress`` None: where the rounds have got to)."""
        self._emit(stage, message, self._progress if progress is None else progress)

    def pooled_draws(self, rnd: Round[P, Any, Any]) -> int:
        """Return how many independent noise draws round ``rnd``'s pooled value carries.

        One for a secure sum, one per connected site otherwise.
        """
        return 1 if self.planned(rnd.name).secure else max(1, len(self.registry.connected()))

    def sites_allowing(self, kind: str) -> list[str]:
        """Return connected sites whose policy allows task kind ``kind``."""
        return [s.site_id for s in self.registry.connected() if kind in s.hello.allowed_kinds]

    # ------------------------------------------------------------------ releases
    async def release(self, rnd: Round[P, I, V], inputs: I, *,
                      among: Collection[str] | None = None) -> Pooled[V]:
        """Run round ``rnd`` with ``inputs`` and return its pooled value.

        ``among`` restricts the round to these sites (e.g. those whose earlier releases the
        inputs were computed from). An optional round of the plan needs one answering site,
        and a site that fails it keeps its "ok" outcome (with the failure in its reason); it
        returns an empty record when nobody answered.

        Raises
        ------
        QuorumError
            Fewer eligible or answering sites than the job's quorum (or a secure sum's).
        """
        self._start()
        planned = self.planned(rnd.name)
        budget = rnd.task_budget(self.budget(rnd.name), inputs)
        ask = Ask(self.params, self.federation.schema, inputs, budget)
        index = self.plan.index(planned)
        span = (_ROUNDS_END - _ROUNDS_START) / len(self.plan)
        progress = (_ROUNDS_START + span * index, _ROUNDS_START + span * (index + 1))
        if planned.secure and isinstance(rnd, SumRound):
            pooled = await secure_release(self, rnd, ask, among=among, progress=progress)
        elif planned.optional:
            pooled = await self._optional(rnd, ask, among, progress)
        else:
            pooled = await self._site_level(rnd, ask, among, progress)
        self._progress = progress[1]
        return pooled

    async def _site_level(self, rnd: Round[P, I, V], ask: Ask[P, I],
                          among: Collection[str] | None, progress: tuple[float, float],
                          quorum: int | None = None) -> Pooled[V]:
        request = rnd.request(ask)
        outgoing = OutgoingTask(rnd.name, rnd.task_kind, ask.budget, request.params, request.arrays,
                    request.max_result_bytes, lambda result: rnd.check(result, ask))
        results = await self.dispatch(outgoing, only=among, progress=progress, quorum=quorum)
        value = rnd.pool(results, ask)
        return Pooled(rnd.name, value, ask.budget, _rows(results),
                      {s: r.spend for s, r in results.items()}, results)

    async def _optional(self, rnd: Round[P, I, V], ask: Ask[P, I],
                        among: Collection[str] | None,
                        progress: tuple[float, float]) -> Pooled[V]:
        allowing = set(self.sites_allowing(rnd.task_kind))
        only = [s for s in (among if among is not None else sorted(allowing)) if s in allowing]
        before = dict(self.outcomes)
        try:
            if not only:
                raise QuorumError(f"no site of this job allows {rnd.task_kind!r} tasks")
            pooled = await self._site_level(rnd, ask, only, progress, quorum=1)
        except QuorumError as exc:
            self.emit(rnd.name, f"round {rnd.name!r}: no answer ({exc})")
            pooled = Pooled(rnd.name, rnd.pool({}, ask), ask.budget, {}, {})
        for site_id, earlier in before.items():  # a failed optional round keeps a site "ok"
            now = self.outcomes.get(site_id)
            if earlier.status == SiteStatus.OK and now is not None and now.status != SiteStatus.OK:
                self.outcomes[site_id] = dataclasses.replace(
                    earlier, reason=f"{rnd.name}: {now.status} ({now.reason})",
                    spend=now.spend)
        return pooled

    # ------------------------------------------------------------------ who takes part
    def _start(self) -> None:
        """Before the first round: leave out every site that cannot take part in all rounds.

        A fresh job checks every connected site against the whole plan and refuses itself,
        charging nothing, when fewer than the quorum remain. A resumed job re-applies what its
        first run decided (its sites have since paid for the rounds it replays, so their
        budgets no longer tell).
        """
        if self._started:
            return
        self._started = True
        if self.resumed:
            for o in self._earlier:
                if o.left_out:
                    self._left_out.add(o.site_id)
                    self._admitted.add(o.site_id)
                    self.outcomes[o.site_id] = o
            return
        for s in self.registry.connected():
            if not self.spec.sites or s.site_id in self.spec.sites:
                self._admit(s, self.plan)
        if self._left_out and self._save_outcomes is not None:
            self._save_outcomes(tuple(self.outcomes[s] for s in sorted(self.outcomes)))
        eligible = [s for s in self.registry.connected() if s.site_id in self._admitted
                    and s.site_id not in self._left_out]
        needed = self.min_sites
        if any(r.secure for r in self.plan):
            needed = secure_quorum([secure_policy(s.hello) for s in eligible], self.min_sites)
        if len(eligible) < needed and self.wait_for_quorum_s <= 0:
            raise QuorumError(self._short_of(len(eligible), needed))

    def _admit(self, s: SiteSession, plan: tuple[PlannedRound, ...]) -> None:
        """Check one site against ``plan``; leave it out (recorded, refused) if it fails."""
        self._admitted.add(s.site_id)
        found = exclusion(s.hello, self.kind.name, plan, sums=self.kind.sums,
                          accountant=self._accountant, whole_budget=not self.resumed,
                          study=self.spec.study)
        if found is not None:
            self._left_out.add(s.site_id)
            self.outcomes[s.site_id] = SiteOutcome(s.site_id, SiteStatus.REFUSED, found.reason,
                                                   row_count=s.hello.row_count,
                                                   code=found.code, left_out=True)
            log.info("job=%s site=%s left out: %s", self.job_id, s.site_id, found.reason)

    def _short_of(self, have: int, needed: int) -> str:
        refused = "; ".join(f"{o.site_id}: {o.reason}" for o in self.outcomes.values()
                            if o.status == SiteStatus.REFUSED)
        return (f"{have} eligible site(s) connected; this job needs min_sites={needed}"
                + (f". {refused}" if refused else "") + "; nothing was charged")

    def _skipped(self, s: SiteSession, only: Collection[str] | None) -> bool:
        """Whether a connected site is simply not part of this round (nothing to record)."""
        if (self.spec.sites and s.site_id not in self.spec.sites) or s.site_id in self._left_out:
            return True
        earlier = self.outcomes.get(s.site_id)
        if earlier is not None and earlier.status != SiteStatus.OK:
            return True  # failed an earlier round of this job: later rounds go without it
        return only is not None and s.site_id not in only

    def _remaining_plan(self, round_name: str) -> tuple[PlannedRound, ...]:
        names = [r.name for r in self.plan]
        base = round_name.split("-keys-")[0].split("-sum-")[0]
        return self.plan[names.index(base):] if base in names else self.plan

    def _eligible(self, s: SiteSession, outgoing: OutgoingTask) -> bool:
        """Return whether the site can be sent ``outgoing``.

        A site seen for the first time is admitted against the rest of the plan (recorded as
        refused when it cannot take part).
        """
        if s.site_id not in self._admitted:
            self._admit(s, self._remaining_plan(outgoing.round_name))
            if s.site_id in self._left_out:
                return False
        return outgoing.kind in s.hello.allowed_kinds

    def _targets(self, outgoing: OutgoingTask, only: Collection[str] | None) -> list[str]:
        targets = []
        for s in self.registry.connected():
            if self._skipped(s, only):
                continue
            if not self._eligible(s, outgoing):
                if s.site_id not in self._left_out:
                    self.outcomes[s.site_id] = SiteOutcome(
                        s.site_id, SiteStatus.REFUSED,
                        f"not_allowed: the site's policy does not allow {outgoing.kind!r} jobs",
                        row_count=s.hello.row_count, code=RefusalCode.NOT_ALLOWED)
                continue
            targets.append(s.site_id)
        return targets

    async def wait_for_sites(self, only: Collection[str] | None = None) -> None:
        """For a resumed job, wait (up to the resume wait) until the quorum has reconnected.

        A fresh job starts with the sites that are connected; a job resumed after a
        coordinator restart gives them ``resume_wait_s`` to dial back in first. Only sites
        the round could use count towards the quorum.
        """
        if self.wait_for_quorum_s > 0:
            await self.registry.wait_for_count(
                self.min_sites, self.wait_for_quorum_s,
                eligible=lambda s: not self._skipped(s, only))

    # ------------------------------------------------------------------ one task at every site
    async def dispatch(self, outgoing: OutgoingTask, *, only: Collection[str] | None = None,
                       progress: tuple[float, float] = (0.0, 0.9),
                       quorum: int | None = None) -> dict[str, TaskResult]:
        """Send one task to every eligible site; return the answers that passed the check.

        The task id is ``<job id>/<round name>``, so a resumed job re-sends the same ids and
        every site replays its ledger's stored answer instead of charging again. A site's
        reported spend is checked against the task's (epsilon, delta); each site's outcome
        accumulates its spend over the job's rounds. ``quorum`` overrides ``min_sites`` for a
        round whose answers are each site's own (an optional summary).

        The round ends when every target answered, when the deadline (plus a short grace for
        a transfer in flight) passed, or at once when the quorum is met and every target still
        outstanding is disconnected (a dead site is not awaited until the deadline).

        Raises
        ------
        QuorumError
            When fewer than the quorum are eligible, or answered successfully.
        """
        min_sites = self.min_sites if quorum is None else quorum
        if quorum is None:
            await self.wait_for_sites(only)
        targets = self._targets(outgoing, only)
        if len(targets) < min_sites:
            refused = "; ".join(f"{o.site_id}: {o.reason}" for o in self.outcomes.values()
                                if o.status == SiteStatus.REFUSED)
            raise QuorumError(
                f"{len(targets)} eligible site(s) connected ({', '.join(targets) or 'none'}); "
                f"this job needs min_sites={min_sites}" + (f". {refused}" if refused else ""))
        task = Task(f"{self.job_id}/{outgoing.round_name}", self.job_id, outgoing.kind,
                    outgoing.budget.epsilon, outgoing.budget.delta, dict(outgoing.params),
                    dict(outgoing.arrays), self.analyst_id, self.spec.study)
        payload = await asyncio.to_thread(task_to_bytes, task)  # large params: off the loop
        started, deadline = time.monotonic(), time.time() + self.deadline_s
        lo, hi = progress
        self.emit("dispatch", f"round {outgoing.round_name!r}: task sent to {len(targets)} "
                  f"site(s) ({', '.join(targets)}); deadline {self.deadline_s:g}s", lo)
        done = 0
        results: dict[str, TaskResult] = {}

        def record(outcome: SiteOutcome, result: TaskResult | None) -> None:
            nonlocal done
            self.outcomes[outcome.site_id] = _with_earlier_spend(
                outcome, self.outcomes.get(outcome.site_id))
            if result is not None:
                results[outcome.site_id] = result
            done += 1
            log.info("job=%s task=%s site=%s outcome=%s %s", self.job_id, task.task_id,
                     outcome.site_id, outcome.status, outcome.reason)
            detail = ("result received" if outcome.status == SiteStatus.OK
                      else f"{outcome.status}: {outcome.reason}")
            self.emit("site", f"site {outcome.site_id}: {detail} ({done}/{len(targets)})",
                      lo + (hi - lo) * done / len(targets))

        async def one(site_id: str) -> None:
            own = outgoing.site_arrays.get(site_id)
            data = payload if not own else await asyncio.to_thread(
                task_to_bytes, dataclasses.replace(task, arrays={**task.arrays, **own}))
            record(*await self._run_at_site(site_id, task, data, deadline, outgoing))

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
                        earlier = self.outcomes.get(site_id)
                        record(SiteOutcome(site_id, SiteStatus.DISCONNECTED,
                                           "the site disconnected; the round completed without "
                                           "it (every other site had answered)",
                                           row_count=earlier.row_count if earlier else 0), None)
                    pending = set()
        finally:
            for t in pending:
                t.cancel()
        self.registry.metrics.observe_round(outgoing.kind, time.monotonic() - started,
                                            ok=len(results) >= min_sites)
        if len(results) < min_sites:
            failed = "; ".join(f"{o.site_id}: {o.status} ({o.reason})"
                               for o in self.outcomes.values() if o.status != SiteStatus.OK)
            raise QuorumError(f"only {len(results)} site(s) answered round "
                              f"{outgoing.round_name!r}; this job needs min_sites={min_sites}. "
                              f"{failed}")
        return results

    async def _wait_for_return(self, site_id: str, remaining: float) -> SiteSession | None:
        """Wait for a disconnected target to come back, marked absent meanwhile."""
        self._absent.add(site_id)
        self._changed.set()
        try:
            return await self.registry.wait_for_site(site_id, remaining)
        finally:
            self._absent.discard(site_id)

    def _awaiting_approval(self, site_id: str, task: Task, reason: str, rows: int) -> None:
        """Show (and store) that ``site_id`` holds the task for its data steward."""
        earlier = self.outcomes.get(site_id)
        if earlier is not None and earlier.status == SiteStatus.AWAITING_APPROVAL:
            return
        self.outcomes[site_id] = SiteOutcome(
            site_id, SiteStatus.AWAITING_APPROVAL, f"waiting for approval at {site_id}: {reason}",
            earlier.spend if earlier is not None else None, rows,
            code=RefusalCode.AWAITING_APPROVAL)
        if self._save_outcomes is not None:
            self._save_outcomes(tuple(self.outcomes[s] for s in sorted(self.outcomes)))
        log.info("job=%s task=%s site=%s outcome=awaiting_approval", self.job_id, task.task_id,
                 site_id)
        self.emit("site", f"round {task.task_id.rpartition('/')[2]!r}: waiting for approval at "
                  f"{site_id} ({reason})")

    async def _run_at_site(self, site_id: str, task: Task, payload: bytes, deadline: float,
                           outgoing: OutgoingTask) -> tuple[SiteOutcome, TaskResult | None]:
        task_id = task.task_id
        rows = 0
        poll = APPROVAL_POLL_S
        while True:
            remaining = deadline + DEADLINE_GRACE_S - time.time()
            if remaining <= 0:
                held = self.outcomes.get(site_id)
                if held is not None and held.status == SiteStatus.AWAITING_APPROVAL:
                    return SiteOutcome(site_id, SiteStatus.TIMEOUT, "the task's deadline passed "
                                       f"while it was waiting for approval at {site_id}; "
                                       "nothing was charged", row_count=rows), None
                return SiteOutcome(site_id, SiteStatus.TIMEOUT, "no answer before the deadline",
                                   row_count=rows), None
            session = self.registry.get(site_id)
            if session is None:
                session = await self._wait_for_return(site_id, remaining)
                if session is None:
                    return SiteOutcome(site_id, SiteStatus.DISCONNECTED,
                                       "the site disconnected and did not come back before the "
                                       "deadline", row_count=rows), None
            rows = session.hello.row_count
            try:
                answer = await asyncio.wait_for(
                    session.submit(task_id, payload, deadline,
                                   max_result_bytes=outgoing.max_result_bytes), remaining)
            except TimeoutError:
                return SiteOutcome(site_id, SiteStatus.TIMEOUT, "no answer before the deadline",
                                   row_count=rows), None
            except SiteDisconnected:
                log.info("site=%s disconnected during %s; will resend if it returns", site_id,
                         task_id)
                continue
            except ProtocolError as exc:
                log.warning("site=%s misbehaved on %s: %s", site_id, task_id, exc)
                return SiteOutcome(site_id, SiteStatus.ERROR, f"invalid result: {exc}",
                                   row_count=rows), None
            if isinstance(answer, Refusal) and answer.code is RefusalCode.AWAITING_APPROVAL:
                # The site holds the task (nothing computed or charged): ask again until its
                # steward decides or the deadline passes; the resend carries the same task id.
                self._awaiting_approval(site_id, task, answer.reason, rows)
                await asyncio.sleep(max(0.0, min(poll, deadline + DEADLINE_GRACE_S - time.time())))
                poll = min(APPROVAL_POLL_MAX_S, poll * 2)
                continue
            if isinstance(answer, Refusal):
                return SiteOutcome(site_id, SiteStatus.REFUSED, f"{answer.code}: {answer.reason}",
                                   row_count=rows, code=answer.code), None
            try:
                if answer.task_id != task_id:
                    raise ProtocolError(f"answer for task {answer.task_id!r}, expected {task_id!r}")
                if answer.spend.epsilon > task.epsilon * (1 + 1e-9) or (
                        answer.spend.delta > task.delta * (1 + 1e-9)):
                    raise ProtocolError("the site reports spending more than the task asked for")
                if outgoing.check is not None:
                    outgoing.check(answer)
            except ProtocolError as exc:
                log.warning("site=%s sent an invalid result: %s", site_id, exc)
                return SiteOutcome(site_id, SiteStatus.ERROR, f"invalid result: {exc}",
                                   answer.spend, rows), None
            n = answer.metadata.get("n_rows", rows)
            return SiteOutcome(site_id, SiteStatus.OK, "", answer.spend,
                               int(n) if isinstance(n, int) else rows), answer


def _rows(results: Mapping[str, TaskResult]) -> dict[str, int]:
    """Return the public row counts the sites reported with their releases."""
    return {s: int(r.metadata["n_rows"]) for s, r in results.items()
            if isinstance(r.metadata.get("n_rows"), int)}


def _with_earlier_spend(outcome: SiteOutcome, earlier: SiteOutcome | None) -> SiteOutcome:
    """Return ``outcome`` with the site's spend over all of the job's rounds so far."""
    if earlier is None or earlier.spend is None:
        return outcome
    if outcome.spend is None:
        return dataclasses.replace(outcome, spend=earlier.spend)
    return dataclasses.replace(outcome, spend=earlier.spend + outcome.spend)

