"""Coordinator side of ``svt`` and ``query``: validation before anything is charged, strategy
choice, typed results and the report dispatcher."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpfed.aggregator.federation import Federation
from dpfed.aggregator.orchestrator import JobManager
from dpfed.aggregator.query_cli import parse_bins
from dpfed.aggregator.query_results import QueryJobResult, SVTJobResult
from dpfed.aggregator.result_file import encode_result
from dpfed.aggregator.result_reports import report_for_result
from dpfed.common.data.demo_data import demo_model
from dpfed.common.errors import ValidationError
from dpfed.common.jobs.registry import job_kind
from dpfed.common.queries.query_language import parse_domain
from dpfed.common.queries.workload_spec import build_workload, choose_strategy, query_names
from dpfed.common.transport.protocol import JobSpec

SCHEMA = demo_model(12, seed=0, mixed=True).schema
FED = Federation(SCHEMA)
Q = [{"per": "ward"}, {"name": "old", "where": {"column": "age", "op": ">=", "value": 70}}]


def validate(kind: str, spec: JobSpec, federation: Federation) -> dict[str, object]:
    """The canonical parameters of ``spec`` (what the coordinator stores and sends)."""
    return job_kind(kind).canonical(spec.params, spec.epsilon, spec.delta, federation.schema)


def spec(kind: str, params: dict[str, Any], eps: float = 1.0, delta: float = 0.0) -> JobSpec:
    return JobSpec(kind, eps, delta, params)


def test_svt_canonical_parameters() -> None:
    p = validate("svt", spec("svt", {"queries": Q, "threshold": 10, "cutoff": 2}),
                                  FED)
    assert p["action"] == "open" and p["cutoff"] == 2 and len(p["queries"]) == 2
    c = validate("svt", spec("svt", {"queries": Q, "session": "job-1"}), FED)
    assert c["action"] == "batch" and c["session"] == "job-1"
    z = validate("svt", spec("svt", {"session": "job-1", "close": True}), FED)
    assert z == {"action": "close", "session": "job-1"}


@pytest.mark.parametrize(("params", "eps", "delta", "match"), [
    ({"queries": Q, "threshold": 10, "cutoff": 0}, 1.0, 0.0, "cutoff"),
    ({"queries": Q, "threshold": 10, "cutoff": 5000}, 1.0, 0.0, "cutoff"),
    ({"queries": Q, "threshold": 1e13}, 1.0, 0.0, "threshold"),
    ({"queries": Q}, 1.0, 0.0, "threshold"),
    ({"queries": Q, "threshold": 1, "numeric_epsilon": 2.0}, 1.0, 0.0, "numeric_epsilon"),
    ({"queries": Q, "threshold": 1}, 1.0, 1e-5, "delta must be 0"),
    ({"queries": Q, "threshold": 1, "monotonic": True}, 1.0, 0.0, "one direction"),
    ({"queries": Q, "session": "j", "threshold": 3}, 1.0, 0.0, "fixed when a session opens"),
    ({"close": True}, 1.0, 0.0, "close needs the session"),
    ({"queries": [{"name": "x", "where": {"column": "nope", "op": "<", "value": 1}}],
      "threshold": 1}, 1.0, 0.0, "unknown column 'nope'"),
    ({"queries": Q, "threshold": 1, "colour": 1}, 1.0, 0.0, "unknown svt parameter"),
])
def test_svt_bad_input(params: dict[str, Any], eps: float, delta: float, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        validate("svt", spec("svt", params, eps, delta), FED)


def test_monotonic_chains_are_accepted() -> None:
    chain = [{"name": f"a{v}", "where": {"column": "age", "op": ">=", "value": v}}
             for v in (80, 70)]
    p = validate("svt", spec("svt", {"queries": chain, "threshold": 3,
                                               "monotonic": True}), FED)
    assert p["monotonic"] is True


@pytest.mark.parametrize(("params", "delta", "match"), [
    ({"domain": {"columns": ["nope"]}}, 0.0, "unknown column 'nope'"),
    ({"domain": {"columns": ["age"]}}, 0.0, "needs public bins"),
    ({"domain": {"columns": ["age"], "bins": {"age": 2000}}, "strategy": "h2"}, 0.0,
     r"is 2,000 cells; a query job supports at most 1,024 .* fewer --columns or fewer --bins"),
    ({"domain": {"columns": ["age"], "bins": {"age": 600}}, "strategy": "optimized"}, 0.0,
     "supports at most 512"),
    ({"domain": {"columns": ["ward", "severity"]}, "workload": "all_range"}, 0.0,
     "needs an ordered one-column domain"),
    ({"domain": {"columns": ["ward"]}, "workload": {"kind": "marginals", "k": 3}}, 0.0,
     "marginals needs k in 0..1"),
    ({"domain": {"columns": ["ward"]}, "workload": {"kind": "custom", "matrix": [[1, 2]]}},
     0.0, r"shape \(m, 5\)"),
    ({"domain": {"columns": ["ward"]}, "noise": "laplace"}, 1e-5, "delta must be 0"),
    ({"domain": {"columns": ["ward"]}, "noise": "gaussian"}, 0.0, "delta"),
    ({"domain": {"columns": ["ward"]}, "reconstruction": "magic"}, 0.0, "reconstruction"),
    ({"domain": {"columns": ["ward"]}, "strategy": "best"}, 0.0, "strategy must be one of"),
])
def test_query_bad_input(params: dict[str, Any], delta: float, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        validate("query", spec("query", params, 1.0, delta), FED)


def test_pure_epsilon_jobs_may_have_zero_delta_but_pca_may_not() -> None:
    manager = JobManager.__new__(JobManager)
    manager.federation = FED
    manager.validate(spec("query", {"domain": {"columns": ["ward"]}}, 1.0, 0.0))
    with pytest.raises(ValidationError, match="delta"):
        manager.validate(spec("pca", {"n_components": 2}, 1.0, 0.0))


def test_strategy_choice_beats_or_equals_identity() -> None:
    domain = parse_domain(SCHEMA, ["age"], {"age": 64})
    w = build_workload(domain, {"kind": "all_range"})
    pick = choose_strategy(w, strategy_name="auto", noises=("laplace",), epsilon=1.0,
                           delta=0.0, n_sites=4)
    assert pick.rmse <= pick.identity_rmse and pick.name != "identity"
    names = query_names(domain, w)
    assert len(names) == w.n_queries and names[0] == "age=[0, 1.71875) .. age=[0, 1.71875)"
    m = build_workload(parse_domain(SCHEMA, ["ward", "severity"]), {"kind": "marginals", "k": 1})
    mn = query_names(parse_domain(SCHEMA, ["ward", "severity"]), m, 1)
    assert len(mn) == m.n_queries and mn[0] == "ward=general"


def test_results_and_report_dispatch(tmp_path: Path) -> None:
    above = np.array([[1, 0, -1], [0, 1, 0]], dtype=np.int8)
    svt = SVTJobResult({"above": above, "values": np.full((2, 3), np.nan),
                        "n_above": np.array([1, 1, 0]), "n_examined": np.array([2, 2, 1]),
                        "value_sum": np.full(3, np.nan), "value_std_error": np.full(3, np.nan)},
                       {"kind": "svt", "job_id": "j", "session": "j", "action": "open",
                        "queries": ["a", "b", "c"], "site_ids": ["h1", "h2"],
                        "sites": [{"site_id": "h1", "halted": True},
                                  {"site_id": "h2", "halted": False}],
                        "params": {"threshold": 3, "cutoff": 1}, "epsilon": 1.0})
    assert svt.table["which_sites"].tolist() == ["h1", "h2", ""]
    assert svt.halted_sites == ["h1"]
    p = svt.save(tmp_path / "s.npz")
    assert SVTJobResult.load(p).table.equals(svt.table)
    svt.save(tmp_path / "s.csv")
    assert (tmp_path / "s.csv").read_text().startswith("query,sites_above")
    html = report_for_result(p).render()
    assert "data:image/png;base64" in html and "SVT session j" in html
    with pytest.raises(ValidationError, match="not a query result"):
        QueryJobResult.load(p)
    other = tmp_path / "other.npz"
    other.write_bytes(encode_result({"x": np.zeros(1)}, {"kind": "unknown-kind"}))
    with pytest.raises(ValidationError, match="no report for result kind 'unknown-kind'"):
        report_for_result(other)


def test_parse_bins() -> None:
    assert parse_bins(["age=0,18,65,110", "bmi=4"]) == {"age": [0.0, 18.0, 65.0, 110.0],
                                                        "bmi": 4}
    for bad in ("age", "age=", "age=a,b", "age=2.5"):
        with pytest.raises(ValidationError, match="--bins"):
            parse_bins([bad])
