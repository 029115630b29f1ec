"""Pooled Skellam noise of a secure sum against a central analytic Gaussian, before and after.

For the secure sums' real plans at t = 0 (a Gram and a row sum at their fixed-point scales, the
synth job's counts over 12 columns, 10 pair scores) and epsilon from 0.001 to 5 at delta 1e-6,
prints ``sqrt(mu) / sigma_G`` where ``sigma_G`` is the analytic Gaussian's sigma for the same
(epsilon, delta) and L2 sensitivity:

``rdp``   the calibration dpfed used before: the Skellam RDP bound of Agarwal, Kairouz & Liu
          (2021) converted at integer orders up to 4096 (reproduced here)
``exact`` today's :func:`dpfed.common.privacy.skellam.skellam_calibrate`: the exact (GDP)
          pair, and the zCDP rho cap
``gdp``   the (epsilon, delta) target alone (no rho cap)

With t colluders tolerated each site adds ``mu / (n - t)``: the pooled noise is ``n/(n - t)``
times these variances whatever the calibration.

Run: ``python bench/skellam_noise.py``.
"""

from __future__ import annotations

import math

import numpy as np

from dpfed.common.privacy.composition import round_rho
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.privacy.skellam import _smallest_grid_variance, skellam_calibrate, skellam_rho
from dpfed.common.secagg.secure_sum import plan_counts, plan_gram, plan_row_sum, plan_scores

_ORDERS = np.asarray(tuple(range(2, 65)) + tuple(range(72, 257, 8))
                     + (384, 512, 768, 1024, 1536, 2048, 4096), dtype=np.float64)


def rdp_epsilon(mu: float, delta: float, l2: float, l1: float) -> float:
    a = _ORDERS
    surcharge = np.minimum(((2 * a - 1) * l2 * l2 + 6 * l1) / (4 * mu * mu), 3 * l1 / (2 * mu))
    rdp = a * l2 * l2 / (2 * mu) + surcharge
    eps = rdp + np.log1p(-1.0 / a) - (math.log(delta) + np.log(a)) / (a - 1)
    return max(0.0, float(eps.min()))


def rdp_mu(epsilon: float, delta: float, l2: float, l1: float) -> float:
    cap = round_rho(epsilon, delta)

    def meets(m: float) -> bool:
        return rdp_epsilon(m, delta, l2, l1) <= epsilon and skellam_rho(m, l2, l1) <= cap

    lo, hi = l2 * l2 * 1e-6, max(l2 * l2, 1.0)
    while not meets(hi):
        hi *= 2.0
        if hi > 1e300:  # orders up to 4096 cannot reach this epsilon (about 0.001 and below)
            return math.inf
    while meets(lo):
        lo /= 2.0
    while hi / lo > 1 + 1e-9:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if meets(mid) else (mid, hi)
    return hi


def main() -> None:
    delta, sites = 1e-6, ["a", "b", "c"]
    print(f"sqrt(mu) / sigma of the central analytic Gaussian, delta {delta:g}, t = 0\n")
    print(f"{'statistic':>10s} {'epsilon':>8s} {'rdp':>7s} {'exact':>7s} {'gdp':>7s}")
    for eps in (0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0):
        plans = [plan_gram(dim=50, total_rows=30000, epsilon=eps, delta=delta,
                           participants=sites),
                 plan_row_sum(dim=50, total_rows=30000, epsilon=eps, delta=delta,
                              participants=sites),
                 plan_counts(dim=120, total_rows=30000, epsilon=eps, delta=delta,
                             participants=sites, row_norm=math.sqrt(12)),
                 plan_scores(dim=10, total_rows=30000, epsilon=eps, delta=delta,
                             participants=sites, row_norm=2.0)]
        for plan in plans:
            l2, l1 = plan.calibration.l2_sensitivity, plan.calibration.l1_sensitivity
            central = gaussian_sigma(eps, delta, l2)
            old = math.sqrt(rdp_mu(eps, delta, l2, l1)) / central  # inf: not reachable
            new = math.sqrt(skellam_calibrate(eps, delta, l2, l1).mu) / central
            alone = math.sqrt(_smallest_grid_variance(eps, delta, l2, l1)) / central
            print(f"{plan.statistic:>10s} {eps:8g} {old:7.3f} {new:7.3f} {alone:7.3f}")


if __name__ == "__main__":
    main()
