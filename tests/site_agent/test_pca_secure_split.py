"""A secure pca job's budget split: settled from the secure sums' pooled noise, stored, replayed.

The split's targets (docs/pca.md, "Budget split") are checked against the noise the real
secure-sum planners give each round at its settled budget -- the pooled variance of the decoded
sum, ``n / (n - t - d)`` times the calibrated one -- so a split that ignored the colluders'
or the dropouts' factor (a planted copy) misses them and is caught.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest

from dpfed.common.jobs.modes import secure_limits
from dpfed.common.jobs.params import ConnectedSite
from dpfed.common.jobs.registry import job_kind
from dpfed.common.pca.centring import MEAN_ERROR_RATIO, QUANTILE_COUNT_ERROR
from dpfed.common.pca.clipping import norm_bound, norm_grid
from dpfed.common.secagg.secure_sum import SecureSumPlan, plan_counts, plan_gram, plan_row_sum
from tests.site_agent.test_pca_rounds import SCHEMA, P

EPS, DELTA, ROWS = 1.0, 1e-3, 1000
SECURE = {"n_components": 2, "aggregation": "secure"}


def facts(n: int, tolerated: int, dropouts: int = 0) -> list[ConnectedSite]:
    return [ConnectedSite(ROWS, "pld", tolerated, dropouts)] * n


def settled(n: int, tolerated: int, dropouts: int = 0) -> dict[str, Any]:
    kind = job_kind("pca")
    return kind.settle(kind.canonical(SECURE, EPS, DELTA, SCHEMA), EPS, DELTA, SCHEMA,
                       facts(n, tolerated, dropouts))


def pooled(plan: SecureSumPlan, dropouts: int) -> float:
    """The decoded sum's noise variance per entry, in the units of the rows."""
    plan = dataclasses.replace(plan, dropouts=dropouts)  # as the coordinator sets it
    return plan.pooled_variance / plan.scale ** (2 * plan.degree)


def targets(raw: dict[str, Any], n: int, tolerated: int, wanted_drops: int) -> tuple[float, float]:
    """Return (norms, mean) at the real secure plans, each 1 when the split meets its target.

    ``norms``: three standard deviations of the pooled cumulative count over
    ``QUANTILE_COUNT_ERROR N``; ``mean``: the DP mean's error energy over
    ``MEAN_ERROR_RATIO`` of the centred Gram noise's spectral norm ``2 sqrt(p) sd``.
    """
    kind = job_kind("pca")
    budget = {r.name: r for r in kind.plan(kind.parse(raw, SCHEMA), EPS, DELTA)}
    ids = [f"h{i}" for i in range(n)]
    total = n * ROWS
    _, d = secure_limits(n, [tolerated], [wanted_drops])

    def plan(planner: Any, name: str, dim: int) -> SecureSumPlan:
        plan: SecureSumPlan = planner(dim=dim, total_rows=total, epsilon=budget[name].epsilon,
                                      delta=budget[name].delta, participants=ids,
                                      tolerated=tolerated)
        return plan

    bins = len(norm_grid(norm_bound(SCHEMA, centred=False)))
    count_sd = math.sqrt(bins * pooled(plan(plan_counts, "norms", bins), d))
    norms = 3.0 * count_sd / (QUANTILE_COUNT_ERROR * total)
    mean_energy = P * pooled(plan(plan_row_sum, "mean", P), d) / total ** 2
    gram_spectral = 2.0 * math.sqrt(P * pooled(plan(plan_gram, "pca", P), d)) / total
    return norms, mean_energy / (MEAN_ERROR_RATIO * gram_spectral)


@pytest.mark.parametrize(("n", "tolerated", "drops"), [(3, 1, 0), (4, 1, 1)])
def test_the_secure_split_meets_its_targets_at_the_real_pooled_noise(
        n: int, tolerated: int, drops: int) -> None:
    raw = settled(n, tolerated, drops)
    assert list(raw["split"]) == ["norms", "mean", "pca"] and raw["composition"] == "gdp"
    norms, mean = targets(raw, n, tolerated, drops)
    # the Skellam calibration's slack (~1 %) and the fixed-point rounding bound, no more
    assert norms == pytest.approx(1.0, abs=0.03)
    assert mean == pytest.approx(1.0, abs=0.03)


def test_a_split_that_ignores_the_colluders_factor_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import dpfed.common.jobs.modes as modes

    monkeypatch.setattr(modes, "secure_pooled_factor", lambda n, t, d=0: 1.0)  # planted
    norms, mean = targets(settled(3, 1), 3, 1, 0)
    assert norms > 1.15 and mean > 1.15  # sqrt(n / (n - t)) = 1.22 short of the targets


def test_the_secure_split_is_stored_and_replayed_byte_for_byte() -> None:
    kind = job_kind("pca")
    raw = settled(4, 1)
    stored = json.dumps(raw, sort_keys=True)
    params = kind.parse(json.loads(stored), SCHEMA)  # what a resumed job runs with
    assert json.dumps(params.to_mapping(), sort_keys=True) == stored
    assert params.clip_first and params.required_accountant(EPS, DELTA)[0] == "pld"
    plan = kind.plan(params, EPS, DELTA)
    assert [r.name for r in plan] == ["norms", "mean", "pca"]
    assert kind.plan(kind.parse(raw, SCHEMA), EPS, DELTA) == plan  # deterministic
    # the split depends on t: more colluders, more pooled noise, larger auxiliary shares
    assert settled(4, 2)["split"]["mean"][0] > raw["split"]["mean"][0]
    # a stored secure job from before the secure split keeps its bytes and its fixed split
    old = kind.canonical(SECURE, EPS, DELTA, SCHEMA)
    assert "split" not in old
    old_params = kind.parse(json.loads(json.dumps(old)), SCHEMA)
    assert old_params.to_mapping() == old
    old_plan = kind.plan(old_params, EPS, DELTA)
    assert [r.name for r in old_plan] == ["norms", "mean", "pca"]
    assert [r.epsilon for r in old_plan] == pytest.approx([0.1, 0.1, 0.8])
    # settling is for new jobs: a job that already has a split keeps it
    assert kind.settle(raw, 2 * EPS, DELTA, SCHEMA, facts(10, 0)) == raw


def test_a_secure_job_with_a_fixed_clip_norm_keeps_the_fixed_split() -> None:
    # its Gram is centred at the coordinator: the mean's error enters to first order, which
    # the split's targets (rows centred at the sites) do not model
    kind = job_kind("pca")
    for clip in ("schema", 0.5):
        raw = kind.canonical({**SECURE, "clip_norm": clip}, EPS, DELTA, SCHEMA)
        assert kind.settle(raw, EPS, DELTA, SCHEMA, facts(3, 1)) == raw
        params = kind.parse(raw, SCHEMA)
        assert not params.clip_first
        assert "secure jobs with a fixed clip_norm" in params.plan_note(EPS, DELTA)


def test_no_secure_site_or_no_honest_one_leaves_the_fixed_split() -> None:
    kind = job_kind("pca")
    old = kind.canonical(SECURE, EPS, DELTA, SCHEMA)
    site_only = [ConnectedSite(ROWS, "pld")] * 4  # their policies are off
    assert kind.settle(old, EPS, DELTA, SCHEMA, site_only) == old
    assert kind.settle(old, EPS, DELTA, SCHEMA, facts(2, 2)) == old
    note = kind.parse(settled(3, 1), SCHEMA).plan_note(EPS, DELTA)
    assert "n / (n - t - d)" in note and note.startswith("budget split: shares of mu^2")
