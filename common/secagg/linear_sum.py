"""A secure sum of linear answers ``Ã x_s``: a public strategy in fixed point, exact integers.

The matrix mechanism's sites answer ``A x_s`` for a public strategy ``A`` (``k x n``) and their
histogram ``x_s`` over a public domain of ``n`` cells. Under secure aggregation the strategy is
encoded once, deterministically and publicly, as the integer matrix ``Ã = rint(s A)`` for a
power-of-two scale ``s`` (so ``s A`` is exact in float64 and every party computes the same
``Ã``). Each site computes ``Ã x_s`` exactly in int64 (its counts are integers), adds its
Skellam share and its masks (:func:`dpfed.common.secagg.secure_sum.site_contribution`); the
coordinator decodes ``Σ = Ã x + noise`` (:func:`dpfed.common.secagg.secure_sum.decode_sum`
divides by ``s``) and reconstructs with the strategy ``Ã / s`` it actually used — so the
rounding of ``A`` changes which strategy is used, never the answers' expectation.

Privacy
-------
Replace-one at one site: one row moves from cell ``i`` to cell ``j`` (every row lies in exactly
one public cell; the site checks that its counts add up to its rows), so ``Ã x_s`` — and the
pooled sum — moves by ``ã_j - ã_i``. The sensitivities of the integer statistic are therefore
``Δ₂ = max_{i≠j} ||ã_i - ã_j||₂`` and ``Δ₁ = max_{i≠j} ||ã_i - ã_j||₁``, computed from ``Ã``
itself (:func:`integer_sensitivities`, reusing
:func:`dpfed.common.queries.federated_matrix.replace_one_sensitivity`): ``Δ₂`` exactly (the Gram
matrix of integers with ``k M² <= 2^50``, ``M = max |ã|``, is exact in float64), ``Δ₁`` exactly
for matrices whose entries are 0 or one value and for small matrices, else the upper bound
``2 max_j ||ã_j||₁`` (flagged ``sensitivity_exact = False``; Δ₁ enters the Skellam
accountant's integer surcharge, and calibrates the discrete Laplace: a bound over-noises).
No randomised rounding is involved: ``Ã`` and ``x_s`` are exact, so the sensitivity follows
from the public ``Ã`` alone. The noise is one of
:data:`LINEAR_NOISES`: ``skellam``, calibrated for ``(Δ₂, Δ₁)`` by
:func:`dpfed.common.privacy.skellam.skellam_calibrate`, each of the ``n`` participants adding
``Sk(μ / (n - t - d))``; or ``dlaplace`` (pure epsilon), ``α = exp(-ε/Δ₁)``, each participant
adding Pólya shares of shape ``1 / (n - t - d)`` (:mod:`dpfed.common.privacy.polya`). Every
site recomputes ``Ã``, the sensitivities and the noise from the verified strategy, the public
scale and the named noise — never from a number it is sent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfed.common.errors import DataError, ImpossibleSumError, ProtocolError, ValidationError
from dpfed.common.privacy.polya import (
    DLaplaceCalibration,
    dlaplace_calibrate,
)
from dpfed.common.privacy.skellam import SkellamCalibration, skellam_calibrate
from dpfed.common.queries.federated_matrix import replace_one_sensitivity
from dpfed.common.secagg.fixed_point import SAFE_ABS
from dpfed.common.secagg.secure_sum import (
    MU_MAX,
    SecureSumPlan,
    check_participants,
    pooled_noise_tail,
)
from dpfed.common.validation import check_finite_array, check_int

__all__ = [
    "LINEAR_NOISES",
    "SCALE_MAX",
    "LinearSumPlan",
    "check_linear_decoded",
    "check_scale",
    "choose_linear_scale",
    "integer_sensitivities",
    "integer_strategy",
    "linear_answers",
    "linear_calibration",
    "plan_linear",
    "sum_fits_ring",
]

#: Largest fixed-point scale: at 2^16 the strategy's rounding (relative 2^-17 of an entry) and
#: the Skellam accountant's integer surcharge (relative ~1/μ) are both negligible.
SCALE_MAX = 2 ** 16
#: The noises a secure linear sum may carry: distributed Skellam ((epsilon, delta)) or
#: distributed discrete Laplace from Pólya shares (pure epsilon).
LINEAR_NOISES: tuple[str, ...] = ("skellam", "dlaplace")
#: ``k M^2`` stays below this, so the Gram matrix of ``Ã`` (and ``G_ii + G_jj - 2 G_ij``) is
#: exact in float64 (every partial sum an integer below 2^53).
_GRAM_EXACT = 2.0 ** 50


def check_scale(scale: Any) -> int:
    """Return the scale as an int if it is a power of two in ``[1, SCALE_MAX]``."""
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise ValidationError(f"scale must be a number, got {scale!r}") from None
    if not (math.isfinite(s) and s.is_integer() and 1 <= s <= SCALE_MAX
            and int(s) & (int(s) - 1) == 0):
        raise ValidationError(f"scale must be a power of two between 1 and {SCALE_MAX}, "
                              f"got {scale!r}")
    return int(s)


def integer_strategy(matrix: Any, scale: Any) -> np.ndarray:
    """Return ``Ã = rint(s A)`` as int64 (deterministic: ``s`` is a power of two).

    Raises
    ------
    ValidationError
        ``A`` is not a finite 2-D matrix, ``s`` is not an allowed scale, ``Ã`` is all zeros, or
        ``k M^2`` exceeds the bound under which the sensitivities are computed exactly.
    """
    a = check_finite_array(matrix, "strategy matrix", ndim=2)
    s = check_scale(scale)
    z = np.rint(a * float(s))
    m = float(np.abs(z).max()) if z.size else 0.0
    if m == 0.0:
        raise ValidationError(f"the strategy is all zeros at scale {s}")
    if a.shape[0] * m * m > _GRAM_EXACT:
        raise ValidationError(f"scale {s} is too large for this strategy: k M^2 = "
                              f"{a.shape[0] * m * m:.3g} exceeds 2^50 (exact sensitivities)")
    return z.astype(np.int64)


def integer_sensitivities(a_int: np.ndarray) -> tuple[float, float, bool]:
    """Return ``(Δ₂, Δ₁, Δ₁ exact)`` of ``x -> Ã x`` under replace-one (integer domain)."""
    a = np.asarray(a_int)
    if a.dtype != np.int64 or a.ndim != 2:
        raise ValidationError("the integer strategy must be a 2-D int64 matrix")
    af = a.astype(np.float64)
    l2, _ = replace_one_sensitivity(af, "l2")
    l1, exact = replace_one_sensitivity(af, "l1")
    if l2 <= 0.0:
        raise ValidationError("the strategy's answers do not depend on the histogram beyond "
                              "its total (sensitivity 0); nothing to release")
    return l2, l1, exact


@dataclass(frozen=True, eq=False)
class LinearSumPlan:
    """A secure sum of ``Ã x_s``: the generic plan plus the integer strategy.

    Attributes
    ----------
    plan : SecureSumPlan
        ``statistic = "linear"``, ``dim = k``, the scale, ``bound = max_j ||ã_j||₂`` (one row's
        contribution), the Skellam variance and the participants.
    matrix : ndarray of int64, shape (k, n)
        ``Ã``.
    sensitivity_exact : bool
        False when ``Δ₁`` is the ``2 max_j ||ã_j||₁`` bound.
    """

    plan: SecureSumPlan
    matrix: np.ndarray
    sensitivity_exact: bool

    @property
    def strategy(self) -> np.ndarray:
        """The strategy actually used, ``Ã / s`` (reconstruct with it)."""
        return self.matrix.astype(np.float64) / self.plan.scale

    @property
    def answer_variance(self) -> float:
        """Variance of each decoded answer (units of ``A x``): ``n`` shares, divided by ``s²``.

        ``n μ / (n - t - d)``: for Pólya shares ``n · 2rα/(1-α)²`` with ``r = 1/(n - t - d)``.
        """
        p = self.plan
        return len(p.participants) * p.share / p.scale ** 2


def linear_calibration(noise: str, epsilon: float, delta: float, l2: float,
                       l1: float) -> SkellamCalibration | DLaplaceCalibration:
    """Calibrate the named noise (:data:`LINEAR_NOISES`) for integer sensitivities."""
    if noise == "skellam":
        return skellam_calibrate(epsilon, delta, l2, l1)
    if noise == "dlaplace":
        return dlaplace_calibrate(epsilon, l2, l1)
    raise ValidationError(f"secure linear noise must be one of {list(LINEAR_NOISES)}, got "
                          f"{noise!r}")


def plan_linear(matrix: Any, *, scale: Any, epsilon: float, delta: float,
                participants: Sequence[str], tolerated: int,
                noise: str = "skellam") -> LinearSumPlan:
    """Plan the secure sum of ``Ã x_s`` from public inputs only (sites call this themselves).

    ``noise`` (:data:`LINEAR_NOISES`): ``dlaplace`` ignores ``delta`` (pure epsilon).
    """
    ids, t = check_participants(participants, tolerated)
    a_int = integer_strategy(matrix, scale)
    l2, l1, exact = integer_sensitivities(a_int)
    cal = linear_calibration(noise, epsilon, delta, l2, l1)
    if cal.mu > MU_MAX * 1.01:
        raise ValidationError(f"the scale {scale!r} needs noise variance {cal.mu:.3g}, above "
                              f"the sampler's limit {MU_MAX:.3g}")
    bound = float(np.sqrt((a_int.astype(np.float64) ** 2).sum(axis=0)).max())
    plan = SecureSumPlan("linear", a_int.shape[0], float(check_scale(scale)), bound, cal.mu, t,
                         ids, cal)
    return LinearSumPlan(plan, a_int, exact)


def _fits_ring(total_rows: int, max_entry: float, tail: float) -> bool:
    """Whether ``total_rows * max_entry`` plus the noise's tail bound stays below ``2^62``."""
    return total_rows * max_entry + tail <= SAFE_ABS


