"""Integer noise as Gaussian differential privacy: Skellam and discrete Gaussian shift pairs.

For integer noise ``X`` with a symmetric log-concave pmf, the pair ``(X, X + 1)`` has monotone
likelihood ratio, so its trade-off curve is the piecewise-linear interpolation of the
threshold tests' error pairs ``(P(X > y), P(X <= y - 1))``. It lies above the Gaussian curve
``G_m`` (Dong, Roth & Su 2022) exactly when every *probit increment*
``z(y) - z(y - 1)``, ``z = Phi^-1(F)``, is at most ``m`` (a chord of the convex ``G_m`` lies
above it, so the vertices suffice). Then a shift by an integer ``k`` is ``|k| m``-GDP (the
increments telescope), and a shift by an integer vector ``v`` is ``||v||_2 m``-GDP (GDP
composition over independent coordinates). :func:`skellam_gdp` and
:func:`discrete_gaussian_gdp` return that unit ``m``, with the centre increment
``2 Phi^-1((1 + p(0))/2)`` as the answer in practice.

The increments are verified on a window ``|y| <= Y`` only. Beyond it the pair is replaced by a
pessimistic one that reveals the tail outright (mass ``alpha = P(X > Y - k)`` at ``+inf`` per
shifted coordinate): :meth:`IntegerNoiseGDP.tail_mass` (proof in docs/privacy.md, "Tight
accounting"). With ``Y`` where ``P(X > Y)`` is about ``e^-700`` the tail is negligible.

Two ways to the window, both bounds from above:

* ``mu <= MU_LATTICE`` (and every discrete Gaussian): the exact pmf on the lattice
  (``scipy.special.ive``), survival functions summed in log space with the remainder beyond
  the window bounded; the increment is at most ``z_up(y) - z_lo(y - 1)``.
* larger Skellam variances: blocks ``[a, b]`` of ``y``. ``g(L) = Phi-bar^-1(e^-L)`` is concave,
  so ``z(y) - z(y - 1) <= m(z(y - 1)) ln(S(y - 1)/S(y))`` (``m`` the Gaussian Mills ratio);
  ``m(z)`` decreases and ``ln(S(y-1)/S(y))`` increases (log-concave), so a block is bounded
  by ``m(z_lo(a - 1)) ln(1 + 1/T_lo(b))``. ``T = S(y)/p(y)`` and ``p(y)/p(0)`` are bounded
  through the Bessel ratio bounds ``e^-asinh((k + 3/2)/mu) <= I_(k+1)(mu)/I_k(mu) <=
  e^-asinh((k + 1/2)/mu)`` (Amos 1974; Segura 2011, Thm. 1) and integral comparisons.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from scipy import special

from dpfed.common.errors import ValidationError
from dpfed.common.validation import check_positive

#: Skellam variances up to this use the exact lattice; larger ones the block bounds.
MU_LATTICE = 1e6
#: The window ends where the survival function drops below ``e^WINDOW_LOG_TAIL``.
WINDOW_LOG_TAIL = -650.0
#: Relative margin on the returned unit (floating-point error of the increments).
MARGIN = 1e-7
#: Block width in the block method: the probit moves by at most about this across a block.
_KAPPA = 1e-2
#: Largest discrete Gaussian sigma^2 handled (its window has about 40 sigma points).
SIGMA2_MAX = 1e8


@dataclass(frozen=True, eq=False)
class IntegerNoiseGDP:
    """The GDP unit of an integer noise and its tail beyond the verified window.

    Attributes
    ----------
    unit : float
        ``m``: a shift by an integer vector ``v`` is ``||v||_2 m``-GDP up to the tail.
    window : int
        ``Y``: increments verified for ``|y| <= Y``.
    points, log_survival : ndarray
        Increasing points ``y`` and ``ln S_up(y)`` with ``S_up(y) >= P(X > y)``.
    """

    unit: float
    window: int
    points: np.ndarray = field(repr=False)
    log_survival: np.ndarray = field(repr=False)

    def tail_mass(self, shift: float, count: float) -> float:
        """Mass at ``+inf`` covering ``count`` shifted coordinates, each by at most ``shift``.

        ``count * P(X > Y - shift)`` (``P`` bounded from above at the nearest tabulated point
        at or below ``Y - shift``); 1 when the window is too short for the shift.
        """
        y = self.window - math.ceil(shift)
        i = int(np.searchsorted(self.points, y, side="right")) - 1
        if i < 0:
            return 1.0
        return min(1.0, count * math.exp(float(self.log_survival[i])))


def _probit_of_survival(log_s: np.ndarray) -> np.ndarray:
    """``Phi-bar^-1(S)`` from ``ln S`` (accurate for tiny S)."""
    return np.asarray(-special.ndtri_exp(log_s))


def _log_mills(z: np.ndarray) -> np.ndarray:
    """``ln(Phi-bar(z) / phi(z))``."""
    return np.asarray(special.log_ndtr(-z) + 0.5 * z * z + 0.5 * math.log(2.0 * math.pi))


def _from_lattice(logp: np.ndarray, log_remainder: float, p0: float) -> IntegerNoiseGDP:
    """GDP unit from a symmetric pmf given on ``k = 0..K`` and a bound on ``P(X > K)``."""
    # S_lo(y) = sum_{y < k <= K} p(k), S_up = S_lo + remainder, y = 0..K-1
    tail = np.logaddexp.accumulate(logp[::-1])[::-1]  # ln sum_{k >= y} p(k)
    log_s_lo = tail[1:]
    log_s_up = np.logaddexp(log_s_lo, log_remainder)
    ok = np.flatnonzero(log_s_lo > WINDOW_LOG_TAIL)
    window = int(ok[-1]) if ok.size else 0
    z_up = _probit_of_survival(log_s_lo[:window + 1])
    z_lo = _probit_of_survival(log_s_up[:window + 1])
    centre = 2.0 * math.sqrt(2.0) * float(special.erfinv(p0))  # z(0) - z(-1) = 2 z(0)
    steps = z_up[1:] - z_lo[:-1] if window >= 1 else np.zeros(0)
    unit = max(centre, float(steps.max()) if steps.size else 0.0) * (1.0 + MARGIN)
    return IntegerNoiseGDP(unit, window, np.arange(window + 1, dtype=np.float64),
                           log_s_up[:window + 1].copy())


def _stable_a_difference(t: np.ndarray | float, s: float, mu: float) -> np.ndarray:
    """``A(t) - A(s)`` with ``A(t) = t asinh(t/mu) - sqrt(t^2 + mu^2)`` (no cancellation)."""
    tt = np.asarray(t, dtype=np.float64)
    first = tt * np.arcsinh(tt / mu) - s * math.asinh(s / mu)
    second = (tt * tt - s * s) / (np.sqrt(tt * tt + mu * mu) + math.sqrt(s * s + mu * mu))
    return np.asarray(first - second)


def _skellam_p0_upper(mu: float) -> float:
    """Return an upper bound on ``P(Sk(mu) = 0) = e^-mu I_0(mu)`` for ``mu >= 1000``.

    The asymptotic series ``(2 pi mu)^-1/2 (1 + 1/(8mu) + 9/(128 mu^2) + 75/(1024 mu^3) + ...)``
    (DLMF 10.40.1), with twice the next term added (scipy's ``ive`` returns NaN for large
    arguments); the terms are below 1e-12 from ``mu = 1000`` on.
    """
    x = check_positive(mu, "mu")
    if x < 1000.0:
        raise ValidationError(f"the series bound needs mu >= 1000, got {x:g}")
    terms = 1.0 + 1.0 / (8.0 * x) + 9.0 / (128.0 * x * x) + 75.0 / (1024.0 * x ** 3)
    terms += 2.0 * 3675.0 / (32768.0 * x ** 4)
    return terms / math.sqrt(2.0 * math.pi * x) * (1.0 + 1e-12)  # and the rounding


def _skellam_blocks(mu: float) -> IntegerNoiseGDP:
    """Return the unit by the block method, for a large Skellam variance (module docstring)."""
    sq = math.sqrt(mu)
    p0 = _skellam_p0_upper(mu)
    log_p0 = math.log(p0)
    centre = 2.0 * math.sqrt(2.0) * float(special.erfinv(p0))
    # block starts: width ~ KAPPA sqrt(mu) / max(1, z), z ~ y / sqrt(mu)
    y_end = int(math.ceil(40.0 * sq)) + 2
    inner = np.arange(1, int(sq) + 1, max(1, int(_KAPPA * sq / 5.0)), dtype=np.float64)
    j = np.arange(0, int((40.0 ** 2) / (2.0 * _KAPPA)) + 2, dtype=np.float64)
    outer = np.floor(sq * np.sqrt(1.0 + 2.0 * _KAPPA * j))
    starts = np.unique(np.concatenate((inner, outer[outer > inner[-1]])))
    starts = starts[starts <= y_end]
    ends = np.append(starts[1:] - 1.0, float(y_end))

    big_u = 60.0 * sq  # beyond ~60 sqrt(mu) every Gaussian factor below is < e^-1800

    def log_p_up(y: np.ndarray) -> np.ndarray:
        # ln p(y) - ln p(0) = sum_{k<y} ln r(k) <= -sum_{k<y} asinh((k + 1/2)/mu)
        #                   <= -(A(y) - A(0))   (asinh is concave on t >= 0: midpoint rule)
        return np.asarray(log_p0 - _stable_a_difference(y, 0.0, mu))

    def log_t_up(y: np.ndarray) -> np.ndarray:
        # T(y) = sum_{j>=1} G(j), G(u) = exp(-(A(b + u) - A(b))), b = y - 1/2, and
        # (ln G)'' >= -1/mu, so G(j) <= e^(1/(8 mu)) int_{j-1/2}^{j+1/2} G: T <= e^(1/(8mu))
        # int_{1/2}^inf G, with A(b+u) - A(b) >= a1 u + u^2/(2w) up to U, linear beyond.
        b = y - 0.5
        a1 = np.arcsinh(b / mu)
        w = np.sqrt((b + big_u) ** 2 + mu * mu)
        a2 = np.arcsinh((b + big_u) / mu)
        head = (0.5 * np.log(2.0 * math.pi * w) + 0.5 * a1 * a1 * w
                + special.log_ndtr(-(0.5 + a1 * w) / np.sqrt(w)))
        rest = -a1 * big_u - big_u * big_u / (2.0 * w) - np.log(a2)
        return np.asarray(1.0 / (8.0 * mu) + np.logaddexp(head, rest))

    def log_t_lo(y: np.ndarray) -> np.ndarray:
        # T(y) >= sum_{1<=j<=J} G(j), G(u) = exp(-(A(c + u) - A(c))), c = y + 3/2; ln G is
        # concave with slope >= -s_J, so G(j) >= f(s_J) int_{j-1/2}^{j+1/2} G, f(s) =
        # s / (2 sinh(s/2)); and A(c+u) - A(c) <= a u + u^2/(2v).
        c = y + 1.5
        a = np.arcsinh(c / mu)
        v = np.sqrt(c * c + mu * mu)
        s_j = np.arcsinh((c + big_u + 0.5) / mu)
        log_f = np.log(s_j) - np.log(2.0 * np.sinh(s_j / 2.0))
        x1 = (0.5 + a * v) / np.sqrt(v)
        x2 = (big_u + 0.5 + a * v) / np.sqrt(v)
        l1, l2 = special.log_ndtr(-x1), special.log_ndtr(-x2)
        return np.asarray(log_f + 0.5 * np.log(2.0 * math.pi * v) + 0.5 * a * a * v + l1
                          + np.log1p(-np.exp(l2 - l1)))

    prev = starts - 1.0  # y = a - 1 >= 0
    log_s_up_prev = np.where(prev == 0.0, math.log((1.0 - p0 * (1.0 - 1e-9)) / 2.0),
                             log_p_up(prev) + log_t_up(np.maximum(prev, 1.0)))
    z_lo = _probit_of_survival(log_s_up_prev)
    hazard = np.log1p(np.exp(-log_t_lo(ends)))
    bounds = np.exp(_log_mills(z_lo)) * hazard
    unit = max(centre, float(bounds.max())) * (1.0 + MARGIN)
    end = np.array([float(y_end)])
    if float((log_p_up(end) + log_t_up(end))[0]) > WINDOW_LOG_TAIL:
        raise ValidationError(f"Skellam variance {mu:g}: the verified window does not reach "
                              f"the tail")
    # (points as doubles: beyond 2^53 a lattice step is far below the unit's MARGIN)
    return IntegerNoiseGDP(unit, y_end, prev, log_s_up_prev)


#: Skellam variances are rounded down to the grid 2^(k / GRID_PER_OCTAVE) before the unit is
#: computed (``Sk(mu)`` is ``Sk(mu')`` plus independent noise for ``mu' <= mu``, so the unit of
#: ``mu'`` holds for ``mu``): at most 0.034 % in the unit, and a small set of cached values.
GRID_PER_OCTAVE = 1024


def skellam_grid_point(mu: float) -> float:
    """Return the largest grid variance ``2^(k/GRID_PER_OCTAVE)`` not above ``mu (1 + 3e-12)``.

    The 3e-12 lets a variance that went through ``sqrt`` and back (a ledger event stores a
    standard deviation) find its grid point; the unit's :data:`MARGIN` covers it.
    """
    m = check_positive(mu, "mu")
    k = math.floor(math.log2(m) * GRID_PER_OCTAVE + 1e-9)
    while 2.0 ** (k / GRID_PER_OCTAVE) > m * (1.0 + 3e-12):
        k -= 1
    return float(2.0 ** (k / GRID_PER_OCTAVE))


def skellam_gdp(mu: float) -> IntegerNoiseGDP:
    """Return the GDP unit of ``Sk(mu)`` (difference of two Poisson(mu/2)), any ``mu > 0``.

    Privacy
    -------
    ``Sk(mu) + v`` for an integer vector ``v`` with ``||v||_2 <= l2`` against ``Sk(mu)`` is
    dominated by the ``unit * l2``-GDP pair plus ``tail_mass(l_inf, count)`` at ``+inf``
    (module docstring), computed at :func:`skellam_grid_point` of ``mu``. ``unit * sqrt(mu)``
    is about ``1 + 1/(6 mu)`` (0.5 % more above ``MU_LATTICE``, from the block widths).
    """
    return _skellam_gdp_at(skellam_grid_point(mu))


@lru_cache(maxsize=4096)
def _skellam_gdp_at(m: float) -> IntegerNoiseGDP:
    if m > MU_LATTICE:
        return _skellam_blocks(m)
    k_max = 64
    while True:
        k = np.arange(k_max + 1, dtype=np.float64)
        p = special.ive(k, m)
        positive = np.flatnonzero(p > 1e-300)  # normal doubles only
        last = int(positive[-1])
        if last < k_max or math.log(float(p[-1])) < WINDOW_LOG_TAIL - 50.0:
            break
        k_max *= 2
    logp = np.log(p[:last + 1])
    # beyond K = last: p(K + j) <= p(K) r^j with r = r_up(K) (the ratio decreases)
    r = math.exp(-math.asinh((last + 0.5) / m))
    log_rem = float(logp[-1]) + math.log(r) - math.log1p(-r)
    return _from_lattice(logp, log_rem, float(p[0]))


@lru_cache(maxsize=1024)
def discrete_gaussian_gdp(sigma2: float) -> IntegerNoiseGDP:
    """Return the GDP unit of the discrete Gaussian ``N_Z(0, sigma2)`` (CKS 2020), as above."""
    s2 = check_positive(sigma2, "sigma2")
    if s2 > SIGMA2_MAX:
        raise ValidationError(f"discrete Gaussian sigma^2 {s2:g} is above {SIGMA2_MAX:g}")
    k_max = int(math.ceil(math.sqrt(2.0 * s2 * (-WINDOW_LOG_TAIL + 60.0)))) + 2
    k = np.arange(k_max + 1, dtype=np.float64)
    logw = -k * k / (2.0 * s2)
    log_z = float(np.logaddexp(logw[0], math.log(2.0) + special.logsumexp(logw[1:])))
    logp = logw - log_z
    # beyond K: p(K + j) <= p(K) r^j, r = exp(-(2K + 1)/(2 sigma2))
    r = math.exp(-(2.0 * k_max + 1.0) / (2.0 * s2))
    log_rem = float(logp[-1]) + math.log(r) - math.log1p(-r)
    return _from_lattice(logp, log_rem, math.exp(float(logp[0])))
