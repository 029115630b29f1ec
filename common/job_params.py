"""Parameters of each job kind, validated identically by the coordinator and the sites.

The coordinator validates a job's parameters when an analyst submits it (a clear
INVALID_ARGUMENT instead of a job that fails at every site); each site validates the task it
receives again, because a site trusts nothing that comes over the network.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self

from dpfed.common.data.schema import ContinuousColumn
from dpfed.common.errors import ValidationError
from dpfed.common.job_choices import AGGREGATIONS, CENTERINGS, SITE_WEIGHTINGS
from dpfed.common.jobs.params import (
    Aggregation,
    ConnectedSite,
    Params,
    ParseContext,
    Parser,
    RoundShare,
    choice,
    integer,
    param,
)
from dpfed.common.privacy.composition import COMPOSITIONS, gdp_split, split_budget
from dpfed.common.privacy.mechanisms import CALIBRATIONS, gaussian_sigma
from dpfed.common.synth.column_cells import RESOLUTIONS
from dpfed.common.synth.pair_marginals import DEFAULT_GROUPS, MAX_GROUPS
from dpfed.common.validation import (
    check_choice,
    check_delta,
    check_epsilon,
    check_int,
    check_positive,
    check_probability,
)

if TYPE_CHECKING:
    from dpfed.common.data.schema import Schema


#: Share of a centred job's epsilon and delta spent on the DP mean (round ``mean``).
MEAN_SHARE = 0.1
#: Share of the job's epsilon and delta spent on the DP row-norm quantile (round ``norms``).
NORMS_SHARE = 0.1
#: Default quantile of the row norms used as the clip radius by ``clip_norm="auto"``.
DEFAULT_CLIP_QUANTILE = 0.9


#: Largest number of features assumed where the schema is not at hand (a client's --plan).
_ANY_FEATURES = 1 << 30


def _n_features(ctx: ParseContext) -> int:
    from dpfed.common.pca.features import feature_names

    return _ANY_FEATURES if ctx.schema is None else len(feature_names(ctx.schema))


def _clip_norm(value: Any, _ctx: ParseContext) -> float | str | None:
    if value == "auto":
        return "auto"
    if value is None or value == "schema":
        return None
    if isinstance(value, str):
        raise ValidationError(f"clip_norm must be 'auto', 'schema' or a number > 0, got "
                              f"{value!r}")
    return check_positive(value, "clip_norm")


def _clip_quantile(value: Any, _ctx: ParseContext) -> float:
    quantile = check_probability(value, "clip_quantile", open_interval=False)
    if quantile == 0.0:
        raise ValidationError("clip_quantile must be in (0, 1], got 0.0")
    return quantile


#: How a pca ``split`` composes: shares of (epsilon, delta), or shares of the GDP ``mu^2``.
PCA_COMPOSITIONS: tuple[str, ...] = ("basic", "gdp")


def _pca_rounds(parsed: Mapping[str, Any]) -> tuple[str, ...]:
    """Return the rounds of a pca job in the clip-first order (from centering, clip_norm)."""
    return ((("norms",) if parsed["clip_norm"] == "auto" else ())
            + (("mean",) if parsed["centering"] == "mean" else ()) + ("pca",))


def _pca_split(raw: Any, rounds: tuple[str, ...], resolved_clip: Any = None
               ) -> tuple[tuple[str, float, float], ...] | None:
    """Validate a pca ``split``: {round: [share, delta share]} over exactly the job's rounds.

    A task sent after the ``norms`` round carries the radius it chose as ``clip_norm``
    (``resolved_clip``); its split still names ``norms``.
    """
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValidationError("split must map round names to [share, delta share]")
    named = set(raw)
    if isinstance(resolved_clip, float):  # a task after the norms round resolved the radius
        named.discard("norms")
    if named != set(rounds):
        raise ValidationError(f"split must name exactly this job's rounds {list(rounds)}, "
                              f"got {sorted(raw)}")
    out = []
    for name in [r for r in ("norms", "mean", "pca") if r in raw]:
        pair = raw[name]
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise ValidationError(f"split[{name!r}] must be [share, delta share]")
        e = check_positive(pair[0], f"split[{name!r}] share")
        d = check_positive(pair[1], f"split[{name!r}] delta share")
        out.append((name, e, d))
    for i, what in ((1, "shares"), (2, "delta shares")):
        total = sum(float(r[i]) for r in out)
        if abs(total - 1.0) > 1e-9:
            raise ValidationError(f"split {what} must sum to 1, got {total:g}")
    return tuple(out)


def _pca_composition(raw: Any, split: Any) -> str:
    composition = check_choice(raw, "composition", PCA_COMPOSITIONS)
    if split is None and composition != "basic":
        raise ValidationError("composition applies to a pca job with a split")
    return composition


@dataclass(frozen=True)
class PCAParams(Params):
    """Parameters of a ``pca`` job (DPdisPCA).

    Attributes
    ----------
    n_components : int
        K, the dimension of the subspace returned.
    rank : int
        R, the number of eigenpairs each site sends (default 2K, as in DPdisPCA).
    calibration : {"analytic", "classic"}
        Gaussian calibration (classic only where it is DP).
    aggregation : {"site", "secure"}
        ``site`` (default): every site noises its own release (DPdisPCA); ``secure``: the
        sites' Gram matrices (and row sums, when centred) are summed under secure aggregation
        with distributed Skellam noise (``dpfed.common.secagg``), so the noise is that of one
        row of the pooled data; centring then happens at the coordinator; with
        ``clip_norm="auto"`` the norm histogram is a secure sum too.
    clip_norm : float, None or "auto"
        Public bound on the norm of the rows the PCA round decomposes, in the space where every
        column is scaled to [-1, 1] (centred at the DP mean when ``centering="mean"``).
        ``"auto"`` (default): a DP quantile of the row norms (round ``norms``; secure jobs
        made before it existed said ``schema``); None (the user types ``schema``): the worst
        case the schema allows, nothing is clipped.
    centering : {"mean", "none"}
        ``"mean"`` (default): a DP mean round first, then the centred second moment;
        ``"none"``: the second moment around the schema's midpoint (DPdisPCA as published).
    clip_quantile : float
        The quantile of the row norms that ``clip_norm="auto"`` uses (default 0.9).
    site_weighting : {"size", "equal"}
        ``"size"`` (default): the sites' matrices weighted by ``N_s / N``; ``"equal"``: the
        paper's ``1/S``. Post-processing either way (``N_s`` is public).
    split : tuple of (round, share, delta share) or None
        How the job's budget is divided between its rounds, which then run clip first
        (:attr:`clip_first`). Chosen at submission from public numbers when not given
        (:meth:`settle`); None (jobs made before) keeps the fixed :data:`MEAN_SHARE` /
        :data:`NORMS_SHARE` split and the old round order.
    composition : {"basic", "gdp"}
        How ``split`` turns into the rounds' budgets: shares of (epsilon, delta), or shares
        of the job's GDP ``mu^2`` (for sites whose ledger is ``pld``, charged exactly
        (epsilon, delta)).
    """

    kind: ClassVar[str] = "pca"

    n_components: int = param(
        parse=lambda v, ctx: check_int(v, "n_components", minimum=1, maximum=_n_features(ctx)),
        required="pca needs n_components (K)", flag="--k", help="number of components K")
    rank: int = param(
        derive_default=lambda ctx: min(2 * ctx.parsed["n_components"], _n_features(ctx)),
        parse=lambda v, ctx: check_int(v, "rank", minimum=ctx.parsed["n_components"],
                                       maximum=_n_features(ctx)),
        flag="--rank", help="eigenpairs each site sends (default 2K)")
    calibration: str = param("analytic", parse=choice("calibration", CALIBRATIONS),
                             flag="--calibration")
    aggregation: str = param("site", parse=choice("aggregation", AGGREGATIONS),
                             flag="--aggregation")
    clip_norm: float | str | None = param(
        "auto", parse=_clip_norm, wire=lambda v: "schema" if v is None else v, flag="--clip-norm")
    centering: str = param("mean", parse=choice("centering", CENTERINGS), flag="--centering")
    clip_quantile: float = param(DEFAULT_CLIP_QUANTILE, parse=_clip_quantile,
                                 flag="--clip-quantile")
    site_weighting: str = param("size", parse=choice("site_weighting", SITE_WEIGHTINGS),
                                flag="--site-weighting")
    split: tuple[tuple[str, float, float], ...] | None = param(  # absent: the first plan
        None, parse=lambda v, ctx: _pca_split(v, _pca_rounds(ctx.parsed),
                                              ctx.parsed["clip_norm"]),
        wire=lambda split: {n: [e, d] for n, e, d in split}, omit=lambda p: p.split is None)
    composition: str = param(
        "basic", parse=lambda v, ctx: _pca_composition(v, ctx.parsed["split"]),
        omit=lambda p: p.split is None)

    settles: ClassVar[bool] = True

    @property
    def clip_first(self) -> bool:
        """Whether the rounds run clip first (site level with a ``split``; secure and auto).

        ``norms`` of the uncentred rows, then ``mean`` of the rows clipped to the radius,
        then ``pca`` of the rows centred at the sites; site-level jobs made before (no
        ``split``) keep ``mean``, ``norms``, ``pca`` with the mean of the box-bounded rows.
        Secure jobs with a fixed ``clip_norm`` (``schema`` or a number) keep the uncentred
        Gram, centred at the coordinator, whatever their split.
        """
        if self.secure:
            return self.clip_norm == "auto"
        return self.split is not None

    def settle(self, epsilon: float, delta: float, schema: Schema,
               sites: Sequence[ConnectedSite]) -> Self:
        """Return the job with its budget split chosen from public numbers (module pca docs).

        A job of more than one round, submitted without ``split``, gets the shares of
        :func:`dpfed.common.pca.centring.centred_round_split` for the schema's feature count
        and the connected sites' public row counts, with the pooled noise of its mode: the
        sites' number at site level; a secure sum's ``n / (n - t - d)`` over the sites that
        take secure sums (:func:`secure_noise_factor`; secure jobs with ``clip_norm`` auto,
        the clip-first rounds the shares are derived for). Composed in GDP
        (``composition="gdp"``) when every such site's ledger is ``pld`` (charged exactly
        the job's (epsilon, delta)), else as shares of (epsilon, delta). Without such sites
        the job keeps the fixed split of jobs made before.
        """
        from dpfed.common.pca.centring import centred_round_split
        from dpfed.common.pca.features import feature_names

        rounds = _pca_rounds({"centering": self.centering, "clip_norm": self.clip_norm})
        if self.split is not None or len(rounds) < 2:
            return self
        pooled_noise = None
        if self.secure:
            if not self.clip_first:  # the coordinator-centred Gram: the targets do not apply
                return self
            sites = [s for s in sites if s.secure_tolerated is not None]
            pooled_noise = secure_noise_factor(sites)
            if pooled_noise is None:
                return self
        n_total = sum(s.row_count for s in sites)
        if not sites or n_total < 1:
            return self
        split = centred_round_split(len(feature_names(schema)), n_total, epsilon, delta,
                                    n_sites=len(sites), rounds=rounds,
                                    pooled_noise=pooled_noise)
        gdp = all(s.accountant == "pld" for s in sites)
        return dataclasses.replace(self, split=tuple(split),
                                   composition="gdp" if gdp else "basic")

    def plan_note(self, epsilon: float, delta: float) -> str:
        """Return the split, and why, for ``--plan``."""
        if self.split is None:
            shares = ", ".join(f"{r.name} {r.epsilon / epsilon:.0%}"
                               for r in self.shares(epsilon, delta))
            if len(self.shares(epsilon, delta)) < 2:
                return ""
            why = ("secure jobs with a fixed clip_norm" if self.secure and not self.clip_first
                   else "no site taking secure sums connected to settle it on" if self.secure
                   else "no site connected to settle it on")
            return f"budget split: fixed ({shares} of epsilon and delta; {why})"
        unit = "mu^2 (GDP)" if self.composition == "gdp" else "epsilon"
        shares = ", ".join(f"{n} {e:.3f}" for n, e, _ in self.split)
        sites = ("the connected sites' rows and the noise of a secure sum over them "
                 "(n / (n - t - d) for their policies' t colluders and d dropouts)"
                 if self.secure else "the connected sites' rows and their number")
        note = (f"budget split: shares of {unit}: {shares}; chosen from the schema's "
                f"dimension, {sites}, and epsilon "
                "(rounds run clip radius first, then the mean of the clipped rows)")
        if self.composition == "gdp":
            note += (f"\na pld ledger is charged exactly epsilon {epsilon:g} at delta "
                     f"{delta:g} for these rounds together (their epsilons add up to more)")
        return note

    def required_accountant(self, epsilon: float, delta: float) -> tuple[str, str] | None:
        """Return A GDP-composed job runs only at sites whose ledger is ``pld``."""
        if self.composition != "gdp" or self.split is None:
            return None
        charged = sum(r.epsilon for r in self.shares(epsilon, delta))
        return ("pld", f"its rounds are composed in GDP; a 'basic' ledger would be charged "
                       f"{charged:.3g} epsilon for this epsilon={epsilon:g} job")

    def aggregation_mode(self) -> Aggregation:
        """How the job's sums travel."""
        return Aggregation(self.aggregation)

    def check_privacy(self, epsilon: float, delta: float) -> None:
        """Raise if some round's (epsilon, delta, calibration) cannot be calibrated."""
        if self.split is not None and self.clip_norm != "auto" and any(
                name == "norms" for name, _, _ in self.split):
            raise ValidationError("split names the norms round, which picks clip_norm 'auto'; "
                                  f"this job's clip_norm is {self.to_mapping()['clip_norm']!r}")
        rounds = self.shares(epsilon, delta)
        for r in rounds:
            try:
                gaussian_sigma(r.epsilon, r.delta, 1.0, self.calibration)
            except ValidationError as exc:
                if len(rounds) == 1:
                    raise
                raise ValidationError(
                    f"the {r.name!r} round gets {r.epsilon:g} of the job's epsilon {epsilon:g} "
                    f"and {r.delta:g} of its delta {delta:g}, and there: {exc}") from None

    def shares(self, epsilon: float, delta: float) -> list[RoundShare]:
        """Return the rounds in order, each with what its task carries.

        With a ``split``: its rounds (``norms``, ``mean``, ``pca``), ``basic`` composition
        giving each its shares of (epsilon, delta), ``gdp`` its share of ``mu^2``
        (:func:`dpfed.common.privacy.composition.gdp_split`). Without (jobs made before):
        ``mean`` (centred jobs) gets :data:`MEAN_SHARE`, ``norms`` (``clip_norm="auto"``)
        :data:`NORMS_SHARE`, and ``pca`` the rest.
        """
        if self.split is not None:
            if self.composition == "gdp":
                return [RoundShare(n, e, d) for n, e, d in gdp_split(epsilon, delta, self.split)]
            return [RoundShare(n, epsilon * e, delta * d) for n, e, d in self.split]
        shares: list[tuple[str, float]] = []
        if self.clip_norm == "auto" and self.clip_first:
            shares.append(("norms", NORMS_SHARE))
        if self.centering == "mean":
            shares.append(("mean", MEAN_SHARE))
        if self.clip_norm == "auto" and not self.clip_first:
            shares.append(("norms", NORMS_SHARE))
        rest = 1.0 - sum(s for _, s in shares)
        out = [RoundShare(name, epsilon * s, delta * s) for name, s in shares]
        out.append(RoundShare("pca", epsilon * rest, delta * rest))
        return out


