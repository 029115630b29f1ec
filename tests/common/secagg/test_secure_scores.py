"""The ``scores`` statistic of a secure sum (the synth job's floored dependence scores): the
sensitivities and scale the plan derives from the per-entry bound ``b``, the refusals of what
a scores sum cannot be, the no-wrap bound from the public range ``[0, b N]``, the decoded
pooled scores, and an exhaustive worst-case search over neighbouring tables of a small domain
(floored L1 distances to an independence table, the real ``dependence_scores``), which also
catches a plan calibrated for ``b = 1`` and a score that double counts."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.secagg.fixed_point import SAFE_ABS, skellam_tail
from dpfed.common.secagg.secure_sum import (
    MAX_SCORE_BOUND,
    PLANNERS,
    STATISTICS,
    SecureSumPlan,
    decode_sum,
    plan_for,
    plan_from_scale,
    plan_scores,
    score_bound,
)
from dpfed.common.synth.pair_marginals import PairGrid, PairTableAccumulator, dependence_scores
from tests.common.secagg.conftest import SITES
from tests.common.secagg.test_secure_sum import _run


def _plan(dim: int = 10, *, b: float = 2, epsilon: float = 1.0,
          total_rows: int = 4000) -> SecureSumPlan:
    return plan_scores(dim=dim, total_rows=total_rows, epsilon=epsilon, delta=1e-6,
                       participants=SITES, row_norm=b)


def test_plan_has_scale_one_and_the_per_entry_sensitivities() -> None:
    plan = _plan(10, b=2)
    assert (plan.statistic, plan.scale, plan.bound, plan.n_values) == ("scores", 1.0, 2.0, 10)
    assert plan.calibration.l2_sensitivity == pytest.approx(2 * math.sqrt(10))
    assert plan.calibration.l1_sensitivity == pytest.approx(20.0)
    assert STATISTICS["scores"] == 1 and PLANNERS["scores"] is plan_scores
    assert plan_for("scores", dim=10, total_rows=4000, epsilon=1.0, delta=1e-6,
                    participants=SITES, row_norm=2.0) == plan
    # a site recomputing the plan from the same public inputs adds the same noise
    again = plan_from_scale("scores", dim=10, scale=1.0, row_norm=2.0, epsilon=1.0,
                            delta=1e-6, participants=list(SITES), tolerated=0)
    assert again.mu_total == plan.mu_total
    # the noise grows with b: b = 3 needs more than b = 2
    assert _plan(10, b=3).mu_total > plan.mu_total
    assert score_bound(2.0) == 2 and score_bound(7) == 7


@pytest.mark.parametrize("row_norm", [1.5, 0.0, -2.0, math.nan, math.inf, True, "2",
                                      MAX_SCORE_BOUND + 1])
def test_plan_refuses_a_bound_that_is_not_a_positive_integer(row_norm: object) -> None:
    with pytest.raises(ValidationError, match="row_norm = the per-entry bound b"):
        _plan(10, b=row_norm)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="row_norm = the per-entry bound b"):
        plan_from_scale("scores", dim=10, scale=1.0, row_norm=row_norm,  # type: ignore[arg-type]
                        epsilon=1.0, delta=1e-6, participants=list(SITES), tolerated=0)


def test_plan_refuses_what_a_scores_sum_cannot_be() -> None:
    with pytest.raises(ValidationError, match="scale 1"):
        plan_from_scale("scores", dim=10, scale=2.0, row_norm=2.0, epsilon=1.0, delta=1e-6,
                        participants=list(SITES), tolerated=0)
    with pytest.raises(ValidationError, match="dim"):
        _plan(0)
    with pytest.raises(ValidationError, match="total_rows"):
        _plan(10, total_rows=0)
    with pytest.raises(ValidationError, match="more than 4 participants"):
        plan_scores(dim=10, total_rows=100, epsilon=1.0, delta=1e-6, participants=SITES,
                    tolerated=4, row_norm=2.0)


def test_no_wrap_bound_uses_the_public_range_b_times_n() -> None:
    plan = _plan(10, b=2, epsilon=0.1)
    tail = skellam_tail(plan.mu_total, plan.n_values)
    inside = int((SAFE_ABS - 2 * tail) // 2)
    assert _plan(10, b=2, epsilon=0.1, total_rows=inside)
    # b N, not N: the same row count fits a b = 1 sum but not a b = 2 one
    over = int((SAFE_ABS - tail) // 2) + 1
    with pytest.raises(ValidationError, match="64-bit ring"):
        _plan(10, b=2, epsilon=0.1, total_rows=over)
    assert _plan(10, b=1, epsilon=0.1, total_rows=over)


def test_decoded_scores_are_the_pooled_scores(fed: Path) -> None:
    rng = np.random.default_rng(31)
    n_s = 1000
    scores = {s: rng.integers(0, 2 * n_s + 1, 12).astype(np.int64) for s in SITES}
    plan = _plan(12, epsilon=50.0, total_rows=4 * n_s)
    decoded = decode_sum(_run(fed, plan, scores, rng), plan)
    # at epsilon 50 the Skellam noise has sd ~ 0.5: the decode is the pooled sum
    assert np.max(np.abs(decoded - sum(scores.values()))) <= 4.0


# --------------------------------------------------------------------------- worst case

_SMALL = Schema.from_toml("""
[[columns]]
name = "x"
type = "ordinal"
levels = ["1", "2", "3"]
[[columns]]
name = "y"
type = "nominal"
categories = ["a", "b", "c"]
[[columns]]
name = "z"
type = "ordinal"
levels = ["lo", "hi"]
""")
#: Uneven DP proportions: fractional independence tables, so flooring matters.
_PROPS = np.array([0.17, 0.31, 0.52, 0.45, 0.35, 0.2, 0.63, 0.37])


def _floored(codes: np.ndarray, *, double: bool = False) -> tuple[np.ndarray, int]:
    grid = PairGrid.from_proportions(_SMALL, _PROPS, 2)
    pairs = grid.candidate_pairs()
    table = EncodedTable(_SMALL, {c.name: codes[:, i].astype(np.int32)
                                  for i, c in enumerate(_SMALL.columns)}, codes.shape[0])
    acc = PairTableAccumulator(grid, pairs)
    acc.add(table)
    if double:  # planted bug: every row counted twice in the tables
        acc.add(table)
    s = dependence_scores(acc.counts, grid, pairs, _PROPS, codes.shape[0])
    return np.floor(s).astype(np.int64), len(pairs)


def _search(*, double: bool = False) -> tuple[float, float, float, int]:
    """Largest per-entry, L2 and L1 change over every replacement of row 0, several tables."""
    records = np.array(list(itertools.product(range(3), range(3), range(2))))
    rng = np.random.default_rng(5)
    worst_inf = worst2 = worst1 = 0.0
    n_pairs = 0
    for n in (1, 4, 9):
        for _ in range(4):
            base = records[rng.integers(0, len(records), n)]
            stats = []
            for r in records:
                rows = base.copy()
                rows[0] = r
                stat, n_pairs = _floored(rows, double=double)
                if not double:
                    assert stat.min() >= 0 and stat.max() <= 2 * n  # the public range
                stats.append(stat.astype(np.float64))
            for a, b in itertools.combinations(stats, 2):
                worst_inf = max(worst_inf, float(np.abs(a - b).max()))
                worst2 = max(worst2, float(np.linalg.norm(a - b)))
                worst1 = max(worst1, float(np.abs(a - b).sum()))
    return worst_inf, worst2, worst1, n_pairs


def test_worst_case_search_within_and_attaining_the_plans_bounds() -> None:
    worst_inf, worst2, worst1, n_pairs = _search()
    plan = _plan(n_pairs, b=2)
    assert worst_inf == plan.bound == 2.0  # attained: flooring keeps, never exceeds, b = 2
    assert worst2 <= plan.calibration.l2_sensitivity + 1e-12
    assert worst1 <= plan.calibration.l1_sensitivity + 1e-12
    assert worst2 == pytest.approx(plan.calibration.l2_sensitivity)  # every pair moves by 2


def test_search_catches_a_plan_for_b_one_and_a_double_counting_score() -> None:
    worst_inf, worst2, _, n_pairs = _search()
    broken_plan = _plan(n_pairs, b=1)  # planted: the sensitivity of an unfloored count
    assert worst_inf > broken_plan.bound and worst2 > broken_plan.calibration.l2_sensitivity
    worst_inf, worst2, _, _ = _search(double=True)
    plan = _plan(n_pairs, b=2)
    assert worst_inf > plan.bound and worst2 > plan.calibration.l2_sensitivity * 1.5
