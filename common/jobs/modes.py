"""Which aggregation adds less noise for the connected sites: secure or site level.

A sum over ``n`` sites released at site level carries ``n`` independent draws of the noise one
site's release needs; as a secure sum it carries one pooled draw, raised by ``n / (n - t - d)``
in variance so that the honest survivors still hold it when ``t`` may collude and ``d`` drop
(docs/secure-aggregation.md), plus the Skellam calibration's slack (about 1 %). With the same
Gaussian noise in both modes the pooled noise's standard deviation, secure over site level,
is therefore ``1 / sqrt(n - t)`` at ``d = 0`` times that slack: never much better with few
sites and a large ``t``, no better at all once ``n - t <= 1``. A kind whose noise may differ
between the modes (a query's site-level Laplace, its secure discrete Laplace) gives both modes'
expected errors instead (:meth:`dpfed.common.jobs.params.Params.mode_errors`). The model
covers the sums' noise only (not DPdisPCA's rank-R truncation at each site, nor rounding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dpfed.common.validation import check_int

#: The Skellam share's noise over the analytic Gaussian's, at the same (epsilon, delta).
SKELLAM_SLACK = 1.01


def secure_pooled_factor(n_sites: int, tolerated: int, dropouts: int = 0) -> float:
    """Return a secure sum's pooled noise variance over the calibrated variance ``mu``.

    Every one of the ``n`` sites adds ``mu / (n - t - d)``, so that the honest survivors of
    the worst case alone carry ``mu``: the decoded sum carries ``n / (n - t - d)`` times it
    (:attr:`dpfed.common.secagg.secure_sum.SecureSumPlan.pooled_variance`). ``inf`` when no
    honest survivor would remain.
    """
    n = check_int(n_sites, "n_sites", minimum=1)
    t = check_int(tolerated, "tolerated", minimum=0)
    d = check_int(dropouts, "dropouts", minimum=0)
    return n / (n - t - d) if n - t - d >= 1 else math.inf


def secure_limits(n_sites: int, tolerated: Sequence[int], dropouts: Sequence[int]
                  ) -> tuple[int, int]:
    """Return the ``(t, d)`` a secure sum over ``n`` sites with these policies runs with.

    The strictest policy's ``t``, and the most dropouts any policy asks for, capped as the
    coordinator caps them: by what the neighbour graph it would choose survives
    (:func:`dpfed.common.secagg.graph.drop_capacity`; never below 0).
    """
    from dpfed.common.secagg.graph import choose_degree, drop_capacity

    t, wanted = max(tolerated), max(dropouts)
    capacity = drop_capacity(n_sites, choose_degree(n_sites, t, wanted), t)
    return t, max(0, min(wanted, capacity))


def compare_modes(n_sites: int, tolerated: int, *, dropouts: int = 0,
                  errors: tuple[float, float] | None = None) -> tuple[float, str]:
    """Return ``(ratio, sentence)`` comparing the two modes for ``n`` sites tolerating ``t``.

    ``errors``: the job's own expected error of each mode, ``(site level, secure)`` (e.g. a
    query's per-answer RMSE under the noise each mode would use: site-level Laplace can beat
    any Gaussian-like noise); without, the pooled sums' noise ratio (module docs). The
    sentence warns when secure aggregation is expected to be no more accurate than site level.
    """
    factor = secure_pooled_factor(n_sites, tolerated, dropouts)
    if math.isinf(factor):
        return math.inf, (f"secure aggregation cannot run with {n_sites} site(s) tolerating "
                          f"t={tolerated} colluders (it needs more than t + 1 sites)")
    drops = f", d={dropouts}" if dropouts else ""
    if errors is None:
        ratio = SKELLAM_SLACK * math.sqrt(factor / n_sites)
        head = (f"expected noise of the pooled sums with {n_sites} site(s), t={tolerated}"
                f"{drops}: secure / site-level = {ratio:.2f}")
    else:
        site, secure = errors
        ratio = secure / site if site > 0 else math.inf
        head = (f"expected error with {n_sites} site(s), t={tolerated}{drops}: secure "
                f"{secure:.4g} / site-level {site:.4g} = {ratio:.2f}")
    if ratio >= 1.0:
        return ratio, (f"{head}. WARNING: secure aggregation is expected to be no more "
                       "accurate than site-level here; prefer --aggregation site unless the "
                       "coordinator must not see per-site releases")
    return ratio, (f"{head}: secure aggregation is the more accurate mode here (site-level "
                   f"error is {1 / ratio:.2f}x larger)")