def secure_noise_factor(sites: Sequence[ConnectedSite]) -> float | None:
    """Return the pooled noise of a secure sum over ``sites``, in units of its ``mu``.

    The sum tolerates the strictest policy's ``t`` colluders and the most dropouts any policy
    asks for, capped as the coordinator caps them
    (:func:`dpfed.common.jobs.modes.secure_limits`); every site then adds
    ``mu / (n - t - d)`` (:func:`dpfed.common.jobs.modes.secure_pooled_factor`). None when no
    secure sum can run over them (no site takes secure sums, or ``n <= t``).
    """
    from dpfed.common.jobs.modes import secure_limits, secure_pooled_factor

    on = [s for s in sites if s.secure_tolerated is not None]
    if not on:
        return None
    n = len(on)
    t, d = secure_limits(n, [int(s.secure_tolerated or 0) for s in on],
                         [s.secure_dropouts for s in on])
    return None if n - t < 1 else secure_pooled_factor(n, t, d)


#: Rounds of a ``synth`` job per output mode, in order (without the pair rounds).
SYNTH_ROUNDS: dict[str, tuple[str, ...]] = {
    "generative": ("links", "pca"),
    "row_aligned": ("links", "pca", "factors"),
}
#: Rounds generative mode adds after ``pca`` when ``pairs > 0`` (DP 2-way marginals of a
#: chosen forest of column pairs, :mod:`dpfed.common.synth.pair_marginals`).
PAIR_ROUNDS: tuple[str, ...] = ("pair_scores", "pairs")
#: Default (epsilon share, delta share) of each round, per mode, without pair rounds (the
#: generative split applies with ``--pairs 0``; the central fit of
#: :mod:`dpfed.common.synth.factor_model` renormalises these shares).
SYNTH_DEFAULT_SPLIT: dict[str, dict[str, tuple[float, float]]] = {
    "generative": {"links": (0.8, 0.5), "pca": (0.2, 0.5)},
    "row_aligned": {"links": (0.2, 0.5), "pca": (0.2, 0.5), "factors": (0.6, 0.0)},
}
#: Default split of generative mode with the pair rounds (the default, ``pairs > 0``):
#: measured on three tables at epsilon 0.5-5 (docs/synthesis.md), a quarter of epsilon for the
#: latent second moment (whose noise otherwise dominates the 2-way error at small epsilon)
#: and an eighth for the pair tables; the noisy scores only rank pairs and need little.
SYNTH_PAIRS_DEFAULT_SPLIT: dict[str, tuple[float, float]] = {
    "links": (0.6, 0.4), "pca": (0.25, 0.3), "pair_scores": (0.03, 0.1), "pairs": (0.12, 0.2),
}
SYNTH_MAX_BINS = 1024
SYNTH_MAX_LATENT_DIM = 2000
#: Most pairs a job may ask for (a forest over C columns has at most C - 1 edges).
SYNTH_MAX_PAIRS = SYNTH_MAX_LATENT_DIM


