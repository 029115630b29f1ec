"""Privacy costs, composition and budget policies.

A :class:`PrivacyCost` is what one release spends: its (epsilon, delta) and its zCDP rho
(Bun & Steinke 2016), plus the descriptive fields a ledger event stores (mechanism,
sensitivity, noise scale). Budgets are checked by a :class:`BudgetPolicy` against the *events*
a ledger holds, composed by :class:`dpfed.common.privacy.spent.Spent`; totals are always
derived from events, never stored.

Three accountants:

``pld`` (default)
    Tight composition: every event's dominating pair (Gaussian, Skellam and discrete Gaussian
    as GDP, Laplace as its privacy loss distribution, other pure releases as randomized
    response, anything else as its generic (epsilon, delta) pair), composed exactly (GDP) or on
    a pessimistic grid, read at the cap's delta; the least of that, basic composition and zCDP
    (all three valid) is the spent epsilon. See docs/privacy.md, "Tight accounting".
``basic``
    Basic sequential composition: sum of epsilons <= cap and sum of deltas <= cap.
``zcdp``
    Sum of rho, converted to (epsilon, delta_cap) with the conversion of Canonne, Kamath &
    Steinke (2020, Prop. 12/Cor. 13), which is never looser than ``rho + 2 sqrt(rho ln(1/delta))``.
    A Gaussian release costs rho = sensitivity^2 / (2 sigma^2); a pure epsilon-DP release costs
    rho = epsilon^2 / 2.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpfed.common.errors import BudgetExceededError, ValidationError
from dpfed.common.validation import check_choice, check_delta, check_nonnegative, check_positive

if TYPE_CHECKING:
    from dpfed.common.privacy.spent import Spent

ACCOUNTANTS: tuple[str, ...] = ("pld", "basic", "zcdp")
#: The accountant a site uses when its configuration names none.
DEFAULT_ACCOUNTANT = "pld"


@dataclass(frozen=True)
class PrivacyCost:
    """The privacy spent by one release (or a composition of releases).

    Attributes
    ----------
    epsilon, delta : float
        The (epsilon, delta)-DP guarantee the release was calibrated for.
    rho : float
        Its zCDP parameter (composes by addition).
    mechanism : str
        A short name (``"gaussian"``, ``"laplace"``, ``"svt"``, ``"composed"``, ...).
    sensitivity : float
        The sensitivity the noise was calibrated to (0 when composed of several).
    noise_scale : float
        Gaussian sigma or Laplace scale (0 when composed of several).
    """

    epsilon: float
    delta: float
    rho: float
    mechanism: str = "unknown"
    sensitivity: float = 0.0
    noise_scale: float = 0.0

    def __post_init__(self) -> None:
        check_nonnegative(self.epsilon, "epsilon")
        check_nonnegative(self.delta, "delta")
        check_nonnegative(self.rho, "rho")
        if self.delta >= 1.0:
            raise ValidationError(f"delta must be < 1, got {self.delta!r}")

    @classmethod
    def pure(cls, epsilon: float, *, mechanism: str = "laplace", sensitivity: float = 0.0,
             noise_scale: float = 0.0) -> PrivacyCost:
        """Cost of a pure epsilon-DP release (rho = epsilon^2 / 2)."""
        eps = check_positive(epsilon, "epsilon")
        return cls(eps, 0.0, eps * eps / 2.0, mechanism, sensitivity, noise_scale)

    @classmethod
    def gaussian(cls, epsilon: float, delta: float, *, sigma: float, sensitivity: float,
                 mechanism: str = "gaussian") -> PrivacyCost:
        """Cost of a Gaussian release calibrated to (epsilon, delta); rho = D^2 / (2 sigma^2)."""
        s = check_positive(sigma, "sigma")
        d = check_positive(sensitivity, "sensitivity")
        return cls(float(epsilon), float(delta), d * d / (2.0 * s * s), mechanism, d, s)

    def __add__(self, other: PrivacyCost) -> PrivacyCost:
        """Sequential composition (epsilons, deltas and rhos add)."""
        return PrivacyCost(self.epsilon + other.epsilon, self.delta + other.delta,
                           self.rho + other.rho, "composed")

    @staticmethod
    def total(costs: Iterable[PrivacyCost]) -> PrivacyCost:
        """Compose a sequence of costs; the empty sequence costs nothing."""
        eps = delta = rho = 0.0
        for c in costs:
            eps += c.epsilon
            delta += c.delta
            rho += c.rho
        return PrivacyCost(eps, delta, rho, "composed")


def zcdp_to_epsilon(rho: float, delta: float) -> float:
    """Return the smallest epsilon such that rho-zCDP implies (epsilon, delta)-DP.

    Uses Canonne, Kamath & Steinke (2020), Cor. 13:
    ``epsilon = inf_{a>1} a rho + (ln(1/delta) + (a-1) ln(1-1/a) - ln a) / (a-1)``,
    minimised numerically over the Renyi order a; never larger than the standard
    ``rho + 2 sqrt(rho ln(1/delta))`` (which is returned if the minimiser does worse).
    """
    r = check_nonnegative(rho, "rho")
    dl = check_delta(delta)
    if r == 0.0:
        return 0.0
    standard = r + 2.0 * math.sqrt(r * math.log(1.0 / dl))

    def bound(log_am1: float) -> float:
        a = 1.0 + math.exp(log_am1)
        return a * r + (math.log(1.0 / dl) + (a - 1.0) * math.log1p(-1.0 / a) - math.log(a)) / (
            a - 1.0)

    from scipy import optimize  # here: a module-level import costs every start-up
    res = optimize.minimize_scalar(bound, bounds=(-20.0, 20.0), method="bounded",
                                   options={"xatol": 1e-10})
    best = float(res.fun) if res.success else standard
    return max(0.0, min(best, standard))


def rho_for_epsilon(epsilon: float, delta: float) -> float:
    """Return the largest rho whose (epsilon, delta) conversion stays within ``epsilon``."""
    eps = check_positive(epsilon, "epsilon")
    dl = check_delta(delta)
    hi = eps  # the conversion is at least rho for delta below about 1/4 ...
    while zcdp_to_epsilon(hi, dl) < eps:  # ... and grows without bound in rho
        hi *= 2.0
    # (a relative tolerance only: rho can be 1e-12 and smaller at tiny epsilon)
    from scipy import optimize  # here: a module-level import costs every start-up
    rho = float(optimize.brentq(lambda r: zcdp_to_epsilon(r, dl) - eps, 1e-300, hi,
                                xtol=1e-300, rtol=1e-13))
    step = 1e-13 * rho
    while zcdp_to_epsilon(rho, dl) > eps:  # the root from below
        rho -= step
        step *= 2.0
    return rho


@dataclass(frozen=True)
class BudgetStatus:
    """What a site has spent and has left, derived from its ledger events."""

    accountant: str
    epsilon_cap: float
    delta_cap: float
    epsilon_spent: float
    delta_spent: float
    rho_spent: float
    events: int
    #: The site's study budgets (``[studies.NAME]`` of site.toml), each within this total.
    studies: tuple[StudyStatus, ...] = ()

    @property
    def epsilon_remaining(self) -> float:
        """Epsilon still available (0 when exhausted)."""
        return max(self.epsilon_cap - self.epsilon_spent, 0.0)

    @property
    def delta_remaining(self) -> float:
        """Delta still available (0 when exhausted)."""
        return max(self.delta_cap - self.delta_spent, 0.0)


@dataclass(frozen=True)
class StudyStatus:
    """One study's budget at a site: its cap and spend (``status``) and its last day."""

    name: str
    #: The last day (UTC, ``YYYY-MM-DD``) on which the study's jobs may spend.
    expires: str
    status: BudgetStatus


