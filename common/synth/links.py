"""Mixed-type link functions of the factor-model synthesizer (seed 000, Alg. 2).

Following the framework of Song et al. (2013) that the seed cites, every schema column is
tied to latent Gaussian coordinates:

continuous ``y`` -> 1 coordinate, identity after standardising
    ``v = (y - centre) / half_range`` (public schema bounds, ``v in [-1, 1]``) and then either
    nothing more (``continuous_scaling="bounds"``) or ``z = (v - mean) / sd`` with a DP
    mean and variance (``"dp"``, the default). Inverse: the affine map back, clipped to the
    schema bounds.
ordinal code ``c in 0..M-1`` -> 1 coordinate, threshold link
    ``c = #{m : tau_m <= z}`` with ``tau_m = Phi^{-1}(f_m)``, ``f_m`` the proportion of codes
    ``< m``. Forward: ``z ~ N(0, 1)`` truncated to ``[tau_c, tau_{c+1})``.
nominal code ``c in 0..Q-1`` -> Q-1 coordinates, multinomial probit link
    decode ``u`` as 0 if ``max(u) <= 0`` else ``1 + argmax(u)``.

What exactly the nominal forward map samples (the seed's wording is loose)
---------------------------------------------------------------------------
The latent model is ``u ~ N(m, I_{Q-1})`` with a location vector ``m`` fitted so that the
decoded categories have the (DP) proportions ``pi``: ``P(decode(u) = l) = pi_l``. Given a
category, the forward map draws ``u`` from this model *conditioned on decoding to it*:

* category 0: ``u_k ~ N(m_k, 1)`` truncated to ``(-inf, 0)``, independently (the region is a
  product set, so this is the exact conditional);
* category ``l >= 1`` (coordinate ``l-1``): first ``t = u_{l-1}`` from its exact conditional
  marginal, density ``prop. to phi(t - m_{l-1}) prod_{k != l-1} Phi(t - m_k)`` on ``t > 0``;
  then, given ``t``, every other ``u_k ~ N(m_k, 1)`` truncated to ``(-inf, t)``,
  independently. That is the exact conditional of ``N(m, I)`` on
  ``{u_{l-1} > 0, u_{l-1} > u_k for all k}``. The marginal of ``t`` is sampled by inverse CDF
  on a 4097-point grid (cumulative trapezoid, linear interpolation; error of the CDF below
  1e-6); everything else by exact inverse-CDF truncated normals (``scipy.special.ndtri``).

The latent coordinate stored is ``e = u - m``. When the data's proportions equal ``pi`` the
mixture of these conditionals is exactly ``N(m, I)``, so ``e`` is standard normal in every
coordinate -- the same property the ordinal threshold link has. That is what lets the
generative mode of :mod:`dpfed.common.synth.factor_model` sample a Gaussian latent and decode it to
the
right marginals.

Deviation from the seed: the seed draws the nominal latent with *zero* mean (our ``m = 0``),
which pins the decoded proportions to ``2^{-(Q-1)}`` for category 0 and equal shares for the
rest whatever the data say; the ordinal link fits its thresholds to the data, so we fit the
nominal locations to the data in the same way (from DP proportions). The seed's "element of
u* from a standard normal if u = l" is not a valid conditional; the sampler above is.
Rows whose sampled value would sit within ``1e-10 (1 + max|m|)`` of a decision boundary are
nudged inside it so that decoding is exact despite rounding (a change of probability ~1e-10).

Fitting: all proportions, means and variances are DP statistics
(:mod:`dpfed.common.synth.dp_marginals`): :func:`fit_link_statistics` is the site step,
:func:`combine_link_statistics` the coordinator step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import special

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import ContinuousColumn, NominalColumn, OrdinalColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.synth import dp_marginals
from dpfed.common.synth.dp_marginals import MarginalRelease
from dpfed.common.validation import check_choice, check_finite_array, check_positive

CONTINUOUS_SCALINGS: tuple[str, ...] = ("dp", "bounds")
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_GRID_POINTS = 4097  # nominal sampler: inverse-CDF table per category
_SOLVER_GRID_POINTS = 2049  # nominal location solver (Simpson's rule)
_U_MIN = 2.0 ** -53  # uniforms are kept in (0, 1) so ndtri never returns +-inf
_COMPARE_THRESHOLDS = 16  # ordinal decoding: up to this many thresholds, compare (no search)


def _uniforms(rng: np.random.Generator, shape: int | tuple[int, ...]) -> np.ndarray:
    u = rng.random(shape)
    np.clip(u, _U_MIN, 1.0 - _U_MIN, out=u)
    return u


def truncated_normal(lower: np.ndarray, upper: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw of N(0, 1) truncated to ``[lower, upper)``, elementwise.

    Parameters
    ----------
    lower, upper : ndarray
        Bounds (``-inf``/``+inf`` allowed), broadcastable; ``lower < upper``.
    u : ndarray
        Uniforms in (0, 1).

    Notes
    -----
    ``x = Phi^{-1}(Phi(a) + u (Phi(b) - Phi(a)))``. Intervals in the upper tail (``a > 0``)
    are drawn as the negative of the mirrored interval, so ``Phi`` is always evaluated where
    it is accurate. The result is clipped into ``[lower, upper)``.
    """
    lo = np.asarray(lower, dtype=np.float64)
    hi = np.asarray(upper, dtype=np.float64)
    flip = lo > 0.0
    a = np.where(flip, -hi, lo)
    b = np.where(flip, -lo, hi)
    fa = special.ndtr(a)
    x = special.ndtri(fa + u * (special.ndtr(b) - fa))
    np.negative(x, out=x, where=flip)
    return np.asarray(np.clip(x, lo, np.nextafter(hi, -np.inf)))


