"""The ``counts`` statistic of a secure sum (the synth job's histograms): the decoded pooled
counts, the noise variance against the plan (a half-share copy is caught), the sensitivities
and scale the plan derives from the number of groups, and the no-wrap bound from public N."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from dpfed.common.errors import ValidationError
from dpfed.common.secagg.fixed_point import SAFE_ABS, skellam_tail
from dpfed.common.secagg.secure_sum import (
    SecureSumPlan,
    count_groups,
    decode_sum,
    plan_counts,
    plan_for,
    plan_from_scale,
    plan_weighted_counts,
)
from tests.common.secagg.conftest import SITES
from tests.common.secagg.test_secure_sum import _run

#: Three groups (histograms) of 4, 3 and 5 cells.
SIZES = (4, 3, 5)


def _histograms(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.concatenate([np.bincount(rng.integers(0, k, n), minlength=k) for k in SIZES])


def _plan(epsilon: float = 1.0, total_rows: int = 4000) -> SecureSumPlan:
    return plan_counts(dim=sum(SIZES), total_rows=total_rows, epsilon=epsilon, delta=1e-6,
                       participants=SITES, row_norm=math.sqrt(len(SIZES)))


def test_plan_has_scale_one_and_the_histograms_sensitivities() -> None:
    plan = plan_counts(dim=12, total_rows=4000, epsilon=1.0, delta=1e-6, participants=SITES,
                       row_norm=math.sqrt(3))
    assert plan.scale == 1.0 and plan.n_values == 12 and plan.statistic == "counts"
    assert plan.calibration.l2_sensitivity == pytest.approx(math.sqrt(6.0))
    assert plan.calibration.l1_sensitivity == pytest.approx(6.0)
    assert plan_for("counts", dim=12, total_rows=4000, epsilon=1.0, delta=1e-6,
                    participants=SITES, row_norm=math.sqrt(3)) == plan
    # a site recomputing the plan from the same public inputs gets the same noise
    again = plan_from_scale("counts", dim=12, scale=1.0, row_norm=math.sqrt(3), epsilon=1.0,
                            delta=1e-6, participants=list(SITES), tolerated=0)
    assert again.mu_total == plan.mu_total
    assert count_groups(math.sqrt(3)) == 3


def test_plan_refuses_what_a_counts_sum_cannot_be() -> None:
    common = {"epsilon": 1.0, "delta": 1e-6, "participants": SITES, "tolerated": 0}
    with pytest.raises(ValidationError, match="scale 1"):
        plan_from_scale("counts", dim=12, scale=2.0, row_norm=math.sqrt(3), **common)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="sqrt"):
        plan_from_scale("counts", dim=12, scale=1.0, row_norm=1.5, **common)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="at most one group per cell"):
        plan_from_scale("counts", dim=2, scale=1.0, row_norm=math.sqrt(3), **common)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="statistic must be one of"):
        plan_for("votes", dim=3, total_rows=10, epsilon=1.0, delta=1e-6, participants=SITES)


def test_decoded_counts_are_the_pooled_histograms(fed: Path) -> None:
    rng = np.random.default_rng(21)
    counts = {s: _histograms(rng, 1000) for s in SITES}
    plan = _plan(epsilon=50.0)
    decoded = decode_sum(_run(fed, plan, counts, rng), plan)
    pooled = sum(counts.values())
    # at epsilon 50 the Skellam noise has sd ~ 0.2 count: the decode is the pooled sum
    assert np.max(np.abs(decoded - pooled)) <= 3.0
    assert decoded.sum() == pytest.approx(len(SIZES) * 4000, abs=12)


def _noise_p_value(fed: Path, factor: float) -> float:
    from scipy import stats

    rng = np.random.default_rng(22)
    plan = _plan(epsilon=1.0)
    draws = []
    for _ in range(30):
        zero = {s: np.zeros(sum(SIZES), dtype=np.int64) for s in SITES}
        draws.append(decode_sum(_run(fed, plan, zero, rng, share_factor=factor), plan))
    noise = np.concatenate(draws)
    chi = float(np.sum(noise ** 2) / plan.mu_total)
    return float(2 * min(stats.chi2.cdf(chi, noise.size), stats.chi2.sf(chi, noise.size)))


def test_counts_carry_the_planned_variance_and_half_shares_are_caught(fed: Path) -> None:
    assert _noise_p_value(fed, 1.0) > 1e-3
    assert _noise_p_value(fed, 0.5) < 1e-6


def test_no_wrap_bound_from_the_public_row_count() -> None:
    plan = _plan(epsilon=0.1, total_rows=10 ** 12)
    tail = skellam_tail(plan.mu_total, plan.n_values)
    assert 10 ** 12 + tail < SAFE_ABS
    # the largest pooled count plus the noise's tail bound must fit the signed margin
    with pytest.raises(ValidationError, match="64-bit ring"):
        _plan(epsilon=0.1, total_rows=SAFE_ABS - int(tail) + 1)
    assert _plan(epsilon=0.1, total_rows=SAFE_ABS - int(2 * tail))  # just inside still plans


# --------------------------------------------------------------------------- weighted counts

#: Integer weights of the three groups (more cells, more weight, as the synth link round's).
WEIGHTS = np.array([3, 2, 4], dtype=np.int64)


def _weighted_plan(epsilon: float = 1.0, total_rows: int = 4000) -> SecureSumPlan:
    return plan_weighted_counts(dim=sum(SIZES), total_rows=total_rows, epsilon=epsilon,
                                delta=1e-6, participants=SITES,
                                row_norm=math.sqrt(float((WEIGHTS ** 2).sum())))


def test_weighted_plan_bounds_the_weighted_histograms_change() -> None:
    plan = _weighted_plan()
    assert plan.statistic == "weighted_counts" and plan.scale == 1.0
    # search: every pair of single rows (one cell per group each) -> the change one replaced
    # row makes to the weighted count vector
    rows = [np.concatenate([np.eye(k, dtype=np.int64)[c] * w for k, c, w in
                            zip(SIZES, cells, WEIGHTS, strict=True)])
            for cells in np.ndindex(*SIZES)]
    worst2 = max(float(np.linalg.norm(a - b)) for a in rows[:20] for b in rows)
    worst1 = max(float(np.abs(a - b).sum()) for a in rows[:20] for b in rows)
    assert worst2 == pytest.approx(plan.calibration.l2_sensitivity)  # tight
    assert worst1 == pytest.approx(2.0 * float(WEIGHTS.sum()))
    assert worst1 <= plan.calibration.l1_sensitivity  # the plan's L1 is conservative
    # the same weights as plain counts would under-state the sensitivity: the search catches it
    unweighted = _plan()
    assert worst2 > unweighted.calibration.l2_sensitivity * 1.5
    with pytest.raises(ValidationError, match="scale 1"):
        plan_from_scale("weighted_counts", dim=12, scale=2.0, row_norm=math.sqrt(29.0),
                        epsilon=1.0, delta=1e-6, participants=list(SITES), tolerated=0)
    with pytest.raises(ValidationError, match="sqrt"):
        plan_from_scale("weighted_counts", dim=12, scale=1.0, row_norm=1.5, epsilon=1.0,
                        delta=1e-6, participants=list(SITES), tolerated=0)


def test_decoded_weighted_counts_divided_by_the_weights_are_the_pooled_histograms(
        fed: Path) -> None:
    rng = np.random.default_rng(23)
    cell_weights = np.repeat(WEIGHTS, SIZES)
    counts = {s: _histograms(rng, 1000) for s in SITES}
    plan = _weighted_plan(epsilon=50.0)
    decoded = decode_sum(_run(fed, plan, {s: c * cell_weights for s, c in counts.items()},
                              rng), plan) / cell_weights
    assert np.max(np.abs(decoded - sum(counts.values()))) <= 3.0


def test_weighted_no_wrap_bound_uses_the_largest_weight() -> None:
    plan = _weighted_plan(epsilon=0.1, total_rows=10 ** 12)
    tail = skellam_tail(plan.mu_total, plan.n_values)
    limit = (SAFE_ABS - tail) / plan.bound  # pooled rows times the largest weight bound
    with pytest.raises(ValidationError, match="64-bit ring"):
        _weighted_plan(epsilon=0.1, total_rows=int(limit * (1 + 1e-9)))
    assert _weighted_plan(epsilon=0.1, total_rows=int(limit * (1 - 1e-9)))
    # plain counts of the same rows would still plan: the weights shrink the room
    assert _plan(epsilon=0.1, total_rows=int(limit * 2))