@dataclass(frozen=True)
class BudgetPolicy:
    """A site's total privacy budget and how releases compose against it.

    Attributes
    ----------
    epsilon : float
        Total epsilon cap (> 0).
    delta : float
        Total delta cap, in (0, 1).
    accountant : {"pld", "basic", "zcdp"}
        ``pld`` (default): the tight epsilon of the composed events at ``delta`` must stay
        <= ``epsilon``. ``basic``: sums of epsilon and of delta are capped. ``zcdp``: the sum
        of rho, converted at ``delta``, must stay <= ``epsilon``.
    max_epsilon_per_task : float or None
        Largest epsilon a single task may spend; None means no per-task limit.
    """

    epsilon: float
    delta: float
    accountant: str = DEFAULT_ACCOUNTANT
    max_epsilon_per_task: float | None = None

    def __post_init__(self) -> None:
        check_positive(self.epsilon, "budget.epsilon")
        check_delta(self.delta, "budget.delta")
        check_choice(self.accountant, "budget.accountant", ACCOUNTANTS)
        if self.max_epsilon_per_task is not None:
            check_positive(self.max_epsilon_per_task, "policy.max_epsilon_per_task")

    def spent_epsilon(self, spent: Spent) -> tuple[float, float]:
        """Return ``(epsilon, delta)`` spent under this policy's accountant."""
        if spent.events == 0:
            return 0.0, 0.0
        if self.accountant == "zcdp":
            return (zcdp_to_epsilon(spent.rho_sum, self.delta) if spent.rho_sum > 0 else 0.0,
                    self.delta)
        if self.accountant == "pld":
            return spent.epsilon(self.delta), self.delta
        return spent.epsilon_sum, spent.delta_sum

    def status(self, spent: Spent) -> BudgetStatus:
        """Return the budget status of the composed events ``spent``."""
        eps_spent, delta_spent = self.spent_epsilon(spent)
        return BudgetStatus(self.accountant, self.epsilon, self.delta, eps_spent, delta_spent,
                            spent.rho_sum, spent.events)

    def check(self, spent: Spent, request: PrivacyCost) -> None:
        """Raise :class:`BudgetExceededError` unless ``request`` fits beside ``spent``.

        Pure arithmetic: no noise is drawn and nothing is released when this raises.
        """
        if self.max_epsilon_per_task is not None and request.epsilon > self.max_epsilon_per_task:
            raise BudgetExceededError(
                f"task epsilon {request.epsilon:g} exceeds the site's max_epsilon_per_task "
                f"{self.max_epsilon_per_task:g}"
            )
        # A tiny relative slack so that spending exactly the cap in floating point is allowed.
        slack = 1e-12
        cap = self.epsilon * (1 + slack)
        if self.accountant == "pld":
            after = spent.add(request)
            if not after.fits(cap, self.delta):
                raise BudgetExceededError(
                    f"budget exceeded: spent epsilon {spent.epsilon(self.delta):.6g} + this task "
                    f"would reach epsilon {after.epsilon(self.delta):.6g} at delta "
                    f"{self.delta:g} (tight composition), cap {self.epsilon:g}"
                )
            return
        if self.accountant == "zcdp":
            after_eps = zcdp_to_epsilon(spent.rho_sum + request.rho, self.delta)
            if after_eps > cap:
                before = zcdp_to_epsilon(spent.rho_sum, self.delta) if spent.rho_sum > 0 else 0.0
                raise BudgetExceededError(
                    f"zCDP budget exceeded: spent epsilon {before:.6g} (rho {spent.rho_sum:.6g}) "
                    f"+ this task would reach epsilon {after_eps:.6g} at delta {self.delta:g}, "
                    f"cap {self.epsilon:g}"
                )
            return
        if spent.epsilon_sum + request.epsilon > cap:
            raise BudgetExceededError(
                f"epsilon budget exceeded: spent {spent.epsilon_sum:.6g} + requested "
                f"{request.epsilon:.6g} > cap {self.epsilon:g}"
            )
        if spent.delta_sum + request.delta > self.delta * (1 + slack):
            raise BudgetExceededError(
                f"delta budget exceeded: spent {spent.delta_sum:.6g} + requested "
                f"{request.delta:.6g} > cap {self.delta:g}"
            )