def _summary_budget(params: Mapping[str, Any], evaluate_rows: int) -> tuple[float, float]:
    """Validate the DP evaluation summary's (epsilon, delta); (0, 0) when none is asked."""
    raw_eps = params.get("summary_epsilon", 0.0)
    raw_delta = params.get("summary_delta", 0.0)
    if raw_eps in (0, 0.0, None):
        if raw_delta not in (0, 0.0, None):
            raise ValidationError("--evaluate-summary-delta needs --evaluate-summary-epsilon")
        return 0.0, 0.0
    if not evaluate_rows:
        raise ValidationError("--evaluate-summary-epsilon needs --evaluate (the summary is of "
                              "the sites' evaluation of a synthetic sample)")
    eps = check_epsilon(raw_eps, "--evaluate-summary-epsilon")
    delta = check_delta(raw_delta, "--evaluate-summary-delta")
    gaussian_sigma(eps, delta, 1.0)
    return eps, delta


def _latent_dim(ctx: ParseContext) -> int:
    from dpfed.common.synth.links import latent_dim

    return SYNTH_MAX_LATENT_DIM if ctx.schema is None else latent_dim(ctx.schema)


def _synth_mode(value: Any, _ctx: ParseContext) -> str:
    return check_choice(str(value).replace("-", "_"), "mode", tuple(SYNTH_ROUNDS))


