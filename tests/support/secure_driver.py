"""The coordinator's side of one secure sum, stage by stage, for tests that drive sites by hand.

The tasks are the ones :func:`dpfed.aggregator.jobs.secure_rounds.secure_release` sends, and
the answers go through its own checks, share routing and recovery; a test chooses who takes
part in each stage (sites that "vanish") and may alter what is relayed (a hostile
coordinator). ``ask`` sends one task to one site: a :class:`TaskRunner` in process, or a real
site process behind :class:`tests.e2e.rogue_coordinator.RogueCoordinator`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pytest

from dpfed.aggregator.jobs.secure_rounds import (
    Recovery,
    addressed_shares,
    check_reveal,
    check_shares,
    graph_params,
    sum_graph,
)
from dpfed.common.jobs.contract import DataAccess, Site
from dpfed.common.jobs.registry import secure_round
from dpfed.common.secagg import dropouts, masking, secure_sum
from dpfed.common.secagg.graph import NeighbourGraph
from dpfed.common.secagg.masking import MaskContext
from dpfed.common.secagg.messages import plan_params
from dpfed.common.secagg.secure_sum import SecureSumPlan, decode_survivors, plan_gram
from dpfed.common.transport.protocol import Refusal, Task, TaskResult
from dpfed.common.transport.wire import result_from_bytes

Ask = Callable[[str, Task], Awaitable[TaskResult | Refusal]]


@dataclass
class SumDriver:
    """One secure Gram sum (``source`` pca) of ``dim`` columns, driven stage by stage."""

    ask: Ask
    job_id: str = "job-9"
    sum_round: str = "pca-sum-1"
    dim: int = 2
    total_rows: int = 600
    epsilon: float = 1.0
    delta: float = 1e-5
    refusals: dict[str, dict[str, Refusal]] = field(default_factory=dict)
    answers: dict[str, dict[str, TaskResult]] = field(default_factory=dict)
    #: The graph shown at ``shares`` (derived from the keys as the coordinator does).
    graph: NeighbourGraph | None = None

    @property
    def sum_task_id(self) -> str:
        """The task id of the contribute stage, which every stage names."""
        return f"{self.job_id}/{self.sum_round}"

    @property
    def context(self) -> MaskContext:
        """The sum's mask context."""
        return MaskContext(self.job_id, self.sum_round, self.sum_task_id)

    def _ids(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "sum_round": self.sum_round,
                "sum_task_id": self.sum_task_id}

    async def stage(self, stage: str, sites: list[str], params: Mapping[str, Any],
                    arrays: Mapping[str, np.ndarray],
                    per_site: Mapping[str, Mapping[str, np.ndarray]] | None = None,
                    check: Callable[[TaskResult], None] | None = None,
                    epsilon: float = 0.0, delta: float = 0.0) -> dict[str, TaskResult]:
        """Send one stage to ``sites``; keep answers and refusals (by stage)."""
        task_id = self.sum_task_id if stage == "contribute" else (
            f"{self.job_id}/{self.sum_round.replace('-sum-', f'-{stage}-')}")
        out: dict[str, TaskResult] = {}
        for s in sites:
            task = Task(task_id, self.job_id, "secagg", epsilon, delta,
                        {"stage": stage, **params},
                        {**arrays, **((per_site or {}).get(s, {}))})
            answer = await self.ask(s, task)
            if isinstance(answer, Refusal):
                self.refusals.setdefault(stage, {})[s] = answer
                continue
            if check is not None:
                check(answer)
            out[s] = answer
        self.answers[stage] = out
        return out

    async def keys(self, sites: list[str]) -> dict[str, TaskResult]:
        """Collect the sites' signed round keys."""
        return await self.stage("keys", sites, self._ids(), {})

    def relayed(self) -> dict[str, np.ndarray]:
        """Every key answer's arrays, as the coordinator relays them."""
        return {k: v for r in self.answers["keys"].values() for k, v in r.arrays.items()}

    async def shares(self, order: list[str], tolerated: int,
                     relayed: Mapping[str, np.ndarray] | None = None,
                     sites: list[str] | None = None, wanted_drops: int = 0,
                     shown: Mapping[str, Any] | None = None) -> dict[str, TaskResult]:
        """Relay the keys and collect every dealer's sealed shares.

        The graph is the coordinator's (:func:`sum_graph`); ``shown`` replaces the graph
        parameters the sites see (a hostile coordinator).
        """
        arrays = self.relayed() if relayed is None else relayed
        self.graph = graph = sum_graph(self.context, arrays, order, tolerated, wanted_drops)
        return await self.stage(
            "shares", sites if sites is not None else order,
            {**self._ids(), "participants": order, "tolerated": tolerated,
             **(graph_params(graph, wanted_drops) if shown is None else shown)},
            arrays, check=lambda r: check_shares(r, order, graph))

    def plan(self, participants: list[str], tolerated: int, wanted_drops: int) -> SecureSumPlan:
        """The coordinator's plan for these dealers, with the drops they can tolerate."""
        plan = plan_gram(dim=self.dim, total_rows=self.total_rows, epsilon=self.epsilon,
                         delta=self.delta, participants=participants, tolerated=tolerated)
        assert self.graph is not None
        lost = len(self.graph.ring) - len(participants)
        drops = min(wanted_drops, self.graph.capacity(tolerated) - lost)
        return SecureSumPlan(plan.statistic, plan.dim, plan.scale, plan.bound, plan.mu_total,
                             plan.tolerated, plan.participants, plan.calibration, drops)

    async def contribute(self, plan: SecureSumPlan, sites: list[str] | None = None,
                         participants: list[str] | None = None) -> dict[str, TaskResult]:
        """Send each site its addressed shares and the plan; collect masked vectors."""
        part = list(plan.participants)
        shown = participants if participants is not None else part
        return await self.stage(
            "contribute", sites if sites is not None else part,
            {"sum_round": self.sum_round, **plan_params(plan, row_norm=1.0),
             "participants": shown},
            {}, addressed_shares(self.answers["shares"], part, self.graph),
            epsilon=self.epsilon, delta=self.delta)

    async def confirm(self, participants: list[str], survivors: list[str],
                      sites: list[str] | None = None,
                      shown: Mapping[str, list[str]] | None = None) -> dict[str, TaskResult]:
        """Have survivors sign the view (``shown``: per site, other survivor sets)."""
        out = {}
        for s in sites if sites is not None else survivors:
            view = (shown or {}).get(s, survivors)
            out.update(await self.stage("confirm", [s], {**self._ids(),
                                                         "participants": participants,
                                                         "survivors": view}, {}))
        self.answers["confirm"] = out
        return out

    async def unmask(self, participants: list[str], survivors: list[str],
                     sites: list[str] | None = None,
                     signatures: Mapping[str, np.ndarray] | None = None
                     ) -> dict[str, TaskResult]:
        """Relay the view signatures and collect the revealed shares."""
        relayed = signatures if signatures is not None else {
            k: v for r in self.answers["confirm"].values() for k, v in r.arrays.items()}
        return await self.stage(
            "unmask", sites if sites is not None else sorted(self.answers["confirm"]),
            {**self._ids(), "participants": participants, "survivors": survivors}, relayed,
            check=lambda r: check_reveal(r, survivors, participants, self.graph))

    def recovery(self, plan: SecureSumPlan) -> Recovery:
        """The coordinator's recovery state of this sum."""
        part = list(plan.participants)
        assert self.graph is not None
        return Recovery(sorted(self.graph.ring), part, self.answers["keys"],
                        self.answers["shares"], self.answers["unmask"],
                        self.graph.share_threshold(plan.tolerated), self.context, self.graph)

    def exact_gram(self, data: DataAccess, plan: SecureSumPlan) -> np.ndarray:
        """A site's exact integer Gram (fresh randomised rounding) through the round's code."""
        _kind, rnd = secure_round("pca", "gram")
        t = Task(self.sum_task_id, self.job_id, "secagg", self.epsilon, self.delta,
                 {"stage": "contribute", "sum_round": self.sum_round,
                  **plan_params(plan, row_norm=1.0)})
        contribution = rnd.contribution(t, Site(data, None), list(plan.participants),
                                        plan.tolerated)
        stat, _rows = contribution.compute(np.random.default_rng(0))
        return np.asarray(stat, dtype=np.float64)

    def decode(self, plan: SecureSumPlan) -> np.ndarray:
        """Unmask and decode the survivors' sum (int64)."""
        results = self.answers["contribute"]
        survivors = sorted(results)
        correction = self.recovery(plan).correction(survivors, plan.n_values)
        return decode_survivors({s: results[s].arrays["masked"] for s in survivors}, plan,
                                correction)

    async def run(self, sites: list[str], tolerated: int = 1, wanted_drops: int = 0,
                  vanish_after_shares: tuple[str, ...] = ()) -> tuple[SecureSumPlan,
                                                                       np.ndarray]:
        """The whole sum; ``vanish_after_shares`` deal shares, then never contribute."""
        await self.keys(sites)
        order = sorted(self.answers["keys"])
        await self.shares(order, tolerated, wanted_drops=wanted_drops)
        participants = sorted(self.answers["shares"])
        plan = self.plan(participants, tolerated, wanted_drops)
        await self.contribute(plan, sites=[s for s in participants
                                           if s not in vanish_after_shares])
        survivors = sorted(self.answers["contribute"])
        await self.confirm(participants, survivors)
        await self.unmask(participants, survivors)
        return plan, self.decode(plan)


