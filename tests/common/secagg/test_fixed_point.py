"""Fixed-point encoding: unbiased conditional rounding inside the public bound, a scale that
cannot wrap for the most extreme schema-valid rows, and wrap detection on decode."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpfed.common.errors import ValidationError
from dpfed.common.secagg.fixed_point import (
    SAFE_ABS,
    conditional_round,
    from_ring,
    max_scale,
    rounded_norm_bound,
    skellam_tail,
    to_ring,
)


def test_rounding_is_unbiased_and_within_the_bound() -> None:
    rng = np.random.default_rng(3)
    d, s = 20, 37.5
    x = rng.normal(size=(1, d))
    x /= np.linalg.norm(x)
    bound = rounded_norm_bound(s, d)
    z = conditional_round(np.repeat(x, 20_000, axis=0), s, bound, rng)
    assert np.all(np.linalg.norm(z, axis=1) <= bound + 1e-9)
    err = z.mean(axis=0) - s * x[0]
    assert np.max(np.abs(err)) < 5 * 0.5 / math.sqrt(20_000)  # rounding variance <= 1/4


def test_a_too_tight_bound_is_refused() -> None:
    rng = np.random.default_rng(4)
    with pytest.raises(ValidationError, match="public bound"):
        conditional_round(np.ones((3, 4)), 10.0, 5.0, rng)


@pytest.mark.parametrize("dim,total_rows", [(5, 10), (50, 200_000), (1000, 4_000_000)])
def test_extreme_rows_cannot_wrap_the_ring(dim: int, total_rows: int) -> None:
    rng = np.random.default_rng(dim)
    mu = 1e6
    n_values = dim * (dim + 1) // 2
    s = max_scale(row_norm=1.0, dim=dim, total_rows=total_rows, degree=2, mu=mu,
                  n_values=n_values)
    bound = rounded_norm_bound(s, dim)
    # The most extreme schema-valid row for a Gram entry: all mass on one coordinate.
    e1 = np.zeros((1, dim))
    e1[0, 0] = 1.0
    z = conditional_round(e1, s, bound, rng)
    worst_entry = total_rows * float(z[0] @ z[0]) + skellam_tail(mu, n_values)
    assert worst_entry < SAFE_ABS
    # The chosen scale is close to the largest safe one: doubling it would not fit.
    assert total_rows * rounded_norm_bound(2 * s, dim) ** 2 > SAFE_ABS - skellam_tail(mu, n_values)


def test_ring_round_trip_and_wrap_detection() -> None:
    v = np.array([-5, 0, 7, -(2**61)], dtype=np.int64)
    assert np.array_equal(from_ring(to_ring(v) + np.uint64(0)), v)
    with pytest.raises(ValidationError, match="wrapped"):
        from_ring(np.array([2**63 - 5], dtype=np.uint64))
    with pytest.raises(ValidationError):
        to_ring(np.array([1.5]))
