"""Fixed-point encoding for secure aggregation: real rows to bounded integer rows, and the ring.

Secure aggregation adds masked integers in the ring Z_(2^64) (numpy ``uint64`` arithmetic
wraps exactly there). A site turns each real row ``x`` (already in a public ball of radius
``c``) into an integer row ``z = round(s x)`` with *randomized* rounding (each coordinate goes
up with probability equal to its fractional part, so ``E[z] = s x``), conditioned on
``||z||_2 <= B``: a row whose rounding lands outside the bound is rounded again. The bound ``B``
is public, so the sensitivity of any integer statistic built from the rows (a sum, a Gram
matrix) is derived from ``B`` alone, whatever the rounding did.

``B`` follows Kairouz, Liu & Steinke (ICML 2021, the distributed discrete Gaussian, Lemma on
randomized rounding): with probability at least ``1 - beta`` an unconditioned rounding already
satisfies ``||z||^2 <= (s c)^2 + d/4 + sqrt(2 ln(1/beta)) (s c + sqrt(d)/2)``; and always
``||z|| <= s c + sqrt(d)``. We take the smaller of the two.

Nothing may wrap: :func:`max_scale` chooses the largest scale ``s`` for which the largest
possible absolute value of the pooled statistic plus a tail bound on the noise stays below
``2^62`` (half the signed range, a factor-2 margin), from public quantities only (the schema's
dimension, the public row counts and the noise variance).
"""

from __future__ import annotations

import math

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.validation import check_int, check_positive

__all__ = [
    "RING_BITS",
    "conditional_round",
    "conditional_round_float",
    "from_ring",
    "max_scale",
    "rounded_norm_bound",
    "skellam_tail",
    "to_ring",
]

#: The ring is Z_(2^RING_BITS); numpy uint64 arithmetic wraps exactly there.
RING_BITS = 64
#: Largest absolute value a decoded coordinate may have (a factor-2 margin below 2^63).
SAFE_ABS = 2 ** 62
#: Rounding failures tolerated before giving up (each retry succeeds with prob >= 1 - beta).
_MAX_ROUNDS = 64
#: Values rounded per pass (256 KiB of float64): scaled rows, uniforms and norms stay in cache.
_PASS_VALUES = 1 << 15


def rounded_norm_bound(scaled_norm: float, dim: int, beta: float = math.exp(-20)) -> float:
    """Public bound B on ``||round(s x)||`` for rows with ``||s x|| <= scaled_norm``."""
    c = float(scaled_norm)
    if not math.isfinite(c) or c < 0:
        raise ValidationError(f"scaled_norm must be finite and >= 0, got {scaled_norm!r}")
    d = check_int(dim, "dim", minimum=1)
    if not 0 < beta < 1:
        raise ValidationError(f"beta must lie in (0, 1), got {beta!r}")
    tight = math.sqrt(c * c + d / 4 + math.sqrt(2 * math.log(1 / beta)) * (c + math.sqrt(d) / 2))
    return min(tight, c + math.sqrt(d))


