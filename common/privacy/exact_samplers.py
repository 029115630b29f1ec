"""Exact samplers for integer-valued releases: discrete Laplace and discrete Gaussian.

The samplers follow Canonne, Kamath & Steinke, "The Discrete Gaussian for Differential
Privacy" (NeurIPS 2020; CKS below), Algorithms 1-3. Every step is exact: parameters are
:class:`fractions.Fraction`, every random decision is an integer comparison against a uniform
integer from ``randbelow``, and no floating-point number is ever computed on the sampling path.
The output distribution is therefore *exactly* the stated pmf (up to the quality of the
randomness source), which is what makes these samplers immune to the floating-point attacks
on textbook Laplace sampling (Mironov, CCS 2012).

Where dpfed uses which grade of noise
-------------------------------------
*Exact* (this module)
    Scalar and small-vector integer releases: counts, histogram cells a site returns one by
    one, budget-critical scalar answers. Randomness comes from the ``secrets`` module (the
    operating system's CSPRNG) unless a test injects a deterministic source.
*Floating-point grade* (:mod:`dpfed.common.privacy.mechanisms`)
    Matrix-valued releases: the noisy covariance of DP-PCA, matrix-mechanism measurements,
    factor-model noise. These use ``numpy.random.Generator`` Laplace/Gaussian noise in IEEE
    doubles, which OpenDP would label "floating-point". That is acceptable there because the
    release is a whole matrix that is immediately post-processed (eigendecomposition, least
    squares), and the known attacks (Mironov 2012; the DP-Sniper finding that a textbook
    "0.1-DP" Laplace is not 0.25-DP) read the low-order bits of a *single scalar* output to
    rule out a neighbouring input. It is nevertheless a residual risk, not a proof: a released
    noisy matrix still carries those bits, and dpfed documents it as such rather than claiming
    exactness. Exact per-entry sampling (this module, upper triangle only) is the conservative
    alternative where p is small.

Randomness sources
------------------
A source is any object with ``randbelow(n) -> int`` returning a uniform integer in
``[0, n)`` (:class:`RandomSource`). Production uses :class:`SystemRandomSource`
(``secrets.randbelow``); tests pass a :class:`SeededRandomSource` or a seeded
:class:`random.Random`, which is adapted automatically. No RPC lets a caller choose a seed.
"""

from __future__ import annotations

import math
import numbers
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol, runtime_checkable

from dpfed.common.errors import ValidationError
from dpfed.common.privacy.accounting import PrivacyCost, rho_for_epsilon
from dpfed.common.validation import check_delta, check_epsilon, check_int, check_positive

__all__ = [
    "DiscreteGaussianMechanism",
    "DiscreteLaplaceMechanism",
    "RandomSource",
    "SeededRandomSource",
    "SystemRandomSource",
    "discrete_gaussian_pmf",
    "discrete_laplace_pmf",
    "resolve_source",
    "sample_bernoulli_exp",
    "sample_discrete_gaussian",
    "sample_discrete_gaussian_many",
    "sample_discrete_laplace",
    "sample_discrete_laplace_many",
]

# Denominator used when a float sigma^2 from calibration is rounded *up* to a rational.
_SIGMA2_DENOMINATOR = 1 << 32


# --------------------------------------------------------------------------- sources


@runtime_checkable
class RandomSource(Protocol):
    """Anything that returns uniform integers in ``[0, n)`` from ``randbelow(n)``."""

    def randbelow(self, n: int, /) -> int:
        """Return a uniform integer in ``[0, n)`` for an integer ``n >= 1``."""
        ...


class SystemRandomSource:
    """The production source: the operating system's CSPRNG via :func:`secrets.randbelow`."""

    def randbelow(self, n: int, /) -> int:
        """Return a uniform integer in ``[0, n)``."""
        return secrets.randbelow(n)


class SeededRandomSource:
    """A deterministic source (a seeded :class:`random.Random`) for tests and demos only.

    Never use it for a real release: its output is predictable from the seed.
    """

    def __init__(self, seed: int) -> None:
        self._random = random.Random(check_int(seed, "seed"))

    def randbelow(self, n: int, /) -> int:
        """Return a uniform integer in ``[0, n)``."""
        return self._random.randrange(n)


