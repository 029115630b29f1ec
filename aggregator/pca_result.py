"""The analyst's handle on a DP-PCA result, with scikit-learn-like attributes.

Spaces. The job maps every row ``x`` (raw units) to ``u`` (each column scaled to [-1, 1] by its
declared bounds, one-hots in {0, 1}), centres it at the DP centre ``c0`` (the DP mean; 0, the
schema midpoint, for ``centering="none"``) and divides by the job's clip radius ``c``:
``z = (u - c0) / c`` -- the *unit* space. ``components_`` (K x p, orthonormal rows) and
``explained_variance_`` (eigenvalues of the aggregated noisy matrix ``A_c`` -- the covariance
when centred, the second moment when not) live in that space, and ``explained_variance_ratio_``
divides them by ``trace(A_c)``.

``transform(X)`` takes raw values by default -- a DataFrame with the schema's columns, or a
numpy array of the p features in raw units (the schema's column order; for a nominal column its
one-hot indicators, or the schema's columns when no column is nominal) -- and returns
``((u(X) - c0) / c) @ components_.T``; ``space="unit"`` takes ``z`` directly. Both are affine:
rows outside the clip radius are not clipped (clipping only bounds a row's influence on the
release). ``inverse_transform`` maps scores back to raw feature units (or ``z``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd

from dpfed.aggregator.result_file import decode_result, encode_result
from dpfed.common.data.encoding import RowPolicy, encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.pca.features import UnitBallMap, feature_affine, max_feature_norm

Space = Literal["raw", "unit"]


@dataclass(frozen=True)
class PCAResult:
    """A finished ``pca`` job's release (everything here is DP: post-processing of the sites')."""

    components_: np.ndarray
    explained_variance_: np.ndarray
    explained_variance_ratio_: np.ndarray
    #: The p features the components are over (``column=category`` for one-hots).
    feature_names_in_: tuple[str, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    #: All eigenvalues of the aggregated noisy matrix A_c (up to min(p, S R)), largest first.
    spectrum_: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: The DP centre in the scaled [-1, 1] space (zeros: the schema midpoint, uncentred job).
    scaled_center_: np.ndarray | None = None

    @property
    def n_components_(self) -> int:
        """K."""
        return int(self.components_.shape[0])

    @property
    def n_features_in_(self) -> int:
        """p, the number of features ``transform`` takes (and ``mean_`` has)."""
        return int(self.components_.shape[1])

    @property
    def schema(self) -> Schema:
        """The federation schema the job ran on."""
        return Schema.from_toml(self.metadata["schema_toml"], "result metadata")

    @property
    def centering(self) -> str:
        """``"mean"`` (centred at the DP mean) or ``"none"`` (at the schema midpoint)."""
        return str(self.metadata.get("centering", "none"))

    @property
    def clip_radius(self) -> float:
        """The public radius ``c`` the job divided the (centred) rows by."""
        clip = self.metadata.get("clip_norm")
        if isinstance(clip, int | float) and not isinstance(clip, bool):
            return float(clip)
        return max_feature_norm(self.schema)

    @property
    def _center(self) -> np.ndarray:
        if self.scaled_center_ is None:
            return np.zeros(self.n_features_in_)
        return np.asarray(self.scaled_center_, dtype=np.float64)

    @property
    def mean_(self) -> np.ndarray:
        """The centre in raw units per feature (a one-hot's entry is the category's share).

        The DP mean for a centred job; the schema's midpoints for ``centering="none"``.
        """
        offset, scale = feature_affine(self.schema)
        return np.asarray(offset + scale * self._center)

    def get_feature_names_out(self, input_features: Any = None) -> np.ndarray:
        """``["pca0", ..., "pca{K-1}"]``, as scikit-learn names PCA outputs."""
        del input_features
        return np.array([f"pca{i}" for i in range(self.n_components_)], dtype=object)

    def __repr__(self) -> str:
        m = self.metadata
        return (f"PCAResult(n_components={self.n_components_}, n_features={self.n_features_in_}, "
                f"centering={self.centering!r}, clip_radius={self.clip_radius:.4g}, "
                f"epsilon={m.get('epsilon')}, delta={m.get('delta')}, "
                f"sites={len(m.get('sites', []))}, rows={m.get('n_rows_total')})")

    # ------------------------------------------------------------------ projections
    def to_unit(self, x: pd.DataFrame | np.ndarray) -> np.ndarray:
        """Map raw rows (DataFrame, or numpy in raw units) to the unit space ``z``."""
        schema = self.schema
        p = self.n_features_in_
        if isinstance(x, pd.DataFrame):
            table, _ = encode_table(schema, x, policy=RowPolicy("error", "error", "clip"),
                                    source="transform input")
            u = UnitBallMap(schema).scaled(table)
        else:
            arr = np.asarray(x)
            if arr.ndim != 2:
                raise ValidationError(f"x must be 2-dimensional (n, {p}), got shape {arr.shape}")
            if arr.shape[1] != p and arr.shape[1] == len(schema.columns):
                return self.to_unit(pd.DataFrame(arr, columns=list(schema.names)))
            if arr.shape[1] != p:
                raise ValidationError(
                    f"x must have shape (n, {p}) (the features {', '.join(self.feature_names_in_)}"
                    f" in raw units) or (n, {len(schema.columns)}) (the schema's columns), "
                    f"got {arr.shape}")
            offset, scale = feature_affine(schema)
            u = (_finite(arr, "x") - offset) / scale
        return np.asarray((u - self._center) / self.clip_radius)

    def transform(self, x: pd.DataFrame | np.ndarray, *, space: Space = "raw") -> np.ndarray:
        """Project rows onto the components (n x K scores in the unit space).

        Parameters
        ----------
        x : DataFrame or ndarray
            ``space="raw"`` (default): raw rows -- a DataFrame with the schema's columns
            (validated as at the sites; invalid rows raise), or an array (n, p) of the
            features in raw units, or (n, #columns) in the schema's column order. A DataFrame
            and the same rows as an array give the same scores. ``space="unit"``: rows already
            in the unit space ``(u - centre) / clip radius`` (n, p).
        """
        if space == "unit":
            z = _finite(np.asarray(x), "x")
            if z.ndim != 2 or z.shape[1] != self.n_features_in_:
                raise ValidationError(f"x must have shape (n, {self.n_features_in_}) in the unit "
                                      f"space, got {z.shape}")
        elif space == "raw":
            z = self.to_unit(x)
        else:
            raise ValidationError(f"space must be 'raw' or 'unit', got {space!r}")
        return np.asarray(z @ self.components_.T)

    def inverse_transform(self, scores: np.ndarray, *, space: Space = "raw") -> np.ndarray:
        """Map scores (n x K) back to rows: raw feature units (n x p) or the unit space."""
        s = _finite(np.asarray(scores), "scores")
        if s.ndim != 2 or s.shape[1] != self.n_components_:
            raise ValidationError(f"scores must have shape (n, {self.n_components_}), "
                                  f"got {s.shape}")
        z = s @ self.components_
        if space == "unit":
            return np.asarray(z)
        if space != "raw":
            raise ValidationError(f"space must be 'raw' or 'unit', got {space!r}")
        offset, scale = feature_affine(self.schema)
        return np.asarray(offset + scale * (z * self.clip_radius + self._center))

    # ------------------------------------------------------------------ files
    def arrays(self) -> dict[str, np.ndarray]:
        """Return the arrays of ``pca.npz`` by name (the one definition of the file layout)."""
        return {"components": self.components_, "eigenvalues": self.explained_variance_,
                "explained_variance_ratio": self.explained_variance_ratio_,
                "spectrum": self.spectrum_, "center": self._center,
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
                       arrays.get("spectrum", arrays["eigenvalues"]), arrays.get("center"))
        except KeyError as exc:
            raise ValidationError(f"not a pca result file: missing {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> PCAResult:
        """Read ``pca.npz`` (FileNotFoundError when there is no such file)."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"no such result file: {p}")
        return cls.from_bytes(str(p))


def _finite(a: np.ndarray, name: str) -> np.ndarray:
    try:
        out = np.asarray(a, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{name} must be numeric: {exc}") from None
    if not np.all(np.isfinite(out)):
        raise ValidationError(f"{name} must contain only finite values (no NaN or inf)")
    return out
