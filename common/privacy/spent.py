"""What a sequence of releases has spent together: each event's dominating pair, composed.

A ledger event records its mechanism, its (epsilon, delta), its zCDP rho, its sensitivity and
its noise scale. :func:`event_loss` turns that into the tightest dominating pair dpfed can
justify for the mechanism (docs/privacy.md, "Tight accounting"):

=================================  ============================================================
mechanism                          dominating pair
=================================  ============================================================
Gaussian (plain, symmetric,        ``Delta/sigma``-GDP: exact (Balle & Wang 2018)
matrix)
Skellam (pooled, or a secure       ``unit(mu) Delta``-GDP plus a ``+inf`` mass below 1e-200
round's share)                     (:mod:`dpfed.common.privacy.lattice_gdp`)
discrete Gaussian                  likewise, with the discrete Gaussian's unit
Laplace (real-valued, matrix)      the 1-D Laplace pair at ``Delta_1/b``: exact, and it
                                   dominates every multivariate Laplace of L1 sensitivity
                                   ``Delta_1``
SVT, discrete Laplace (incl. a      randomized response at epsilon (Kairouz, Oh & Viswanath 2015):
secure ``secure-dlaplace[...]``    exact for a discrete Laplace at ``Delta_1 = 1``, which *is*
round), any pure epsilon release   randomized response; the continuous Laplace pair would
                                   under-count it
anything else                      the generic (epsilon, delta) pair (KOV 2015): never looser than
                                   basic composition
=================================  ============================================================

A pair is used only when the event's stored (epsilon, delta) follows from it (a consistency
check on the stored sensitivity and noise scale); otherwise the event falls back to its
(epsilon, delta). :class:`Spent` composes the pairs: Gaussian parts by adding ``mu^2``, the
rest as a pessimistic :class:`~dpfed.common.privacy.pld.LossDistribution`, and reports the
smallest of three valid figures at a delta: the composed pairs, basic composition and zCDP.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, replace
from functools import lru_cache

from dpfed.common.errors import ValidationError
from dpfed.common.privacy import pld
from dpfed.common.privacy.accounting import PrivacyCost, zcdp_to_epsilon
from dpfed.common.privacy.lattice_gdp import (
    SIGMA2_MAX,
    discrete_gaussian_gdp,
    skellam_gdp,
)
from dpfed.common.privacy.mechanisms import gaussian_delta
from dpfed.common.validation import check_delta

GAUSSIAN_MECHANISMS = frozenset({"gaussian", "symmetric-gaussian", "matrix-gaussian"})
LAPLACE_MECHANISMS = frozenset({"laplace", "matrix-laplace"})
_SECURE_SKELLAM = re.compile(r"secure-skellam\[n=(\d{1,6}),t=(\d{1,6})(?:,d=(\d{1,6}))?\]")
_SECURE_DLAPLACE = re.compile(r"secure-dlaplace\[n=(\d{1,6}),t=(\d{1,6})(?:,d=(\d{1,6}))?\]")
#: Relative tolerance of the consistency check between a pair and the event's (epsilon, delta).
_CONSISTENCY = 1e-6
#: Largest privacy loss the composed discretised pairs may reach. Pairs past it (events of a
#: pure or approximate epsilon in the tens or more, used to check a pipeline against its
#: non-private answer) compose by basic composition instead: on the pairs' uniform grid their
#: support alone would be tens of millions of points and every ledger read seconds long.
MAX_PAIRS_LOSS = 20.0


@dataclass(frozen=True)
class EventLoss:
    """The dominating pair charged for one event.

    Attributes
    ----------
    method : str
        ``"gaussian"``, ``"skellam"``, ``"discrete-gaussian"``, ``"laplace"``, ``"pure"`` or
        ``"approximate"`` (the generic (epsilon, delta) pair).
    mu : float
        GDP parameter of the Gaussian part (0 if none).
    infinity : float
        ``+inf`` mass beside the Gaussian part.
    kernel : tuple or None
        Key of the discretised part (``("laplace", eps)``, ``("pure", eps)`` or
        ``("approximate", eps, delta)``); None for a Gaussian-type pair.
    """

    method: str
    mu: float = 0.0
    infinity: float = 0.0
    kernel: tuple[Hashable, ...] | None = None


@lru_cache(maxsize=1024)
def _kernel(key: tuple[Hashable, ...]) -> pld.LossDistribution:
    kind = key[0]
    if kind == "laplace":
        return pld.laplace_loss(float(key[1]))  # type: ignore[arg-type]
    if kind == "pure":
        return pld.pure_loss(float(key[1]))  # type: ignore[arg-type]
    return pld.approximate_loss(float(key[1]), float(key[2]))  # type: ignore[arg-type]


def _kernel_epsilon(key: tuple[Hashable, ...]) -> float:
    """Return the largest finite privacy loss of a kernel (its pure or approximate epsilon)."""
    return float(key[1])  # type: ignore[arg-type]


def _kernel_delta(key: tuple[Hashable, ...]) -> float:
    """Return the delta a kernel carries (approximate pairs only)."""
    return float(key[2]) if key[0] == "approximate" else 0.0  # type: ignore[arg-type]


def _kernel_order(key: tuple[Hashable, ...]) -> tuple[float, str]:
    return _kernel_epsilon(key), repr(key)


def _fallback(cost: PrivacyCost) -> EventLoss:
    if cost.delta == 0.0:
        return EventLoss("pure", kernel=("pure", cost.epsilon))
    return EventLoss("approximate", kernel=("approximate", cost.epsilon, cost.delta))


def _gdp_consistent(cost: PrivacyCost, mu: float, infinity: float) -> bool:
    """Whether the stored (epsilon, delta) follows from the GDP pair (then the pair is used)."""
    if cost.delta <= 0.0 or infinity >= cost.delta:
        return False
    claimed = pld.delta_at(cost.epsilon, mu=mu, loss=None, infinity=infinity)
    return claimed <= cost.delta * (1.0 + _CONSISTENCY)


def _skellam_variance(mechanism: str, noise_scale: float) -> float | None:
    """Return the pooled Skellam variance protecting the site (None: another mechanism).

    ``skellam``: ``noise_scale`` is the pooled standard deviation. A secure round's event
    (``secure-skellam[n=N,t=T]``, or ``[n=N,t=T,d=D]`` when ``D`` drops are tolerated)
    stores the standard deviation of the site's own share ``mu / (N - T - D)``: the
    ``N - T - D`` honest survivors of the worst case carry ``mu``.
    """
    if mechanism == "skellam":
        return noise_scale * noise_scale
    match = _SECURE_SKELLAM.fullmatch(mechanism)
    if match is None:
        return None
    n, t, d = int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)
    if not 0 <= t < n - d:
        return None
    return noise_scale * noise_scale * (n - t - d)


@lru_cache(maxsize=65536)
def event_loss(cost: PrivacyCost) -> EventLoss:
    """Return the dominating pair of one charged release (module docstring; cached per cost)."""
    name, sens, scale = cost.mechanism, cost.sensitivity, cost.noise_scale
    if not (sens > 0.0 and scale > 0.0 and math.isfinite(sens) and math.isfinite(scale)):
        return _fallback(cost)
    if name in GAUSSIAN_MECHANISMS:
        mu = sens / scale
        if (cost.delta > 0.0
                and gaussian_delta(scale, cost.epsilon, sens) <= cost.delta * (1 + _CONSISTENCY)):
            return EventLoss("gaussian", mu=mu)
        return _fallback(cost)
    variance = _skellam_variance(name, scale)
    if variance is not None:
        noise = skellam_gdp(variance)
        mu, inf = noise.unit * sens, noise.tail_mass(sens, sens * sens)
        if _gdp_consistent(cost, mu, inf):
            return EventLoss("skellam", mu=mu, infinity=inf)
        return _fallback(cost)
    if name == "discrete-gaussian" and scale * scale <= SIGMA2_MAX:
        noise = discrete_gaussian_gdp(scale * scale)
        mu, inf = noise.unit * sens, noise.tail_mass(sens, sens * sens)
        if _gdp_consistent(cost, mu, inf):
            return EventLoss("discrete-gaussian", mu=mu, infinity=inf)
        return _fallback(cost)
    if name in LAPLACE_MECHANISMS:
        ratio = sens / scale
        if ratio <= cost.epsilon * (1 + 1e-12):
            return EventLoss("laplace", kernel=("laplace", ratio))
    if _SECURE_DLAPLACE.fullmatch(name) is not None and cost.delta == 0.0:
        # a discrete Laplace: never the continuous Laplace pair (module docstring)
        return EventLoss("pure", kernel=("pure", cost.epsilon))
    return _fallback(cost)


@dataclass(frozen=True)
class Spent:
    """The composed cost of a ledger's events (immutable; :meth:`add` returns a new one).

    The discretised pairs are kept as counts per kernel and composed when a figure needs them
    (:attr:`loss`), the same way whatever order the events came in: a ledger under the basic
    or zCDP accountant never composes them, and one under ``pld`` composes once per read.

    Attributes
    ----------
    events : int
        Number of events composed.
    epsilon_sum, delta_sum, rho_sum : float
        Basic-composition sums and the zCDP rho.
    mu_squared : float
        Sum of the squared GDP parameters of the Gaussian-type pairs.
    infinity : float
        Sum of their ``+inf`` masses.
    kernels : tuple
        ``(kernel key, count)`` of the discretised pairs, sorted by key.
    fallbacks : int
        Events charged by their (epsilon, delta) alone (no usable mechanism description).
    """

    events: int = 0
    epsilon_sum: float = 0.0
    delta_sum: float = 0.0
    rho_sum: float = 0.0
    mu_squared: float = 0.0
    infinity: float = 0.0
    kernels: tuple[tuple[tuple[Hashable, ...], int], ...] = ()
    fallbacks: int = 0

    @staticmethod
    def of(costs: Iterable[PrivacyCost]) -> Spent:
        """Compose ``costs``."""
        spent = Spent()
        for cost in costs:
            spent = spent.add(cost)
        return spent

    def add(self, cost: PrivacyCost) -> Spent:
        """Return the composition of these events and ``cost``."""
        pair = event_loss(cost)
        kernels = self.kernels
        if pair.kernel is not None:
            counts = Counter(dict(kernels))
            counts[pair.kernel] += 1
            kernels = tuple(sorted(counts.items(), key=lambda kv: _kernel_order(kv[0])))
        return replace(self, events=self.events + 1,
                       epsilon_sum=self.epsilon_sum + cost.epsilon,
                       delta_sum=self.delta_sum + cost.delta, rho_sum=self.rho_sum + cost.rho,
                       mu_squared=self.mu_squared + pair.mu * pair.mu,
                       infinity=self.infinity + pair.infinity, kernels=kernels,
                       fallbacks=self.fallbacks + (pair.method == "approximate"))

    @property
    def loss(self) -> pld.LossDistribution | None:
        """The composed discretised pairs (smallest epsilon first, up to MAX_PAIRS_LOSS)."""
        return _composed(self.kernels)[0]

    @property
    def outside_epsilon(self) -> float:
        """Summed epsilon of the pairs kept out of :attr:`loss` (past MAX_PAIRS_LOSS).

        They join the pairs' figure by basic composition (:meth:`pairs_epsilon`).
        """
        return _composed(self.kernels)[1]

    @property
    def outside_delta(self) -> float:
        """Summed delta of the pairs kept out of :attr:`loss`."""
        return _composed(self.kernels)[2]

    @property
    def basic(self) -> PrivacyCost:
        """The basic-composition sums as a cost."""
        return PrivacyCost(self.epsilon_sum, self.delta_sum, self.rho_sum, "composed")

    @property
    def discretisation_error(self) -> float:
        """How much the composed-pairs epsilon may overstate the pairs' exact one."""
        return 0.0 if self.loss is None else self.loss.error

    def pairs_delta(self, epsilon: float) -> float:
        """``delta(epsilon)`` of the composed pairs (an upper bound on the true one)."""
        if epsilon < self.outside_epsilon:
            return 1.0
        inner = pld.delta_at(epsilon - self.outside_epsilon, mu=math.sqrt(self.mu_squared),
                             loss=self.loss, infinity=self.infinity)
        return min(1.0, inner + self.outside_delta)

    def pairs_epsilon(self, delta: float) -> float:
        """Return the composed pairs' epsilon at ``delta`` (``inf`` past their ``+inf`` mass)."""
        if self.events == 0:
            return 0.0
        if delta <= self.outside_delta:
            return math.inf
        return self.outside_epsilon + pld.epsilon_at(
            delta - self.outside_delta, mu=math.sqrt(self.mu_squared), loss=self.loss,
            infinity=self.infinity)

    def epsilon(self, delta: float) -> float:
        """Return the tight epsilon at ``delta``: the least of composed pairs, basic and zCDP.

        Each is a valid bound for the whole sequence, so the least is too.
        """
        dl = check_delta(delta)
        if self.events == 0:
            return 0.0
        best = self.pairs_epsilon(dl)
        if self.delta_sum <= dl:
            best = min(best, self.epsilon_sum)
        if self.rho_sum > 0.0:
            best = min(best, zcdp_to_epsilon(self.rho_sum, dl))
        return best

    def fits(self, epsilon: float, delta: float) -> bool:
        """Whether the sequence is (epsilon, delta)-DP by one of the three figures."""
        dl = check_delta(delta)
        if epsilon < 0.0:
            raise ValidationError(f"epsilon must be >= 0, got {epsilon!r}")
        if self.events == 0:
            return True
        if self.delta_sum <= dl and self.epsilon_sum <= epsilon:
            return True
        if self.rho_sum > 0.0 and zcdp_to_epsilon(self.rho_sum, dl) <= epsilon:
            return True
        return self.pairs_delta(epsilon) <= dl


def _composed(kernels: tuple[tuple[tuple[Hashable, ...], int], ...],
              ) -> tuple[pld.LossDistribution | None, float, float]:
    """Compose kernel counts: the smallest epsilons first, identical pairs by squaring.

    Pairs that would take the composed loss past :data:`MAX_PAIRS_LOSS` stay out; returns
    ``(loss, outside epsilon, outside delta)``.
    """
    reach = out_eps = out_delta = 0.0
    kept_counts = []
    for key, count in kernels:
        each = _kernel_epsilon(key)
        kept = count if each <= 0.0 else min(count, int((MAX_PAIRS_LOSS - reach) // each))
        if kept > 0:
            kept_counts.append((key, kept))
            reach += kept * each
        out_eps += (count - kept) * each
        out_delta += (count - kept) * _kernel_delta(key)
    return _compose_kept(tuple(kept_counts)), out_eps, out_delta


@lru_cache(maxsize=64)
def _compose_kept(kept: tuple[tuple[tuple[Hashable, ...], int], ...],
                  ) -> pld.LossDistribution | None:
    loss: pld.LossDistribution | None = None
    for key, count in kept:
        part = _kernel(key).power(count)
        loss = part if loss is None else loss.compose(part)
    return loss
