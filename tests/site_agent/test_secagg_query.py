"""The ``query`` source of a secure sum at the site, through the real runner, ledger and
certificates: an honest contribution is charged once and the masked vectors decode to the pooled
``Ã x``; the replace-one sensitivity is searched over extreme schema-valid records (every bin
edge, out-of-range values that get clipped, every category) through the site's own encoding,
counting and integer answers; a tampered strategy, a site that does not run query jobs and a
site-level query at a site that requires secure aggregation are refused before any charge."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.jobs.contract import Site
from dpfed.common.jobs.query import QUERY
from dpfed.common.jobs.registry import sum_kinds
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.queries.federated_matrix import strategy_digest
from dpfed.common.queries.matrix_mechanism import optimize_strategy, strategy
from dpfed.common.queries.query_language import compile_query_set, parse_domain
from dpfed.common.queries.workloads import all_range_workload
from dpfed.common.secagg.linear_sum import integer_strategy, plan_linear
from dpfed.common.secagg.messages import plan_params
from dpfed.common.secagg.policy import SecureAggregationPolicy
from dpfed.common.transport.certs import init_federation
from dpfed.common.transport.protocol import Refusal, Task
from dpfed.common.transport.wire import result_from_bytes
from dpfed.site_agent.handlers import default_handlers
from dpfed.site_agent.handlers.secagg import SecureAggregationHandler, SiteIdentity
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner
from tests.support.schemas import AGE_WARD as SCHEMA
from tests.support.secure_driver import dealt, run_sum
from tests.support.tables import FrameData

SITES = ("hospital-a", "hospital-b", "hospital-c")
JOB = "job-7"
SUM = "query-sum-1"
DOMAIN = {"columns": ["age"], "bins": {"age": 8}}
SCALE = 1024


def _frame(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"age": rng.uniform(0, 100, n),
                         "ward": rng.choice(["general", "icu", "surgery"], n)})


def _runner(tmp_path: Path, site: str, fed: Path, allowed: tuple[str, ...]) -> TaskRunner:
    csv = tmp_path / f"{site}.csv"
    _frame(300, len(site) + ord(site[-1])).to_csv(csv, index=False)
    source = open_data_source(spec_from_path(csv), SCHEMA)
    kit = fed / "sites" / site
    handler = SecureAggregationHandler(
        SiteIdentity.load(kit / "ca.pem", kit / "site.pem", kit / "site.key"),
        SecureAggregationPolicy(min_participants=2, tolerated=1,
                                federation_list=kit / "revoked.toml"), allowed_kinds=allowed)
    ledger = Ledger(tmp_path / f"{site}.sqlite", BudgetPolicy(100.0, 1e-2))
    return TaskRunner(source, ledger, (*allowed, "secagg"), handlers={**default_handlers(),
                                                                      "secagg": handler})


@pytest.fixture
def fed(tmp_path: Path) -> Path:
    root = tmp_path / "fed"
    init_federation(root, coordinator_hosts=["localhost"], sites=list(SITES), analysts=[])
    return root


def _keys(runners: dict[str, TaskRunner]) -> dict[str, dict[str, np.ndarray]]:
    """Per site: the relayed keys and the shares dealt to it (the keys and shares stages)."""
    return dealt(runners, job_id=JOB, sum_round=SUM)


def _contribute(relayed: dict[str, np.ndarray], a: np.ndarray, *, epsilon: float = 1.0,
                spec: dict[str, Any] | None = None,
                extra: dict[str, np.ndarray] | None = None) -> Task:
    linear = plan_linear(a, scale=SCALE, epsilon=epsilon, delta=1e-6, participants=SITES,
                         tolerated=1)
    params = {"stage": "contribute", "sum_round": SUM, "source": "query", "domain": DOMAIN,
              "strategy": spec or {"name": "h2", "n": 8},
              **plan_params(linear.plan, row_norm=1.0)}
    return Task(f"{JOB}/{SUM}", JOB, "secagg", epsilon, 1e-6, params,
                {**relayed, **(extra or {})})


def _pooled_histogram(runners: dict[str, TaskRunner]) -> np.ndarray:
    domain = parse_domain(SCHEMA, DOMAIN["columns"], DOMAIN["bins"])
    q = compile_query_set(SCHEMA, [{"name": "h", "domain": domain.to_json()}], canonical=True)
    return sum(q.counts(t for t, _ in r.data.iter_chunks())[0] for r in runners.values())


def test_an_honest_secure_query_is_charged_once_and_decodes_to_the_pooled_answers(
        tmp_path: Path, fed: Path) -> None:
    runners = {s: _runner(tmp_path, s, fed, ("query",)) for s in SITES}
    a = strategy("h2", 8)
    task = _contribute({}, a, epsilon=50.0)
    linear = plan_linear(a, scale=SCALE, epsilon=50.0, delta=1e-6, participants=SITES,
                         tolerated=1)
    sent: dict[str, Task] = {}
    answers, total = run_sum(runners, task, linear.plan, 1.0, sent)
    assert total is not None
    for site, r in runners.items():
        answer = answers[site]
        assert isinstance(answer, bytes), answer
        result = result_from_bytes(answer)
        assert result.metadata["strategy_digest"] == strategy_digest(a)
        assert result.metadata["n_rows"] == 300 and result.metadata["statistic"] == "linear"
        assert r.run(sent[site]) == answer  # a resent task replays the ledger, no second charge
        (event,) = r.ledger.events()
        assert event.mechanism == "secure-skellam[n=3,t=1]" and event.epsilon == 50.0
    decoded = total.astype(np.float64) / linear.plan.scale
    expected = linear.strategy @ _pooled_histogram(runners)
    assert np.max(np.abs(decoded - expected)) < 6 * linear.answer_variance ** 0.5


#: Extreme schema-valid records: every bin edge, both bounds, values outside them (clipped).
EXTREMES = [(age, ward) for age in (-40.0, 0.0, 12.5, 49.999, 50.0, 100.0, 250.0)
            for ward in ("general", "surgery")]


@pytest.mark.parametrize("name", ["identity", "prefix", "h2", "wavelet", "optimized"])
def test_replace_one_sensitivity_search_through_the_site_code_path(name: str) -> None:
    a = (optimize_strategy(all_range_workload(8), noise="gaussian").matrix
         if name == "optimized" else strategy(name, 8))
    spec: dict[str, Any] = ({"name": "matrix", "digest": strategy_digest(a), "shape": [8, 8]}
                            if name == "optimized" else {"name": name, "n": 8})
    if name == "optimized":
        spec["shape"] = list(a.shape)
    arrays = {"strategy": a} if name == "optimized" else {}
    base = pd.DataFrame(EXTREMES, columns=["age", "ward"])
    table = FrameData(SCHEMA, base, chunk_rows=None)
    # the plan once (it depends on public inputs only); then the site's own counting and
    # integer answers on every neighbouring table
    c = QUERY.contribution(_contribute({}, a, spec=spec, extra=arrays), Site(table), list(SITES),
                           1)
    stat0, n0 = c.compute(np.random.default_rng(0))
    assert n0 == len(base)
    worst2 = worst1 = 0.0
    for i, record in itertools.product(range(len(base)), EXTREMES):
        table.frame = base.copy()
        table.frame.iloc[i] = record  # replace-one: same number of rows, one row changed
        stat, n_rows = c.compute(np.random.default_rng(0))
        assert n_rows == n0
        diff = (stat - stat0).astype(np.float64)
        worst2 = max(worst2, float(np.linalg.norm(diff)))
        worst1 = max(worst1, float(np.abs(diff).sum()))
    plan = c.plan
    cal = plan.calibration
    # never exceeded, and attained (the calibration is not loose)
    assert worst2 <= cal.l2_sensitivity * (1 + 1e-12) and worst1 <= cal.l1_sensitivity
    assert worst2 == pytest.approx(cal.l2_sensitivity, rel=1e-12)
    assert worst1 == pytest.approx(cal.l1_sensitivity, rel=1e-12)
    # a planted broken copy calibrated to one column's norm (the add/remove figure) is caught:
    # the search exceeds it (prefix's first column happens to be longer than any difference)
    column = float(np.linalg.norm(integer_strategy(a, SCALE), axis=0).max())
    assert (worst2 > column * 1.01) == (name != "prefix")


def test_a_tampered_strategy_or_a_site_without_query_jobs_is_refused_before_any_charge(
        tmp_path: Path, fed: Path) -> None:
    runners = {s: _runner(tmp_path, s, fed, ("query",)) for s in SITES}
    relayed = _keys(runners)["hospital-a"]
    a = optimize_strategy(all_range_workload(8), noise="gaussian").matrix
    spec = {"name": "matrix", "digest": strategy_digest(a), "shape": list(a.shape)}
    tampered = a.copy()
    tampered[0, 0] *= 2.0  # the coordinator swaps in another matrix under the announced digest
    answer = runners["hospital-a"].run(_contribute(relayed, a, spec=spec,
                                                   extra={"strategy": tampered}))
    assert isinstance(answer, Refusal) and "digest" in answer.reason
    assert runners["hospital-a"].ledger.events() == []
    (tmp_path / "b").mkdir()
    no_query = _runner(tmp_path / "b", "hospital-b", fed, ("pca",))
    others = {s: _runner(tmp_path / "b", s, fed, ("query",)) for s in ("hospital-a",
                                                                         "hospital-c")}
    relayed = _keys({**others, "hospital-b": no_query})["hospital-b"]
    answer = no_query.run(_contribute(relayed, strategy("h2", 8)))
    assert isinstance(answer, Refusal) and "does not run 'query' jobs" in answer.reason
    assert no_query.ledger.events() == []


def test_a_site_that_requires_secure_aggregation_refuses_site_level_query_answers(
        tmp_path: Path, fed: Path) -> None:
    assert "query" in sum_kinds() and "svt" not in sum_kinds()  # SVT stays per site
    r = _runner(tmp_path, "hospital-a", fed, ("query", "svt"))
    strict = TaskRunner(r.data, r.ledger, r.allowed_kinds, handlers=r.handlers,
                        secure_required_kinds=sum_kinds())
    answer = strict.run(Task("job-1/query", "job-1", "query", 1.0, 0.0,
                             {"domain": DOMAIN, "noise": "laplace",
                              "strategy": {"name": "identity", "n": 8}}))
    assert isinstance(answer, Refusal) and "requires secure aggregation" in answer.reason
    assert r.ledger.events() == []