def truncated_normal_above(upper: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw of N(0, 1) truncated to ``(-inf, upper)`` (one ``ndtr``, one ``ndtri``)."""
    x = special.ndtri(u * special.ndtr(upper))
    return np.asarray(np.minimum(x, np.nextafter(upper, -np.inf)))


def ceil_float32(values: np.ndarray) -> np.ndarray:
    """Return the smallest float32 ``>= values``, elementwise.

    For a float32 ``z``, ``t <= z`` iff ``ceil_float32(t) <= z``, exactly: a float32 latent
    is thresholded without converting it.
    """
    v = np.asarray(values, dtype=np.float64)
    out = v.astype(np.float32)
    low = out.astype(np.float64) < v
    out[low] = np.nextafter(out[low], np.float32(np.inf))
    return out


# --------------------------------------------------------------------------- ordinal


def ordinal_thresholds(proportions: np.ndarray) -> np.ndarray:
    """Thresholds ``tau_m = Phi^{-1}(sum_{c<m} pi_c)``, m = 1..M-1 (seed Alg. 2, threshold link).

    ``proportions`` must be strictly positive and sum to 1 (use
    :func:`dpfed.common.synth.dp_marginals.proportions_from_counts` on a DP histogram).
    """
    p = _check_proportions(proportions, "proportions")
    cumulative = np.cumsum(p)[:-1]
    return np.asarray(special.ndtri(np.clip(cumulative, 0.0, 1.0)))


def _check_proportions(proportions: np.ndarray, name: str) -> np.ndarray:
    p = check_finite_array(proportions, name, ndim=1)
    if p.shape[0] < 2 or np.any(p <= 0) or abs(p.sum() - 1.0) > 1e-9:
        raise ValidationError(
            f"{name} must have >= 2 strictly positive entries summing to 1, got {p.tolist()}")
    return np.asarray(p / p.sum())


# --------------------------------------------------------------------------- nominal model


def _simpson_weights(n: int, h: float) -> np.ndarray:
    w = np.ones(n)
    w[1:-1:2] = 4.0
    w[2:-1:2] = 2.0
    return np.asarray(w * (h / 3.0))


def _grid(locations: np.ndarray, n_points: int) -> np.ndarray:
    # The conditional density of t is <= phi(t - m_l): nothing beyond max(m) + 10 matters
    # (phi(10) ~ 8e-23).
    top = max(0.0, float(locations.max())) + 10.0
    return np.linspace(0.0, top, n_points)


def _log_terms(locations: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                np.ndarray]:
    """Return ``(log phi(t - m_k), log Phi(t - m_k), sum_k log Phi(t - m_k))`` on the grid."""
    d = t[None, :] - locations[:, None]
    log_phi = -0.5 * d * d - _LOG_SQRT_2PI
    log_cdf = special.log_ndtr(d)
    return log_phi, log_cdf, log_cdf.sum(axis=0)


def nominal_probabilities(locations: np.ndarray) -> np.ndarray:
    """Return the decoded category probabilities ``P(decode(u) = l)``, ``u ~ N(m, I)``.

    The result has length Q.

    ``P_0 = prod_k Phi(-m_k)``; ``P_l = int_0^inf phi(t - m_{l-1}) prod_{k != l-1}
    Phi(t - m_k) dt`` (Simpson's rule on a fine grid; the Q values sum to 1 within ~1e-12).
    """
    m = check_finite_array(locations, "locations", ndim=1)
    log_p, _ = _log_probabilities(m, with_jacobian=False)
    return np.concatenate([[np.exp(special.log_ndtr(-m).sum())], np.exp(log_p)])


def _log_probabilities(m: np.ndarray, *, with_jacobian: bool) -> tuple[np.ndarray,
                                                                       np.ndarray | None]:
    """``log P_l`` for l = 1..Q-1 and (optionally) the Jacobian ``d log P_l / d m_j``."""
    t = _grid(m, _SOLVER_GRID_POINTS)
    log_phi, log_cdf, log_prod = _log_terms(m, t)
    base = log_prod + np.log(_simpson_weights(t.size, float(t[1] - t[0])))
    a = log_phi - log_cdf  # log(phi_l / Phi_l): integrand of P_l is exp(a_l + log_prod)
    log_p = special.logsumexp(a + base[None, :], axis=1)
    if not with_jacobian:
        return log_p, None
    # dP_l/dm_j (j != l) = -int phi_l phi_j prod_{k != l, j} Phi_k = -int exp(a_l + a_j + base)
    half = a + 0.5 * base[None, :]
    shift = float(half.max())
    e = np.exp(half - shift)
    cross = (e @ e.T) * math.exp(2.0 * shift)
    jac = -cross
    np.fill_diagonal(jac, 0.0)
    # Shifting every m by c moves the lower limit of each integral: sum_j dP_l/dm_j = f_l(0).
    f0 = np.exp(log_phi[:, 0] - log_cdf[:, 0] + log_prod[0])
    np.fill_diagonal(jac, f0 - jac.sum(axis=1))
    return log_p, jac / np.exp(log_p)[:, None]


def nominal_locations(proportions: np.ndarray, *, tol: float = 1e-11,
                      max_iter: int = 100) -> np.ndarray:
    """Solve ``P(decode(N(m, I)) = l) = pi_l`` for the Q-1 locations ``m``.

    Newton on ``log P_l(m) - log pi_l`` (l = 1..Q-1) with the analytic Jacobian, started
    from a common shift that matches ``pi_0``; the map is a bijection for this additive
    random-utility model (Berry 1994), and from there Newton converges in a few steps for
    most strictly positive ``pi``. Q = 2 has the closed form ``m = Phi^{-1}(pi_1)``.

    Steps are at most 1 per coordinate (a trust region) and are not required to lower the
    residual: far from the solution -- one category near 1, others at the floor -- it grows
    for a few steps before Newton's fast convergence sets in, and a line search insisting on
    a decrease there stalls. From the shift start the Jacobian can also be numerically
    singular (categories whose probability is ~1e-30 at the start); when Newton fails, the
    solver follows the path ``(1 - t) uniform + t pi`` from the uniform proportions to ``pi``,
    each solution starting the next, with steps in ``t`` halved where Newton fails
    (``test_nominal_locations_converge_on_extreme_valid_proportions`` searches such vectors).
    """
    p = _check_proportions(proportions, "proportions")
    k = p.shape[0] - 1
    if k == 1:
        return np.array([float(special.ndtri(p[1]))])
    target = np.log(p[1:])
    start = -special.ndtri(p[0] ** (1.0 / k)) + 0.5 * (target - target.mean())
    m = _newton_locations(p, start, tol, max_iter)
    if m is not None:
        return m
    uniform = np.full(p.shape[0], 1.0 / p.shape[0])
    m = _newton_locations(uniform, np.full(k, -special.ndtri(uniform[0] ** (1.0 / k))), tol,
                          max_iter)
    t, dt = 0.0, 0.5
    while m is not None and t < 1.0 and dt > 1e-6:
        t_next = min(1.0, t + dt)
        found = _newton_locations((1.0 - t_next) * uniform + t_next * p, m, tol, 30)
        if found is None:
            dt /= 2.0
            continue
        m, t, dt = found, t_next, min(2.0 * dt, 1.0)
    if m is not None and t >= 1.0:
        return m
    raise ValidationError(
        f"could not fit nominal locations to proportions {p.tolist()} (Newton did not converge)")


def _newton_locations(p: np.ndarray, start: np.ndarray, tol: float,
                      max_iter: int) -> np.ndarray | None:
    """Newton steps of :func:`nominal_locations` from ``start``; None if they do not converge."""
    k = p.shape[0] - 1
    target = np.log(p[1:])

    def residual(x: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            r = _log_probabilities(x, with_jacobian=False)[0] - target
        return r if np.all(np.isfinite(r)) else np.full(k, np.inf)

    m = np.array(start, dtype=np.float64)
    for _ in range(max_iter):
        with np.errstate(all="ignore"):
            log_p, jac = _log_probabilities(m, with_jacobian=True)
        assert jac is not None
        r = log_p - target
        if not (np.all(np.isfinite(r)) and np.all(np.isfinite(jac))):
            return None
        if float(np.abs(r).max()) < tol:
            return m
        try:
            step = np.linalg.solve(jac, -r)
        except np.linalg.LinAlgError:
            return None
        if not np.all(np.isfinite(step)):
            return None
        biggest = float(np.abs(step).max())
        if biggest > 1.0:
            step /= biggest  # trust region: at most 1 per coordinate
        alpha = 1.0
        while alpha > 1e-8 and not np.all(np.isfinite(residual(m + alpha * step))):
            alpha *= 0.5
        m = m + alpha * step
    return m if float(np.abs(residual(m)).max()) < 1e-8 else None


# --------------------------------------------------------------------------- links


@dataclass(frozen=True, eq=False)
class ContinuousLink:
    """Identity link after standardising (seed Alg. 2, ``h_1j``).

    ``z = ((y - centre) / half_range - mean) / sd``; ``mean = 0, sd = 1`` is the public
    bounds-only scaling.
    """

    column: ContinuousColumn
    mean: float = 0.0
    sd: float = 1.0
    standard_normal: bool = False  # True when mean/sd were fitted (z is ~standardised)

    @property
    def width(self) -> int:
        """Number of latent coordinates (1)."""
        return 1

    def forward(self, values: np.ndarray, out: np.ndarray,
                rng: np.random.Generator | None = None) -> None:
        """Write the latent coordinate of ``values`` into ``out`` (n x 1).

        ``rng`` is unused by the identity link (subclasses such as the quantile link of
        :mod:`dpfed.common.synth.quantile_link` draw with it).
        """
        col = self.column
        z = out[:, 0]
        np.subtract(values, col.center + col.half_range * self.mean, out=z)
        z *= 1.0 / (col.half_range * self.sd)

    def inverse(self, latent: np.ndarray) -> np.ndarray:
        """Values from latent (n x 1), clipped to the schema bounds (float64)."""
        col = self.column
        y = np.multiply(latent[:, 0], col.half_range * self.sd, dtype=np.float64)
        y += col.center + col.half_range * self.mean
        if col.integer:
            np.rint(y, out=y)
        np.clip(y, col.min, col.max, out=y)
        return np.asarray(y)


@dataclass(frozen=True, eq=False)
class OrdinalLink:
    """Threshold link (seed Alg. 2, ``h_2j``) with thresholds from DP proportions."""

    column: OrdinalColumn
    proportions: np.ndarray
    thresholds: np.ndarray = field(init=False)
    _tables: tuple[np.ndarray, ...] = field(init=False, repr=False)
    _thresholds32: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p = _check_proportions(self.proportions, f"proportions of {self.column.name!r}")
        if p.shape[0] != self.column.n_levels:
            raise ValidationError(
                f"{self.column.name!r} has {self.column.n_levels} levels, got "
                f"{p.shape[0]} proportions")
        tau = ordinal_thresholds(p)
        object.__setattr__(self, "proportions", p)
        object.__setattr__(self, "thresholds", tau)
        bounds = np.concatenate([[-np.inf], tau, [np.inf]])
        # Per level: Phi of the (mirrored when in the upper tail) bounds, as truncated_normal.
        lower, upper = bounds[:-1], bounds[1:]
        flip = lower > 0.0
        a = np.where(flip, -upper, lower)
        b = np.where(flip, -lower, upper)
        fa = special.ndtr(a)
        object.__setattr__(self, "_tables", (fa, special.ndtr(b) - fa, flip, lower,
                                             np.nextafter(upper, -np.inf)))
        object.__setattr__(self, "_thresholds32", ceil_float32(tau))

    @property
    def width(self) -> int:
        """Number of latent coordinates (1)."""
        return 1

    def forward(self, codes: np.ndarray, out: np.ndarray, rng: np.random.Generator) -> None:
        """Sample ``z ~ N(0,1)`` truncated to ``[tau_c, tau_{c+1})`` into ``out`` (n x 1).

        Same draw as :func:`truncated_normal`, with ``Phi`` of the bounds tabulated per level.
        """
        lo_cdf, width, flip, lower, upper = self._tables
        u = _uniforms(rng, codes.shape[0])
        u *= width[codes]
        u += lo_cdf[codes]
        z = special.ndtri(u)
        np.negative(z, out=z, where=flip[codes])
        np.clip(z, lower[codes], upper[codes], out=z)
        out[:, 0] = z

    def inverse(self, latent: np.ndarray) -> np.ndarray:
        """Codes ``#{m : tau_m <= z}`` (int32).

        A float32 latent is compared with the thresholds rounded up to float32, which decides
        exactly as the float64 thresholds would (:func:`ceil_float32`).
        """
        z = latent[:, 0]
        tau = self._thresholds32 if z.dtype == np.float32 else self.thresholds
        if tau.shape[0] > _COMPARE_THRESHOLDS:
            return np.searchsorted(tau, z, side="right").astype(np.int32)
        # Few thresholds: one branch-free comparison pass each beats a binary search per row.
        code = np.zeros(z.shape[0], dtype=np.int32)
        above = np.empty(z.shape[0], dtype=bool)
        for t in tau:
            np.greater_equal(z, t, out=above)
            code += above
        return code


@dataclass(frozen=True, eq=False)
class NominalLink:
    """Multinomial probit link (seed Alg. 2, ``h_3j``) with locations from DP proportions.

    See the module docstring for the exact conditional the forward map samples.
    """

    column: NominalColumn
    proportions: np.ndarray
    locations: np.ndarray = field(init=False)
    _cdf_flat: np.ndarray = field(init=False, repr=False)
    _t_flat: np.ndarray = field(init=False, repr=False)
    _gap: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p = _check_proportions(self.proportions, f"proportions of {self.column.name!r}")
        if p.shape[0] != self.column.n_categories:
            raise ValidationError(
                f"{self.column.name!r} has {self.column.n_categories} categories, got "
                f"{p.shape[0]} proportions")
        m = nominal_locations(p)
        object.__setattr__(self, "proportions", p)
        object.__setattr__(self, "locations", m)
        # Inverse-CDF tables of t = u_l | category l+1, one row per category, on one grid.
        t = _grid(m, _GRID_POINTS)
        log_phi, log_cdf, log_prod = _log_terms(m, t)
        log_f = log_phi - log_cdf + log_prod[None, :]
        f = np.exp(log_f - log_f.max(axis=1, keepdims=True))
        cdf = np.zeros_like(f)
        np.cumsum(0.5 * (f[:, 1:] + f[:, :-1]), axis=1, out=cdf[:, 1:])
        cdf /= cdf[:, -1:]
        # Offset row l by 2l so one np.interp serves every category (rows stay increasing).
        offsets = 2.0 * np.arange(m.shape[0])[:, None]
        object.__setattr__(self, "_cdf_flat", np.ascontiguousarray((cdf + offsets).ravel()))
        object.__setattr__(self, "_t_flat", np.tile(t, m.shape[0]))
        object.__setattr__(self, "_gap", 1e-10 * (1.0 + float(np.abs(m).max())))

    @property
    def width(self) -> int:
        """Number of latent coordinates (Q - 1)."""
        return self.column.n_categories - 1

    def sample_top(self, categories: np.ndarray, u: np.ndarray) -> np.ndarray:
        """``t = u_{l-1}`` for rows of category ``l >= 1`` from its exact conditional marginal.

        ``categories`` holds ``l`` (1..Q-1), ``u`` uniforms in (0, 1).
        """
        return np.asarray(np.interp(u + 2.0 * (categories - 1), self._cdf_flat, self._t_flat))

    def forward(self, codes: np.ndarray, out: np.ndarray, rng: np.random.Generator) -> None:
        """Sample ``e = u - m`` given the categories into ``out`` (n x (Q-1))."""
        m = self.locations
        n = codes.shape[0]
        top = np.zeros(n)  # the upper truncation point of every coordinate: 0 or t
        positive = codes > 0
        u_top = _uniforms(rng, n)
        if positive.any():
            t = self.sample_top(codes[positive], u_top[positive])
            top[positive] = np.maximum(t, self._gap)
        # Every coordinate: u_k ~ N(m_k, 1) truncated to (-inf, top - gap), i.e. e_k < top - m_k.
        # Laid out x n so each coordinate is contiguous (``out`` is column-major).
        bound = (top - self._gap)[None, :] - m[:, None]
        e = truncated_normal_above(bound, _uniforms(rng, (m.shape[0], n)))
        # The chosen coordinate of a category-l row is t itself.
        rows = np.flatnonzero(positive)
        chosen = codes[rows] - 1
        e[chosen, rows] = top[rows] - m[chosen]
        out[:] = e.T

    def inverse(self, latent: np.ndarray) -> np.ndarray:
        """Codes: 0 if ``max(u) <= 0`` else ``1 + argmax(u)``, with ``u = e + m`` (int32).

        One pass per coordinate over contiguous columns (the latent of
        :meth:`dpfed.common.synth.generative.FactorModel.latent` is column-major), ``u`` in
        float64 whatever the latent's precision; ties go to the first coordinate, as argmax.
        """
        m = self.locations
        n = latent.shape[0]
        best = np.add(latent[:, 0], m[0], dtype=np.float64)
        code = np.ones(n, dtype=np.int32)
        u = np.empty(n, dtype=np.float64)
        better = np.empty(n, dtype=bool)
        step = np.empty(n, dtype=np.int32)
        for k in range(1, m.shape[0]):
            np.add(latent[:, k], m[k], out=u, dtype=np.float64)
            np.greater(u, best, out=better)
            # code = k + 1 where better, branch-free (masked stores are ~3x slower).
            np.subtract(np.int32(k + 1), code, out=step)
            step *= better
            code += step
            np.maximum(best, u, out=best)
        code *= best > 0.0
        return code


Link = ContinuousLink | OrdinalLink | NominalLink


@dataclass(frozen=True, eq=False)
class LatentLinks:
    """One link per schema column, in schema order, and the latent layout they define.

    Use :func:`combine_link_statistics` (from DP statistics) or :meth:`from_proportions`
    (from public or known proportions) to build one.
    """

    schema: Schema
    links: tuple[Link, ...]
    offsets: tuple[int, ...] = field(init=False)
    dim: int = field(init=False)

    def __post_init__(self) -> None:
        if len(self.links) != len(self.schema.columns):
            raise ValidationError("need exactly one link per schema column")
        offsets = [0]
        for col, link in zip(self.schema.columns, self.links, strict=True):
            if link.column != col:
                raise ValidationError(f"link for {link.column.name!r} does not match column "
                                      f"{col.name!r}")
            offsets.append(offsets[-1] + link.width)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "dim", offsets[-1])

    @classmethod
    def from_proportions(cls, schema: Schema,
                         proportions: Mapping[str, np.ndarray | Sequence[float]],
                         moments: Mapping[str, tuple[float, float]] | None = None
                         ) -> LatentLinks:
        """Build links from proportions per categorical column (+ optional continuous moments).

        ``moments`` maps a continuous column to ``(mean, sd)`` of ``v = (y - centre) /
        half_range``; absent columns use the bounds-only scaling. No privacy is involved:
        the caller vouches that the numbers are public or DP.
        """
        moments = moments or {}
        links: list[Link] = []
        for col in schema.columns:
            if isinstance(col, ContinuousColumn):
                if col.name in moments:
                    mean, sd = moments[col.name]
                    links.append(ContinuousLink(col, float(mean), check_positive(sd, "sd"),
                                                True))
                else:
                    links.append(ContinuousLink(col))
            else:
                if col.name not in proportions:
                    raise ValidationError(f"no proportions given for column {col.name!r}")
                p = np.asarray(proportions[col.name], dtype=np.float64)
                if isinstance(col, OrdinalColumn):
                    links.append(OrdinalLink(col, p))
                else:
                    links.append(NominalLink(col, p))
        return cls(schema, tuple(links))

    @property
    def latent_names(self) -> tuple[str, ...]:
        """Names of the latent coordinates (``column`` or ``column#k``)."""
        names: list[str] = []
        for link in self.links:
            if link.width == 1:
                names.append(link.column.name)
            else:
                names.extend(f"{link.column.name}#{k + 1}" for k in range(link.width))
        return tuple(names)

    @property
    def standard_normal(self) -> np.ndarray:
        """Per latent coordinate: True where the link model makes it N(0, 1) marginally.

        Ordinal and nominal coordinates always; continuous ones when DP mean/sd were fitted.
        """
        flags: list[bool] = []
        for link in self.links:
            sn = link.standard_normal if isinstance(link, ContinuousLink) else True
            flags.extend([sn] * link.width)
        return np.array(flags, dtype=bool)

    def to_latent(self, table: EncodedTable, rng: np.random.Generator) -> np.ndarray:
        """Site step (Alg. 2 step 1): map encoded rows to latent rows (n x dim, C order)."""
        if table.schema.digest() != self.schema.digest():
            raise ValidationError("table was encoded with a different schema than these links")
        # Column-major while filling (every coordinate is contiguous), C order on return.
        out = np.empty((table.n_rows, self.dim), dtype=np.float64, order="F")
        for link, start, stop in zip(self.links, self.offsets[:-1], self.offsets[1:],
                                     strict=True):
            values = table.columns[link.column.name]
            block = out[:, start:stop]
            if isinstance(link, ContinuousLink):
                link.forward(values, block, rng)
            else:
                link.forward(np.asarray(values, dtype=np.intp), block, rng)
        return np.ascontiguousarray(out)

    def from_latent(self, latent: np.ndarray) -> EncodedTable:
        """Map latent rows (n x dim) to typed, encoded rows (Alg. 2 step 4)."""
        x = np.asarray(latent)
        if x.dtype != np.float32:
            # float32 (the generative sampler's draws) is decoded as it is: every link
            # computes in float64 from it, or compares exactly (OrdinalLink).
            x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValidationError(f"latent rows must have shape (n, {self.dim}), got {x.shape}")
        if not np.isfinite(x).all():
            raise ValidationError("latent rows must be finite")
        columns: dict[str, np.ndarray] = {}
        for link, start, stop in zip(self.links, self.offsets[:-1], self.offsets[1:],
                                     strict=True):
            columns[link.column.name] = link.inverse(x[:, start:stop])
        return EncodedTable(self.schema, columns, x.shape[0])


# --------------------------------------------------------------------------- unit ball


def clip_to_unit_ball(latent: np.ndarray, clip_norm: float) -> tuple[np.ndarray, int]:
    """Scale rows with ``||x|| > clip_norm`` down to it, then divide by ``clip_norm``.

    Returns (rows with ``||x||_2 <= 1``, number of rows clipped). ``clip_norm`` is a declared
    public bound (never data-derived), so rows inside it are only rescaled and the map is
    undone by multiplying by ``clip_norm``.

    Deviation from the seed (Alg. 2 step 2 "normalize each sample"): normalising every row
    to unit norm would discard each row's norm and could not be inverted; clipping to a
    declared bound keeps rows within it intact (the unit-ball map of docs/algorithms.md).
    """
    c = check_positive(clip_norm, "clip_norm")
    x = np.array(latent, dtype=np.float64, order="C")
    norms = np.sqrt(np.einsum("ij,ij->i", x, x))
    over = norms > c
    scale = np.full(x.shape[0], 1.0 / c)
    scale[over] = 1.0 / norms[over]
    x *= scale[:, None]
    return x, int(np.count_nonzero(over))


def latent_dim(schema: Schema) -> int:
    """Return the number of latent coordinates the links give ``schema``.

    1 per continuous or ordinal column, Q-1 per nominal column of Q categories.
    """
    return sum(c.n_categories - 1 if isinstance(c, NominalColumn) else 1
               for c in schema.columns)


def default_clip_norm(dim: int) -> float:
    """Return the public default norm bound for ``dim`` latent coordinates, ``sqrt(dim)``.

    Each coordinate is about N(0, 1) under the link model, so ``||x||^2`` is about
    ``dim`` on average: roughly half the rows are shrunk slightly, and no row is scaled
    up. Depends on the schema only.
    """
    if dim < 1:
        raise ValidationError(f"dim must be >= 1, got {dim}")
    return math.sqrt(dim)


# --------------------------------------------------------------------------- fitting


def needs_link_statistics(schema: Schema, continuous_scaling: str = "dp") -> bool:
    """Whether any DP statistic must be released to fit the links for this schema."""
    check_choice(continuous_scaling, "continuous_scaling", CONTINUOUS_SCALINGS)
    return dp_marginals.marginals_sensitivity(
        schema, moments=continuous_scaling == "dp") > 0.0


def link_statistics_cost(schema: Schema, epsilon: float,
                         continuous_scaling: str = "dp") -> PrivacyCost:
    """Privacy cost of :func:`fit_link_statistics` (before any noise is drawn)."""
    check_choice(continuous_scaling, "continuous_scaling", CONTINUOUS_SCALINGS)
    return dp_marginals.marginals_cost(schema, epsilon, moments=continuous_scaling == "dp")


def fit_link_statistics(table: EncodedTable, *, epsilon: float, rng: np.random.Generator,
                        continuous_scaling: str = "dp") -> tuple[MarginalRelease, PrivacyCost]:
    """Site step: the DP statistics the links are fitted from.

    A DP histogram of every ordinal and nominal column, and (for ``continuous_scaling="dp"``)
    noisy ``(sum v, sum v^2)`` of every continuous column.

    Privacy
    -------
    :func:`dpfed.common.synth.dp_marginals.release_marginals`: replace-one row with ``N``
    public (docs/privacy.md), Laplace on every entry with ``Delta_1 = 2 n_categorical +
    9/4 n_continuous`` (the continuous term only with "dp"), scale ``Delta_1 / epsilon``, pure
    epsilon-DP.
    """
    check_choice(continuous_scaling, "continuous_scaling", CONTINUOUS_SCALINGS)
    return dp_marginals.release_marginals(table, epsilon=epsilon, rng=rng,
                                          moments=continuous_scaling == "dp")


def combine_link_statistics(schema: Schema,
                            releases: MarginalRelease | Sequence[MarginalRelease] | None, *,
                            continuous_scaling: str = "dp", min_proportion: float = 1e-4,
                            min_variance: float = 1e-4) -> LatentLinks:
    """Coordinator step: sum the sites' DP statistics and fit every link (post-processing).

    Proportions come from :func:`dpfed.common.synth.dp_marginals.proportions_from_counts` (negative
    noisy
    counts to 0, floor ``min_proportion``), thresholds ``Phi^{-1}`` of their cumulative
    sums, nominal locations from :func:`nominal_locations`; continuous means and variances
    from :func:`dpfed.common.synth.dp_marginals.mean_variance_from_moments` (with its noise-aware
    variance floor). ``releases`` may be None
    only when the schema needs no statistics (continuous columns with "bounds" scaling).
    """
    check_choice(continuous_scaling, "continuous_scaling", CONTINUOUS_SCALINGS)
    if releases is None:
        if needs_link_statistics(schema, continuous_scaling):
            raise ValidationError("this schema's links need DP statistics; releases is None")
        return LatentLinks.from_proportions(schema, {})
    if isinstance(releases, MarginalRelease):
        releases = [releases]
    total = dp_marginals.sum_releases(releases)
    proportions: dict[str, np.ndarray] = {}
    moments: dict[str, tuple[float, float]] = {}
    for col in schema.columns:
        if isinstance(col, ContinuousColumn):
            if continuous_scaling == "dp":
                if col.name not in total.moments:
                    raise ValidationError(f"no DP moments released for column {col.name!r}")
                mean, var = dp_marginals.mean_variance_from_moments(
                    total.moments[col.name], total.n_rows, min_variance=min_variance,
                    noise_scale=total.noise_scale * math.sqrt(total.n_sites))
                moments[col.name] = (mean, math.sqrt(var))
        else:
            if col.name not in total.counts:
                raise ValidationError(f"no DP histogram released for column {col.name!r}")
            proportions[col.name] = dp_marginals.proportions_from_counts(
                total.counts[col.name], min_proportion=min_proportion)
    return LatentLinks.from_proportions(schema, proportions, moments)
