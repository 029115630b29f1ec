"""The analyst's handle on a DP-PCA result, with scikit-learn-like attributes.

``components_`` is K x p with orthonormal rows (sklearn orientation), ``explained_variance_``
holds the eigenvalues of the aggregated noisy second-moment matrix
``A_c = (1/S) sum_s P_s P_s^T`` of the *unit-ball-scaled* features, and
``explained_variance_ratio_`` divides them by its trace. ``transform`` applies the same public
scaling (schema bounds, clip norm) to new rows before projecting, so scores are comparable
across sites and with the released eigenvalues.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dpfed.aggregator.result_file import decode_result, encode_result
from dpfed.common.data.encoding import RowPolicy, encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.pca.features import UnitBallMap


@dataclass(frozen=True)
class PCAResult:
    """A finished ``pca`` job's release (everything here is DP: post-processing of the sites')."""

    components_: np.ndarray
    explained_variance_: np.ndarray
    explained_variance_ratio_: np.ndarray
    feature_names_in_: tuple[str, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    #: All eigenvalues of the aggregated noisy matrix A_c (up to min(p, S R)), largest first.
    spectrum_: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def n_components_(self) -> int:
        """K."""
        return int(self.components_.shape[0])

    @property
    def schema(self) -> Schema:
        """The federation schema the job ran on."""
        return Schema.from_toml(self.metadata["schema_toml"], "result metadata")

    def transform(self, x: pd.DataFrame | np.ndarray) -> np.ndarray:
        """Project rows onto the components.

        ``x`` is either a DataFrame with the schema's columns (validated and scaled exactly as
        at the sites: bounds, clip norm; invalid rows raise) or an array that is already in
        the unit-ball feature space (n x p).
        """
        if isinstance(x, pd.DataFrame):
            table, _ = encode_table(self.schema, x, policy=RowPolicy("error", "error", "clip"),
                                    source="transform input")
            features, _ = UnitBallMap(self.schema, self.metadata.get("clip_norm")).transform(table)
        else:
            features = np.asarray(x, dtype=np.float64)
            if features.ndim != 2 or features.shape[1] != self.components_.shape[1]:
                raise ValidationError(f"x must have shape (n, {self.components_.shape[1]}), "
                                      f"got {features.shape}")
        return np.asarray(features @ self.components_.T)

    # ------------------------------------------------------------------ files
    def arrays(self) -> dict[str, np.ndarray]:
        """Return the arrays of ``pca.npz`` by name (the one definition of the file layout)."""
        return {"components": self.components_, "eigenvalues": self.explained_variance_,
                "explained_variance_ratio": self.explained_variance_ratio_,
                "spectrum": self.spectrum_,
                "feature_names": np.array(self.feature_names_in_, dtype=np.str_)}

    def to_bytes(self) -> bytes:
        """Return the ``pca.npz`` bytes."""
        return encode_result(self.arrays(), self.metadata)

    def save(self, path: str | Path) -> Path:
        """Write ``pca.npz``: components (K x p), eigenvalues (K), feature_names, metadata."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(self.to_bytes())
        return p

    @classmethod
    def from_bytes(cls, data: bytes | str) -> PCAResult:
        """Read a result file's bytes (or path)."""
        arrays, meta = decode_result(data)
        try:
            return cls(arrays["components"], arrays["eigenvalues"],
                       arrays["explained_variance_ratio"],
                       tuple(str(n) for n in arrays["feature_names"]), meta,
                       arrays.get("spectrum", arrays["eigenvalues"]))
        except KeyError as exc:
            raise ValidationError(f"not a pca result file: missing {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> PCAResult:
        """Read ``pca.npz``."""
        return cls.from_bytes(str(path))
