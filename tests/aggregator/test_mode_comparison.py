"""``--plan``'s secure / site-level comparison: the error each mode is expected to have.

A query's site-level noise may be Laplace (pure epsilon), which on a small marginal beats the
Gaussian-like Skellam noise of a secure sum even with four sites; the comparison prices each
mode with the noise it would use (closed forms checked here), so it warns there, and a planted
comparison that assumes Gaussian noise in both modes is caught. Sites' policies (t, d) reach
the plan's facts.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from dpfed.aggregator.plan_cli import mode_comparison, print_kind_plan
from dpfed.common.data.demo_data import generate_demo
from dpfed.common.job_params import QueryParams
from dpfed.common.jobs.eligibility import connected_facts
from dpfed.common.jobs.modes import SKELLAM_SLACK, compare_modes
from dpfed.common.jobs.params import ConnectedSite
from dpfed.common.jobs.registry import job_kind
from dpfed.common.privacy.accounting import BudgetStatus
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.transport.protocol import SiteInfo

SCHEMA = generate_demo(1, 50, 20, seed=0, mixed=True)[0]
MARGINAL = {"domain": {"columns": ["ward", "severity"]},
            "workload": {"kind": "marginals", "k": 2}}
EPS, DELTA = 1.0, 1e-5


def sites(n: int, policy: str = "allowed, min 2 sites, t=1") -> list[Any]:
    return [SimpleNamespace(site_id=f"h{i}", allowed_kinds=("query", "pca", "secagg"),
                            secure_policy=policy, budget=None) for i in range(n)]


def verdict(n: int, raw: dict[str, Any] = MARGINAL, delta: float = DELTA) -> str:
    params = job_kind("query").parse({**raw, "aggregation": "secure"}, SCHEMA)
    return mode_comparison(sites(n), params, EPS, delta, SCHEMA)


def test_a_query_is_priced_with_each_modes_own_noise() -> None:
    params = job_kind("query").parse({**MARGINAL, "aggregation": "secure"}, SCHEMA)
    site, secure = params.mode_errors(EPS, DELTA, SCHEMA, 4, 4 / 3)
    # identity on one marginal: every answer one cell; L1 sensitivity 2, L2 sqrt(2)
    assert site == pytest.approx(math.sqrt(4 * 2 * (2 / EPS) ** 2))  # four Laplace draws
    assert secure == pytest.approx(gaussian_sigma(EPS, DELTA, math.sqrt(2.0))
                                   * SKELLAM_SLACK * math.sqrt(4 / 3))
    text = verdict(4)
    assert "t=1: secure 6.153 / site-level 5.657 = 1.09. WARNING" in text
    assert "more accurate" in verdict(6)
    # the ranges over 32 bins: secure wins already with 3 sites
    ranges = {"domain": {"columns": ["age"], "bins": {"age": 32}},
              "workload": {"kind": "all_range"}}
    assert "more accurate" in verdict(3, ranges)
    assert "needs --delta > 0" in verdict(4, delta=0.0)


def test_a_comparison_that_assumes_gaussian_noise_in_both_modes_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert "WARNING" in verdict(4)
    monkeypatch.setattr(QueryParams, "mode_errors", lambda *a, **k: None)  # planted
    assert "WARNING" not in verdict(4)  # the generic noise ratio: 1.01 / sqrt(3)


def test_the_noise_ratio_counts_dropouts_and_the_policies_reach_the_facts() -> None:
    ratio, text = compare_modes(5, 1, dropouts=1)  # every share mu / 3: pooled 5/3 mu
    assert ratio == pytest.approx(SKELLAM_SLACK * math.sqrt(5 / 3 / 5)) and "d=1" in text
    pca = job_kind("pca").parse({"n_components": 2, "aggregation": "secure"}, SCHEMA)
    assert pca.mode_errors(EPS, DELTA, SCHEMA, 4, 4 / 3) is None  # Gaussian in both modes
    assert "secure / site-level = 0.58" in mode_comparison(sites(4), pca, EPS, DELTA, SCHEMA)
    views = sites(2, "allowed, min 2 sites, t=1, d=1") + [SimpleNamespace(
        site_id="h9", allowed_kinds=("pca",), secure_policy="",
        budget=BudgetStatus("pld", 1.0, 1e-5, 0.0, 0.0, 0.0, 0))]
    facts = connected_facts([(v.site_id, v, 100) for v in views], "pca")
    assert facts == [ConnectedSite(100, None, 1, 1)] * 2 + [ConnectedSite(100, "pld")]


def test_a_query_result_compares_with_the_other_modes_best() -> None:
    from dpfed.aggregator.jobs.query import other_mode
    from dpfed.common.jobs.contract import Budget

    params = job_kind("query").parse({**MARGINAL, "aggregation": "secure"}, SCHEMA)
    workload = params.workload_in(SCHEMA)
    modes = {"n_sites": 3, "tolerated": 1, "dropouts": 0, "secure_over_site_noise": 0.71,
             "sentence": "the pooled noise ratio"}
    secure = other_mode(params, workload, Budget(EPS, DELTA), modes, 6.5, secure=True)
    assert secure is not None
    assert secure["expected_rmse_other_mode"] == pytest.approx(math.sqrt(3 * 8) / EPS)
    assert secure["secure_over_site_noise"] == pytest.approx(6.5 / math.sqrt(24))
    assert "WARNING" in secure["sentence"]
    # a pure-epsilon (Laplace) site-level job: a secure sum would need a delta
    assert other_mode(params, workload, Budget(EPS, 0.0), modes, 4.9, secure=False) is None


def test_a_new_secure_query_is_priced_with_the_discrete_laplace_it_would_use(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A new job (``secure_noise = "auto"``) ranks the distributed discrete Laplace: on the
    marginal its pooled noise is 1.5 Laplace draws against site level's 3, so secure wins with
    3 sites (no warning), also without a delta; a planted comparison that still prices secure
    with Skellam only warns there, and is caught."""
    kind = job_kind("query")
    params = kind.parse(kind.params.submitted({**MARGINAL, "aggregation": "secure"}), SCHEMA)
    site, secure = params.mode_errors(EPS, DELTA, SCHEMA, 3, 3 / 2)
    assert site == pytest.approx(math.sqrt(3 * 2 * (2 / EPS) ** 2))
    assert secure == pytest.approx(math.sqrt(3 / 2 * 2 * (2 / EPS) ** 2))  # one pooled draw
    for delta in (DELTA, 0.0):
        text = mode_comparison(sites(3), params, EPS, delta, SCHEMA)
        assert "secure 3.464 / site-level 4.899 = 0.71" in text and "WARNING" not in text
    views = [SiteInfo(f"h{i}", True, 100, "", "", ("query", "secagg"), None, None, "", "",
                      "allowed, min 2 sites, t=1") for i in range(3)]
    print_kind_plan("query", {**MARGINAL, "aggregation": "secure"}, EPS, 0.0, views, SCHEMA)
    assert "= 0.71: secure aggregation is the more accurate mode" in capsys.readouterr().out
    monkeypatch.setattr(QueryParams, "secure_noises", lambda self, delta: ("gaussian",))
    assert "WARNING" in mode_comparison(sites(3), params, EPS, DELTA, SCHEMA)  # planted
