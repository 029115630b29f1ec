"""``clip_norm = "auto"``: a DP quantile of the row norms picks the public clip radius.

Round ``norms`` (site -> coordinator)
    Each site computes the norm of every row in the space the PCA round will bound (``u`` or
    ``u - mu``, see :mod:`dpfed.common.pca.centring`), counts them on a *public* geometric grid
    (:func:`norm_grid`, fixed by the schema alone) and releases the counts with Gaussian noise
    (:func:`norm_histogram_mechanism`).
Coordinator
    Adds the sites' noisy histograms and takes the smallest grid edge below which at least a
    fraction ``q`` of the public total ``N = sum_s N_s`` of rows lie (:func:`dp_quantile`).
    Post-processing; the same radius is then sent to every site with the PCA task.

The grid spans ``[max_norm / 2^GRID_OCTAVES, max_norm]`` with ``GRID_STEPS_PER_OCTAVE`` edges per
doubling (about 19 % apart), so the chosen radius is at most one step above the exact
quantile; norms below the lowest edge share the first bin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.pca.features import max_feature_norm
from dpfed.common.privacy.mechanisms import GaussianMechanism
from dpfed.common.validation import check_finite_array, check_int, check_positive

#: Number of doublings the grid spans below the largest possible norm.
GRID_OCTAVES = 10
#: Grid edges per doubling.
GRID_STEPS_PER_OCTAVE = 4
#: L2 sensitivity of a histogram under replace-one (one count down, another up).
HISTOGRAM_SENSITIVITY = math.sqrt(2.0)


def norm_grid(max_norm: float) -> np.ndarray:
    """Return the public upper edges of the norm bins, increasing, the last one ``max_norm``.

    Bin ``j`` holds norms in ``(edges[j-1], edges[j]]`` (bin 0: ``[0, edges[0]]``).
    """
    top = check_positive(max_norm, "max_norm")
    n = GRID_OCTAVES * GRID_STEPS_PER_OCTAVE
    return np.asarray(top * 2.0 ** (-np.arange(n, -1, -1) / GRID_STEPS_PER_OCTAVE))


def norm_bound(schema: Schema, centred: bool) -> float:
    """Largest norm a row can have in the space a round bounds: ``B``, or ``2B`` once centred.

    ``u`` lies in [-1, 1]^p so ``||u|| <= B`` (:func:`dpfed.common.pca.features.max_feature_norm`);
    a centre ``mu`` in the same box gives ``||u - mu|| <= ||u|| + ||mu|| <= 2B``.
    """
    bound = max_feature_norm(schema)
    return 2.0 * bound if centred else bound


def norm_histogram(norms: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Count ``norms`` per bin of ``edges`` (norms above the last edge go to the last bin)."""
    idx = np.searchsorted(edges, norms, side="left")
    np.minimum(idx, len(edges) - 1, out=idx)
    return np.bincount(idx, minlength=len(edges)).astype(np.float64)


def norm_histogram_mechanism(epsilon: float, delta: float,
                             calibration: str = "analytic") -> GaussianMechanism:
    """Return the mechanism for one site's histogram of row norms (the ``norms`` round).

    Privacy
    -------
    Neighbouring relation: replace-one (``N_s`` public). Bounds: none needed -- every row adds
    exactly 1 to exactly one bin of a grid fixed by the public schema. Sensitivity: replacing a
    row moves one unit from one bin to another, L2 change ``sqrt(2)`` (L1 2); 0 if both fall in
    the same bin. Calibration: Gaussian with L2 sensitivity ``sqrt(2)``, analytic by default.
    """
    return GaussianMechanism(epsilon, delta, HISTOGRAM_SENSITIVITY, calibration)


def dp_quantile(noisy_histograms: Sequence[np.ndarray], edges: np.ndarray, quantile: float,
                n_total: int) -> float:
    """Coordinator step: the smallest edge whose noisy cumulative count reaches ``q N``.

    Post-processing of the sites' noisy histograms; ``N`` is public. When the noisy counts
    never reach ``q N`` the largest edge (the worst-case bound) is returned.
    """
    if not noisy_histograms:
        raise ValidationError("dp_quantile needs at least one site's histogram")
    q = float(quantile)
    if not 0.0 < q <= 1.0:
        raise ValidationError(f"quantile must be in (0, 1], got {quantile}")
    n = check_int(n_total, "n_total", minimum=1)
    total = np.zeros(len(edges))
    for h in noisy_histograms:
        arr = check_finite_array(h, "histogram", ndim=1)
        if arr.shape != total.shape:
            raise ValidationError(f"histogram must have {len(edges)} bins, got {arr.shape}")
        total += arr
    reached = np.flatnonzero(np.cumsum(total) >= q * n)
    return float(edges[reached[0]] if reached.size else edges[-1])
