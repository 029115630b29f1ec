"""Fixed-point encoding: unbiased conditional rounding inside the public bound, a scale that
cannot wrap for the most extreme schema-valid rows, and wrap detection on decode."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from dpfed.common.errors import ValidationError
from dpfed.common.secagg import fixed_point
from dpfed.common.secagg.fixed_point import (
    SAFE_ABS,
    conditional_round,
    conditional_round_float,
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


Rounder = Callable[[np.ndarray, float, float, np.random.Generator], np.ndarray]

#: One fractional part per column, 100,000 rows: every pass boundary is crossed many times.
FRACTIONS = np.linspace(0.05, 0.95, 19)


def rounding_is_fair(rounder: Rounder) -> bool:
    """Fixed seed, deterministic: for every fractional part f the mean rounding error is 0
    within 5 standard deviations (sqrt(f (1 - f) / m), m = 100,000: about 0.003), and the
    standardised errors of neighbouring values, of values in adjacent columns and of values
    one rounding pass apart are uncorrelated (|mean product| < 0.01; its sd is 0.0007)."""
    m, d = 100_000, FRACTIONS.size
    y = np.tile(3.0 + FRACTIONS, (m, 1))  # s = 1; a bound no rounding reaches: no retries
    z = rounder(y, 1.0, float(np.linalg.norm(y[0])) + math.sqrt(d), np.random.default_rng(8))
    sd = np.sqrt(FRACTIONS * (1 - FRACTIONS))
    r = (z - y) / sd
    unbiased = bool(np.all(np.abs(r.mean(axis=0)) < 5 / math.sqrt(m)))
    lags = {1, max(1, fixed_point._PASS_VALUES // d)}
    rows_independent = all(abs(float(np.mean(r[:-k] * r[k:]))) < 0.01 for k in lags)
    columns_independent = abs(float(np.mean(r[:, :-1] * r[:, 1:]))) < 0.01
    return unbiased and rows_independent and columns_independent


def test_rounding_is_unbiased_and_independent_and_planted_faults_are_caught() -> None:
    assert rounding_is_fair(conditional_round_float)

    def short_uniform(x: np.ndarray, s: float, b: float, rng: np.random.Generator) -> np.ndarray:
        return np.floor(x * s + 0.98 * rng.random(x.shape))  # rounds up too rarely

    def one_pass_of_uniforms(x: np.ndarray, s: float, b: float,
                             rng: np.random.Generator) -> np.ndarray:
        step = fixed_point._PASS_VALUES // x.shape[1]  # a buffer filled once, reused per pass
        u = np.resize(rng.random((step, x.shape[1])), x.shape)
        return np.floor(x * s + u)

    def one_uniform_per_row(x: np.ndarray, s: float, b: float,
                            rng: np.random.Generator) -> np.ndarray:
        return np.floor(x * s + rng.random((x.shape[0], 1)))

    for planted in (short_uniform, one_pass_of_uniforms, one_uniform_per_row):
        assert not rounding_is_fair(planted), planted.__name__


@pytest.mark.parametrize("order", ["C", "F"])
def test_rounding_in_passes_draws_the_stream_of_one_whole_array_draw(order: str) -> None:
    """Across pass boundaries and a final short pass, in either memory order, the rounding is
    the textbook ``floor(s x + U)`` with the uniforms of one draw for the whole array (rows
    well inside the bound: no retries)."""
    d = 7
    n = 3 * (fixed_point._PASS_VALUES // d) + 5
    x = np.asarray(np.random.default_rng(2).uniform(-0.3, 0.3, size=(n, d)), order=order)
    s = 41.3
    z = conditional_round_float(x, s, rounded_norm_bound(s, d), np.random.default_rng(9))
    expected = np.floor(x * s + np.random.default_rng(9).random((n, d)))
    assert np.array_equal(z, expected)


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
