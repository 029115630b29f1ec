"""Privacy loss distributions: discretised pessimistically, composed exactly, read at any delta.

The privacy loss distribution (PLD) of a dominating pair ``(P, Q)`` is the law of
``L = ln(P(o)/Q(o))`` for ``o ~ P`` (Sommer, Meiser & Mohammadi 2019; Koskela, Jälkö & Honkela
2020). Its hockey-stick curve ``delta(eps) = E[(1 - e^(eps - L))_+]`` (``L = +inf`` counting 1)
is the pair's exact privacy profile, and composing mechanisms adds independent losses
(Zhu, Dong & Wang 2022, Thm. 10), so the PLD of a composition is the convolution of the PLDs.

:class:`LossDistribution` holds the losses of the non-Gaussian events on the grid
``k * STEP`` (``STEP = 2^-14``, so every grid point is an exact double). It is **pessimistic**:
every loss is rounded *up* to the grid, tail mass is only ever moved up (to the lowest kept
point, or to ``+inf``), and the floating-point error of each FFT convolution is added to the
``+inf`` mass. Because ``delta(eps)`` is increasing in every loss, a distribution whose losses
are stochastically larger overstates ``delta(eps)`` of the true composition, never understates
it. :attr:`LossDistribution.error` bounds the overstatement in epsilon: the sum of the largest
upward moves of the losses (one grid step per discretised event, one step per coarsening).

The Gaussian events need no grid: a ``mu``-GDP pair composes with another by
``mu^2 = mu_1^2 + mu_2^2`` (Dong, Roth & Su 2022, Cor. 3.3), and its hockey stick is closed
form (:func:`gaussian_hockey_stick`). :func:`delta_at` mixes the two exactly:
``delta(eps) = inf + sum_j w_j h_mu(eps - l_j)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.validation import check_delta, check_nonnegative, check_positive

#: Grid step of every discretised loss (a power of two: grid points are exact doubles).
STEP = 2.0 ** -14
#: Largest number of grid points kept; beyond it the grid is coarsened (by 2, pessimistically).
MAX_POINTS = 2 ** 20
#: Lower-tail mass below which losses are folded up into the lowest kept point.
TAIL_MASS = 1e-40
#: Masses above this are convolved directly (exactly), the rest by FFT.
SPIKE = 1e-2
#: Relative slack applied to every computed delta (floating-point error of the sums).
DELTA_SLACK = 1e-9
_U = float(np.finfo(np.float64).eps)


def _ceil_index(loss: np.ndarray | float, step: float) -> np.ndarray:
    """Smallest integers ``k`` with ``k * step >= loss`` (``step`` a power of two: exact)."""
    return np.ceil(np.asarray(loss, dtype=np.float64) / step).astype(np.int64)


@dataclass(frozen=True)
class LossDistribution:
    """A discretised, pessimistic privacy loss distribution.

    Attributes
    ----------
    step : float
        Grid step (a power of two).
    offset : int
        Loss of ``masses[0]`` is ``offset * step``.
    masses : ndarray
        Non-negative masses on consecutive grid points.
    infinity : float
        Mass at ``+inf`` (releases that identify the pair outright, tails moved up, error).
    error : float
        Upper bound on how far the losses were moved up (an epsilon overstatement).
    events : int
        How many discretised events it composes.
    """

    step: float
    offset: int
    masses: np.ndarray = field(repr=False)
    infinity: float
    error: float
    events: int = 1

    @cached_property
    def losses(self) -> np.ndarray:
        """The loss of every mass."""
        return (self.offset + np.arange(self.masses.size)) * self.step

    def compose(self, other: LossDistribution) -> LossDistribution:
        """Return the PLD of the composition (losses add; a pessimistic convolution)."""
        a, b = _same_step(self, other)
        if a.masses.size < b.masses.size:
            a, b = b, a
        masses, fft_error = _convolve(a.masses, b.masses)
        # (measures of total mass about 1: the product's +inf mass is at most the sum)
        infinity = a.infinity + b.infinity + fft_error
        out = LossDistribution(a.step, a.offset + b.offset, masses, min(infinity, 1.0),
                               a.error + b.error, a.events + b.events)
        return out.trimmed()

    def power(self, n: int) -> LossDistribution:
        """Return the ``n``-fold composition with itself (repeated squaring)."""
        if n < 1:
            raise ValidationError(f"n must be >= 1, got {n}")
        result: LossDistribution | None = None
        base = self
        while n:
            if n & 1:
                result = base if result is None else result.compose(base)
            n >>= 1
            if n:
                base = base.compose(base)
        assert result is not None
        return result

    def trimmed(self) -> LossDistribution:
        """Fold negligible lower tails up, drop zero upper tails, coarsen if too long."""
        masses = self.masses
        offset = self.offset
        cum = np.cumsum(masses)
        first = int(np.searchsorted(cum, TAIL_MASS, side="right"))
        first = min(first, masses.size - 1)
        if first > 0:  # the lowest losses move up to the first kept point: pessimistic
            masses = masses[first:].copy()
            masses[0] += float(cum[first - 1])
            offset += first
        nonzero = np.flatnonzero(masses)
        last = int(nonzero[-1]) + 1 if nonzero.size else 1
        masses = masses[:last]
        out = LossDistribution(self.step, offset, masses, self.infinity, self.error, self.events)
        while out.masses.size > MAX_POINTS:
            out = out.coarsened()
        return out

    def coarsened(self) -> LossDistribution:
        """Return the distribution on a grid twice as coarse (every loss moved up <= 1 old step)."""
        masses, offset = self.masses, self.offset
        if offset % 2:  # align: old index 0 then has an even loss index
            masses = np.concatenate(([0.0], masses))
            offset -= 1
        # new point j (loss (offset/2 + j) * 2 step) takes old points 2j (same loss) and
        # 2j - 1 (one old step below it)
        padded = np.concatenate((masses, [0.0])) if masses.size % 2 == 0 else masses
        padded = np.concatenate(([0.0], padded))  # old[-1] = 0
        new = padded.reshape(-1, 2).sum(axis=1)
        return LossDistribution(2 * self.step, offset // 2, new, self.infinity,
                                self.error + self.step, self.events)


def _convolve(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, float]:
    """Return ``a * b`` and a bound on the mass the floating-point FFT may have lost.

    Entries above :data:`SPIKE` (at most ``1/SPIKE`` of them) are convolved directly: sums of
    non-negative products, no cancellation. The rest goes through the FFT, whose error is
    ``||computed - exact||_2 <= c u log2(n) ||a||_2 ||b||_2`` (Higham 2002, Sec. 24.1); the
    entries it may have lowered sum to at most ``sqrt(n)`` times that, which the caller adds to
    the ``+inf`` mass.
    """
    if min(a.size, b.size) <= 64:
        return np.convolve(a, b), 0.0
    spikes_a, spikes_b = np.flatnonzero(a > SPIKE), np.flatnonzero(b > SPIKE)
    small_a, small_b = a.copy(), b.copy()
    small_a[spikes_a] = 0.0
    small_b[spikes_b] = 0.0
    out = _fft_convolve(small_a, small_b)
    n = out.size
    error = (math.sqrt(n) * (5.0 * math.log2(n) + 10.0) * _U
             * float(np.linalg.norm(small_a)) * float(np.linalg.norm(small_b)))
    np.maximum(out, 0.0, out=out)
    for i in spikes_a:  # a_spikes * b
        out[i:i + b.size] += a[i] * b
    for j in spikes_b:  # a_small * b_spikes
        out[j:j + a.size] += b[j] * small_a
    return out, error


def _fft_convolve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Return the full linear convolution of two real vectors (numpy's real FFT, pocketfft).

    numpy's FFT rather than scipy.signal's: the same algorithm, and importing scipy.signal
    (which pulls in scipy.stats) took seconds of every site and CLI start-up that opens a ledger.
    """
    n = a.size + b.size - 1
    size = 1 << (n - 1).bit_length()
    return np.fft.irfft(np.fft.rfft(a, size) * np.fft.rfft(b, size), size)[:n]


