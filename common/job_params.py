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
from dpfed.common.privacy.mechanisms import CALIBRATIONS, gaussian_sigma
from dpfed.common.validation import (
    check_choice,
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