def _synth_rank(value: Any, ctx: ParseContext) -> int | None:
    dim = _latent_dim(ctx)
    if dim < 1 or dim > SYNTH_MAX_LATENT_DIM:
        raise ValidationError(f"the schema's latent dimension is {dim}; synth supports "
                              f"1..{SYNTH_MAX_LATENT_DIM}")
    return None if value is None else check_int(value, "rank", minimum=1, maximum=dim)


def _info_threshold(value: Any, _ctx: ParseContext) -> float:
    threshold = float(value)
    if not 0.0 < threshold < 1.0:
        raise ValidationError(f"info_threshold must be in (0, 1), got {threshold!r}")
    return threshold


def _synth_aggregation(value: Any, ctx: ParseContext) -> str:
    aggregation = check_choice(value, "aggregation", AGGREGATIONS)
    if aggregation == "secure" and ctx.parsed["mode"] == "row_aligned":
        raise ValidationError(
            "--mode row-aligned cannot run with --aggregation secure: its factors round "
            "releases one noisy row per real row, which is not a sum; use --mode "
            "generative with --aggregation secure, or --aggregation site")
    return aggregation


def _summary(index: int) -> Parser:
    def parse(_value: Any, ctx: ParseContext) -> float:
        return _summary_budget(ctx.raw, ctx.parsed["evaluate_rows"])[index]

    return parse


def _split_field(value: Any, ctx: ParseContext) -> tuple[tuple[str, float, float], ...]:
    mode, pairs = ctx.parsed["mode"], ctx.parsed["pairs"]
    with_pairs = (mode == "generative" and pairs != 0
                  and not (pairs is None and isinstance(value, Mapping)
                           and not any(r in value for r in PAIR_ROUNDS)))
    return _split(mode, value, with_pairs)


def _missing_cells(value: Any, _ctx: ParseContext) -> bool:
    if not isinstance(value, bool):
        raise ValidationError(f"missing_cells must be true or false, got {value!r}")
    return value


def _heaps(value: Any, ctx: ParseContext) -> bool:
    if not isinstance(value, bool):
        raise ValidationError(f"heaps must be true or false, got {value!r}")
    return value and ctx.parsed["resolution"] == "fine"


def _pair_gate(value: Any, ctx: ParseContext) -> bool:
    if not isinstance(value, bool):
        raise ValidationError(f"pair_gate must be true or false, got {value!r}")
    return value and PAIR_ROUNDS[0] in (name for name, _, _ in ctx.parsed["split"])


