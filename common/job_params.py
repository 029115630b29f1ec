"""Parameters of each job kind, validated identically by the coordinator and the sites.

The coordinator validates a job's parameters when an analyst submits it (a clear
INVALID_ARGUMENT instead of a job that fails at every site); each site validates the task it
receives again, because a site trusts nothing that comes over the network.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpfed.common.errors import ValidationError
from dpfed.common.job_choices import AGGREGATIONS, CENTERINGS, SITE_WEIGHTINGS
from dpfed.common.privacy.composition import COMPOSITIONS, split_budget
from dpfed.common.privacy.mechanisms import CALIBRATIONS, gaussian_sigma
from dpfed.common.synth.pair_marginals import DEFAULT_GROUPS, MAX_GROUPS
from dpfed.common.validation import (
    check_choice,
    check_delta,
    check_epsilon,
    check_int,
    check_positive,
    check_probability,
)


def _unknown(params: Mapping[str, Any], known: set[str], kind: str) -> None:
    extra = sorted(set(params) - known)
    if extra:
        raise ValidationError(f"unknown {kind} parameter(s) {extra}; known: {sorted(known)}")


#: Share of a centred job's epsilon and delta spent on the DP mean (round ``mean``).
MEAN_SHARE = 0.1
#: Share of the job's epsilon and delta spent on the DP row-norm quantile (round ``norms``).
NORMS_SHARE = 0.1
#: Default quantile of the row norms used as the clip radius by ``clip_norm="auto"``.
DEFAULT_CLIP_QUANTILE = 0.9
PCA_STAGES: tuple[str, ...] = ("mean", "norms", "pca")


@dataclass(frozen=True)
class PCAParams:
    """Parameters of a ``pca`` job (DPdisPCA).

    Attributes
    ----------
    n_components : int
        K, the dimension of the subspace returned.
    rank : int
        R, the number of eigenpairs each site sends (default 2K, as in DPdisPCA).
    calibration : {"analytic", "classic"}
        Gaussian calibration (classic only where it is DP).
    clip_norm : float, None or "auto"
        Public bound on the norm of the rows the PCA round decomposes, in the space where every
        column is scaled to [-1, 1] (centred at the DP mean when ``centering="mean"``).
        ``"auto"`` (default): a DP quantile of the row norms (round ``norms``); None (the user
        types ``schema``): the worst case the schema allows, nothing is clipped.
    centering : {"mean", "none"}
        ``"mean"`` (default): a DP mean round first, then the centred second moment;
        ``"none"``: the second moment around the schema's midpoint (DPdisPCA as published).
    clip_quantile : float
        The quantile of the row norms that ``clip_norm="auto"`` uses (default 0.9).
    site_weighting : {"size", "equal"}
        ``"size"`` (default): the sites' matrices weighted by ``N_s / N``; ``"equal"``: the
        paper's ``1/S``. Post-processing either way (``N_s`` is public).
    aggregation : {"site", "secure"}
        ``site`` (default): every site noises its own release (DPdisPCA); ``secure``: the
        sites' Gram matrices (and row sums, when centred) are summed under secure aggregation
        with distributed Skellam noise (``dpfed.common.secagg``), so the noise is that of one
        row of the pooled data; centring then happens at the coordinator, and ``clip_norm``
        is ``schema`` or a number.
    """

    n_components: int
    rank: int
    calibration: str = "analytic"
    clip_norm: float | str | None = "auto"
    centering: str = "mean"
    clip_quantile: float = DEFAULT_CLIP_QUANTILE
    site_weighting: str = "size"
    aggregation: str = "site"

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any], *, n_features: int) -> PCAParams:
        """Validate raw parameters against a schema with ``n_features`` numeric features."""
        _unknown(params, {"n_components", "rank", "calibration", "clip_norm", "centering",
                          "clip_quantile", "site_weighting", "aggregation"}, "pca")
        if "n_components" not in params:
            raise ValidationError("pca needs n_components (K)")
        k = check_int(params["n_components"], "n_components", minimum=1, maximum=n_features)
        rank = params.get("rank")
        r = min(2 * k, n_features) if rank is None else check_int(
            rank, "rank", minimum=k, maximum=n_features)
        calibration = check_choice(params.get("calibration", "analytic"), "calibration",
                                   CALIBRATIONS)
        aggregation = check_choice(params.get("aggregation", "site"), "aggregation",
                                   AGGREGATIONS)
        clip = params.get("clip_norm", "auto" if aggregation == "site" else "schema")
        clip_norm: float | str | None
        if clip == "auto":
            clip_norm = "auto"
        elif clip is None or clip == "schema":
            clip_norm = None
        elif isinstance(clip, str):
            raise ValidationError(f"clip_norm must be 'auto', 'schema' or a number > 0, "
                                  f"got {clip!r}")
        else:
            clip_norm = check_positive(clip, "clip_norm")
        centering = check_choice(params.get("centering", "mean"), "centering", CENTERINGS)
        quantile = check_probability(params.get("clip_quantile", DEFAULT_CLIP_QUANTILE),
                                     "clip_quantile", open_interval=False)
        if quantile == 0.0:
            raise ValidationError("clip_quantile must be in (0, 1], got 0.0")
        weighting = check_choice(params.get("site_weighting", "size"), "site_weighting",
                                 SITE_WEIGHTINGS)
        if aggregation == "secure" and clip_norm == "auto":
            raise ValidationError("clip_norm 'auto' is not available with aggregation 'secure' "
                                  "(its norm histogram is a site-level release); use 'schema' "
                                  "or a number")
        return cls(k, r, calibration, clip_norm, centering, quantile, weighting, aggregation)

    def check_privacy(self, epsilon: float, delta: float) -> None:
        """Raise if some round's (epsilon, delta, calibration) cannot be calibrated."""
        rounds = self.rounds(epsilon, delta)
        for name, eps, dl in rounds:
            try:
                gaussian_sigma(eps, dl, 1.0, self.calibration)
            except ValidationError as exc:
                if len(rounds) == 1:
                    raise
                raise ValidationError(
                    f"the {name!r} round gets {eps:g} of the job's epsilon {epsilon:g} and "
                    f"{dl:g} of its delta {delta:g}, and there: {exc}") from None

    def rounds(self, epsilon: float, delta: float) -> list[tuple[str, float, float]]:
        """Return the rounds in order, each with its (epsilon, delta) share (summing to the job's).

        ``mean`` (centred jobs) gets :data:`MEAN_SHARE`, ``norms`` (``clip_norm="auto"``)
        :data:`NORMS_SHARE`, and ``pca`` the rest.
        """
        shares: list[tuple[str, float]] = []
        if self.centering == "mean":
            shares.append(("mean", MEAN_SHARE))
        if self.clip_norm == "auto":
            shares.append(("norms", NORMS_SHARE))
        rest = 1.0 - sum(s for _, s in shares)
        out = [(name, epsilon * s, delta * s) for name, s in shares]
        out.append(("pca", epsilon * rest, delta * rest))
        return out

    def to_mapping(self) -> dict[str, Any]:
        """Return the canonical form sent to sites."""
        return {"n_components": self.n_components, "rank": self.rank,
                "calibration": self.calibration,
                "clip_norm": "schema" if self.clip_norm is None else self.clip_norm,
                "centering": self.centering, "clip_quantile": self.clip_quantile,
                "site_weighting": self.site_weighting, "aggregation": self.aggregation}


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


