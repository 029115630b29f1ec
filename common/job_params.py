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
from dpfed.common.privacy.mechanisms import CALIBRATIONS, gaussian_sigma
from dpfed.common.validation import check_choice, check_int, check_positive

#: How the sites' contributions are combined: each noised alone, or summed securely.
AGGREGATIONS: tuple[str, ...] = ("site", "secure")


def _unknown(params: Mapping[str, Any], known: set[str], kind: str) -> None:
    extra = sorted(set(params) - known)
    if extra:
        raise ValidationError(f"unknown {kind} parameter(s) {extra}; known: {sorted(known)}")


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
    clip_norm : float or None
        Public row-norm bound after per-column scaling (``dpfed.common.pca.features.UnitBallMap``);
        None means no clipping.
    aggregation : {"site", "secure"}
        ``site``: every site noises its own P_s (DPdisPCA); ``secure``: the sites' Gram
        matrices are summed under secure aggregation with distributed Skellam noise
        (``dpfed.common.secagg``), so the noise is that of one row of the pooled data.
    """

    n_components: int
    rank: int
    calibration: str = "analytic"
    clip_norm: float | None = None
    aggregation: str = "site"

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any], *, n_features: int) -> PCAParams:
        """Validate raw parameters against a schema with ``n_features`` numeric features."""
        _unknown(params, {"n_components", "rank", "calibration", "clip_norm", "aggregation"},
                 "pca")
        if "n_components" not in params:
            raise ValidationError("pca needs n_components (K)")
        k = check_int(params["n_components"], "n_components", minimum=1, maximum=n_features)
        rank = params.get("rank")
        r = min(2 * k, n_features) if rank is None else check_int(
            rank, "rank", minimum=k, maximum=n_features)
        calibration = check_choice(params.get("calibration", "analytic"), "calibration",
                                   CALIBRATIONS)
        clip = params.get("clip_norm")
        clip_norm = None if clip is None else check_positive(clip, "clip_norm")
        aggregation = check_choice(params.get("aggregation", "site"), "aggregation",
                                   AGGREGATIONS)
        return cls(k, r, calibration, clip_norm, aggregation)

    def check_privacy(self, epsilon: float, delta: float) -> None:
        """Raise if (epsilon, delta, calibration) cannot be calibrated (e.g. classic at eps=10)."""
        gaussian_sigma(epsilon, delta, 1.0, self.calibration)

    def to_mapping(self) -> dict[str, Any]:
        """Return the canonical form sent to sites."""
        out: dict[str, Any] = {"n_components": self.n_components, "rank": self.rank,
                               "calibration": self.calibration}
        if self.clip_norm is not None:
            out["clip_norm"] = self.clip_norm
        if self.aggregation != "site":
            out["aggregation"] = self.aggregation
        return out