class Runs(Protocol):
    """What :func:`runner_ask` needs of a site: the TaskRunner's ``run``."""

    def run(self, task: Task) -> bytes | Refusal:
        """Run one task; the answer's bytes or a refusal."""


def runner_ask(runners: Mapping[str, Runs]) -> Ask:
    """An ``ask`` for in-process sites (each a TaskRunner with its real ledger)."""
    async def ask(site: str, task: Task) -> TaskResult | Refusal:
        answer = runners[site].run(task)
        return answer if isinstance(answer, Refusal) else result_from_bytes(answer)

    return ask


def dealt(runners: Mapping[str, Runs], *, job_id: str, sum_round: str,
          tolerated: int = 1) -> dict[str, dict[str, np.ndarray]]:
    """Run the keys and shares stages at every runner; per site, its contribute arrays.

    What a test that sends the contribute stage by hand relays: every site's signed keys and
    the sealed shares the other sites dealt it.
    """
    driver = SumDriver(runner_ask(runners), job_id=job_id, sum_round=sum_round)

    async def go() -> dict[str, dict[str, np.ndarray]]:
        await driver.keys(sorted(runners))
        order = sorted(driver.answers["keys"])
        await driver.shares(order, tolerated)
        per_site = addressed_shares(driver.answers["shares"], order, driver.graph)
        return {s: {**driver.relayed(), **per_site[s]} for s in order}

    return asyncio.run(go())