@dataclass(frozen=True)
class SynthParams(Params):
    """Parameters of a ``synth`` job (federated factor-model synthesis).

    Attributes
    ----------
    mode : {"generative", "row_aligned"}
        Output: new rows from the DP model (default), or one noisy row per real row.
    continuous_link : {"quantile", "identity"}
        How continuous columns enter the latent space (DP CDF on public bins, or DP mean/sd).
    n_bins : int
        Public equal-width bins per continuous column (2..1024).
    clip_norm : float or None
        Public norm bound of the latent rows; None means ``sqrt(latent dimension)``.
    rank : int or None
        Number of factors; None means the cumulative-information rule.
    info_threshold : float
        ``c`` of that rule.
    calibration : {"analytic", "classic"}
        Gaussian calibration of the DP-PCA round.
    evaluate_rows : int
        When > 0, a final local-only round sends a synthetic sample of this many rows to
        every site for its site-local evaluation report (nothing is released or charged).
        Every site then holds out ``holdout_size(N_s)`` rows from every round of the job.
    aggregation : {"site", "secure"}
        ``site`` (default): every site noises its own histograms and DP-PCA factor;
        ``secure``: the sites' exact count vectors and latent Gram matrices are summed under
        secure aggregation with distributed Skellam noise (generative mode only).
    summary_epsilon, summary_delta : float
        When ``summary_epsilon > 0`` (needs ``evaluate_rows``), the sites whose policy allows
        it (``evaluation_summary = "dp"``) also release a DP summary of their evaluation,
        charged at this (epsilon, delta) on top of the rounds' budget.
    pairs : int or None
        Most DP 2-way marginals (column pairs) generative mode measures in the rounds
        ``pair_scores`` and ``pairs`` (:data:`PAIR_ROUNDS`), as the user gave it: None means
        the number of columns minus 1 (a spanning tree), 0 skips the two rounds. Row-aligned
        mode and a ``split`` that names neither pair round (given without ``pairs``, as jobs
        made before the pair rounds were) have no pair rounds; :attr:`pair_rounds` and
        :meth:`max_pairs` say what the job does.
    pair_groups : int
        Most groups an ordinal or continuous column's cells are merged into in a pair table
        (2..64, default 6; :class:`dpfed.common.synth.pair_marginals.PairGrid`).
    split : tuple of (round, epsilon share, delta share)
        How the job's epsilon and delta are divided between the rounds (shares sum to 1).
    resolution : {"fine", "bins"}
        The cells of the continuous columns' 1-way releases and links
        (:mod:`dpfed.common.synth.column_cells`): ``fine`` -- whole numbers for small integer
        columns, else the bounds as point cells, ``n_bins`` bins and leaves inside them, with
        the estimate of :mod:`dpfed.common.synth.marginal_estimate` -- is what new jobs get
        (:attr:`NEW_JOB_DEFAULTS`); ``bins`` (``n_bins`` equal-width bins only) is what a stored
        job without the key means, so jobs made before it resume unchanged.
    pair_gate : bool
        Measure a column pair only when its noisy dependence score exceeds the noise its
        table would carry (:func:`dpfed.common.synth.pipeline.pair_forest`): True for new
        jobs (:attr:`NEW_JOB_DEFAULTS`), False (every pair of the forest) for stored jobs
        without the key.
    heaps : bool
        Under ``fine``, a leaf far above its noise keeps its noisy count before the rest of
        its bin is estimated (:func:`dpfed.common.synth.marginal_estimate.heap_masses`):
        True for new jobs (:attr:`NEW_JOB_DEFAULTS`); False for stored jobs without the key,
        whose coordinator then estimates the proportions (and sends their digest) as
        before.
    missing_cells : bool
        Every ``missing = "category"`` column's releases carry *missing* as a cell of its
        own and the synthetic table has missing values at the released rate
        (:mod:`dpfed.common.synth.missing_cells`): True for new jobs
        (:attr:`NEW_JOB_DEFAULTS`); False (a missing value released as the column's fill
        value) for stored jobs without the key.
    composition : {"basic", "zcdp"}
        How the split turns into each round's calibration
        (:mod:`dpfed.common.privacy.composition`): ``basic`` (default) gives every round its
        share of (epsilon, delta); ``zcdp`` its share of the job's rho, for sites whose
        accountant is ``zcdp`` (generative mode, analytic calibration; with
        ``aggregation="secure"`` every secure round's Skellam noise is calibrated so that its
        rho is at most the round's share, :func:`dpfed.common.privacy.skellam.skellam_calibrate`).
    """

    kind: ClassVar[str] = "synth"

    mode: str = param("generative", parse=_synth_mode)
    continuous_link: str = param("quantile", parse=choice("continuous_link",
                                                          ("quantile", "identity")))
    n_bins: int = param(32, parse=integer("n_bins", minimum=2, maximum=SYNTH_MAX_BINS))
    clip_norm: float | None = param(
        None, parse=lambda v, _ctx: None if v is None else check_positive(v, "clip_norm"),
        omit=lambda p: p.clip_norm is None)
    rank: int | None = param(None, parse=_synth_rank, omit=lambda p: p.rank is None)
    info_threshold: float = param(0.8, parse=_info_threshold)
    calibration: str = param("analytic", parse=choice("calibration", CALIBRATIONS))
    evaluate_rows: int = param(0, parse=integer("evaluate_rows", minimum=0, maximum=50_000),
                               omit=lambda p: not p.evaluate_rows)
    aggregation: str = param("site", parse=_synth_aggregation,
                             omit=lambda p: p.aggregation == "site")
    summary_epsilon: float = param(0.0, parse=_summary(0),
                                   omit=lambda p: not p.summary_epsilon)
    summary_delta: float = param(0.0, parse=_summary(1), omit=lambda p: not p.summary_epsilon)
    pairs: int | None = param(None, parse=lambda v, ctx: _pairs(v, ctx.parsed["mode"]),
                              omit=lambda p: p.pairs is None)
    pair_groups: int = param(DEFAULT_GROUPS, parse=integer("--pair-groups", minimum=2,
                                                           maximum=MAX_GROUPS),
                             omit=lambda p: not p.pair_rounds)
    split: tuple[tuple[str, float, float], ...] = param(
        None, parse=_split_field, wire=lambda split: {n: [e, d] for n, e, d in split})
    composition: str = param(  # absent by default: older jobs resume unchanged
        "basic", parse=lambda v, ctx: _composition(v, ctx.parsed["mode"],
                                                   ctx.parsed["calibration"]),
        omit=lambda p: p.composition == "basic")
    resolution: str = param(  # absent when "bins": jobs made before the key resume unchanged
        "bins", parse=choice("--resolution", RESOLUTIONS), omit=lambda p: p.resolution == "bins")
    pair_gate: bool = param(False, parse=_pair_gate, omit=lambda p: not p.pair_gate)
    missing_cells: bool = param(False, parse=_missing_cells, omit=lambda p: not p.missing_cells)
    heaps: bool = param(False, parse=_heaps, omit=lambda p: not p.heaps)

    #: A job being submitted gets the fine cells, the pair gate, the missing cells and the
    #: heaps; a stored job without the keys parses as "bins", no gate, no missing cells and no
    #: heaps, so its canonical mapping keeps its bytes.
    new_job_defaults: ClassVar[Mapping[str, Any]] = {"resolution": "fine", "pair_gate": True,
                                                     "missing_cells": True, "heaps": True}

    def validate(self, schema: Schema | None) -> None:
        """Refuse unless A joint model of one column is its marginal: synth needs at least two."""
        if schema is not None and len(schema.columns) < 2:
            raise ValidationError(
                f"the federation schema has {len(schema.columns)} column(s); synth needs at "
                "least 2 (ordinal, nominal or continuous)")
        if schema is not None and self.missing_cells and self.continuous_link == "identity":
            absent = [c.name for c in schema.columns if isinstance(c, ContinuousColumn)
                      and c.missing == "category"]
            if absent:
                raise ValidationError(
                    f"continuous_link 'identity' cannot generate the missing values of "
                    f"{absent} (missing = \"category\"): use the quantile link (the default), "
                    "or missing_cells = false to release them as their fill value")

    def aggregation_mode(self) -> Aggregation:
        """How the job's sums travel."""
        return Aggregation(self.aggregation)

    @property
    def zcdp(self) -> bool:
        """Whether the rounds compose in zCDP."""
        return self.composition == "zcdp"

    def required_accountant(self, epsilon: float, delta: float) -> tuple[str, str] | None:
        """Return A ``zcdp`` composed job runs only at sites whose ledger adds rho."""
        if not self.zcdp:
            return None
        charged = sum(e for _, e, _ in self.plan(epsilon, delta))
        return ("zcdp", f"--composition zcdp; a 'basic' ledger would be charged {charged:.3g} "
                        f"epsilon for this epsilon={epsilon:g} job")

    @property
    def rounds(self) -> tuple[str, ...]:
        """The job's rounds in order (those of its split)."""
        return tuple(name for name, _, _ in self.split)

    @property
    def pair_rounds(self) -> bool:
        """Whether the job runs the rounds ``pair_scores`` and ``pairs``."""
        return PAIR_ROUNDS[0] in self.rounds

    def max_pairs(self, n_columns: int) -> int:
        """Return the most pairs measured over ``n_columns`` columns.

        0 without pair rounds, else ``pairs`` (None: C - 1) capped at C - 1.
        """
        if not self.pair_rounds:
            return 0
        most = max(int(n_columns) - 1, 0)
        return most if self.pairs is None else min(self.pairs, most)

    def plan(self, epsilon: float, delta: float) -> list[tuple[str, float, float]]:
        """Each round's (name, epsilon, delta) at every site: the split the ledgers record.

        Under ``zcdp`` composition the rounds' epsilons add up to more than ``epsilon`` (each
        is the round's own guarantee); their rhos add up to the job's
        (:func:`dpfed.common.privacy.composition.split_budget`).
        """
        return split_budget(epsilon, delta, self.split, self.composition)

    def plan_note(self, epsilon: float, delta: float) -> str:
        """Say, for ``--plan``, that the gated pairs round may be skipped and cost nothing."""
        if not (self.pair_gate and self.pair_rounds):
            return ""
        pairs = {n: e for n, e, _ in self.plan(epsilon, delta)}.get("pairs")
        if pairs is None:
            return ""
        return (f"pair gate: the pairs round (epsilon {pairs:.4g} at each site) runs only for "
                "column pairs whose noisy dependence score exceeds the noise their table would "
                "carry; with none, it is skipped and charged nothing (the figures above are "
                "the most the job can cost)")

    def shares(self, epsilon: float, delta: float) -> list[RoundShare]:
        """Return the split's rounds, then the evaluation rounds (optional: only where allowed)."""
        out = [RoundShare(n, e, d) for n, e, d in self.plan(epsilon, delta)]
        if self.evaluate_rows:
            out.append(RoundShare("evaluate", 0.0, 0.0, charged=False, optional=True))
        if self.summary_epsilon:
            out.append(RoundShare("evaluate_summary", self.summary_epsilon,
                                  self.summary_delta, optional=True))
        return out

    def check_privacy(self, epsilon: float, delta: float) -> None:
        """Raise if a Gaussian round cannot be calibrated at its share of (epsilon, delta)."""
        check_epsilon(epsilon)
        check_delta(delta)
        for name, eps, dlt in self.plan(epsilon, delta):
            if name == "factors":
                continue
            if dlt <= 0.0:
                raise ValidationError(f"round {name!r} is Gaussian and got delta 0; pass a "
                                      "positive --delta")
            gaussian_sigma(eps, dlt, 1.0, self.calibration if name == "pca" else "analytic")


