"""The clip-first pca plan (jobs with a ``split``) through the real site and coordinator code.

The ``mean`` round of such a job sums rows clipped to the radius the ``norms`` round chose
(``clip_c(u) / c``: sensitivity 2, i.e. ``2c`` in ``u``) and the ``norms`` round histograms
the uncentred rows. Sensitivity is SEARCHED over every extreme schema-valid row (as in
test_pca_rounds.py); a planted copy that forgets the clip is caught by the same search, and
the noise's scale is checked statistically against a planted half-sensitivity copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest

from dpfed.common.errors import ValidationError
from dpfed.common.job_params import PCAParams
from dpfed.common.jobs import pca as handler_module
from dpfed.common.jobs.contract import Ask, Budget
from dpfed.common.jobs.params import ConnectedSite
from dpfed.common.jobs.registry import job_kind
from dpfed.common.pca.features import UnitBallMap
from dpfed.common.privacy.mechanisms import GaussianMechanism, gaussian_sigma
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.site_agent.handlers.base import site_release
from tests.site_agent.test_pca_rounds import SCHEMA, P, base_frame, extreme_rows
from tests.support.tables import FrameData, ZeroNoise, cost_of, produced

SPLIT = {"norms": [0.05, 0.1], "mean": [0.15, 0.1], "pca": [0.8, 0.8]}


def task(stage: str, clip: float | str, **extra: Any) -> Task:
    params = {"n_components": 2, "rank": P, "clip_norm": clip, "centering": "mean",
              "split": SPLIT, "composition": "gdp", "stage": stage, **extra}
    return Task(f"j/{stage}", "j", "pca", 1.0, 1e-5, params, {})


def search(t: Task) -> tuple[float, float]:
    """Largest L2 change of the released statistic over replace-one neighbours."""
    base = base_frame()
    stats, claimed = [], 0.0
    for row in extreme_rows():
        frame = pd.concat([base, pd.DataFrame([row])], ignore_index=True)
        prepared = site_release(t, FrameData(SCHEMA, frame))
        stats.append(next(iter(produced(prepared, ZeroNoise()).arrays.values())))
        claimed = cost_of(prepared).sensitivity
    m = np.array(stats)
    sq = np.sum(m * m, axis=1)
    return float(np.sqrt(max(float((sq[:, None] + sq[None, :] - 2 * m @ m.T).max()), 0.0))), \
        claimed


@pytest.mark.parametrize("clip", [0.25, 1.0, 2.5])
def test_clipped_mean_round_sensitivity_search(clip: float) -> None:
    observed, claimed = search(task("mean", clip))
    assert claimed == 2.0  # in units of the radius: 2c in u
    assert observed <= claimed * (1 + 1e-9)
    if clip <= 1.0:  # extreme rows are longer than the radius: the bound is nearly attained
        assert observed >= 1.5


def test_planted_unclipped_mean_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def unclipped(site: Any, clip: float | None, center: Any = None) -> Any:
        unit = UnitBallMap(site.data.schema)
        for table, _report in site.data.iter_chunks():
            yield unit.scaled(table) / clip, 0  # divides by the radius but never clips

    monkeypatch.setattr(handler_module, "_unit_rows", unclipped)
    observed, claimed = search(task("mean", 0.25))
    assert observed > claimed * 1.2


def test_norms_round_of_a_clip_first_job_reads_uncentred_rows() -> None:
    observed, claimed = search(task("norms", "auto"))  # no centre is sent or needed
    assert claimed == pytest.approx(np.sqrt(2)) and observed == pytest.approx(np.sqrt(2))


def mean_noise(clip: float) -> np.ndarray:
    frame = base_frame(50)
    prepared = site_release(task("mean", clip), FrameData(SCHEMA, frame))
    exact = produced(prepared, ZeroNoise()).arrays["sum"]
    rng = np.random.default_rng(11)
    return np.concatenate([produced(prepared, rng).arrays["sum"] - exact for _ in range(200)])


def sd_matches(noise: np.ndarray, sigma: float) -> bool:
    return abs(noise.std() - sigma) < 4 * sigma / np.sqrt(2 * noise.size)


def test_clipped_mean_noise_scale_and_a_planted_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    sigma = gaussian_sigma(1.0, 1e-5, 2.0)
    assert sd_matches(mean_noise(0.5), sigma)
    monkeypatch.setattr(handler_module, "mean_sum_mechanism",
                        lambda e, d, c="analytic": GaussianMechanism(e, d, 1.0, c))
    assert not sd_matches(mean_noise(0.5), sigma)  # planted: half the sensitivity


def test_a_clip_first_mean_task_needs_its_resolved_radius() -> None:
    with pytest.raises(ValidationError, match="resolved clip_norm"):
        site_release(task("mean", "auto"), FrameData(SCHEMA, base_frame()))


def test_the_coordinator_scales_the_clipped_mean_back_and_projects_it() -> None:
    params = PCAParams.parse({k: v for k, v in task("mean", "auto").params.items()
                              if k != "stage"}, SCHEMA)
    ask = Ask(params, SCHEMA, 0.5, Budget(1.0, 1e-5))
    results = {"a": TaskResult("j/mean", cost_of(site_release(task("mean", 0.5), FrameData(
        SCHEMA, base_frame()))), {"sum": np.full(P, 10.0)}, {"n_rows": 20})}
    mu = handler_module.MEAN.pool(results, ask)
    # 10 / 20 per coordinate in units of c, times c = 0.25 each; norm 0.61 > c: projected
    assert np.linalg.norm(mu) == pytest.approx(0.5)
    assert np.allclose(mu, mu[0])
    assert handler_module.MEAN.request(ask).params["clip_norm"] == 0.5


# --------------------------------------------------------------------------- the plan

FACTS = [ConnectedSite(1000, "pld")] * 10


def test_settle_chooses_a_public_split_and_the_first_plan_keeps_its_bytes() -> None:
    kind = job_kind("pca")
    canonical = kind.canonical({"n_components": 2}, 1.0, 1e-3, SCHEMA)
    assert canonical == {"n_components": 2, "rank": 4, "calibration": "analytic",
                         "aggregation": "site", "clip_norm": "auto", "centering": "mean",
                         "clip_quantile": 0.9, "site_weighting": "size"}  # the first plan
    first = kind.plan(kind.parse(canonical, SCHEMA), 1.0, 1e-3)
    assert [r.name for r in first] == ["mean", "norms", "pca"]
    assert [r.epsilon for r in first] == pytest.approx([0.1, 0.1, 0.8])
    settled = kind.settle(canonical, 1.0, 1e-3, SCHEMA, FACTS)
    assert settled == kind.settle(canonical, 1.0, 1e-3, SCHEMA, FACTS)  # deterministic
    assert settled["composition"] == "gdp" and list(settled["split"]) == ["norms", "mean", "pca"]
    params = kind.parse(settled, SCHEMA)
    assert params.clip_first and params.required_accountant(1.0, 1e-3)[0] == "pld"
    plan = kind.plan(params, 1.0, 1e-3)
    assert [r.name for r in plan] == ["norms", "mean", "pca"]
    assert sum(r.delta for r in plan) == pytest.approx(1e-3)
    # a basic ledger among the sites: shares of (epsilon, delta), summing to the job's
    basic = kind.parse(kind.settle(canonical, 1.0, 1e-3, SCHEMA,
                                   [*FACTS[:9], ConnectedSite(1000, "basic")]), SCHEMA)
    assert basic.composition == "basic" and basic.required_accountant(1.0, 1e-3) is None
    assert sum(r.epsilon for r in kind.plan(basic, 1.0, 1e-3)) == pytest.approx(1.0)
    # no site connected, a secure job, or a one-round job: nothing to settle
    assert kind.settle(canonical, 1.0, 1e-3, SCHEMA, []) == canonical
    one = kind.canonical({"n_components": 2, "centering": "none", "clip_norm": 1.0}, 1.0, 1e-3,
                         SCHEMA)
    assert kind.settle(one, 1.0, 1e-3, SCHEMA, FACTS) == one


def test_gdp_split_is_charged_exactly_the_job_budget_by_a_pld_ledger() -> None:
    from dpfed.common.privacy.spent import Spent

    kind = job_kind("pca")
    settled = kind.settle(kind.canonical({"n_components": 2}, 1.0, 1e-3, SCHEMA), 1.0, 1e-3,
                          SCHEMA, FACTS)
    plan = kind.plan(kind.parse(settled, SCHEMA), 1.0, 1e-3)
    costs = [GaussianMechanism(r.epsilon, r.delta, 1.0).cost() for r in plan]
    spent = Spent.of(costs).pairs_epsilon(1e-3)
    assert 0.99 <= spent <= 1.0 + 1e-6  # the whole budget buys noise, no more is charged
    assert sum(c.epsilon for c in costs) > 1.2  # what a basic ledger would have added up


@pytest.mark.parametrize(("split", "match"), [
    ({"mean": [0.5, 0.5], "pca": [0.5, 0.5]}, "exactly this job's rounds"),
    ({"norms": [0.2, 0.1], "mean": [0.2, 0.1], "pca": [0.5, 0.8]}, "shares must sum to 1"),
    ({"norms": [0.2, 0.1], "mean": [0.2, 0.1], "pca": [0.6, 0.7]}, "delta shares must sum"),
    ({"norms": [0.0, 0.1], "mean": [0.2, 0.1], "pca": [0.8, 0.8]}, "share"),
    ({"norms": 0.1, "mean": [0.2, 0.1], "pca": [0.7, 0.8]}, r"\[share, delta share\]"),
    ("even", "must map round names"),
])
def test_bad_splits_are_refused_before_anything_runs(split: Any, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        job_kind("pca").canonical({"n_components": 2, "split": split}, 1.0, 1e-3, SCHEMA)


def test_split_rules_between_fields() -> None:
    kind = job_kind("pca")
    with pytest.raises(ValidationError, match="composition applies to a pca job with a split"):
        kind.canonical({"n_components": 2, "composition": "gdp"}, 1.0, 1e-3, SCHEMA)
    secure = kind.canonical({"n_components": 2, "aggregation": "secure", "clip_norm": 1.0,
                             "split": {"mean": [0.2, 0.2], "pca": [0.8, 0.8]}}, 1.0, 1e-3,
                            SCHEMA)  # secure jobs settle (and take) a split too
    assert [r.epsilon for r in kind.plan(kind.parse(secure, SCHEMA), 1.0, 1e-3)] == \
        pytest.approx([0.2, 0.8])
    with pytest.raises(ValidationError, match="norms round"):
        kind.canonical({"n_components": 2, "clip_norm": 1.0, "split": SPLIT}, 1.0, 1e-3, SCHEMA)


def test_a_pld_site_with_exactly_the_job_budget_left_takes_part() -> None:
    from dpfed.common.jobs.eligibility import exclusion
    from dpfed.common.privacy.accounting import BudgetStatus

    kind = job_kind("pca")
    params = kind.parse(kind.settle(kind.canonical({"n_components": 2}, 1.0, 1e-3, SCHEMA),
                                    1.0, 1e-3, SCHEMA, FACTS), SCHEMA)
    plan = kind.plan(params, 1.0, 1e-3)
    assert sum(r.epsilon for r in plan) > 1.2

    def site(accountant: str, cap: float) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(allowed_kinds=("pca",), max_epsilon_per_task=None,
                               secure_policy="", budget=BudgetStatus(
                                   accountant, cap, 1e-3, 0.0, 0.0, 0.0, 0))

    need = params.required_accountant(1.0, 1e-3)
    assert exclusion(site("pld", 1.0 + 1e-6), "pca", plan, sums=True, accountant=need) is None
    tight = exclusion(site("pld", 0.9), "pca", plan, sums=True, accountant=need)
    assert tight is not None and "epsilon=1" in tight.reason
    basic = exclusion(site("basic", 10.0), "pca", plan, sums=True, accountant=need)
    assert basic is not None and "'pld' accountant" in basic.reason


def test_the_centred_radius_is_a_public_function_of_the_radius_and_the_mean() -> None:
    from dpfed.common.pca.centring import centred_radius

    assert centred_radius(2.0, np.zeros(3)) == 2.0
    assert centred_radius(2.0, np.array([1.2, 0.0, 1.6])) == pytest.approx(np.sqrt(4 - 4) + 0.5)
    assert centred_radius(5.0, np.array([3.0, 0.0, 0.0])) == pytest.approx(4.0)
    with pytest.raises(ValidationError, match="clip_norm"):
        centred_radius(0.0, np.zeros(3))


def test_a_pld_site_that_has_spent_is_not_left_out_for_its_delta() -> None:
    """A pld ledger reports its spend at its delta cap (no delta 'left'): epsilon decides."""
    from types import SimpleNamespace

    from dpfed.common.jobs.eligibility import exclusion
    from dpfed.common.privacy.accounting import BudgetStatus

    kind = job_kind("pca")
    plan = kind.plan(kind.parse(kind.canonical({"n_components": 2}, 1.0, 1e-5, SCHEMA),
                                SCHEMA), 1.0, 1e-5)
    spent = SimpleNamespace(allowed_kinds=("pca",), max_epsilon_per_task=None, secure_policy="",
                            budget=BudgetStatus("pld", 10.0, 1e-5, 0.6, 1e-5, 0.0, 3))
    assert spent.budget.delta_remaining == 0.0
    assert exclusion(spent, "pca", plan, sums=True) is None


def test_plan_notes_state_the_split_and_why() -> None:
    kind = job_kind("pca")
    fixed = kind.parse(kind.canonical({"n_components": 2}, 1.0, 1e-3, SCHEMA), SCHEMA)
    assert "fixed (mean 10%, norms 10%, pca 80%" in fixed.plan_note(1.0, 1e-3)
    secure = kind.parse(kind.canonical({"n_components": 2, "aggregation": "secure"}, 1.0,
                                       1e-3, SCHEMA), SCHEMA)
    assert "norms 10%, mean 10%, pca 80% of epsilon and delta; no site taking secure sums" in \
        secure.plan_note(1.0, 1e-3)
    settled = kind.parse(kind.settle(fixed.to_mapping(), 1.0, 1e-3, SCHEMA, FACTS), SCHEMA)
    note = settled.plan_note(1.0, 1e-3)
    assert note.startswith("budget split: shares of mu^2 (GDP): norms 0.")
    assert "charged exactly epsilon 1 at delta 0.001" in note