def conditional_round_float(rows: np.ndarray, scale: float, bound: float,
                            rng: np.random.Generator) -> np.ndarray:
    """Randomized rounding of ``scale * rows``, as float64 integers, each row's norm <= bound.

    ``floor(y + U)`` with ``U ~ Uniform[0, 1)`` rounds ``y`` up with probability equal to its
    fractional part (unbiased). Rows whose rounded norm exceeds ``bound`` are rounded again
    (rare: see :func:`rounded_norm_bound`). Values are exact integers held in float64, ready
    for BLAS; :func:`conditional_round` returns them as int64. The rows are rounded in passes
    of about ``_PASS_VALUES`` values, so that the scaled values, their uniforms and their norms
    stay in the CPU cache; the uniforms are drawn in row order, as one draw for the whole array
    would draw them, and the retries after all rows.

    Raises
    ------
    ValidationError
        If a row cannot satisfy the bound (its scaled norm is already too large) or keeps
        failing after many retries (the bound is smaller than :func:`rounded_norm_bound`).
    """
    x = np.asarray(rows, dtype=np.float64)
    if x.ndim != 2 or not np.all(np.isfinite(x)):
        raise ValidationError("rows must be a finite 2-D array")
    s = check_positive(scale, "scale")
    b2 = check_positive(bound, "bound") ** 2 * (1 + 1e-12)
    n, d = x.shape
    z = np.empty((n, d), dtype=np.float64)
    step = max(1, _PASS_VALUES // max(d, 1))
    uniforms = np.empty((min(step, n), d), dtype=np.float64)
    too_long = [np.zeros(0, dtype=np.intp)]
    for start in range(0, n, step):
        stop = min(start + step, n)
        part, u = z[start:stop], uniforms[:stop - start]
        rng.random(out=u)
        np.multiply(x[start:stop], s, out=part)
        part += u
        np.floor(part, out=part)
        too_long.append(start + np.flatnonzero(np.einsum("ij,ij->i", part, part) > b2))
    todo = np.concatenate(too_long)
    for _ in range(_MAX_ROUNDS):
        if todo.size == 0:
            return z
        retry = np.floor(x[todo] * s + rng.random((todo.size, d)))
        ok = np.einsum("ij,ij->i", retry, retry) <= b2
        z[todo[ok]] = retry[ok]
        todo = todo[~ok]
    raise ValidationError(f"{todo.size} row(s) could not be rounded within the public bound "
                          f"{bound:g}; are the rows inside the declared ball?")


def conditional_round(rows: np.ndarray, scale: float, bound: float,
                      rng: np.random.Generator) -> np.ndarray:
    """Return :func:`conditional_round_float` as int64."""
    return conditional_round_float(rows, scale, bound, rng).astype(np.int64)


def skellam_tail(mu: float, n_values: int, failure: float = 2.0 ** -60) -> float:
    """Return T with P(max over n_values Sk(mu) draws of |noise| > T) <= failure.

    Bernstein's inequality for a sum of Poisson(mu/2) minus another (sub-exponential with
    variance mu and scale 1): ``P(|X| > t) <= 2 exp(-t^2 / (2 (mu + t/3)))``, with a union bound.
    """
    m = check_positive(mu, "mu")
    n = check_int(n_values, "n_values", minimum=1)
    log_term = math.log(2 * n / failure)
    # Solve t^2 = 2 (mu + t/3) L for t.
    a, b_, c = 1.0, -2 * log_term / 3, -2 * m * log_term
    return (-b_ + math.sqrt(b_ * b_ - 4 * a * c)) / 2


def max_scale(*, row_norm: float, dim: int, total_rows: int, degree: int, mu: float,
              n_values: int, beta: float = math.exp(-20)) -> float:
    """Return the largest fixed-point scale with which the pooled statistic cannot wrap.

    ``degree`` is 1 for a sum of rows (each coordinate of a row is at most B in absolute
    value) and 2 for a Gram matrix (each entry of ``z z^T`` is at most B^2). The largest
    absolute value of a pooled coordinate is ``total_rows * B(s)^degree``, plus the noise's
    tail bound; both must stay below ``2^62``.
    """
    r = check_positive(row_norm, "row_norm")
    n = check_int(total_rows, "total_rows", minimum=1)
    deg = check_int(degree, "degree", minimum=1, maximum=2)
    budget = SAFE_ABS - skellam_tail(mu, n_values)
    if budget <= 0:
        raise ValidationError(f"noise variance {mu:g} is too large for the 64-bit ring")

    def fits(s: float) -> bool:
        return n * rounded_norm_bound(s * r, dim, beta) ** deg <= budget

    lo, hi = 0.0, 1.0
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2.0 ** 62:
            break
    if lo == 0.0:
        hi_ok = 0.0
        probe = 1.0
        for _ in range(200):
            probe /= 2
            if fits(probe):
                hi_ok = probe
                break
        if hi_ok == 0.0:
            raise ValidationError(f"{n} rows of dimension {dim} cannot be summed in a 64-bit "
                                  "ring at any scale")
        lo, hi = hi_ok, hi_ok * 2
    for _ in range(100):
        mid = (lo + hi) / 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def to_ring(values: np.ndarray) -> np.ndarray:
    """Map int64 values to the ring (two's complement reinterpretation, no copy of meaning)."""
    v = np.asarray(values)
    if v.dtype != np.int64:
        raise ValidationError(f"ring values must be int64, got {v.dtype}")
    return v.astype(np.uint64)


def from_ring(values: np.ndarray) -> np.ndarray:
    """Decode ring elements to signed int64 (centred representatives), checking the margin."""
    v = np.asarray(values)
    if v.dtype != np.uint64:
        raise ValidationError(f"ring elements must be uint64, got {v.dtype}")
    signed = v.astype(np.int64)
    if signed.size and int(np.max(np.abs(signed.astype(np.float64)))) >= SAFE_ABS:
        raise ValidationError("a decoded sum lies outside the safe range: the ring wrapped or a "
                              "participant sent an out-of-range contribution")
    return signed
