"""The check of every decoded secure sum: honest sums pass, impossible ones are refused.

Honest sums are built as the sites build them -- rows rounded into the plan's ball, exact
integer statistics, Skellam noise of the pooled variance -- from the worst rows the bounds
allow (every row on the ball's sphere, all counts in one cell), over many seeded draws; they
must all pass. A participant's shift beyond what the public row count allows (the 2^50 of the
hostile review, or less) must be refused with ``impossible_secure_sum``. A shift that stays
within the bounds is NOT detectable -- asserted here as the documented limit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpfed.common.errors import ImpossibleSumError, ProtocolError
from dpfed.common.privacy.skellam import skellam_noise
from dpfed.common.secagg.linear_sum import check_linear_decoded, plan_linear
from dpfed.common.secagg.secure_sum import (
    SecureSumPlan,
    check_decoded,
    integer_gram_upper,
    integer_row_sum,
    plan_for,
)

SITES = ["a", "b", "c"]
N = 600
SEEDS = range(40)


def _noise(plan: SecureSumPlan, rng: np.random.Generator) -> np.ndarray:
    return skellam_noise(plan.n_values, plan.pooled_variance, rng)


def _rows(dim: int, rng: np.random.Generator, *, sphere: bool) -> np.ndarray:
    x = rng.standard_normal((N, dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x if sphere else x * rng.uniform(0, 1, (N, 1))


@pytest.mark.parametrize("statistic", ["gram", "row_sum"])
@pytest.mark.parametrize("epsilon", [0.5, 20.0])
def test_honest_sums_of_worst_case_rows_pass(statistic: str, epsilon: float) -> None:
    dim = 5
    plan = plan_for(statistic, dim=dim, total_rows=N, epsilon=epsilon, delta=1e-6,
                    participants=SITES, tolerated=1)
    make = integer_gram_upper if statistic == "gram" else integer_row_sum
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        rows = _rows(dim, rng, sphere=True)
        if seed % 2:  # one row repeated: the largest diagonal and off-diagonal entries
            rows = np.repeat(rows[:1], N, axis=0)
        total = make([rows], plan, rng) + _noise(plan, rng)
        check_decoded(total, plan, N)


@pytest.mark.parametrize("statistic", ["gram", "row_sum"])
def test_a_shift_beyond_the_bounds_is_refused(statistic: str) -> None:
    plan = plan_for(statistic, dim=5, total_rows=N, epsilon=5.0, delta=1e-6,
                    participants=SITES, tolerated=1)
    rng = np.random.default_rng(0)
    make = integer_gram_upper if statistic == "gram" else integer_row_sum
    total = make([_rows(5, rng, sphere=False)], plan, rng) + _noise(plan, rng)
    for shift in (2 ** 50, int(2 * N * plan.bound ** plan.degree)):
        shifted = total.copy()
        shifted[0] += shift
        with pytest.raises(ImpossibleSumError, match="^impossible_secure_sum: "):
            check_decoded(shifted, plan, N)
    # a negative diagonal, or an off-diagonal entry its diagonal entries cannot carry
    if statistic == "gram":
        low = total.copy()
        low[0] = -int(N * plan.bound ** 2)
        with pytest.raises(ImpossibleSumError, match="diagonal"):
            check_decoded(low, plan, N)
        off = total.copy()
        off[1] += int(N * plan.bound ** 2 * 0.45)  # within N B^2 / 2 on its own
        with pytest.raises(ImpossibleSumError):
            check_decoded(off, plan, N)


def test_a_shift_within_the_bounds_is_not_detectable() -> None:
    """The documented limit: a participant can bias a sum as far as its rows could."""
    plan = plan_for("row_sum", dim=5, total_rows=N, epsilon=5.0, delta=1e-6,
                    participants=SITES, tolerated=1)
    rng = np.random.default_rng(1)
    total = integer_row_sum([_rows(5, rng, sphere=False) * 0.1], plan, rng)
    total[0] += int(N * plan.bound * 0.5)  # as if half the rows had moved to the edge
    check_decoded(total + _noise(plan, rng), plan, N)


def test_counts_each_group_sums_to_the_rows() -> None:
    groups = (3, 4, 2)
    plan = plan_for("counts", dim=sum(groups), total_rows=N, epsilon=1.0, delta=1e-6,
                    participants=SITES, tolerated=1, row_norm=math.sqrt(len(groups)))
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        counts = np.concatenate([np.bincount(rng.integers(0, g, N) if seed % 3 else
                                             np.zeros(N, dtype=int), minlength=g)
                                 for g in groups]).astype(np.int64)
        check_decoded(counts + _noise(plan, rng), plan, N, groups=groups)
    rng = np.random.default_rng(0)
    counts = np.concatenate([np.bincount(rng.integers(0, g, N), minlength=g) for g in groups])
    with pytest.raises(ImpossibleSumError, match="summing to"):  # rows counted twice
        check_decoded(2 * counts.astype(np.int64), plan, N, groups=groups)
    hostile = counts.astype(np.int64) + _noise(plan, rng)
    hostile[0] += 17_000_000_000  # the secure count of 1.7e10 from 6,000 rows
    with pytest.raises(ImpossibleSumError, match="outside"):
        check_decoded(hostile, plan, N, groups=groups)


def test_weighted_counts_and_scores() -> None:
    weights = (2, 3)
    groups = (4, 5)
    plan = plan_for("weighted_counts", dim=9, total_rows=N, epsilon=1.0, delta=1e-6,
                    participants=SITES, tolerated=1,
                    row_norm=math.sqrt(sum(w * w for w in weights)))
    rng = np.random.default_rng(2)
    counts = np.concatenate([w * np.bincount(rng.integers(0, g, N), minlength=g)
                             for w, g in zip(weights, groups, strict=True)]).astype(np.int64)
    check_decoded(counts + _noise(plan, rng), plan, N, groups=groups, weights=weights)
    with pytest.raises(ImpossibleSumError):  # the weights of another site
        check_decoded(2 * counts + _noise(plan, rng), plan, N, groups=groups, weights=weights)
    scores = plan_for("scores", dim=6, total_rows=N, epsilon=1.0, delta=1e-6,
                      participants=SITES, tolerated=1, row_norm=2.0)
    top = np.full(6, 2 * N, dtype=np.int64)  # every score at its largest
    check_decoded(top + _noise(scores, rng), scores, N)
    with pytest.raises(ImpossibleSumError):
        check_decoded(top + 2 ** 40, scores, N)


def test_linear_answers_lie_between_n_times_their_rows_extremes() -> None:
    a = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [-1.0, 0.0, 1.0]])
    linear = plan_linear(a, scale=64, epsilon=1.0, delta=1e-6, participants=SITES, tolerated=1)
    rng = np.random.default_rng(3)
    for cell in range(3):  # every row in one cell: each answer at an extreme
        x = np.zeros(3, dtype=np.int64)
        x[cell] = N
        total = linear.matrix @ x + _noise(linear.plan, rng)
        check_linear_decoded(total, linear, N)
    hostile = linear.matrix @ np.array([N, 0, 0]) + _noise(linear.plan, rng)
    hostile[1] += 2 ** 50
    with pytest.raises(ImpossibleSumError, match="^impossible_secure_sum: .* answer 1"):
        check_linear_decoded(hostile, linear, N)
    with pytest.raises(ProtocolError, match="may have wrapped"):
        check_linear_decoded(hostile, linear, 2 ** 62)