def _split(mode: str, raw: Any, with_pairs: bool) -> tuple[tuple[str, float, float], ...]:
    rounds = synth_rounds(mode, with_pairs)
    if raw is None:
        chosen = SYNTH_PAIRS_DEFAULT_SPLIT if with_pairs else SYNTH_DEFAULT_SPLIT[mode]
    else:
        if not isinstance(raw, Mapping):
            raise ValidationError("split must map round names to [epsilon share, "
                                  "delta share]")
        chosen = {}
        for name, pair in raw.items():
            if name in PAIR_ROUNDS and not with_pairs:
                raise ValidationError(f"split names round {name!r}, but this job has no "
                                      "pair rounds (--pairs 0 or row-aligned mode); drop it "
                                      "from the split")
            check_choice(name, "split round", rounds)
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise ValidationError(f"split[{name!r}] must be [epsilon share, delta share]")
            chosen[name] = (float(pair[0]), float(pair[1]))
    out = []
    for name in rounds:
        e, d = chosen.get(name, (0.0, 0.0))
        if not (e > 0.0 and 0.0 <= d <= 1.0):
            hint = (" (--pairs 0 skips the pair rounds)" if name in PAIR_ROUNDS else "")
            raise ValidationError(f"split gives round {name!r} epsilon share {e!r}; every "
                                  f"round needs a positive share{hint}")
        out.append((name, e, d))
    e_total = sum(e for _, e, _ in out)
    d_total = sum(d for _, _, d in out)
    if abs(e_total - 1.0) > 1e-9 or (d_total > 0 and abs(d_total - 1.0) > 1e-9):
        raise ValidationError(f"split shares must sum to 1 (epsilon {e_total:g}, "
                              f"delta {d_total:g})")
    if out[1][2] <= 0.0:
        raise ValidationError("the pca round is Gaussian and needs a positive delta share")
    return tuple(out)


def _composition(raw: Any, mode: str, calibration: str) -> str:
    """Validate ``composition`` (``--composition``) against the job's other settings."""
    composition = check_choice(raw, "--composition", COMPOSITIONS)
    if composition == "zcdp":
        if mode != "generative":
            raise ValidationError("--composition zcdp needs --mode generative (row-aligned "
                                  "mode's factors round is a pure-epsilon release)")
        if calibration != "analytic":
            raise ValidationError("--composition zcdp needs --calibration analytic")
    return composition


def synth_rounds(mode: str, with_pairs: bool) -> tuple[str, ...]:
    """Return a synth job's rounds in order: :data:`SYNTH_ROUNDS`, then :data:`PAIR_ROUNDS`."""
    return SYNTH_ROUNDS[mode] + (PAIR_ROUNDS if with_pairs and mode == "generative" else ())


def _pairs(raw: Any, mode: str) -> int | None:
    """Validate ``pairs`` (``--pairs``): None (not given) or an int >= 0.

    Row-aligned mode has no pair rounds (its rows are the sites' noisy factors, not samples
    a correction could move): an explicit ``--pairs`` above 0 there is refused.
    """
    pairs = None if raw is None else check_int(raw, "--pairs", minimum=0,
                                               maximum=SYNTH_MAX_PAIRS)
    if mode == "row_aligned" and pairs:
        raise ValidationError("--pairs applies to --mode generative only (row-aligned "
                              "rows are the sites' noisy factors); omit --pairs or pass 0")
    return pairs


# --------------------------------------------------------------------------- query

QUERY_NOISES: tuple[str, ...] = ("auto", "laplace", "gaussian")
#: A secure query's noise: ``auto`` ranks both, or one of the secure linear sum's noises.
SECURE_QUERY_NOISES: tuple[str, ...] = ("auto", "skellam", "dlaplace")
#: secure noise -> the site-level noise family its expected error is ranked with.
SECURE_NOISE_FAMILY: Mapping[str, str] = {"skellam": "gaussian", "dlaplace": "laplace"}
RECONSTRUCTIONS: tuple[str, ...] = ("least_squares", "nnls", "l1")


def _domain(value: Any, ctx: ParseContext) -> dict[str, Any]:
    from dpfed.common.queries.query_language import parse_domain

    if not isinstance(value, dict):
        raise ValidationError("query needs a domain: {columns = [...], bins = {...}}")
    if ctx.schema is None:
        return dict(value)
    return parse_domain(ctx.schema, value.get("columns"), value.get("bins")).to_json()


def _workload(value: Any, _ctx: ParseContext) -> dict[str, Any]:
    w = {"kind": value} if isinstance(value, str) else value
    if not isinstance(w, dict):
        raise ValidationError(f"workload must be a name or an object, got {value!r}")
    return w


def _strategy(value: Any, _ctx: ParseContext) -> str:
    from dpfed.common.queries.workload_spec import STRATEGY_CHOICES

    if value not in STRATEGY_CHOICES:
        raise ValidationError(f"strategy must be one of {list(STRATEGY_CHOICES)}, got "
                              f"{value!r}")
    return str(value)


def _listed(name: str, choices: tuple[str, ...]) -> Parser:
    def parse(value: Any, _ctx: ParseContext) -> str:
        if value not in choices:
            raise ValidationError(f"{name} must be one of {list(choices)}, got {value!r}")
        return str(value)

    return parse


