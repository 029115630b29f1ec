"""The distributed discrete Laplace of a secure query at the site, through the real runner,
ledger and certificates: an honest sum is charged once as ``secure-dlaplace[n=3,t=1]`` at
(epsilon, 0) and decodes to the pooled ``Ã x`` within its tail bound; the integer strategy's L1
sensitivity is searched over extreme schema-valid records through the site's own counting and
reached exactly, and the plan's alpha is ``exp(-epsilon / Δ1)`` of it; a task stating another
alpha, another Pólya shape (r = 1/n, ignoring t), another noise, or none of them is refused
before any charge; with two of six sites dropping, the shares are sized r = 1/(n - t - d) and
the survivors' sum decodes."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from dpfed.aggregator.jobs.secure_rounds import addressed_shares
from dpfed.common.jobs.contract import Site
from dpfed.common.jobs.query import QUERY
from dpfed.common.privacy.polya import polya_shape
from dpfed.common.queries.matrix_mechanism import strategy
from dpfed.common.secagg.linear_sum import LinearSumPlan, integer_strategy, plan_linear
from dpfed.common.secagg.messages import plan_params
from dpfed.common.secagg.secure_sum import SecureSumPlan
from dpfed.common.transport.certs import init_federation
from dpfed.common.transport.protocol import Refusal, Task
from dpfed.common.transport.wire import result_from_bytes
from dpfed.site_agent.runner import TaskRunner
from tests.site_agent.test_secagg_query import (
    DOMAIN,
    EXTREMES,
    JOB,
    SCALE,
    SITES,
    SUM,
    _keys,
    _pooled_histogram,
    _runner,
    fed,
)
from tests.support.schemas import AGE_WARD as SCHEMA
from tests.support.secure_driver import SumDriver, run_sum, runner_ask
from tests.support.tables import FrameData

__all__ = ["fed"]  # the fixture, shared with the Skellam tests


def _linear(a: np.ndarray, epsilon: float = 1.0) -> LinearSumPlan:
    return plan_linear(a, scale=SCALE, epsilon=epsilon, delta=0.0, participants=SITES,
                       tolerated=1, noise="dlaplace")


def _task(relayed: dict[str, np.ndarray], a: np.ndarray, *, epsilon: float = 1.0,
          spec: dict[str, Any] | None = None, drop: tuple[str, ...] = (),
          **override: Any) -> Task:
    params = {"stage": "contribute", "sum_round": SUM, "source": "query", "domain": DOMAIN,
              "strategy": spec or {"name": "h2", "n": 8}, "noise": "dlaplace",
              **plan_params(_linear(a, epsilon).plan, row_norm=1.0), **override}
    for key in drop:
        params.pop(key)
    return Task(f"{JOB}/{SUM}", JOB, "secagg", epsilon, 0.0, params, relayed)


def test_an_honest_dlaplace_query_is_charged_pure_epsilon_once_and_decodes(
        tmp_path: Path, fed: Path) -> None:
    runners = {s: _runner(tmp_path, s, fed, ("query",)) for s in SITES}
    a = strategy("h2", 8)
    linear = _linear(a, epsilon=5.0)
    assert linear.plan.noise == "dlaplace" and linear.plan.share == pytest.approx(
        linear.plan.mu_total / 2)  # r = 1/(n - t) of the discrete Laplace's variance
    sent: dict[str, Task] = {}
    answers, total = run_sum(runners, _task({}, a, epsilon=5.0), linear.plan, 1.0, sent)
    assert total is not None, answers
    for site, r in runners.items():
        answer = answers[site]
        assert isinstance(answer, bytes), answer
        assert result_from_bytes(answer).spend.mechanism == "secure-dlaplace[n=3,t=1]"
        assert r.run(sent[site]) == answer  # a resent task replays, no second charge
        (event,) = r.ledger.events()
        assert (event.mechanism, event.epsilon, event.delta) == (
            "secure-dlaplace[n=3,t=1]", 5.0, 0.0)
        assert event.rho == pytest.approx(5.0 ** 2 / 2)  # pure epsilon on a zCDP reading
    decoded = total.astype(np.float64) / linear.plan.scale
    expected = linear.strategy @ _pooled_histogram(runners)
    assert np.max(np.abs(decoded - expected)) <= linear.plan.noise_tail(8) / linear.plan.scale


@pytest.mark.parametrize("name", ["identity", "prefix", "h2", "wavelet"])
def test_l1_sensitivity_search_through_the_site_code_path_reaches_delta1(name: str) -> None:
    a = strategy(name, 8)
    base = pd.DataFrame(EXTREMES, columns=["age", "ward"])
    table = FrameData(SCHEMA, base, chunk_rows=None)
    c = QUERY.contribution(_task({}, a, spec={"name": name, "n": 8}), Site(table),
                           list(SITES), 1)
    plan = c.plan
    assert plan.noise == "dlaplace"
    stat0, n0 = c.compute(np.random.default_rng(0))
    worst1 = 0.0
    for i, record in itertools.product(range(len(base)), EXTREMES):
        table.frame = base.copy()
        table.frame.iloc[i] = record  # replace-one
        stat, n_rows = c.compute(np.random.default_rng(0))
        assert n_rows == n0
        worst1 = max(worst1, float(np.abs((stat - stat0).astype(np.float64)).sum()))
    cal = plan.calibration
    assert worst1 == cal.l1_sensitivity  # exact: never exceeded, and reached
    assert cal.alpha == math.exp(-1.0 / worst1)  # calibrated to that Δ1 at epsilon 1


@pytest.mark.parametrize(("override", "drop", "match"), [
    ({"alpha": "shrunk"}, (), "alpha"),  # less noise than the site computes
    ({"polya_shape": 1.0 / 3.0}, (), "polya_shape"),  # r = 1/n, ignoring t
    ({"noise": "gaussian"}, (), "secure linear noise must be one of"),
    ({}, ("alpha",), "alpha"),
    ({}, ("alpha", "polya_shape"), "alpha"),
])
def test_a_plan_whose_noise_the_site_does_not_compute_is_refused_before_any_charge(
        tmp_path: Path, fed: Path, override: dict[str, Any], drop: tuple[str, ...],
        match: str) -> None:
    runners = {s: _runner(tmp_path, s, fed, ("query",)) for s in SITES}
    relayed = _keys(runners)["hospital-a"]
    a = strategy("h2", 8)
    honest = _linear(a).plan.calibration.alpha
    if override.get("alpha") == "shrunk":
        override = {"alpha": honest ** 2}
    task = _task(relayed, a, drop=drop, **override)
    site: TaskRunner = runners["hospital-a"]
    answer = site.run(task)
    assert isinstance(answer, Refusal) and match in answer.reason, answer
    assert site.ledger.events() == []


def test_two_sites_dropping_leave_a_dlaplace_sum_with_shares_sized_for_the_survivors(
        tmp_path: Path) -> None:
    """Six sites, t = 1, two vanish after dealing: every share has Pólya shape 1/(6 - 1 - 2),
    the survivors are charged (epsilon, 0) as ``secure-dlaplace[n=6,t=1,d=2]`` and the sum of
    the four survivors decodes within the noise's tail bound."""
    sites = [f"hospital-{i}" for i in range(1, 7)]
    root = tmp_path / "fed6"
    init_federation(root, coordinator_hosts=["localhost"], sites=sites, analysts=[])
    runners = {s: _runner(tmp_path, s, root, ("query",)) for s in sites}
    gone = ("hospital-2", "hospital-5")
    a = strategy("h2", 8)
    driver = SumDriver(runner_ask(runners), job_id=JOB, sum_round=SUM, epsilon=5.0, delta=0.0)

    async def go() -> tuple[SecureSumPlan, np.ndarray]:
        await driver.keys(sites)
        order = sorted(driver.answers["keys"])
        await driver.shares(order, 1, wanted_drops=2)
        participants = sorted(driver.answers["shares"])
        assert driver.graph is not None
        drops = min(2, driver.graph.capacity(1) - (len(driver.graph.ring) - len(participants)))
        linear = plan_linear(a, scale=SCALE, epsilon=5.0, delta=0.0, participants=participants,
                             tolerated=1, noise="dlaplace")
        plan = dataclasses.replace(linear.plan, dropouts=drops)
        await driver.stage(
            "contribute", [s for s in participants if s not in gone],
            {"sum_round": SUM, "source": "query", "domain": DOMAIN,
             "strategy": {"name": "h2", "n": 8}, "noise": "dlaplace",
             **plan_params(plan, row_norm=1.0)}, {},
            addressed_shares(driver.answers["shares"], participants, driver.graph),
            epsilon=5.0, delta=0.0)
        survivors = sorted(driver.answers["contribute"])
        await driver.confirm(participants, survivors)
        await driver.unmask(participants, survivors)
        return plan, driver.decode(plan)

    plan, total = asyncio.run(go())
    assert plan.dropouts == 2 and polya_shape(6, 1, 2) == pytest.approx(1 / 3)
    survivors = {s: r for s, r in runners.items() if s not in gone}
    assert sorted(driver.answers["contribute"]) == sorted(survivors)
    for s, r in runners.items():
        events = r.ledger.events()
        if s in gone:
            assert events == []
            continue
        (event,) = events
        assert (event.mechanism, event.epsilon, event.delta) == (
            "secure-dlaplace[n=6,t=1,d=2]", 5.0, 0.0)
        assert event.noise_scale == pytest.approx((plan.mu_total / 3) ** 0.5)
    expected = integer_strategy(a, SCALE) @ _pooled_histogram(survivors).astype(np.int64)
    assert np.max(np.abs(total - expected)) <= plan.noise_tail(plan.n_values)