@dataclass(frozen=True)
class SynthParams:
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
    split : tuple of (round, epsilon share, delta share)
        How the job's epsilon and delta are divided between the rounds (shares sum to 1).
    evaluate_rows : int
        When > 0, a final local-only round sends a synthetic sample of this many rows to
        every site for its site-local evaluation report (nothing is released or charged).
    aggregation : {"site", "secure"}
        ``site`` (default): every site noises its own histograms and DP-PCA factor;
        ``secure``: the sites' exact count vectors and latent Gram matrices are summed under
        secure aggregation with distributed Skellam noise (generative mode only).
        Every site then holds out ``holdout_size(N_s)`` rows from every round of the job.
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
    resolution : {"fine", "bins"}
        The cells of the continuous columns' 1-way releases and links
        (:mod:`dpfed.common.synth.column_cells`): ``fine`` -- whole numbers for small integer
        columns, else the bounds as point cells, ``n_bins`` bins and leaves inside them, with
        the estimate of :mod:`dpfed.common.synth.marginal_estimate` -- is what new jobs get
        (:meth:`with_defaults`); ``bins`` (``n_bins`` equal-width bins only) is what a stored
        job without the key means, so jobs made before it resume unchanged.
    pair_gate : bool
        Measure a column pair only when its noisy dependence score exceeds the noise its
        table would carry (:func:`dpfed.common.synth.pipeline.pair_forest`): True for new
        jobs (:meth:`with_defaults`), False (every pair of the forest) for stored jobs
        without the key.
    composition : {"basic", "zcdp"}
        How the split turns into each round's calibration
        (:mod:`dpfed.common.privacy.composition`): ``basic`` (default) gives every round its
        share of (epsilon, delta); ``zcdp`` its share of the job's rho, for sites whose
        accountant is ``zcdp`` (generative mode, analytic calibration; with
        ``aggregation="secure"`` every secure round's Skellam noise is calibrated so that its
        rho is at most the round's share, :func:`dpfed.common.privacy.skellam.skellam_calibrate`).
    """

    mode: str = "generative"
    continuous_link: str = "quantile"
    n_bins: int = 32
    clip_norm: float | None = None
    rank: int | None = None
    info_threshold: float = 0.8
    calibration: str = "analytic"
    split: tuple[tuple[str, float, float], ...] = ()
    evaluate_rows: int = 0
    aggregation: str = "site"
    summary_epsilon: float = 0.0
    summary_delta: float = 0.0
    pairs: int | None = None
    pair_groups: int = DEFAULT_GROUPS
    composition: str = "basic"
    resolution: str = "bins"
    pair_gate: bool = False

    @staticmethod
    def with_defaults(params: Mapping[str, Any]) -> dict[str, Any]:
        """Return a new job's parameters with the defaults of new jobs filled in.

        ``resolution`` defaults to "fine" and ``pair_gate`` to True for a job being submitted
        (a stored job without the keys is "bins" and False: :meth:`from_mapping`).
        """
        return {"resolution": "fine", "pair_gate": True, **params}

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any], *, latent_dim: int) -> SynthParams:
        """Validate raw parameters (``latent_dim`` is the schema's latent dimension)."""
        _unknown(params, {"mode", "continuous_link", "n_bins", "clip_norm", "rank",
                          "info_threshold", "calibration", "split", "evaluate_rows",
                          "aggregation", "summary_epsilon", "summary_delta", "pairs",
                          "pair_groups", "composition", "resolution", "pair_gate"}, "synth")
        mode = check_choice(str(params.get("mode", "generative")).replace("-", "_"), "mode",
                            tuple(SYNTH_ROUNDS))
        link = check_choice(params.get("continuous_link", "quantile"), "continuous_link",
                            ("quantile", "identity"))
        n_bins = check_int(params.get("n_bins", 32), "n_bins", minimum=2,
                           maximum=SYNTH_MAX_BINS)
        if latent_dim < 1 or latent_dim > SYNTH_MAX_LATENT_DIM:
            raise ValidationError(f"the schema's latent dimension is {latent_dim}; synth "
                                  f"supports 1..{SYNTH_MAX_LATENT_DIM}")
        clip = params.get("clip_norm")
        clip_norm = None if clip is None else check_positive(clip, "clip_norm")
        rank_raw = params.get("rank")
        rank = None if rank_raw is None else check_int(rank_raw, "rank", minimum=1,
                                                       maximum=latent_dim)
        threshold = float(params.get("info_threshold", 0.8))
        if not 0.0 < threshold < 1.0:
            raise ValidationError(f"info_threshold must be in (0, 1), got {threshold!r}")
        calibration = check_choice(params.get("calibration", "analytic"), "calibration",
                                   CALIBRATIONS)
        evaluate_rows = check_int(params.get("evaluate_rows", 0), "evaluate_rows", minimum=0,
                                  maximum=50_000)
        aggregation = check_choice(params.get("aggregation", "site"), "aggregation",
                                   AGGREGATIONS)
        if aggregation == "secure" and mode == "row_aligned":
            raise ValidationError(
                "--mode row-aligned cannot run with --aggregation secure: its factors round "
                "releases one noisy row per real row, which is not a sum; use --mode "
                "generative with --aggregation secure, or --aggregation site")
        summary_eps, summary_delta = _summary_budget(params, evaluate_rows)
        pairs = _pairs(params.get("pairs"), mode)
        pair_groups = check_int(params.get("pair_groups", DEFAULT_GROUPS), "--pair-groups",
                                minimum=2, maximum=MAX_GROUPS)
        raw_split = params.get("split")
        with_pairs = (mode == "generative" and pairs != 0
                      and not (pairs is None and isinstance(raw_split, Mapping)
                               and not any(r in raw_split for r in PAIR_ROUNDS)))
        split = cls._split(mode, raw_split, with_pairs)
        composition = _composition(params.get("composition", "basic"), mode,
                                   calibration)
        resolution = check_choice(params.get("resolution", "bins"), "--resolution",
                                  ("fine", "bins"))
        gate = params.get("pair_gate", False)
        if not isinstance(gate, bool):
            raise ValidationError(f"pair_gate must be true or false, got {gate!r}")
        return cls(mode, link, n_bins, clip_norm, rank, threshold, calibration, split,
                   evaluate_rows, aggregation, summary_eps, summary_delta, pairs, pair_groups,
                   composition, resolution, gate and with_pairs)

    @staticmethod
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

    def check_privacy(self, epsilon: float, delta: float) -> None:
        """Raise if a Gaussian round cannot be calibrated at its share of (epsilon, delta)."""
        for name, eps, dlt in self.plan(epsilon, delta):
            if name == "factors":
                continue
            if dlt <= 0.0:
                raise ValidationError(f"round {name!r} is Gaussian and got delta 0; pass a "
                                      "positive --delta")
            gaussian_sigma(eps, dlt, 1.0, self.calibration if name == "pca" else "analytic")

    def to_mapping(self) -> dict[str, Any]:
        """Return the canonical form sent to sites (deterministic: resumed jobs resend it)."""
        out: dict[str, Any] = {"mode": self.mode, "continuous_link": self.continuous_link,
                               "n_bins": self.n_bins, "info_threshold": self.info_threshold,
                               "calibration": self.calibration,
                               "split": {n: [e, d] for n, e, d in self.split}}
        if self.clip_norm is not None:
            out["clip_norm"] = self.clip_norm
        if self.rank is not None:
            out["rank"] = self.rank
        if self.evaluate_rows:
            out["evaluate_rows"] = self.evaluate_rows
        if self.aggregation != "site":
            out["aggregation"] = self.aggregation
        if self.summary_epsilon:
            out["summary_epsilon"] = self.summary_epsilon
            out["summary_delta"] = self.summary_delta
        if self.pairs is not None:
            out["pairs"] = self.pairs
        if self.pair_rounds:
            out["pair_groups"] = self.pair_groups
        if self.composition != "basic":  # absent by default: older jobs resume unchanged
            out["composition"] = self.composition
        if self.resolution != "bins":  # absent: jobs made before the key resume unchanged
            out["resolution"] = self.resolution
        if self.pair_gate:  # absent: the same
            out["pair_gate"] = True
        return out


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