def _same_step(a: LossDistribution, b: LossDistribution) -> tuple[LossDistribution,
                                                                   LossDistribution]:
    while a.step < b.step:
        a = a.coarsened()
    while b.step < a.step:
        b = b.coarsened()
    return a, b


def _from_atoms(losses: np.ndarray, masses: np.ndarray, infinity: float) -> LossDistribution:
    """Round each atom's loss up to the grid and collect them."""
    idx = _ceil_index(losses, STEP)
    lo = int(idx.min())
    out = np.zeros(int(idx.max()) - lo + 1)
    np.add.at(out, idx - lo, masses)
    return LossDistribution(STEP, lo, out, infinity, STEP)


def pure_loss(epsilon: float) -> LossDistribution:
    """PLD of randomized response at ``epsilon``: the dominating pair of every epsilon-DP release.

    Any epsilon-DP mechanism's pair is a post-processing of ``RR_epsilon`` (Kairouz, Oh &
    Viswanath 2015, Thm. 2.2): loss ``+epsilon`` w.p. ``e^eps/(1+e^eps)``, ``-epsilon`` else.
    """
    return approximate_loss(epsilon, 0.0)


def approximate_loss(epsilon: float, delta: float) -> LossDistribution:
    """PLD of the dominating pair of every (epsilon, delta)-DP release (KOV 2015, Thm. 2.2).

    Loss ``+inf`` w.p. ``delta``, and randomized response scaled by ``1 - delta``.
    """
    from scipy import special  # imported on first use: a slow import for every process

    eps = check_nonnegative(epsilon, "epsilon")
    dl = check_nonnegative(delta, "delta")
    if dl >= 1.0:
        raise ValidationError(f"delta must be < 1, got {dl!r}")
    up = float(special.expit(eps)) * (1.0 - dl)
    down = float(special.expit(-eps)) * (1.0 - dl)
    return _from_atoms(np.array([eps, -eps]), np.array([up, down]), dl)


