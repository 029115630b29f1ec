"""Sixteen real sites (TaskRunner, real ledgers, certificates from the project's CA tool) on the
sparse graph, the coordinator's side driven by hand through its own checks and recovery: each
site deals to and masks with its eight neighbours only, two neighbours of one site vanish and
the sum still decodes with every survivor charged once; a site shown a graph other than the
one the signed keys give -- or shares routed along another graph -- refuses before any
charge."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpfed.aggregator.jobs.secure_rounds import addressed_shares, graph_params, sum_graph
from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.secagg.graph import NeighbourGraph
from dpfed.common.secagg.messages import plan_params
from dpfed.common.secagg.policy import SecureAggregationPolicy
from dpfed.common.secagg.secure_sum import SecureSumPlan
from dpfed.common.transport.certs import init_federation
from dpfed.site_agent.handlers import default_handlers
from dpfed.site_agent.handlers.secagg import SecureAggregationHandler, SiteIdentity
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner
from tests.support.schemas import AGE_BMI as SCHEMA
from tests.support.secure_driver import SumDriver, count_mask_streams, runner_ask

SITES = [f"hospital-{i:02d}" for i in range(1, 17)]
ROWS = 100
DEGREE = 8  # choose_degree(16, t=1, d=2)


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fed") / "f"
    init_federation(root, coordinator_hosts=["localhost"], sites=SITES, analysts=[])
    return root


@pytest.fixture
def runners(tmp_path: Path, fed: Path) -> dict[str, TaskRunner]:
    out = {}
    for site in SITES:
        csv = tmp_path / f"{site}.csv"
        rng = np.random.default_rng(int(site.rsplit("-", 1)[1]))
        pd.DataFrame({"age": rng.uniform(0, 100, ROWS),
                      "bmi": rng.uniform(10, 60, ROWS)}).to_csv(csv, index=False)
        kit = fed / "sites" / site
        handler = SecureAggregationHandler(
            SiteIdentity.load(kit / "ca.pem", kit / "site.pem", kit / "site.key"),
            SecureAggregationPolicy(min_participants=2, tolerated=1, tolerated_dropouts=2,
                                    federation_list=kit / "revoked.toml"))
        out[site] = TaskRunner(open_data_source(spec_from_path(csv), SCHEMA),
                               Ledger(tmp_path / f"{site}.sqlite", BudgetPolicy(1e5, 1e-2)),
                               ("pca", "secagg"),
                               handlers={**default_handlers(), "secagg": handler})
    return out


def _driver(runners: dict[str, TaskRunner], job_id: str = "job-9") -> SumDriver:
    return SumDriver(runner_ask(runners), job_id=job_id, total_rows=ROWS * len(SITES))


def test_sixteen_sites_mask_with_their_neighbours_and_decode_after_two_drops(
        runners: dict[str, TaskRunner], monkeypatch: pytest.MonkeyPatch) -> None:
    expanded = count_mask_streams(monkeypatch)
    driver = _driver(runners)

    async def go() -> tuple[SecureSumPlan, np.ndarray, list[str]]:
        await driver.keys(SITES)
        await driver.shares(SITES, 1, wanted_drops=2)
        graph = driver.graph
        assert graph is not None and graph.degree == DEGREE and not graph.complete
        for answer in driver.answers["shares"].values():  # k sealed shares each, not n - 1
            assert sum(name.startswith("sealed/") for name in answer.arrays) == DEGREE
        plan = driver.plan(SITES, 1, 2)
        centre = graph.ring[3]
        gone = list(graph.neighbours(centre))[:2]  # the worst case: both next to one site
        expanded["n"] = 0
        await driver.contribute(plan, sites=[s for s in SITES if s not in gone])
        survivors = sorted(driver.answers["contribute"])
        # each contributor expands a stream per neighbour (dealt or not) and its self-mask
        assert expanded["n"] == len(survivors) * (DEGREE + 1)
        await driver.confirm(SITES, survivors)
        await driver.unmask(SITES, survivors)
        for r, answer in driver.answers["unmask"].items():  # only shares it holds
            assert len(answer.arrays) <= DEGREE + 1
            assert {name.split("/", 1)[1] for name in answer.arrays} <= {
                r, *graph.neighbours(r)}
        return plan, driver.decode(plan), survivors

    plan, total, survivors = asyncio.run(go())
    assert len(survivors) == 14 and plan.dropouts == 2
    # the survivors' pooled Gram within noise and rounding (noise sd 0.6 % of the scale here;
    # a mask left in would be off by about 2^63)
    reference = np.sum([driver.exact_gram(runners[s].data, plan) for s in survivors], axis=0)
    assert np.max(np.abs(total - reference)) / (ROWS * 14 * plan.bound ** 2) < 0.05
    for s in SITES:
        events = runners[s].ledger.events()
        if s in survivors:
            (event,) = events
            assert event.mechanism == "secure-skellam[n=16,t=1,d=2]"
        else:
            assert events == []


def _steered(graph: NeighbourGraph) -> dict[str, object]:
    """The graph with hospital-01 moved next to a site that is not its neighbour (as the
    coordinator might, to choose a site's neighbours)."""
    target = next(s for s in graph.ring if s != "hospital-01"
                  and s not in graph.neighbours("hospital-01"))
    ring = [s for s in graph.ring if s != "hospital-01"]
    ring.insert(ring.index(target) + 1, "hospital-01")
    assert ring != list(graph.ring)
    return {**graph_params(graph, 2), "ring": ring}


SHOWN: dict[str, Callable[[NeighbourGraph], dict[str, object]]] = {
    "a neighbour the coordinator chose": _steered,
    "a ring in the coordinator's order": lambda g: {**graph_params(g, 2), "ring": SITES},
    "fewer neighbours than n, t and d call for": lambda g: {**graph_params(g, 2),
                                                           "degree": DEGREE - 2},
    "the degree of fewer drops than asked for": lambda g: {**graph_params(g, 2),
                                                          "wanted_dropouts": 5},
}


def test_a_site_shown_another_graph_refuses_before_any_charge(
        runners: dict[str, TaskRunner]) -> None:
    async def go() -> None:
        plan: SecureSumPlan | None = None
        for i, lie in enumerate(sorted(SHOWN)):
            driver = _driver(runners, job_id=f"job-{i}")
            await driver.keys(SITES)
            graph = sum_graph(driver.context, driver.relayed(), SITES, 1, 2)
            await driver.shares(SITES, 1, wanted_drops=2, shown=SHOWN[lie](graph))
            assert driver.answers["shares"] == {}, lie
            assert all("neighbour graph shown" in r.reason
                       for r in driver.refusals["shares"].values()), lie
            # no shares dealt: a contribution is refused too
            plan = plan or driver.plan(SITES, 1, 2)
            await driver.stage("contribute", SITES, {"sum_round": driver.sum_round,
                                                     **plan_params(plan, row_norm=1.0),
                                                     "participants": SITES}, {},
                               epsilon=driver.epsilon, delta=driver.delta)
            assert all("dealt no shares" in r.reason
                       for r in driver.refusals["contribute"].values())

    asyncio.run(go())
    for runner in runners.values():
        assert runner.ledger.events() == []


def test_shares_routed_along_another_graph_are_refused_before_the_charge(
        runners: dict[str, TaskRunner]) -> None:
    driver = _driver(runners)

    async def go() -> None:
        await driver.keys(SITES)
        await driver.shares(SITES, 1, wanted_drops=2)
        graph = driver.graph
        assert graph is not None
        site = graph.ring[0]
        near = graph.neighbours(site)
        stranger = next(s for s in graph.ring if s != site and s not in near)
        routed = addressed_shares(driver.answers["shares"], SITES, graph)[site]
        # a neighbour's shares relayed as if a non-neighbour had dealt them
        forged = {**routed, **{f"{f}/{stranger}": routed[f"{f}/{near[0]}"]
                               for f in ("sealed", "commit_self", "commit_key")}}
        plan = driver.plan(SITES, 1, 2)
        await driver.stage("contribute", [site], {"sum_round": driver.sum_round,
                                                  **plan_params(plan, row_norm=1.0),
                                                  "participants": SITES}, {},
                           per_site={site: forged}, epsilon=driver.epsilon,
                           delta=driver.delta)
        reason = driver.refusals["contribute"][site].reason
        assert f"shares relayed from ['{stranger}']" in reason
        assert runners[site].ledger.events() == []

    asyncio.run(go())