def sum_fits_ring(plan: LinearSumPlan, total_rows: int) -> bool:
    """Whether the decoded sum of ``total_rows`` rows under ``plan`` cannot have wrapped.

    The coordinator checks this again with the row counts the sites report with their
    contributions (the scale was chosen from the counts announced when they connected).
    """
    p = plan.plan
    return _fits_ring(check_int(total_rows, "total_rows", minimum=0),
                      float(np.abs(plan.matrix).max()), p.noise_tail(p.dim))


def check_linear_decoded(total: np.ndarray, plan: LinearSumPlan, n_rows: int) -> None:
    """Refuse a decoded ``Ã x + noise`` that no honest run over ``n_rows`` rows gives.

    Every row lies in one cell, so ``x >= 0`` sums to ``n_rows`` and answer ``r`` lies in
    ``[n_rows min_j ã_rj, n_rows max_j ã_rj]``; the noise adds at most its tail bound
    (:meth:`~dpfed.common.secagg.secure_sum.SecureSumPlan.noise_tail`) but with probability
    ``2^-60``.

    Raises
    ------
    ProtocolError
        The reported rows exceed what the scale was chosen for (the sum may have wrapped).
    ImpossibleSumError
        An answer outside its range (``impossible_secure_sum``).
    """
    p = plan.plan
    if not sum_fits_ring(plan, n_rows):
        raise ProtocolError(f"the sites report {n_rows} rows, more than the scale "
                            f"{p.scale:g} was chosen for: the secure sum may have wrapped; "
                            "rerun the job (the sites' row counts are now known)")
    t = np.asarray(total, dtype=np.float64)
    tail = p.noise_tail(max(p.n_values, 1))
    a = plan.matrix.astype(np.float64)
    lo, hi = n_rows * a.min(axis=1) - tail, n_rows * a.max(axis=1) + tail
    outside = np.flatnonzero((t < lo) | (t > hi))
    if t.shape != (p.n_values,) or outside.size:
        r = int(outside[0]) if outside.size else 0
        raise ImpossibleSumError(
            f"{ImpossibleSumError.REASON}: the decoded secure linear sum has answer {r} = "
            f"{float(t[r]) if t.shape == (p.n_values,) else float('nan'):.4g} outside "
            f"[{lo[r]:.4g}, {hi[r]:.4g}], which no honest run over {n_rows} rows can produce; "
            "a participant corrupted its contribution, nothing was published")