def laplace_loss(epsilon: float) -> LossDistribution:
    """PLD of the Laplace pair ``(Lap(0, b), Lap(D, b))`` with ``epsilon = D / b``.

    Under ``Lap(0, b)`` the loss ``(|x - D| - |x|)/b`` is ``+eps`` w.p. 1/2, ``-eps`` w.p.
    ``e^-eps / 2`` and has CDF ``e^((l - eps)/2) / 2`` on ``[-eps, eps)``; each grid cell's mass
    goes to its upper end. The pair also dominates the *multivariate* Laplace mechanism of L1
    sensitivity ``D`` (docs/privacy.md, "Tight accounting").
    """
    eps = check_positive(epsilon, "epsilon")
    lo = int(_ceil_index(-eps, STEP))
    hi = int(_ceil_index(eps, STEP))
    # grid points lo..hi; the mass of (k-1, k] * STEP goes to point k
    points = np.arange(lo, hi + 1) * STEP
    cdf = 0.5 * np.exp((np.minimum(points, eps) - eps) / 2.0)  # P(L <= point), point < eps
    masses = np.empty(points.size)
    masses[0] = cdf[0]  # P(L <= lo*STEP), including the atom at -eps
    masses[1:] = np.diff(cdf)
    masses[-1] += 0.5  # the atom at +eps (hi*STEP >= eps)
    return LossDistribution(STEP, lo, np.maximum(masses, 0.0), 0.0, STEP)


# --------------------------------------------------------------------------- Gaussian part


def gaussian_hockey_stick(t: np.ndarray | float, mu: float) -> np.ndarray:
    """``E[(1 - e^(t - L))_+]`` for the ``mu``-GDP loss ``L ~ N(mu^2/2, mu^2)``, any real ``t``.

    ``Phi(-t/mu + mu/2) - e^t Phi(-t/mu - mu/2)`` (Balle & Wang 2018, Thm. 8, for every t),
    and ``(1 - e^t)_+`` when ``mu = 0``. Evaluated in double precision: see
    :func:`gaussian_hockey_stick_upper` for a value that is never below the exact one.
    """
    return _hockey_stick(t, mu)[0]


def gaussian_hockey_stick_upper(t: np.ndarray | float, mu: float) -> np.ndarray:
    """:func:`gaussian_hockey_stick` plus a bound on its floating-point error.

    The difference of the two terms loses relative accuracy as they approach each other
    (small ``t``, large ``1/mu``): computed in log space, each log carries an absolute error
    of at most ``8 u (1 + |log| + (|x| + 1) |dx|)`` (``u`` the unit roundoff, ``x`` the
    argument of ``log Phi`` and ``dx`` its own rounding), and the bound adds what that error
    can do to the difference. Calibrations and the tight accountant use this value, so no
    double-precision evaluation can make them claim less than the exact hockey stick.
    """
    value, error = _hockey_stick(t, mu)
    return np.asarray(value + error)