class _RandomAdapter:
    """Adapts a :class:`random.Random` (whose ``randbelow`` is private) to the protocol."""

    def __init__(self, rng: random.Random) -> None:
        self._random = rng

    def randbelow(self, n: int, /) -> int:
        return self._random.randrange(n)


def resolve_source(rng: RandomSource | random.Random | None) -> RandomSource:
    """Return ``rng`` as a :class:`RandomSource`; None gives the ``secrets`` source."""
    if rng is None:
        return SystemRandomSource()
    if isinstance(rng, random.Random):
        return _RandomAdapter(rng)
    if isinstance(rng, RandomSource):
        return rng
    raise ValidationError(
        "rng must be None, a random.Random or an object with randbelow(n), "
        f"got {type(rng).__name__}"
    )


# --------------------------------------------------------------------------- parameters


def _to_fraction(value: object, name: str, *, allow_zero: bool = False) -> Fraction:
    """Return ``value`` as an exact Fraction > 0 (>= 0 if allowed); floats convert exactly."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValidationError(
            f"{name} must be a positive int, Fraction or float, got {type(value).__name__} "
            f"{value!r}"
        )
    if isinstance(value, numbers.Rational):
        frac = Fraction(int(value.numerator), int(value.denominator))
    else:
        x = float(value)
        if not math.isfinite(x):
            raise ValidationError(f"{name} must be finite and > 0, got {x!r}")
        frac = Fraction(x)  # exact: every finite double is a dyadic rational
    if frac < 0 or (frac == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValidationError(f"{name} must be finite and {bound}, got {value!r}")
    return frac


# --------------------------------------------------------------------------- CKS Algorithm 1


def _bernoulli(num: int, den: int, src: RandomSource) -> bool:
    """Return True with probability num/den (0 <= num <= den) using one uniform integer."""
    return src.randbelow(den) < num


def _bernoulli_exp_at_most_one(num: int, den: int, src: RandomSource) -> bool:
    """Bernoulli(exp(-gamma)) for gamma = num/den in [0, 1]: CKS Alg. 1, first branch.

    Draw A_k ~ Bernoulli(gamma/k) for k = 1, 2, ... until the first A_K = 0 and return
    whether K is odd; P[K odd] = sum_m (-1)^m gamma^m / m! = exp(-gamma).
    """
    k = 1
    while src.randbelow(den * k) < num:  # A_k = 1 with probability gamma / k
        k += 1
    return k % 2 == 1


def _bernoulli_exp(num: int, den: int, src: RandomSource) -> bool:
    """Bernoulli(exp(-gamma)) for any gamma = num/den >= 0 (CKS Alg. 1)."""
    whole, rest = divmod(num, den)
    # CKS Alg. 1, second branch: exp(-gamma) = exp(-1)^floor(gamma) * exp(-(gamma - floor)).
    for _ in range(whole):
        if not _bernoulli_exp_at_most_one(1, 1, src):
            return False
    return _bernoulli_exp_at_most_one(rest, den, src)


def sample_bernoulli_exp(
    gamma: Fraction | int | float, *, rng: RandomSource | random.Random | None = None
) -> bool:
    """Return True with probability exactly ``exp(-gamma)`` (CKS Alg. 1).

    Parameters
    ----------
    gamma : Fraction, int or float
        Non-negative; floats are converted exactly to rationals.
    rng : RandomSource, random.Random or None
        Randomness; None uses ``secrets``.
    """
    g = _to_fraction(gamma, "gamma", allow_zero=True)
    return _bernoulli_exp(g.numerator, g.denominator, resolve_source(rng))


# --------------------------------------------------------------------------- CKS Algorithm 2


def _geometric_exp_minus_one(src: RandomSource) -> int:
    """Return the number of successes before the first failure of Bernoulli(exp(-1))."""
    v = 0
    while _bernoulli_exp_at_most_one(1, 1, src):
        v += 1
    return v


def _discrete_laplace(t: int, s: int, src: RandomSource) -> int:
    """One draw with pmf proportional to exp(-|x| s / t), i.e. scale t/s (CKS Alg. 2)."""
    while True:
        u = src.randbelow(t)  # step 1: U uniform on {0, ..., t-1}
        if not _bernoulli_exp(u, t, src):  # step 2: accept U with probability exp(-U/t)
            continue
        v = _geometric_exp_minus_one(src)  # step 3: V geometric, P[V >= k] = exp(-k)
        x = u + t * v  # step 4: X geometric with P[X >= k] = exp(-k/t)
        y = x // s  # step 5: Y geometric with P[Y >= k] = exp(-k s/t)
        negative = src.randbelow(2) == 1  # step 6: a fair sign
        if negative and y == 0:  # step 7: reject -0 so that 0 is not counted twice
            continue
        return -y if negative else y


def sample_discrete_laplace(
    scale: Fraction | int | float, *, rng: RandomSource | random.Random | None = None
) -> int:
    """Return one exact draw from the discrete Laplace distribution on the integers.

    The pmf is ``P[X = x] = tanh(1/(2 scale)) exp(-|x| / scale)`` for every integer x
    (:func:`discrete_laplace_pmf`).

    Parameters
    ----------
    scale : Fraction, int or float
        The scale t > 0 (floats are converted exactly to rationals).
    rng : RandomSource, random.Random or None
        Randomness; None uses ``secrets``.

    Returns
    -------
    int
        A Python int.

    Privacy
    -------
    ``q(x) + X`` for an integer-valued query with L1 sensitivity Delta is (Delta/scale)-DP:
    the pmf ratio at any output is ``exp(|q(x) - q(x')| / scale)``. Sampler: CKS Alg. 2.
    """
    t = _to_fraction(scale, "scale")
    # Alg. 2 takes integers (s, t) and samples scale t/s: here scale = numerator/denominator.
    return _discrete_laplace(t.numerator, t.denominator, resolve_source(rng))


def sample_discrete_laplace_many(
    scale: Fraction | int | float, size: int, *,
    rng: RandomSource | random.Random | None = None,
) -> list[int]:
    """Return ``size`` iid exact discrete Laplace draws (a loop over the scalar sampler)."""
    t = _to_fraction(scale, "scale")
    n = check_int(size, "size", minimum=0)
    src = resolve_source(rng)
    return [_discrete_laplace(t.numerator, t.denominator, src) for _ in range(n)]


# --------------------------------------------------------------------------- CKS Algorithm 3


def _discrete_gaussian(sigma2: Fraction, src: RandomSource) -> int:
    """One draw with pmf proportional to exp(-x^2 / (2 sigma2)) (CKS Alg. 3)."""
    p, q = sigma2.numerator, sigma2.denominator  # sigma^2 = p / q
    t = math.isqrt(p // q) + 1  # step 1: t = floor(sigma) + 1
    while True:
        y = _discrete_laplace(t, 1, src)  # step 2: Y ~ discrete Laplace of scale t
        # step 3: accept with probability exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2)); with
        # sigma^2 = p/q the exponent is (|Y| q t - p)^2 / (2 p q t^2), kept in integers.
        num = (abs(y) * q * t - p) ** 2
        den = 2 * p * q * t * t
        if _bernoulli_exp(num, den, src):
            return y


def sample_discrete_gaussian(
    sigma2: Fraction | int | float, *, rng: RandomSource | random.Random | None = None
) -> int:
    """Return one exact draw from the discrete Gaussian N_Z(0, sigma2).

    The pmf is ``exp(-x^2 / (2 sigma2)) / sum_y exp(-y^2 / (2 sigma2))`` over the integers
    (:func:`discrete_gaussian_pmf`). Note that ``sigma2`` is the parameter, not exactly the
    variance (the variance is slightly below sigma2; CKS Cor. 9).

    Parameters
    ----------
    sigma2 : Fraction, int or float
        The parameter sigma^2 > 0 (floats are converted exactly to rationals).
    rng : RandomSource, random.Random or None
        Randomness; None uses ``secrets``.

    Returns
    -------
    int
        A Python int.

    Privacy
    -------
    ``q(x) + X`` for an integer-valued query with (L2) sensitivity Delta is
    rho-zCDP with ``rho = Delta^2 / (2 sigma2)`` (CKS Thm. 4; Thm. 14 for vectors of iid
    draws). Sampler: CKS Alg. 3 (rejection from a discrete Laplace).
    """
    return _discrete_gaussian(_to_fraction(sigma2, "sigma2"), resolve_source(rng))


def sample_discrete_gaussian_many(
    sigma2: Fraction | int | float, size: int, *,
    rng: RandomSource | random.Random | None = None,
) -> list[int]:
    """Return ``size`` iid exact discrete Gaussian draws (a loop over the scalar sampler)."""
    s2 = _to_fraction(sigma2, "sigma2")
    n = check_int(size, "size", minimum=0)
    src = resolve_source(rng)
    return [_discrete_gaussian(s2, src) for _ in range(n)]


# --------------------------------------------------------------------------- pmfs


def discrete_laplace_pmf(x: int, scale: Fraction | int | float) -> float:
    """Return ``P[X = x]`` for the discrete Laplace of the given scale (float precision)."""
    k = check_int(x, "x")
    a = 1.0 / float(_to_fraction(scale, "scale"))
    return math.tanh(a / 2.0) * math.exp(-abs(k) * a)


def discrete_gaussian_pmf(x: int, sigma2: Fraction | int | float) -> float:
    """Return ``P[X = x]`` for N_Z(0, sigma2) (float precision; normaliser summed to 1e-300)."""
    k = check_int(x, "x")
    s2 = float(_to_fraction(sigma2, "sigma2"))
    # Terms beyond 40 sigma are below exp(-800): nothing a double can add to the normaliser.
    reach = int(40.0 * math.sqrt(s2)) + 2
    norm = 1.0 + 2.0 * math.fsum(math.exp(-(y * y) / (2.0 * s2)) for y in range(1, reach))
    return math.exp(-(k * k) / (2.0 * s2)) / norm


# --------------------------------------------------------------------------- mechanisms


def _check_integer_values(values: Sequence[int], name: str) -> list[int]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ValidationError(f"{name} must be a sequence of integers, got {type(values).__name__}")
    return [check_int(v, f"{name}[{i}]") for i, v in enumerate(values)]


@dataclass(frozen=True)
class DiscreteLaplaceMechanism:
    """Release integer values plus exact discrete Laplace noise of scale ``sensitivity/epsilon``.

    Attributes
    ----------
    epsilon : float
        Privacy parameter, finite and > 0.
    sensitivity : int or float
        L1 sensitivity of the released integer vector (2 for a histogram under replace-one).
    scale : Fraction
        The exact noise scale ``Fraction(sensitivity) / Fraction(epsilon)`` (derived).

    Privacy
    -------
    Neighbouring relation: the caller's (dpfed's is replace-one record with N public,
    docs/privacy.md: one count moves by at most 1, a histogram by 2 in L1). Sensitivity: L1 norm
    of the largest change of the released integer vector. Calibration: discrete Laplace with
    scale t = Delta/epsilon; for integer outputs the probability ratio is ``exp(||q(x) -
    q(x')||_1 / t) <= exp(epsilon)``, so the release is pure epsilon-DP (as zCDP, epsilon^2/2).
    Exact sampler: CKS (2020) Alg. 2; epsilon and sensitivity floats are converted to rationals
    exactly, so the scale is exactly the ratio of the two values given.
    """

    epsilon: float
    sensitivity: float = 1.0
    scale: Fraction = field(init=False)

    def __post_init__(self) -> None:
        eps = check_epsilon(self.epsilon)
        sens = check_positive(self.sensitivity, "sensitivity")
        object.__setattr__(self, "epsilon", eps)
        object.__setattr__(self, "sensitivity", sens)
        object.__setattr__(self, "scale", Fraction(sens) / Fraction(eps))

    def cost(self) -> PrivacyCost:
        """Return the privacy cost of one release (pure epsilon)."""
        return PrivacyCost.pure(self.epsilon, mechanism="discrete-laplace",
                                sensitivity=self.sensitivity, noise_scale=float(self.scale))

    def release(self, value: int, rng: RandomSource | random.Random | None = None) -> int:
        """Return ``value`` plus one exact discrete Laplace draw."""
        v = check_int(value, "value")
        src = resolve_source(rng)
        return v + _discrete_laplace(self.scale.numerator, self.scale.denominator, src)

    def release_many(self, values: Sequence[int],
                     rng: RandomSource | random.Random | None = None) -> list[int]:
        """Return each value plus iid exact noise (the L1 sensitivity covers the whole vector)."""
        vs = _check_integer_values(values, "values")
        src = resolve_source(rng)
        t, s = self.scale.numerator, self.scale.denominator
        return [v + _discrete_laplace(t, s, src) for v in vs]


@dataclass(frozen=True)
class DiscreteGaussianMechanism:
    """Release integer values plus exact discrete Gaussian noise, calibrated via zCDP.

    Attributes
    ----------
    epsilon : float
        Target epsilon (finite, > 0).
    delta : float
        Target delta, in (0, 1).
    sensitivity : float
        L2 sensitivity of the released integer vector (1 for a count).
    sigma2 : Fraction
        The exact noise parameter (derived, rounded up to a multiple of 2^-32).
    rho : float
        The zCDP parameter ``sensitivity^2 / (2 sigma2)`` actually spent (derived).

    Privacy
    -------
    Neighbouring relation: the caller's (dpfed's is replace-one, docs/privacy.md). Sensitivity:
    L2 norm of the largest change of the released integer vector. Calibration: the discrete
    Gaussian N_Z(0, sigma2) is rho-zCDP with rho = Delta^2/(2 sigma2), exactly as the
    continuous one (CKS Thm. 4 and Thm. 14). We take the largest rho whose zCDP -> (epsilon,
    delta) conversion (CKS Cor. 13, :func:`dpfed.common.privacy.accounting.rho_for_epsilon`) stays
    within
    epsilon, shrink it by a relative 1e-9 against root-finding tolerance, and round sigma2 up
    to a rational; both roundings only add noise. CKS Thm. 7 gives an exact, slightly tighter
    delta(epsilon) for the discrete Gaussian; we use the conservative zCDP route so the
    ledger's zCDP accountant charges exactly :attr:`rho`. Exact sampler: CKS Alg. 3.
    """

    epsilon: float
    delta: float
    sensitivity: float = 1.0
    sigma2: Fraction = field(init=False)
    rho: float = field(init=False)

    def __post_init__(self) -> None:
        eps = check_epsilon(self.epsilon)
        dl = check_delta(self.delta)
        sens = check_positive(self.sensitivity, "sensitivity")
        rho_target = rho_for_epsilon(eps, dl) * (1.0 - 1e-9)
        # sigma^2 = Delta^2 / (2 rho), rounded up onto the grid 2^-32 (never below the target).
        sigma2 = Fraction(sens) ** 2 / (2 * Fraction(rho_target))
        sigma2 = Fraction(math.ceil(sigma2 * _SIGMA2_DENOMINATOR), _SIGMA2_DENOMINATOR)
        object.__setattr__(self, "epsilon", eps)
        object.__setattr__(self, "delta", dl)
        object.__setattr__(self, "sensitivity", sens)
        object.__setattr__(self, "sigma2", sigma2)
        object.__setattr__(self, "rho", float(Fraction(sens) ** 2 / (2 * sigma2)))

    def cost(self) -> PrivacyCost:
        """Return the privacy cost of one release (rho-zCDP, reported at (epsilon, delta))."""
        sigma = math.sqrt(float(self.sigma2))
        return PrivacyCost(self.epsilon, self.delta, self.rho, "discrete-gaussian",
                           self.sensitivity, sigma)

    def release(self, value: int, rng: RandomSource | random.Random | None = None) -> int:
        """Return ``value`` plus one exact discrete Gaussian draw."""
        v = check_int(value, "value")
        return v + _discrete_gaussian(self.sigma2, resolve_source(rng))

    def release_many(self, values: Sequence[int],
                     rng: RandomSource | random.Random | None = None) -> list[int]:
        """Return each value plus iid exact noise (the L2 sensitivity covers the whole vector)."""
        vs = _check_integer_values(values, "values")
        src = resolve_source(rng)
        return [v + _discrete_gaussian(self.sigma2, src) for v in vs]