@dataclass(frozen=True)
class QueryParams(Params):
    """Parameters of a ``query`` job (the matrix mechanism over a public histogram domain).

    Attributes
    ----------
    domain : dict
        1-3 columns, continuous ones with public bins (canonical JSON of
        :class:`dpfed.common.queries.query_language.Domain`).
    workload : dict
        The workload (``{"kind": ...}``; see :mod:`dpfed.common.queries.workload_spec`).
    strategy : str
        ``auto`` (the smallest expected RMSE) or a named strategy.
    noise : {"auto", "laplace", "gaussian"}
        The sites' noise at site level (``auto``: whichever ranks best).
    reconstruction : {"least_squares", "nnls", "l1"}
        How the coordinator reconstructs the histogram.
    aggregation : {"site", "secure"}
        ``secure``: one secure sum of ``Ã x_s`` with distributed noise (``secure_noise``).
    secure_noise : {"auto", "skellam", "dlaplace"}
        The secure sum's noise: distributed Skellam ((epsilon, delta)), distributed discrete
        Laplace from Pólya shares (pure epsilon), or ``auto`` (new jobs): whichever ranks
        best (Skellam only with a delta). Jobs stored before it existed mean ``skellam``.
    """

    kind: ClassVar[str] = "query"
    new_job_defaults: ClassVar[Mapping[str, Any]] = {"secure_noise": "auto"}

    domain: dict[str, Any] = param(parse=_domain, required="query needs a domain: "
                                   "{columns = [...], bins = {...}}")
    workload: dict[str, Any] = param("identity", parse=_workload)
    strategy: str = param("auto", parse=_strategy)
    noise: str = param("auto", parse=_listed("noise", QUERY_NOISES))
    reconstruction: str = param("least_squares", parse=_listed("reconstruction",
                                                               RECONSTRUCTIONS))
    aggregation: str = param("site", parse=_listed("aggregation", AGGREGATIONS),
                             omit=lambda p: p.aggregation == "site")  # older jobs unchanged
    secure_noise: str = param("skellam", parse=_listed("secure_noise", SECURE_QUERY_NOISES),
                              omit=lambda p: p.secure_noise == "skellam")  # likewise

    def validate(self, schema: Schema | None) -> None:
        """Build the workload and check the strategy against the domain (with a schema)."""
        if schema is not None:
            from dpfed.common.queries.workload_spec import check_domain_for

            self.workload_in(schema)  # sizes checked from the shape before any matrix
            check_domain_for(self.strategy, self.domain_in(schema).n_cells)
        if self.secure and self.noise == "laplace":
            raise ValidationError("noise 'laplace' is a site-level noise; aggregation 'secure' "
                                  "chooses its noise with secure_noise ('auto', 'skellam' or "
                                  "'dlaplace', the distributed discrete Laplace)")

    def domain_in(self, schema: Schema) -> Any:
        """Return the :class:`~dpfed.common.queries.query_language.Domain` over ``schema``."""
        from dpfed.common.queries.query_language import parse_domain

        return parse_domain(schema, self.domain.get("columns"), self.domain.get("bins"))

    def workload_in(self, schema: Schema) -> Any:
        """Return the :class:`~dpfed.common.queries.workloads.Workload` over the domain."""
        from dpfed.common.queries.workload_spec import build_workload

        return build_workload(self.domain_in(schema), self.workload)

    def aggregation_mode(self) -> Aggregation:
        """How the job's sum travels."""
        return Aggregation(self.aggregation)

    def check_privacy(self, epsilon: float, delta: float) -> None:
        """Laplace is pure epsilon-DP; Gaussian and Skellam need delta in (0, 1)."""
        if self.secure and self.secure_noise == "skellam" and delta == 0.0:
            raise ValidationError("aggregation 'secure' with secure_noise 'skellam' needs delta "
                                  "in (0, 1) (--delta): Skellam noise is an (epsilon, delta) "
                                  "mechanism; secure_noise 'dlaplace' is pure epsilon")
        if self.secure and self.secure_noise == "dlaplace" and delta != 0.0:
            raise ValidationError(f"secure_noise 'dlaplace' is pure epsilon-DP: delta must be "
                                  f"0, got {delta!r}")
        check_epsilon(epsilon)
        if self.secure:
            if delta != 0.0:
                check_delta(delta)
            return
        if self.noise == "laplace" and delta != 0.0:
            raise ValidationError(f"Laplace noise is pure epsilon-DP: delta must be 0, got "
                                  f"{delta!r}")
        if self.noise == "gaussian" or (self.noise == "auto" and delta != 0.0):
            check_delta(delta)

    def shares(self, epsilon: float, delta: float) -> list[RoundShare]:
        """One round; its delta is charged only if Gaussian noise is chosen."""
        return [RoundShare("query", epsilon, delta)]

    def site_noises(self, delta: float) -> tuple[str, ...]:
        """Return the noises a site-level release may use (auto: Gaussian only with delta)."""
        return {"auto": ("laplace", "gaussian") if delta > 0 else ("laplace",),
                "laplace": ("laplace",), "gaussian": ("gaussian",)}[self.noise]

    def secure_noises(self, delta: float) -> tuple[str, ...]:
        """Return the noise families a secure sum may use (ranked like :meth:`site_noises`).

        ``laplace`` stands for the distributed discrete Laplace, ``gaussian`` for Skellam
        (:data:`SECURE_NOISE_FAMILY`); empty when none can run (Skellam without a delta).
        """
        if self.secure_noise == "auto":
            return ("laplace", "gaussian") if delta > 0 else ("laplace",)
        family = SECURE_NOISE_FAMILY[self.secure_noise]
        return () if family == "gaussian" and delta <= 0 else (family,)

    def mode_errors(self, epsilon: float, delta: float, schema: Schema, n_sites: int,
                    pooled_factor: float) -> tuple[float, float] | str | None:
        """Return the expected per-answer RMSE of the best strategy in each mode.

        :meth:`mode_rmse` on the job's workload; why not, for a job whose secure noise needs
        a delta it does not have.
        """
        if not self.secure_noises(delta):
            return ("secure aggregation with secure_noise 'skellam' needs --delta > 0 (Skellam "
                    "noise is (epsilon, delta)-DP); compare with --delta D --plan")
        return self.mode_rmse(self.workload_in(schema), epsilon, delta, n_sites, pooled_factor)

    def mode_rmse(self, workload: Any, epsilon: float, delta: float, n_sites: int,
                  pooled_factor: float) -> tuple[float, float]:
        """Return the expected RMSE per query ``(site level, secure)``, each mode at its best.

        Site level: ``n_sites`` draws of the noise the parameters allow (:meth:`site_noises`:
        Laplace often wins on small workloads); secure: one draw of the noise it would use
        (:meth:`secure_noises`, :func:`secure_variance_factors`) times the secure sum's
        ``pooled_factor``.
        """
        from dpfed.common.queries.workload_spec import choose_strategy

        site = choose_strategy(workload, strategy_name=self.strategy,
                               noises=self.site_noises(delta), epsilon=epsilon, delta=delta,
                               n_sites=n_sites).rmse
        secure = choose_strategy(workload, strategy_name=self.strategy,
                                 noises=self.secure_noises(delta), epsilon=epsilon,
                                 delta=delta, n_sites=1,
                                 variance_factors=secure_variance_factors()).rmse
        return site, secure * math.sqrt(pooled_factor)