def _hockey_stick(t: np.ndarray | float, mu: float) -> tuple[np.ndarray, np.ndarray]:
    from scipy import special  # imported on first use: a slow import for every process

    tt = np.asarray(t, dtype=np.float64)
    if mu == 0.0:
        value = np.asarray(-np.expm1(np.minimum(tt, 0.0)))
        return value, np.asarray(2.0 * _U * value)
    a = -tt / mu + mu / 2.0
    b = -tt / mu - mu / 2.0
    first = special.log_ndtr(a)
    second = tt + special.log_ndtr(b)
    # first >= second always; exp(first) (1 - exp(second - first)), accurate for tiny values
    diff = np.minimum(second - first, 0.0)
    gap = -np.expm1(diff)
    value = np.exp(first) * gap
    rounding = np.abs(tt / mu) + mu / 2.0  # scale of the rounding in a and b
    e_first = 8.0 * _U * (1.0 + np.abs(first) + (np.abs(a) + 1.0) * rounding)
    e_second = 8.0 * _U * (1.0 + np.abs(second) + np.abs(tt) + (np.abs(b) + 1.0) * rounding)
    error = np.exp(first) * ((e_first + e_second) * np.exp(diff) + gap * (e_first + 4.0 * _U))
    return np.asarray(value), np.asarray(2.0 * error)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Return the smallest epsilon >= 0 at which a ``mu``-GDP pair is (epsilon, delta)-DP."""
    return epsilon_at(delta, mu=mu, loss=None, infinity=0.0)


# --------------------------------------------------------------------------- reading


def delta_at(epsilon: float, *, mu: float, loss: LossDistribution | None,
             infinity: float) -> float:
    """Return ``delta(epsilon)`` of ``mu``-GDP composed with ``loss`` and extra ``+inf`` mass.

    Exact for the given (pessimistic) distributions up to the bounded floating-point error of
    the Gaussian terms (:func:`gaussian_hockey_stick_upper`), times ``1 + DELTA_SLACK``.
    Masses far below ``epsilon`` are bounded together by the largest term they could reach.
    """
    inf = infinity
    h = gaussian_hockey_stick_upper
    if loss is None:
        terms = float(h(epsilon, mu))
    else:
        inf += loss.infinity
        losses, w = loss.losses, loss.masses
        # below l_cut every term is at most h(epsilon - l_cut) < Phi(-12): bound them together
        reach = mu * mu / 2.0 + 12.0 * mu + 2.0 * loss.step
        cut = int(np.searchsorted(losses, epsilon - reach, side="left"))
        below = float(w[:cut].sum())
        terms = below * float(h(epsilon - losses[cut - 1], mu)) if cut else 0.0
        terms += float(np.dot(w[cut:], h(epsilon - losses[cut:], mu)))
    return min(1.0, (inf + terms) * (1.0 + DELTA_SLACK))


def epsilon_at(delta: float, *, mu: float, loss: LossDistribution | None,
               infinity: float) -> float:
    """Return the smallest epsilon >= 0 with :func:`delta_at` ``<= delta`` (``inf`` if none).

    The root of the decreasing ``delta_at`` (Brent, to 1e-10 relative), stepped up until it
    holds: the reported epsilon is never below the one the distributions support.
    """
    dl = check_delta(delta)
    def f(e: float) -> float:
        return delta_at(e, mu=mu, loss=loss, infinity=infinity)
    if f(0.0) <= dl:
        return 0.0
    top = mu * mu / 2.0 + 40.0 * mu + 1.0
    if loss is not None:
        top += float(loss.losses[-1]) if loss.masses.size else 0.0
    if f(top) > dl:
        return math.inf
    log_dl = math.log(dl)
    from scipy import optimize  # here: a module-level import costs every start-up
    root = float(optimize.brentq(lambda e: math.log(max(f(e), 1e-300)) - log_dl, 0.0, top,
                                 xtol=1e-12, rtol=1e-10))
    step = 1e-13 * root + 1e-15
    while f(root) > dl:  # the root from above: never an epsilon the distributions exceed
        root += step
        step *= 2.0
    return root