def run_sum(runners: Mapping[str, Runs], task: Task, plan: SecureSumPlan, row_norm: float,
            sent: dict[str, Task] | None = None
            ) -> tuple[dict[str, bytes | Refusal], np.ndarray | None]:
    """Run ``task`` (a contribute task of ``plan``) as a whole secure sum at every runner.

    Keys, shares, the contribute task (its params and arrays, the plan's public part and the
    shares addressed to each site), then, when every site contributed, confirm and unmask.
    Returns each site's raw contribute answer and the decoded int64 sum (None when a site
    refused); ``sent`` collects the contribute task each site was sent.
    """
    sum_round = task.task_id.split("/")[-1]
    driver = SumDriver(runner_ask(runners), job_id=task.job_id, sum_round=sum_round,
                       epsilon=task.epsilon, delta=task.delta)
    sites = sorted(runners)

    async def go() -> tuple[dict[str, bytes | Refusal], np.ndarray | None]:
        await driver.keys(sites)
        await driver.shares(sites, plan.tolerated)
        per_site = addressed_shares(driver.answers["shares"], sites, driver.graph)
        raw: dict[str, bytes | Refusal] = {}
        for s in sites:
            own = Task(task.task_id, task.job_id, "secagg", task.epsilon, task.delta,
                       {**task.params, "stage": "contribute", "sum_round": sum_round,
                        **plan_params(plan, row_norm=row_norm)}, {**task.arrays, **per_site[s]})
            if sent is not None:
                sent[s] = own
            raw[s] = runners[s].run(own)
        if any(isinstance(a, Refusal) for a in raw.values()):
            return raw, None
        driver.answers["contribute"] = {s: result_from_bytes(a) for s, a in raw.items()
                                        if isinstance(a, bytes)}
        await driver.confirm(sites, sites)
        await driver.unmask(sites, sites)
        return raw, driver.decode(plan)

    return asyncio.run(go())


def count_mask_streams(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count every mask stream expanded from now on (``["n"]``; a test may reset it)."""
    expanded = {"n": 0}
    stream = masking.mask_stream

    def counted(seed: bytes, n_values: int) -> np.ndarray:
        expanded["n"] += 1
        return stream(seed, n_values)

    for module in (masking, secure_sum, dropouts):
        monkeypatch.setattr(module, "mask_stream", counted)
    return expanded