def secure_variance_factors() -> dict[str, float]:
    """Return a secure sum's noise variance over its family's site-level noise, per family.

    Skellam: the calibration's slack squared (:data:`dpfed.common.jobs.modes.SKELLAM_SLACK`);
    the discrete Laplace ``2α/(1-α)²`` is never above the Laplace's ``2 (Δ₁/ε)²``
    (``1 / (2 sinh²(ε/2Δ₁)) <= 2 (Δ₁/ε)²``): factor 1, at most the slight overstatement.
    """
    from dpfed.common.jobs.modes import SKELLAM_SLACK

    return {"gaussian": SKELLAM_SLACK ** 2, "laplace": 1.0}


# --------------------------------------------------------------------------- svt

SVT_ACTIONS: tuple[str, ...] = ("open", "batch", "close")
_SVT_OPEN_KEYS = {"queries", "threshold", "cutoff", "numeric_epsilon", "monotonic"}


def _analyst_svt(raw: Mapping[str, Any], schema: Schema | None) -> dict[str, Any]:
    """Return an analyst's svt parameters in the canonical form.

    The analyst gives ``session``, ``close`` and the session's settings; the canonical form
    names the ``action``, with the queries compiled to their canonical form.
    """
    params = dict(raw)
    session = params.get("session") or ""
    close = params.get("close", False)
    if not isinstance(close, bool):
        raise ValidationError(f"close must be true or false, got {close!r}")
    if not isinstance(session, str) or len(session) > 200:
        raise ValidationError(f"session must be a job id, got {session!r}")
    if close:
        if not session:
            raise ValidationError("close needs the session to close (its opening job id)")
        extra = sorted(set(params) - {"session", "close"})
        if extra:
            raise ValidationError(f"closing a session takes no other parameters, got {extra}")
        return {"action": "close", "session": session}
    if session:
        extra = sorted(set(params) - {"session", "queries", "close"})
        if extra:
            raise ValidationError(
                f"parameter(s) {extra} are fixed when a session opens; a continuation takes "
                "only session and queries")
        return {"action": "batch", "session": session,
                "queries": _canonical_queries(params.get("queries"), schema)}
    extra = sorted(set(params) - _SVT_OPEN_KEYS - {"session", "close"})
    if extra:
        raise ValidationError(f"unknown svt parameter(s) {extra}; known: "
                              f"{sorted(_SVT_OPEN_KEYS)}")
    queries = _canonical_queries(params.get("queries"), schema)
    if "threshold" not in params:
        raise ValidationError("svt needs a threshold T")
    return {"action": "open", **{k: params[k] for k in _SVT_OPEN_KEYS if k in params},
            "queries": queries}


def _canonical_queries(raw: Any, schema: Schema | None) -> Any:
    """Return an analyst's query set, compiled to its canonical form (as given without a schema)."""
    from dpfed.common.queries.query_language import compile_query_set

    return raw if schema is None else list(compile_query_set(schema, raw).canonical)


def _queries(value: Any, ctx: ParseContext) -> list[Any]:
    from dpfed.common.queries.query_language import compile_query_set

    if ctx.parsed["action"] == "close":
        return []
    if ctx.schema is None:
        return list(value) if isinstance(value, list | tuple) else []
    return list(compile_query_set(ctx.schema, value, canonical=True).canonical)


def _flag(name: str) -> Parser:
    def parse(value: Any, _ctx: ParseContext) -> bool:
        if not isinstance(value, bool):
            raise ValidationError(f"{name} must be true or false, got {value!r}")
        return value

    return parse


def _threshold(value: Any, ctx: ParseContext) -> float | None:
    if ctx.parsed["action"] != "open":
        return None
    from dpfed.common.queries.svt_stream import SVTSessionParams

    return SVTSessionParams(value, 1, 1.0).threshold


@dataclass(frozen=True)
class SVTParams(Params):
    """Parameters of an ``svt`` job: open, continue or close a session at every site.

    The analyst gives ``session`` (a continuation's or close's opening job id), ``close``
    and, to open, ``threshold``, ``cutoff``, ``numeric_epsilon`` and ``monotonic``; the
    canonical form names the ``action``. A session's epsilon is the opening job's.
    """

    kind: ClassVar[str] = "svt"

    action: str = param(parse=choice("action", SVT_ACTIONS), required="svt needs an action")
    session: str = param("", omit=lambda p: p.action == "open")
    threshold: float | None = param(None, parse=_threshold,
                                    omit=lambda p: p.action != "open")
    cutoff: int = param(1, parse=integer("cutoff", minimum=1),
                        omit=lambda p: p.action != "open")
    monotonic: bool = param(False, parse=_flag("monotonic"), omit=lambda p: p.action != "open")
    numeric_epsilon: float | None = param(
        None, parse=lambda v, _ctx: None if v is None else check_epsilon(v, "numeric_epsilon"),
        omit=lambda p: p.action != "open" or p.numeric_epsilon is None)
    queries: list[Any] = param(None, parse=_queries, omit=lambda p: p.action == "close")

    @classmethod
    def parse(cls, raw: Mapping[str, Any], schema: Schema | None) -> SVTParams:
        """Accept the analyst's form and the canonical one (see the class docstring)."""
        canonical = raw if "action" in raw else _analyst_svt(raw, schema)
        return super().parse(canonical, schema)

    def validate(self, schema: Schema | None) -> None:
        """Refuse unless A monotonic session needs queries that provably move in one direction."""
        if schema is None or self.action != "open" or not self.monotonic:
            return
        from dpfed.common.queries.query_language import compile_query_set

        if not compile_query_set(schema, self.queries, canonical=True).one_directional(schema):
            raise ValidationError("monotonic=true needs queries that provably move in one "
                                  "direction under replace-one (a chain of nested predicates, "
                                  "e.g. age >= 80, age >= 70, ...); these do not, so use the "
                                  "default noise")

    def session_params(self, epsilon: float) -> Any:
        """Return the session's :class:`~dpfed.common.queries.svt_stream.SVTSessionParams`."""
        from dpfed.common.queries.svt_stream import SVTSessionParams

        if self.threshold is None:
            raise ValidationError("svt needs a threshold T")
        return SVTSessionParams(self.threshold, self.cutoff, epsilon, self.numeric_epsilon,
                                self.monotonic)

    def check_privacy(self, epsilon: float, delta: float) -> None:
        """Pure epsilon-DP (Laplace noise); an opening's settings must fit its epsilon."""
        if delta != 0.0:
            raise ValidationError(f"svt is pure epsilon-DP (Laplace noise): delta must be 0, "
                                  f"got {delta!r}")
        check_epsilon(epsilon)
        if self.action == "open":
            self.session_params(epsilon)

    def shares(self, epsilon: float, delta: float) -> list[RoundShare]:
        """One round; only the opening one is charged (it pays for the whole session)."""
        return [RoundShare("svt", epsilon, 0.0, charged=self.action == "open")]
