"""Dividing a multi-round job's (epsilon, delta) between its Gaussian rounds.

A job such as ``synth`` makes several Gaussian releases at every site, one per round, and its
``split`` gives every round a share. How the shares turn into each round's calibration is the
job's *composition*:

``basic`` (default)
    Round ``i`` gets ``(e_i epsilon, d_i delta)`` and is calibrated to it; the rounds together
    are ``(epsilon, delta)``-DP by basic sequential composition, which is what a site's
    ``basic`` accountant adds up.
``zcdp``
    The job's budget is read as zCDP: ``rho = rho_for_epsilon(epsilon, delta)`` (the largest
    rho that still converts to ``(epsilon, delta)``, Canonne, Kamath & Steinke 2020), and
    round ``i`` gets ``rho_i = e_i rho``, i.e. noise ``sigma_i = sensitivity / sqrt(2 rho_i)``
    (Bun & Steinke 2016, Prop. 1.6). Gaussian rounds compose by adding rho, so the rounds
    together are ``rho``-zCDP and hence ``(epsilon, delta)``-DP. For four rounds this is much
    less noise per round than basic composition (at epsilon 1, delta 1e-6, a round with 3 %
    of the budget gets a fifth of the noise).

So that nothing downstream changes, a ``zcdp`` round is still handed to the sites as an
``(epsilon_i, delta_i)`` pair: ``delta_i = d_i delta`` and ``epsilon_i`` the value at which the
analytic Gaussian calibration (the one every site uses) gives exactly ``sigma_i`` -- never
less noise (:func:`epsilon_for_rho`). That pair is an honest statement about the round alone,
and its ledger event records ``rho_i``. The epsilons add up to more than the job's epsilon
(about 1.7 times for the synth job's four rounds): a site with a ``basic`` accountant would be
charged that sum, so ``zcdp`` jobs are for sites whose accountant is ``zcdp`` (which adds the
rhos: exactly the job's rho).

Privacy: composition sets only each round's noise scale. Every round keeps its own
neighbouring relation (replace-one, docs/privacy.md) and its own L2 sensitivity. Tests check
that the rounds' rho charges, computed from the noise actually drawn, add up to at most the
job's rho and convert back to at most its (epsilon, delta).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dpfed.common.errors import ValidationError
from dpfed.common.privacy.accounting import rho_for_epsilon
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.privacy.pld import gaussian_epsilon
from dpfed.common.validation import check_choice, check_delta, check_positive

COMPOSITIONS: tuple[str, ...] = ("basic", "zcdp")
#: The job's rho is taken this much below :func:`rho_for_epsilon`'s root, so rounding in the
#: root finding can never put the rounds' total above it.
_RHO_MARGIN = 1e-9


def epsilon_for_rho(rho: float, delta: float) -> float:
    """Return the epsilon at which the analytic Gaussian at ``delta`` costs at most ``rho``.

    The analytic calibration gives ``sigma = sensitivity x s(epsilon, delta)``; the root of
    ``s(epsilon, delta) = 1 / sqrt(2 rho)`` is taken from below, so a release calibrated to
    the returned ``(epsilon, delta)`` has ``sensitivity^2 / (2 sigma^2) <= rho``.
    """
    r = check_positive(rho, "rho")
    dl = check_delta(delta)
    target = 1.0 / math.sqrt(2.0 * r)

    def excess(eps: float) -> float:
        return gaussian_sigma(eps, dl, 1.0) - target

    hi = 1.0
    while excess(hi) > 0.0:
        hi *= 2.0
        if hi > 1e6:
            raise ValidationError(f"rho {r:g} is too large to express at delta {dl:g}")
    lo = hi / 2.0
    while excess(lo) < 0.0:
        lo /= 2.0
        if lo < 1e-12:
            raise ValidationError(f"rho {r:g} is too small to express at delta {dl:g}")
    from scipy import optimize  # here: a module-level import costs every start-up
    eps = float(optimize.brentq(excess, lo, hi, xtol=1e-15, rtol=1e-13))
    while excess(eps) < 0.0:  # the root from below: never less noise than sigma_i
        eps = math.nextafter(eps, 0.0) * (1.0 - 1e-13)
    return eps


def split_budget(epsilon: float, delta: float, shares: Sequence[tuple[str, float, float]],
                 composition: str = "basic") -> list[tuple[str, float, float]]:
    """Return each round's ``(name, epsilon_i, delta_i)`` under ``composition``.

    ``shares`` are ``(name, epsilon share, delta share)`` of Gaussian rounds (shares sum to
    1). ``basic``: ``(e_i epsilon, d_i delta)``. ``zcdp``: the round's rho share of the job's
    rho, expressed as the analytic Gaussian's ``(epsilon_i, d_i delta)`` (module docstring);
    every round then needs a positive delta share.
    """
    check_choice(composition, "composition", COMPOSITIONS)
    if composition == "basic":
        return [(name, epsilon * e, delta * d) for name, e, d in shares]
    eps = check_positive(epsilon, "epsilon")
    dl = check_delta(delta)
    rho = rho_for_epsilon(eps, dl) * (1.0 - _RHO_MARGIN)
    out = []
    for name, e, d in shares:
        if not (e > 0.0 and d > 0.0):
            raise ValidationError(f"round {name!r} needs positive epsilon and delta shares "
                                  f"under zCDP composition, got {e!r}, {d!r}")
        out.append((name, epsilon_for_rho(e * rho, dl * d), dl * d))
    return out


def gdp_split(epsilon: float, delta: float,
              shares: Sequence[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """Return each Gaussian round's ``(name, epsilon_i, delta_i)`` from shares of ``mu^2``.

    The job's ``(epsilon, delta)`` is read as the GDP parameter ``mu`` of the analytic
    Gaussian calibrated to it (Dong, Roth & Su 2022: a ``mu``-GDP release is (epsilon,
    delta)-DP exactly when the analytic Gaussian condition holds); round ``i`` gets
    ``mu_i = sqrt(e_i) mu`` (shares ``e_i`` summing to 1), handed to the sites as the pair
    ``(epsilon_i, d_i delta)`` whose analytic Gaussian has at least that round's noise.
    Gaussian rounds compose by ``mu^2 = sum mu_i^2``, so a ``pld`` ledger is charged exactly the
    job's ``(epsilon, delta)``; a ``basic`` ledger would add the ``epsilon_i`` (more than
    ``epsilon``), a ``zcdp`` one their rhos (more than the job's rho). Not offered as a job
    ``composition`` yet (the job wiring comes with the accountant-aware plans).
    """
    eps = check_positive(epsilon, "epsilon")
    dl = check_delta(delta)
    mu = (1.0 - _RHO_MARGIN) / gaussian_sigma(eps, dl, 1.0)
    out = []
    for name, e, d in shares:
        if not (e > 0.0 and d > 0.0):
            raise ValidationError(f"round {name!r} needs positive epsilon and delta shares, "
                                  f"got {e!r}, {d!r}")
        out.append((name, gaussian_epsilon(math.sqrt(e) * mu, dl * d), dl * d))
    return out


def round_rho(epsilon: float, delta: float) -> float:
    """Return the rho charged for a Gaussian round calibrated (analytically) to the pair."""
    return 1.0 / (2.0 * gaussian_sigma(epsilon, delta, 1.0) ** 2)


def rounds_rho(rounds: Sequence[tuple[str, float, float]]) -> float:
    """Return an upper bound on the rho a ``zcdp`` ledger is charged for these rounds.

    A round with ``delta > 0`` is Gaussian with at least the analytic calibration's noise
    (:func:`round_rho`) or Skellam, calibrated to at most that rho
    (:func:`dpfed.common.privacy.skellam.skellam_calibrate`); a pure round costs
    ``epsilon^2 / 2``.
    """
    return float(sum(round_rho(e, d) if d > 0.0 else 0.5 * e * e for _, e, d in rounds))
