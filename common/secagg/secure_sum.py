"""A secure, distributed-noise sum of integer site statistics: plans, site step, decode.

A sum's public :class:`SecureSumPlan` (statistic, scale, row bound, Skellam variance,
participants, tolerated colluders) is computed by the coordinator and recomputed by every
site from the public scale, so a site's noise never depends on a number it cannot check.
:func:`site_contribution` adds a site's noise share and pairwise masks to its exact
statistic; :func:`decode_integer_sum` adds the masked vectors (the masks cancel) and
:func:`check_decoded` refuses a decoded sum no honest run can produce. The protocol, every
statistic's sensitivity and the no-wrap argument are in docs/secure-aggregation.md.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from dpfed.common.errors import ImpossibleSumError, ProtocolError, ValidationError
from dpfed.common.linalg import syrk_upper
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.polya import DLaplaceCalibration, polya_noise, polya_shape, polya_tail
from dpfed.common.privacy.skellam import SkellamCalibration, skellam_calibrate, skellam_noise
from dpfed.common.secagg.fixed_point import (
    SAFE_ABS,
    conditional_round_float,
    from_ring,
    max_scale,
    rounded_norm_bound,
    skellam_tail,
    to_ring,
)
from dpfed.common.secagg.keys import SignedKey, verify_signed_key
from dpfed.common.secagg.masking import (
    MaskContext,
    apply_masks,
    derive_pair_seed,
    mask_stream,
    sum_masked,
)
from dpfed.common.validation import check_int, check_positive

__all__ = [
    "PLANNERS",
    "STATISTICS",
    "SecureSumPlan",
    "check_decoded",
    "check_participants",
    "count_groups",
    "decode_integer_sum",
    "decode_survivors",
    "decode_sum",
    "integer_gram_upper",
    "integer_row_sum",
    "masked_contribution",
    "plan_counts",
    "plan_weighted_counts",
    "plan_for",
    "plan_from_scale",
    "plan_gram",
    "plan_row_sum",
    "plan_scores",
    "plan_within_rho",
    "pooled_noise_tail",
    "score_bound",
    "site_contribution",
]

#: Rows per float64 BLAS block: keeps every partial sum of integer products below 2^53.
_EXACT = 2.0 ** 52
#: Largest total Skellam variance: each Poisson mean stays below 2^52, where float64 still holds
#: every integer (numpy samples large means in floating point); and a
#: larger scale buys no accuracy (rounding error is already far below the noise).
MU_MAX = 2.0 ** 50
#: Largest per-entry bound ``b`` of a scores sum (keeps ``b N`` and the noise far from the ring).
MAX_SCORE_BOUND = 2 ** 20


@dataclass(frozen=True)
class SecureSumPlan:
    """Everything public about one secure sum; sent with the task and checked by every site.

    Attributes
    ----------
    statistic : {"gram", "row_sum", "counts", "weighted_counts", "scores", "linear"}
        What each site contributes (see :data:`STATISTICS`; ``linear``: the answers ``Ã x_s``
        of a public integer strategy, :mod:`dpfed.common.secagg.linear_sum`).
    dim : int
        Row dimension d (``linear``: the number of answers k).
    scale : float
        Fixed-point scale s (rows are multiplied by s before rounding; 1 for counts).
    bound : float
        Public bound B on the norm of a rounded row (for counts: the exact norm ``sqrt(C)`` of
        one row's contribution to ``C`` groups of cells; for scores: the per-entry bound ``b``).
    mu_total : float
        Noise variance per coordinate the honest shares must carry (integer domain).
    tolerated : int
        How many colluding parties (coordinator included) the shares are sized for.
    participants : tuple of str
        The sorted site ids whose masks must cancel.
    calibration : SkellamCalibration or DLaplaceCalibration
        The (epsilon, delta) and sensitivities ``mu_total`` was calibrated for; its type is the
        noise (:attr:`noise`): Skellam shares, or Pólya shares of a discrete Laplace
        (``linear`` sums only, :mod:`dpfed.common.privacy.polya`).
    dropouts : int
        How many participants may drop after dealing their shares with the sum still decoded
        (docs/secure-aggregation.md, "Dropouts"): every share is sized so the honest survivors
        of the worst case, ``n - t - d`` sites, alone carry ``mu_total``.
    """

    statistic: str
    dim: int
    scale: float
    bound: float
    mu_total: float
    tolerated: int
    participants: tuple[str, ...]
    calibration: SkellamCalibration | DLaplaceCalibration
    dropouts: int = 0

    def __post_init__(self) -> None:
        check_int(self.dropouts, "dropouts", minimum=0)
        if self.noise == "dlaplace" and self.statistic != "linear":
            raise ValidationError(f"a secure {self.statistic} sum carries Skellam noise; the "
                                  "discrete Laplace is for linear sums")
        if len(self.participants) - self.tolerated - self.dropouts < 1:
            raise ValidationError(
                f"a secure sum of {len(self.participants)} participants tolerating "
                f"{self.tolerated} colluders cannot also tolerate {self.dropouts} dropouts "
                "(no honest survivor would remain)")

    @property
    def n_values(self) -> int:
        """Length of the contributed vector."""
        d = self.dim
        return d * (d + 1) // 2 if self.statistic == "gram" else d

    @property
    def degree(self) -> int:
        """The statistic's degree in the fixed-point scale (2 for a Gram matrix, else 1)."""
        return STATISTICS[self.statistic]

    def cost(self) -> PrivacyCost:
        """Return what every participant's ledger is charged for the sum: the pooled guarantee.

        The mechanism name records the mode, the number of participants, ``t`` and (when
        drops are tolerated) ``d``: the accountant reads the honest variance back as
        ``share * (n - t - d)``.
        """
        cal = self.calibration
        d = f",d={self.dropouts}" if self.dropouts else ""
        name = f"secure-{self.noise}[n={len(self.participants)},t={self.tolerated}{d}]"
        if isinstance(cal, DLaplaceCalibration):
            return PrivacyCost.pure(cal.epsilon, mechanism=name,
                                    sensitivity=cal.l1_sensitivity,
                                    noise_scale=self.share ** 0.5)
        return PrivacyCost(cal.epsilon, cal.delta, cal.cost().rho, name, cal.l2_sensitivity,
                           self.share ** 0.5)

    @property
    def noise(self) -> str:
        """``"skellam"`` or ``"dlaplace"`` (Pólya shares of a discrete Laplace)."""
        return "dlaplace" if isinstance(self.calibration, DLaplaceCalibration) else "skellam"

    def noise_share(self, rng: np.random.Generator) -> np.ndarray:
        """Draw this participant's int64 noise share: ``Sk(share)``, or Pólya(r) - Pólya'(r)."""
        cal = self.calibration
        if isinstance(cal, DLaplaceCalibration):
            r = polya_shape(len(self.participants), self.tolerated, self.dropouts)
            return polya_noise(self.n_values, r, cal.alpha, rng)
        return skellam_noise(self.n_values, self.share, rng)

    def noise_tail(self, n_values: int) -> float:
        """Return T: honest pooled noise exceeds it on ``n_values`` coordinates w.p. ``2^-60``.

        Skellam: Bernstein's bound; Pólya shares: the Chernoff bound of
        :func:`dpfed.common.privacy.polya.polya_tail` at the pooled shape ``n r``.
        """
        n = len(self.participants)
        return pooled_noise_tail(self.calibration, n / (n - self.tolerated - self.dropouts),
                                 n_values)

    @property
    def share(self) -> float:
        """Variance each site adds: ``mu / (n - t - d)``."""
        return self.mu_total / (len(self.participants) - self.tolerated - self.dropouts)

    @property
    def pooled_variance(self) -> float:
        """Variance the decoded sum actually carries: every participant's share.

        At least ``mu_total`` (what the honest ``n - t`` shares alone guarantee); it is
        ``n / (n - t)`` times that when every site is honest, which is the figure standard
        errors must use.
        """
        return self.share * len(self.participants)


def pooled_noise_tail(cal: SkellamCalibration | DLaplaceCalibration, pooled: float,
                      n_values: int) -> float:
    """Return T: noise of ``pooled`` times the calibrated one exceeds it w.p. ``2^-60``.

    ``pooled`` multiplies the calibrated noise: ``n / (n - t - d)`` for a decoded sum; a
    Skellam variance ``mu`` becomes ``pooled mu`` (Bernstein's bound,
    :func:`~dpfed.common.secagg.fixed_point.skellam_tail`), the discrete Laplace's unit Pólya
    shape becomes ``pooled`` (:func:`dpfed.common.privacy.polya.polya_tail`).
    """
    if isinstance(cal, DLaplaceCalibration):
        return polya_tail(pooled, cal.alpha, n_values)
    return skellam_tail(cal.mu * pooled, n_values)


#: The statistics a secure sum can carry and their degree in the fixed-point scale (``linear``
#: plans come from :mod:`dpfed.common.secagg.linear_sum`, the others from :data:`PLANNERS`).
STATISTICS: dict[str, int] = {"gram": 2, "row_sum": 1, "counts": 1, "weighted_counts": 1,
                              "scores": 1, "linear": 1}


def _sensitivities(statistic: str, dim: int, bound: float) -> tuple[float, float]:
    if statistic == "gram":
        return math.sqrt(2.0) * bound * bound, (dim + 1) * bound * bound
    if statistic == "row_sum":
        return 2.0 * bound, 2.0 * bound * math.sqrt(dim)
    if statistic in ("counts", "weighted_counts"):
        # counts: C = bound^2 groups, one count down and one up in each; weighted counts:
        # bound^2 = sum m_j^2, m_j down and up in group j, L1 2 sum m_j <= 2 bound^2
        return math.sqrt(2.0) * bound, 2.0 * bound * bound
    if statistic == "scores":  # every one of the d entries moves by at most b = bound
        return bound * math.sqrt(dim), bound * dim
    raise ValidationError(f"statistic must be 'gram', 'row_sum', 'counts', 'weighted_counts' "
                          f"or 'scores', got {statistic!r}")


def count_groups(row_norm: float) -> int:
    """Return the number of groups ``C`` a counts plan's ``row_norm = sqrt(C)`` encodes."""
    r = check_positive(row_norm, "row_norm")
    groups = round(r * r)
    if groups < 1 or abs(groups - r * r) > 1e-9 * r * r:
        raise ValidationError(f"a counts sum needs row_norm = sqrt(number of groups), got "
                              f"{row_norm!r}")
    return int(groups)


def score_bound(row_norm: float) -> int:
    """Return the per-entry bound ``b`` a scores plan's ``row_norm`` encodes.

    ``b`` is a positive integer (an integer vector's entries move by whole steps), at most
    :data:`MAX_SCORE_BOUND`.
    """
    if isinstance(row_norm, bool) or not isinstance(row_norm, (int, float, np.integer,
                                                               np.floating)):
        raise ValidationError(f"a scores sum needs row_norm = the per-entry bound b, a "
                              f"positive integer, got {row_norm!r}")
    b = float(row_norm)
    if not math.isfinite(b) or b != math.floor(b) or not 1 <= b <= MAX_SCORE_BOUND:
        raise ValidationError(f"a scores sum needs row_norm = the per-entry bound b, an integer "
                              f"in [1, {MAX_SCORE_BOUND}], got {row_norm!r}")
    return int(b)


def check_participants(participants: Sequence[str], tolerated: int) -> tuple[tuple[str, ...], int]:
    """Return the sorted distinct participants and ``t``; more participants than ``t`` needed."""
    ids = tuple(sorted(set(participants)))
    if len(ids) != len(participants):
        raise ValidationError("participants must be distinct site ids")
    t = check_int(tolerated, "tolerated", minimum=0)
    if len(ids) <= t:
        raise ValidationError(f"a secure sum tolerating {t} colluding parties needs more than "
                              f"{t} participants, got {len(ids)}")
    return ids, t


def plan_from_scale(statistic: str, *, dim: int, scale: float, row_norm: float,
                    epsilon: float, delta: float, participants: Sequence[str],
                    tolerated: int) -> SecureSumPlan:
    """Return the plan for a fixed-point scale: bound, sensitivities, noise from public inputs.

    A site calls this itself with the scale the coordinator chose, so the noise it adds never
    depends on numbers it cannot check: whatever the scale, the bound and the calibration follow
    from it, the schema's dimension and the job's (epsilon, delta).
    """
    d = check_int(dim, "dim", minimum=1)
    s = check_positive(scale, "scale")
    if statistic == "counts" and (s != 1.0 or count_groups(row_norm) > d):
        raise ValidationError(f"a counts sum has scale 1 and at most one group per cell, got "
                              f"scale {s:g}, row_norm {row_norm!r} for {d} cells")
    if statistic == "weighted_counts":
        if s != 1.0:
            raise ValidationError(f"a weighted counts sum has scale 1, got scale {s:g}")
        count_groups(row_norm)  # row_norm^2 = sum of the squared integer weights: an integer
    if statistic == "scores" and s != 1.0:
        raise ValidationError(f"a scores sum has scale 1 (its entries are integers), got "
                              f"scale {s:g}")
    ids, t = check_participants(participants, tolerated)
    # counts and scores are integers already: no rounding; the bound is the exact norm
    # sqrt(C) of one row's counts, or the per-entry bound b of the scores
    if statistic in ("counts", "weighted_counts"):
        bound = float(row_norm)
    elif statistic == "scores":
        bound = float(score_bound(row_norm))
    else:
        bound = rounded_norm_bound(s * check_positive(row_norm, "row_norm"), d)
    l2, l1 = _sensitivities(statistic, d, bound)
    cal = skellam_calibrate(epsilon, delta, l2, l1)
    if cal.mu > MU_MAX * 1.01:
        raise ValidationError(f"the scale {s:g} needs noise variance {cal.mu:.3g}, above the "
                              f"sampler's limit {MU_MAX:.3g}")
    return SecureSumPlan(statistic, d, s, bound, cal.mu, t, ids, cal)


def _plan(statistic: str, *, dim: int, total_rows: int, row_norm: float, epsilon: float,
          delta: float, participants: Sequence[str], tolerated: int) -> SecureSumPlan:
    d = check_int(dim, "dim", minimum=1)
    _sensitivities(statistic, d, 1.0)  # validates the statistic's name
    degree = 2 if statistic == "gram" else 1
    n_values = d * (d + 1) // 2 if degree == 2 else d
    # The largest scale that cannot wrap: the noise grows with the scale (sensitivity ~
    # s^degree) and the room the ring leaves shrinks with the noise, so iterate to a fixed
    # point; the scale is also capped so the noise variance stays below MU_MAX (mu ~ s^(2 deg)).
    mu = 1.0
    cap = math.inf
    plan: SecureSumPlan | None = None
    for _ in range(40):
        scale = min(cap, max_scale(row_norm=row_norm, dim=d, total_rows=total_rows,
                                   degree=degree, mu=mu, n_values=n_values))
        bound = rounded_norm_bound(scale * row_norm, d)
        l2, l1 = _sensitivities(statistic, d, bound)
        mu_needed = skellam_calibrate(epsilon, delta, l2, l1).mu
        if mu_needed > MU_MAX:
            cap = scale * (MU_MAX / mu_needed) ** (1 / (2 * degree)) * 0.99
            continue
        if mu_needed <= mu * (1 + 1e-9):
            plan = plan_from_scale(statistic, dim=d, scale=scale, row_norm=row_norm,
                                   epsilon=epsilon, delta=delta, participants=participants,
                                   tolerated=tolerated)
            break
        mu = max(mu, mu_needed)
    if plan is None:
        raise ValidationError("no fixed-point scale fits this secure sum in a 64-bit ring")
    return plan


def plan_gram(*, dim: int, total_rows: int, epsilon: float, delta: float,
              participants: Sequence[str], tolerated: int = 0,
              row_norm: float = 1.0) -> SecureSumPlan:
    """Plan a secure sum of the sites' Gram matrices of rows in the ball of radius ``row_norm``."""
    return _plan("gram", dim=dim, total_rows=total_rows, row_norm=row_norm, epsilon=epsilon,
                 delta=delta, participants=participants, tolerated=tolerated)


def plan_row_sum(*, dim: int, total_rows: int, epsilon: float, delta: float,
                 participants: Sequence[str], tolerated: int = 0,
                 row_norm: float = 1.0) -> SecureSumPlan:
    """Plan a secure sum of the sites' row sums (e.g. for a pooled DP mean)."""
    return _plan("row_sum", dim=dim, total_rows=total_rows, row_norm=row_norm,
                 epsilon=epsilon, delta=delta, participants=participants, tolerated=tolerated)


def plan_counts(*, dim: int, total_rows: int, epsilon: float, delta: float,
                participants: Sequence[str], tolerated: int = 0,
                row_norm: float = 1.0) -> SecureSumPlan:
    """Plan a secure sum of the sites' exact count vectors (e.g. concatenated histograms).

    ``dim`` is the number of cells and ``row_norm = sqrt(C)`` encodes the number ``C`` of
    groups (histograms) in which every row adds exactly one count.

    Privacy
    -------
    Replace-one at one site; the count vector's L2 sensitivity is ``sqrt(2 C)`` and its L1
    sensitivity ``2 C`` (one count down, another up, in each group); scale 1, no rounding.
    No wrap: every pooled cell lies in ``[0, total_rows]`` before noise, and the plan is
    refused unless ``total_rows`` plus the Skellam tail bound (failure probability
    ``2^-60`` over all cells) stays below ``2^62``.
    """
    return _plan_integers("counts", dim=dim, total_rows=total_rows, row_norm=row_norm,
                          epsilon=epsilon, delta=delta, participants=participants,
                          tolerated=tolerated)


def plan_weighted_counts(*, dim: int, total_rows: int, epsilon: float, delta: float,
                         participants: Sequence[str], tolerated: int = 0,
                         row_norm: float = 1.0) -> SecureSumPlan:
    """Plan a secure sum of count vectors whose groups carry public integer weights.

    ``dim`` is the number of cells; every row adds ``m_j >= 1`` to one cell of each group
    ``j``, and ``row_norm = sqrt(sum_j m_j^2)`` (the exact norm of one row's contribution;
    its square must be an integer).

    Privacy
    -------
    Replace-one at one site; L2 sensitivity ``sqrt(2) row_norm`` (``m_j`` down in one cell and
    up in another, in every group), L1 ``2 sum_j m_j``, bounded by ``2 row_norm^2``; scale 1,
    no rounding. No wrap: every pooled cell lies in ``[0, total_rows max_j m_j]``, within
    ``[0, total_rows row_norm]``, and the plan is refused unless that plus the Skellam tail
    bound (failure probability ``2^-60`` over all cells) stays below ``2^62``.
    """
    return _plan_integers("weighted_counts", dim=dim, total_rows=total_rows, row_norm=row_norm,
                          epsilon=epsilon, delta=delta, participants=participants,
                          tolerated=tolerated)


def plan_scores(*, dim: int, total_rows: int, epsilon: float, delta: float,
                participants: Sequence[str], tolerated: int = 0,
                row_norm: float = 1.0) -> SecureSumPlan:
    """Plan a secure sum of integer score vectors with a public per-entry bound.

    ``dim`` is the number of scores and ``row_norm = b`` (a positive integer, see
    :func:`score_bound`) encodes both what one row may do and the public range: the statistic
    a site sums must satisfy (a) replacing one of its rows moves every entry by at most ``b``
    and (b) every entry lies in ``[0, b N_s]``, ``N_s`` the site's public row count — as a
    sum over rows of per-row terms in ``[0, b]`` does, and the ``synth`` job's floored
    dependence scores do with ``b = 2`` (:mod:`dpfed.common.jobs.synth_pairs`, which
    clips into that range). The pooled entries then lie in ``[0, b N]``, ``N = total_rows``.

    Privacy
    -------
    Replace-one at one site. Every entry moves by at most ``b``: L2 sensitivity
    ``b sqrt(dim)``, L1 ``b dim`` (all entries may move at once). Integers already: scale 1,
    no rounding (``bound = b``). The Skellam variance is calibrated to those sensitivities by
    :func:`plan_from_scale`, which every site repeats from the same public inputs. No wrap:
    the plan is refused unless ``b N`` plus the Skellam tail bound (failure probability
    ``2^-60`` over all entries) stays below ``2^62``.
    """
    return _plan_integers("scores", dim=dim, total_rows=total_rows, row_norm=row_norm,
                          epsilon=epsilon, delta=delta, participants=participants,
                          tolerated=tolerated)


def _plan_integers(statistic: str, *, dim: int, total_rows: int, row_norm: float,
                   epsilon: float, delta: float, participants: Sequence[str],
                   tolerated: int) -> SecureSumPlan:
    """Plan a sum of integer vectors (scale 1); refuse it when the pooled sum could wrap.

    Every pooled entry lies in ``[0, N m]`` before noise, ``m`` the most one row adds to an
    entry: 1 for counts, the plan's bound for weighted counts (``max_j m_j <= row_norm``) and
    for scores (``b``). Refused unless ``N m`` plus the Skellam tail bound (failure
    probability ``2^-60`` over all entries) stays below ``2^62``.
    """
    d = check_int(dim, "dim", minimum=1)
    n = check_int(total_rows, "total_rows", minimum=1)
    plan = plan_from_scale(statistic, dim=d, scale=1.0, row_norm=row_norm, epsilon=epsilon,
                           delta=delta, participants=participants, tolerated=tolerated)
    per_row = 1.0 if statistic == "counts" else plan.bound
    if n * per_row + skellam_tail(plan.mu_total, d) >= SAFE_ABS:
        raise ValidationError(f"{n} pooled rows with entries up to {per_row:g} per row and "
                              f"noise variance {plan.mu_total:.3g} do not fit a secure "
                              f"{statistic} sum in the 64-bit ring")
    return plan


#: statistic -> its planning function (all take the same keyword arguments).
PLANNERS = {"gram": plan_gram, "row_sum": plan_row_sum, "counts": plan_counts,
            "weighted_counts": plan_weighted_counts, "scores": plan_scores}


def plan_for(statistic: str, *, dim: int, total_rows: int, epsilon: float, delta: float,
             participants: Sequence[str], tolerated: int = 0,
             row_norm: float = 1.0) -> SecureSumPlan:
    """Plan a secure sum of any statistic in :data:`STATISTICS` (the coordinator's entry)."""
    planner = PLANNERS.get(statistic)
    if planner is None:
        raise ValidationError(f"statistic must be one of {sorted(PLANNERS)}, got {statistic!r}")
    return planner(dim=dim, total_rows=total_rows, epsilon=epsilon, delta=delta,
                   participants=participants, tolerated=tolerated, row_norm=row_norm)


#: How far above the given epsilon :func:`plan_within_rho` searches, in how many calibrations,
#: and how close below its rho a plan's charge must come to end the search.
_RHO_SEARCH_GROWTH = 64.0
_RHO_SEARCH_STEPS = 40
_RHO_SEARCH_TOLERANCE = 5e-4


def plan_within_rho(statistic: str, *, dim: int, total_rows: int, epsilon: float,
                    delta: float, rho: float, participants: Sequence[str], tolerated: int = 0,
                    row_norm: float = 1.0) -> SecureSumPlan:
    """Plan a sum of a zCDP-composed job: the least noise whose charge stays within ``rho``.

    A round of a job composed in zCDP gets its share ``rho`` as the analytic Gaussian's
    ``(epsilon, delta)``. A Skellam sum calibrated to that pair may be charged a little less
    than ``rho`` (the exact calibration, or its rho cap). This returns a plan at an
    ``epsilon' >= epsilon`` whose charge (the zCDP rho of its noise, checked for every
    candidate) is at most ``rho`` and within 0.05 % of it where one up to 64 ``epsilon``
    reaches it (the charge moves in small steps with the noise's integer scale: then the
    highest step below ``rho``); the plan at ``epsilon`` when no larger one qualifies. The
    search interpolates the charge in log-log space (it grows about like ``epsilon^2``)
    inside a bracket, so a plan costs a handful of exact calibrations, not twenty. Every site
    recomputes the plan from the task's ``epsilon'`` and records that ``(epsilon', delta)``
    -- the round's own guarantee -- and its rho.
    """
    r = check_positive(rho, "rho")

    def at(eps: float) -> tuple[SecureSumPlan, float]:
        plan = plan_for(statistic, dim=dim, total_rows=total_rows, epsilon=eps, delta=delta,
                        participants=participants, tolerated=tolerated, row_norm=row_norm)
        return plan, plan.calibration.cost().rho

    best, lo_rho = at(epsilon)
    if lo_rho > r:
        return best
    target = r * (1.0 - _RHO_SEARCH_TOLERANCE / 2.0)
    lo, top = float(epsilon), float(epsilon) * _RHO_SEARCH_GROWTH
    hi: float | None = None
    hi_rho = 0.0
    slope = 2.0  # d log(rho) / d log(epsilon) of a Gaussian-like charge
    for _ in range(_RHO_SEARCH_STEPS):
        if lo_rho >= (1.0 - _RHO_SEARCH_TOLERANCE) * r or lo >= top:
            break
        if hi is None:
            guess = min(top, lo * math.exp(math.log(target / max(lo_rho, 1e-300)) / slope))
        else:
            if hi / lo < 1.0 + 1e-6:  # the charge steps with the integer scale
                break
            span = math.log(hi_rho / max(lo_rho, 1e-300))
            frac = math.log(target / max(lo_rho, 1e-300)) / span if span > 0 else 0.5
            # inside the bracket, never at its ends (bisect where interpolation stalls)
            frac = min(max(frac, 0.05), 0.95) if math.isfinite(frac) else 0.5
            guess = math.exp(math.log(lo) + frac * math.log(hi / lo))
        plan, charged = at(guess)
        if charged <= r:
            if charged > lo_rho and guess > lo:
                slope = min(max(math.log(charged / max(lo_rho, 1e-300)) / math.log(guess / lo),
                                0.25), 8.0)
            best, lo, lo_rho = plan, guess, charged
        else:
            hi, hi_rho = guess, charged
    return best


def integer_gram_upper(chunks: Iterable[np.ndarray], plan: SecureSumPlan,
                       rng: np.random.Generator) -> np.ndarray:
    """Exact int64 upper triangle (row-major) of ``sum z z^T`` over rounded rows of all chunks."""
    d = plan.dim
    block = max(1, int(_EXACT // max(plan.bound ** 2, 1.0)))
    total = np.zeros((d, d), dtype=np.int64)
    for chunk in chunks:
        x = np.asarray(chunk, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != d:
            raise ValidationError(f"rows must have {d} columns, got shape {x.shape}")
        for start in range(0, x.shape[0], block):
            z = conditional_round_float(x[start:start + block], plan.scale, plan.bound, rng)
            # exact: integer entries, every partial sum < 2^53; upper triangle filled
            total += np.rint(np.triu(syrk_upper(z))).astype(np.int64)
    iu = np.triu_indices(d)
    return total[iu]


def integer_row_sum(chunks: Iterable[np.ndarray], plan: SecureSumPlan,
                    rng: np.random.Generator) -> np.ndarray:
    """Exact int64 sum of the rounded rows of all chunks."""
    total = np.zeros(plan.dim, dtype=np.int64)
    for chunk in chunks:
        x = np.asarray(chunk, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != plan.dim:
            raise ValidationError(f"rows must have {plan.dim} columns, got shape {x.shape}")
        total += np.rint(conditional_round_float(x, plan.scale, plan.bound, rng).sum(
            axis=0)).astype(np.int64)  # exact: |sum| < 2^53 by the no-wrap scale
    return total


def site_contribution(statistic: np.ndarray, *, plan: SecureSumPlan, own_id: str,
                      own_key: X25519PrivateKey, signed_keys: Mapping[str, SignedKey],
                      context: MaskContext, ca: x509.Certificate, min_participants: int,
                      tolerated: int, rng: np.random.Generator,
                      now: dt.datetime | None = None) -> np.ndarray:
    """Noise and mask this site's exact integer statistic for the secure sum.

    ``min_participants`` and ``tolerated`` are the site's own policy: the site refuses a plan
    with fewer verified participants, or sized for fewer colluders, than it requires.

    Raises
    ------
    ValidationError
        The plan does not meet the site's policy or the statistic has the wrong shape.
    ProtocolError, AuthenticationError
        A peer's key does not verify (e.g. substituted by the coordinator).
    """
    if own_id not in plan.participants:
        raise ValidationError(f"site {own_id!r} is not among the plan's participants")
    if len(plan.participants) < min_participants:
        raise ValidationError(f"the secure round has {len(plan.participants)} participants; "
                              f"this site's policy requires at least {min_participants}")
    if plan.tolerated < tolerated:
        raise ValidationError(f"the secure round sizes noise for {plan.tolerated} colluding "
                              f"parties; this site's policy requires {tolerated}")
    if set(signed_keys) != set(plan.participants):
        raise ProtocolError("the relayed keys do not match the plan's participants")
    stat = np.asarray(statistic)
    if stat.dtype != np.int64 or stat.shape != (plan.n_values,):
        raise ValidationError(f"statistic must be int64 of shape ({plan.n_values},), "
                              f"got {stat.dtype} {stat.shape}")
    publics = {peer: verify_signed_key(signed_keys[peer], context=context, ca=ca, now=now)[:32]
               for peer in plan.participants if peer != own_id}
    return masked_contribution(stat, plan=plan, own_id=own_id, mask_key=own_key,
                               mask_publics=publics, context=context, rng=rng)


def masked_contribution(statistic: np.ndarray, *, plan: SecureSumPlan, own_id: str,
                        mask_key: X25519PrivateKey, mask_publics: Mapping[str, bytes],
                        context: MaskContext, rng: np.random.Generator,
                        self_seed: bytes | None = None) -> np.ndarray:
    """Add this site's noise share, its pairwise masks and (if given) its self-mask.

    ``mask_publics``: every other participant's verified 32-byte mask public key.
    """
    seeds = {peer: derive_pair_seed(mask_key, public, own_id=own_id, peer_id=peer,
                                    context=context)
             for peer, public in mask_publics.items()}
    noisy = np.asarray(statistic, dtype=np.int64) + plan.noise_share(rng)
    masked = apply_masks(to_ring(noisy), own_id=own_id, seeds=seeds)
    if self_seed is not None:
        masked += mask_stream(self_seed, plan.n_values)
    return masked


def decode_integer_sum(masked: Mapping[str, np.ndarray], plan: SecureSumPlan) -> np.ndarray:
    """Sum every participant's masked vector: the noisy pooled integer statistic (int64).

    Raises
    ------
    ProtocolError
        A participant's contribution is missing (the masks cannot cancel).
    ImpossibleSumError
        The sum lies outside the ring's safe range (no honest run gets there).
    """
    if set(masked) != set(plan.participants):
        missing = sorted(set(plan.participants) - set(masked))
        raise ProtocolError(f"secure sum incomplete: no contribution from {missing}; the masks "
                            "cannot cancel, retry the round with fresh keys")
    return decode_survivors(masked, plan, np.zeros(plan.n_values, dtype=np.uint64))


def decode_survivors(masked: Mapping[str, np.ndarray], plan: SecureSumPlan,
                     correction: np.ndarray) -> np.ndarray:
    """Sum the survivors' masked vectors minus the rebuilt masks (int64).

    ``correction``: the survivors' self-masks and their pairwise masks with dropped sites
    (:func:`dpfed.common.secagg.dropouts.recovery_correction`).

    Raises
    ------
    ImpossibleSumError
        The sum lies outside the ring's safe range (no honest run gets there).
    """
    survivors = sorted(masked)
    if not set(survivors) <= set(plan.participants):
        raise ProtocolError("a contribution from a site that is not a participant")
    try:
        return from_ring(sum_masked([masked[s] for s in survivors]) - correction)
    except ValidationError as exc:
        raise ImpossibleSumError(f"{ImpossibleSumError.REASON}: {exc}") from None


def decode_sum(masked: Mapping[str, np.ndarray], plan: SecureSumPlan) -> np.ndarray:
    """Return the noisy pooled statistic in the units of the original rows (float64).

    The Gram's upper triangle divided by ``scale^2``, a row sum by ``scale``; counts and
    scores as they are.
    """
    return decode_integer_sum(masked, plan).astype(np.float64) / plan.scale ** plan.degree


def check_decoded(total: np.ndarray, plan: SecureSumPlan, n_rows: int, *,
                  groups: Sequence[int] = (), weights: Sequence[int] = (),
                  partial: Sequence[bool] = ()) -> None:
    """Refuse a decoded integer sum that no honest run of ``plan`` over ``n_rows`` rows gives.

    Honest sites sum rows within the plan's bound, so the exact pooled statistic lies in a
    set the public row count and the statistic determine (docs/secure-aggregation.md,
    "Decoded sums are checked"); the noise adds at most ``plan.noise_tail`` to an entry but with
    probability ``2^-60``. Counts: every row adds ``weights[k]`` (default 1) to one cell of
    each group of ``groups[k]`` cells, so each group sums to ``n_rows * weights[k]``; a
    ``partial[k]`` group gets a row's weight only from the rows that fall in one of its cells
    (the leaves inside a column's bins), so it sums to at most that.

    Raises
    ------
    ImpossibleSumError
        Naming the bound the sum breaks and ``impossible_secure_sum``.
    """
    t = np.asarray(total, dtype=np.float64)
    n = float(n_rows)
    var = plan.pooled_variance
    tail = plan.noise_tail(max(plan.n_values, 1))

    def refuse(what: str) -> None:
        raise ImpossibleSumError(
            f"{ImpossibleSumError.REASON}: the decoded secure {plan.statistic} sum {what}, "
            f"which no honest run over {n_rows} rows can produce (the noise allows "
            f"{tail:.4g}); a participant corrupted its contribution, nothing was published")

    if t.shape != (plan.n_values,):
        refuse(f"has shape {t.shape}")
    b = plan.bound
    if plan.statistic == "gram":
        _check_gram(t, plan.dim, n * b * b, tail, skellam_tail(var * plan.dim, 1), refuse)
    elif plan.statistic == "row_sum":
        if float(np.max(np.abs(t))) > n * b + tail:
            refuse(f"has an entry {float(np.max(np.abs(t))):.4g} above {n * b:.4g}")
        if float(np.linalg.norm(t)) > n * b + math.sqrt(plan.dim) * tail:
            refuse(f"has norm {float(np.linalg.norm(t)):.4g} above {n * b:.4g}")
    elif plan.statistic in ("counts", "weighted_counts", "scores"):
        top = n * (b if plan.statistic in ("weighted_counts", "scores") else 1.0)
        if float(np.min(t)) < -tail or float(np.max(t)) > top + tail:
            refuse(f"has entries in [{float(np.min(t)):.4g}, {float(np.max(t)):.4g}] outside "
                   f"[0, {top:.4g}]")
        _check_groups(t, n, groups, weights, partial, var, refuse)


def _check_gram(t: np.ndarray, dim: int, most: float, tail: float, trace_tail: float,
                refuse: Callable[[str], None]) -> None:
    """Refuse an upper triangle of ``sum z z^T`` (``||z|| <= B``) that no PSD matrix gives.

    The exact matrix is PSD with trace at most ``N B^2`` (``most``), so every 2 x 2 minor
    is PSD too.
    """
    g = np.zeros((dim, dim))
    g[np.triu_indices(dim)] = t
    diag = np.diag(g).copy()
    if float(np.min(diag)) < -tail or float(np.max(diag)) > most + tail:
        refuse(f"has a diagonal entry in [{float(np.min(diag)):.4g}, "
               f"{float(np.max(diag)):.4g}] outside [0, {most:.4g}]")
    trace = float(np.sum(diag))
    if trace > most + trace_tail:
        refuse(f"has trace {trace:.4g} above {most:.4g}")
    upper = np.abs(np.triu(g, 1))
    room = np.sqrt(np.outer(np.clip(diag, 0.0, None) + tail, np.clip(diag, 0.0, None) + tail))
    over = upper > np.triu(np.minimum(room, most / 2.0 + tail), 1) + tail
    if np.any(over):
        i, j = (int(v[0]) for v in np.nonzero(over))
        refuse(f"has an off-diagonal entry ({i}, {j}) of {float(upper[i, j]):.4g}, more than "
               "its diagonal entries allow")


def _check_groups(t: np.ndarray, n: float, groups: Sequence[int], weights: Sequence[int],
                  partial: Sequence[bool], var: float, refuse: Callable[[str], None]) -> None:
    """Each group of counts sums to ``n`` times its weight (a partial group: at most that)."""
    if not groups:
        return
    if sum(groups) != t.shape[0]:
        refuse(f"has {t.shape[0]} cells, not the {sum(groups)} of its groups")
    start = 0
    for k, size in enumerate(groups):
        weight = float(weights[k]) if weights else 1.0
        total = float(np.sum(t[start:start + size]))
        slack = skellam_tail(var * size, len(groups))
        if partial and partial[k]:
            if total < -slack or total > n * weight + slack:
                refuse(f"has a group of cells summing to {total:.4g}, outside "
                       f"[0, {n * weight:.4g}]")
        elif abs(total - n * weight) > slack:
            refuse(f"has a group of cells summing to {total:.4g}, not {n * weight:.4g}")
        start += size