def choose_linear_scale(matrix: Any, *, total_rows: int, epsilon: float, delta: float,
                        n_participants: int, noise: str = "skellam") -> int:
    """Return the largest power-of-two scale (at most :data:`SCALE_MAX`) that fits the ring.

    For each candidate ``s`` (from the largest down) the sensitivities of ``Ã`` are bounded
    from those of ``A`` (``Δ(Ã) <= s Δ(A) + sqrt(k)`` in L2, ``+ k`` in L1: each entry moves by
    at most 1/2), which bounds ``μ`` from above; ``s`` is accepted when ``k M² <= 2^50``,
    ``μ <= MU_MAX`` and ``total_rows · M`` (the largest possible ``|Σ (Ã x)_r|``) plus the
    tail of the pooled noise (Skellam: ``n μ``, as at ``t = d = 0``; Pólya: shape ``n``, the
    most ``n / (n - t - d)`` can be) stays below ``2^62``. Public inputs only.
    """
    a = check_finite_array(matrix, "strategy matrix", ndim=2)
    n_total = check_int(total_rows, "total_rows", minimum=1)
    n_parties = check_int(n_participants, "n_participants", minimum=1)
    k = a.shape[0]
    l2a, _ = replace_one_sensitivity(a, "l2")
    l1a, _ = replace_one_sensitivity(a, "l1")
    amax = float(np.abs(a).max())
    for bits in range(int(math.log2(SCALE_MAX)), -1, -1):
        s = float(2 ** bits)
        m = s * amax + 0.5
        if k * m * m > _GRAM_EXACT:
            continue
        cal = linear_calibration(noise, epsilon, delta, s * l2a + math.sqrt(k), s * l1a + k)
        if cal.mu > MU_MAX:
            continue
        if not _fits_ring(n_total, m, pooled_noise_tail(cal, float(n_parties), k)):
            continue
        return int(s)
    raise ValidationError(f"no fixed-point scale fits this strategy ({k} x {a.shape[1]}) and "
                          f"{n_total} rows in a 64-bit ring")


def linear_answers(plan: LinearSumPlan, counts: Any, n_rows: int) -> np.ndarray:
    """Return ``Ã x_s`` exactly (int64) for a site's histogram of ``n_rows`` rows.

    Raises
    ------
    DataError
        The counts are not non-negative integers adding up to ``n_rows`` (a row outside every
        cell would break the replace-one sensitivity), or ``n_rows M`` could overflow.
    """
    x = check_finite_array(counts, "histogram", ndim=1)
    n = check_int(n_rows, "n_rows", minimum=0)
    if x.shape[0] != plan.matrix.shape[1]:
        raise ValidationError(f"histogram has {x.shape[0]} cells, the strategy "
                              f"{plan.matrix.shape[1]}")
    if np.any(x < 0) or np.any(x != np.rint(x)) or float(x.sum()) != float(n):
        raise DataError("the histogram's counts must be non-negative integers adding up to the "
                        "site's rows (every row in exactly one cell)")
    m = int(np.abs(plan.matrix).max())
    if n * m >= SAFE_ABS:
        raise DataError(f"{n} rows at scale {plan.plan.scale:g} could overflow the 64-bit ring")
    return np.asarray(plan.matrix @ x.astype(np.int64), dtype=np.int64)
