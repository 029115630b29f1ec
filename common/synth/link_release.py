"""The federated synthesis job's link round: DP histograms of every column -> the links.

Site (holds rows, spends budget)
    :class:`LinkHistogramAccumulator` streams encoded chunks into one exact histogram per
    column -- codes for ordinal/nominal columns, public equal-width bins
    (:func:`dpfed.common.synth.quantile_link.bin_edges`) for continuous ones -- and
    :func:`release_link_histograms` adds Gaussian noise to the concatenated vector, less
    to the columns with more cells (:func:`link_noise_weights`).
Coordinator (sees only releases)
    :func:`sum_histograms` adds the sites' vectors; :func:`proportions_from_histograms` turns
    them into floored DP proportions (one block per column, concatenated in schema order);
    :func:`links_from_proportions` builds the links (quantile or identity continuous link);
    :func:`links_digest` is the digest sites check before they use links sent to them.

The links are a deterministic function of (schema, continuous link kind, DP proportions), so
sending the proportions and the digest is sending the links.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import ContinuousColumn, NominalColumn, OrdinalColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.mechanisms import GaussianMechanism
from dpfed.common.synth.dp_marginals import proportions_from_counts
from dpfed.common.synth.links import LatentLinks, Link, NominalLink, OrdinalLink
from dpfed.common.synth.quantile_link import QuantileLink, bin_codes, identity_link_from_bins
from dpfed.common.validation import check_choice, check_finite_array, check_int

CONTINUOUS_LINKS: tuple[str, ...] = ("quantile", "identity")
#: Replace-one L2 sensitivity of one column's histogram: one count down, another up.
HISTOGRAM_L2_SENSITIVITY = math.sqrt(2.0)
#: Floor of every continuous bin's DP proportion (keeps the quantile link's CDF increasing).
CONTINUOUS_BIN_FLOOR = 1e-7


def _vector(values: object, name: str, size: int) -> np.ndarray:
    v = check_finite_array(values, name, ndim=1)
    if v.shape[0] != size:
        raise ValidationError(f"{name} must have {size} entries, got {v.shape[0]}")
    return v


def histogram_sizes(schema: Schema, n_bins: int) -> tuple[int, ...]:
    """Cells per column in schema order (levels, categories, or ``n_bins`` public bins)."""
    b = check_int(n_bins, "n_bins", minimum=2)
    sizes = []
    for col in schema.columns:
        if isinstance(col, ContinuousColumn):
            sizes.append(b)
        elif isinstance(col, OrdinalColumn):
            sizes.append(col.n_levels)
        else:
            sizes.append(col.n_categories)
    return tuple(sizes)


def link_noise_weights(schema: Schema, n_bins: int) -> np.ndarray:
    """Per-column weights ``w_j`` of the link histograms (public: schema and bin count only).

    Column ``j`` of ``M_j`` cells gets ``w_j`` proportional to ``M_j^(1/3)``, scaled so that
    ``sum_j w_j^2`` is the number of columns. :func:`release_link_histograms` adds the same
    Gaussian noise to every cell of the weighted vector ``w_j h_j`` and divides by ``w_j``, so
    column ``j``'s counts carry noise ``sigma / w_j``. Under a fixed sensitivity budget
    (``sum_j 2 w_j^2``) these weights minimise the expected total L1 error
    ``sum_j M_j sigma / w_j`` of the columns' counts (Lagrange: ``M_j / w_j^2`` proportional
    to ``w_j``): a 32-bin continuous column gets 2.5 times less noise than a binary one,
    instead of the same. Returns one weight per column, in schema order.
    """
    sizes = np.asarray(histogram_sizes(schema, n_bins), dtype=np.float64)
    w = np.cbrt(sizes)
    return np.asarray(w / math.sqrt(float((w * w).mean())))


#: Integer weights of the secure link round: ``round(SECURE_WEIGHT_SCALE w_j)`` (at least 1).
SECURE_WEIGHT_SCALE = 8.0


def secure_link_weights(schema: Schema, n_bins: int) -> np.ndarray:
    """Integer per-column weights ``m_j`` of the secure link round (public, >= 1).

    :func:`link_noise_weights` times :data:`SECURE_WEIGHT_SCALE`, rounded: the secure sum adds
    integers, so every row adds ``m_j`` (not ``w_j``) to its cell of column ``j``, and the
    decoded pooled counts are divided by ``m_j`` (noise ``sqrt(mu) / m_j`` on column ``j``).
    The plan's ``row_norm`` is ``sqrt(sum_j m_j^2)`` (:func:`secure_link_row_norm`).
    """
    w = link_noise_weights(schema, n_bins)
    return np.maximum(np.rint(SECURE_WEIGHT_SCALE * w), 1.0).astype(np.int64)


def secure_link_row_norm(schema: Schema, n_bins: int) -> float:
    """``sqrt(sum_j m_j^2)``: the exact norm of one row's weighted counts (secure link round)."""
    m = secure_link_weights(schema, n_bins).astype(np.float64)
    return math.sqrt(float((m * m).sum()))


def secure_cell_weights(schema: Schema, n_bins: int) -> np.ndarray:
    """:func:`secure_link_weights` repeated over every column's cells (int64)."""
    return _per_cell(secure_link_weights(schema, n_bins), schema, n_bins)


def secure_pooled_counts(weighted_total: np.ndarray, schema: Schema, n_bins: int) -> np.ndarray:
    """Return the decoded secure link sum divided by the weights (post-processing)."""
    return np.asarray(np.asarray(weighted_total, dtype=np.float64)
                      / secure_cell_weights(schema, n_bins))


def _cell_weights(schema: Schema, n_bins: int) -> np.ndarray:
    """:func:`link_noise_weights` repeated over every column's cells."""
    return _per_cell(link_noise_weights(schema, n_bins), schema, n_bins)


def _per_cell(per_column: np.ndarray, schema: Schema, n_bins: int) -> np.ndarray:
    """One value per column repeated over that column's cells (the histograms' layout)."""
    return np.repeat(per_column, histogram_sizes(schema, n_bins))


def link_histogram_sensitivity(schema: Schema) -> float:
    """L2 sensitivity of the weighted concatenated histograms under replace-one.

    Replacing one row moves, in every column's histogram, one count down and one count up
    (or nothing when both rows fall in the same cell): ``sqrt(2) w_j`` in column ``j`` of
    the weighted vector, so ``sqrt(2 sum_j w_j^2) = sqrt(2 n_columns)`` for the whole vector
    (the columns' changes are orthogonal; :func:`link_noise_weights` fixes ``sum_j w_j^2``).
    """
    return HISTOGRAM_L2_SENSITIVITY * math.sqrt(len(schema.columns))


def link_histogram_mechanism(schema: Schema, epsilon: float, delta: float) -> GaussianMechanism:
    """Return the Gaussian mechanism of :func:`release_link_histograms`.

    Privacy
    -------
    Relation: replace-one row at this site (``N_s`` public). Bounds: codes in the schema's
    levels/categories; continuous values clipped to the schema bounds and binned on public
    equal-width bins. Sensitivity: :func:`link_histogram_sensitivity` of the weighted vector
    (L2, ``sqrt(2 n_cols)``). Calibration: analytic Gaussian for (epsilon, delta) on every
    cell of the weighted vector; dividing by the public weights is post-processing.
    """
    return GaussianMechanism(epsilon, delta, link_histogram_sensitivity(schema))


def link_noise_sd(schema: Schema, n_bins: int, epsilon: float, delta: float) -> np.ndarray:
    """Per-column standard deviation of one site's noise on its released counts."""
    sigma = link_histogram_mechanism(schema, epsilon, delta).sigma
    return np.asarray(sigma / link_noise_weights(schema, n_bins))


class LinkHistogramAccumulator:
    """Exact per-column histograms over streamed chunks (site-internal, never sent)."""

    def __init__(self, schema: Schema, n_bins: int) -> None:
        self.schema = schema
        self.n_bins = check_int(n_bins, "n_bins", minimum=2)
        self.sizes = histogram_sizes(schema, self.n_bins)
        self.counts = np.zeros(sum(self.sizes), dtype=np.int64)
        self.n_rows = 0

    def add(self, table: EncodedTable) -> None:
        """Add one encoded chunk."""
        if table.schema.digest() != self.schema.digest():
            raise ValidationError("chunk was encoded with a different schema")
        start = 0
        for col, size in zip(self.schema.columns, self.sizes, strict=True):
            values = table.columns[col.name]
            if isinstance(col, ContinuousColumn):
                codes = bin_codes(col, values, self.n_bins)
            else:
                codes = np.asarray(values, dtype=np.intp)
            self.counts[start:start + size] += np.bincount(codes, minlength=size)[:size]
            start += size
        self.n_rows += table.n_rows


def weighted_histograms(counts: np.ndarray, schema: Schema, n_bins: int) -> np.ndarray:
    """Return the vector the link round's noise is added to: column ``j``'s counts times ``w_j``.

    :func:`link_histogram_sensitivity` bounds how far it moves when one row is replaced.
    """
    return _weighted(counts, _cell_weights(schema, n_bins))


def _weighted(counts: np.ndarray, cell_weights: np.ndarray) -> np.ndarray:
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 1 or c.shape[0] != cell_weights.shape[0]:
        raise ValidationError(f"counts must be a 1-d vector of {cell_weights.shape[0]} cells, "
                              f"got shape {c.shape}")
    return np.asarray(c * cell_weights)


def release_link_histograms(counts: np.ndarray, schema: Schema, n_bins: int, *,
                            epsilon: float, delta: float, rng: np.random.Generator
                            ) -> np.ndarray:
    """Site step: the concatenated histograms plus Gaussian noise, ``sigma / w_j`` in column j.

    Privacy
    -------
    See :func:`link_histogram_mechanism`: replace-one, L2 sensitivity ``sqrt(2 n_cols)`` of
    :func:`weighted_histograms`, analytic Gaussian, (epsilon, delta)-DP; the division by the
    public weights (:func:`link_noise_weights`) is post-processing.
    """
    w = _cell_weights(schema, n_bins)
    noisy = link_histogram_mechanism(schema, epsilon, delta).release(_weighted(counts, w), rng)
    return np.asarray(noisy / w)


def sum_histograms(releases: list[np.ndarray], schema: Schema, n_bins: int) -> np.ndarray:
    """Coordinator step: add the sites' released vectors (each checked: shape, finite)."""
    size = sum(histogram_sizes(schema, n_bins))
    if not releases:
        raise ValidationError("need at least one site's histograms")
    total = np.zeros(size)
    for i, r in enumerate(releases):
        total += _vector(r, f"histograms of site {i}", size)
    return total


def project_counts(counts: np.ndarray, n_rows: float) -> np.ndarray:
    """Euclidean projection of noisy counts onto ``{x >= 0, sum x = n_rows}`` (post-processing).

    ``x = max(c - t, 0)`` with the threshold ``t`` that makes the sum ``n_rows`` (the public row
    count). Unlike clipping negatives at 0, it also removes the positive noise that empty cells
    (e.g. the far tail bins of a skewed column) would otherwise keep as spurious mass.
    """
    c = np.asarray(counts, dtype=np.float64)
    n = float(n_rows)
    if not (math.isfinite(n) and n > 0):
        raise ValidationError(f"n_rows must be a positive number, got {n_rows!r}")
    desc = np.sort(c)[::-1]
    cumulative = np.cumsum(desc) - n
    k = np.arange(1, c.size + 1)
    ok = desc - cumulative / k > 0
    last = int(np.flatnonzero(ok)[-1]) if ok.any() else c.size - 1
    threshold = cumulative[last] / (last + 1)
    return np.asarray(np.clip(c - threshold, 0.0, None))


def proportions_from_histograms(total: np.ndarray, schema: Schema, n_bins: int, *,
                                min_proportion: float = 1e-4,
                                n_rows: float | None = None) -> np.ndarray:
    """Floored DP proportions, one block per column, concatenated (post-processing).

    With ``n_rows`` (the public pooled row count) every block is first projected onto the
    counts that sum to it (:func:`project_counts`). Each block then goes through
    :func:`dpfed.common.synth.dp_marginals.proportions_from_counts`
    (negative counts to 0, mixed with the uniform distribution up to the floor). The floor is
    ``min_proportion`` for categorical columns and :data:`CONTINUOUS_BIN_FLOOR` for continuous
    bins, capped at a tenth of the uniform share so blocks with many cells stay valid.
    """
    sizes = histogram_sizes(schema, n_bins)
    t = _vector(total, "histograms", sum(sizes))
    out = []
    start = 0
    for col, size in zip(schema.columns, sizes, strict=True):
        # Continuous bins only need a strictly increasing CDF: a much smaller floor keeps
        # empty tail bins from pulling mass away from the bulk.
        base = CONTINUOUS_BIN_FLOOR if isinstance(col, ContinuousColumn) else min_proportion
        floor = min(base, 0.1 / size)
        block = t[start:start + size]
        if n_rows is not None:
            block = project_counts(block, n_rows)
        out.append(proportions_from_counts(block, min_proportion=floor))
        start += size
    return np.concatenate(out)


def split_proportions(proportions: np.ndarray, schema: Schema,
                      n_bins: int) -> dict[str, np.ndarray]:
    """Cut the concatenated proportions into one block per column name."""
    sizes = histogram_sizes(schema, n_bins)
    p = _vector(proportions, "proportions", sum(sizes))
    blocks: dict[str, np.ndarray] = {}
    start = 0
    for col, size in zip(schema.columns, sizes, strict=True):
        blocks[col.name] = p[start:start + size]
        start += size
    return blocks


def links_from_proportions(schema: Schema, proportions: np.ndarray, n_bins: int,
                           continuous_link: str = "quantile") -> LatentLinks:
    """Build every link from DP proportions (post-processing, deterministic).

    Continuous columns get a :class:`~dpfed.common.synth.quantile_link.QuantileLink`
    (``continuous_link="quantile"``) or the identity link with the DP mean/sd of the binned
    density (``"identity"``); ordinal columns the threshold link; nominal the probit link.
    """
    kind = check_choice(continuous_link, "continuous_link", CONTINUOUS_LINKS)
    blocks = split_proportions(proportions, schema, n_bins)
    links: list[Link] = []
    for col in schema.columns:
        p = blocks[col.name]
        if isinstance(col, ContinuousColumn):
            links.append(QuantileLink(col, proportions=p) if kind == "quantile"
                         else identity_link_from_bins(col, p))
        elif isinstance(col, OrdinalColumn):
            links.append(OrdinalLink(col, p))
        else:
            assert isinstance(col, NominalColumn)
            links.append(NominalLink(col, p))
    return LatentLinks(schema, tuple(links))


def links_digest(schema: Schema, proportions: np.ndarray, n_bins: int,
                 continuous_link: str) -> str:
    """SHA-256 over everything that defines the links (schema, kind, bins, proportions)."""
    h = hashlib.sha256()
    h.update(schema.digest().encode())
    h.update(f"|{continuous_link}|{int(n_bins)}|".encode())
    h.update(np.ascontiguousarray(proportions, dtype="<f8").tobytes())
    return h.hexdigest()


def link_round_cost(schema: Schema, epsilon: float, delta: float) -> PrivacyCost:
    """Cost of the link round at one site (before any noise is drawn)."""
    return link_histogram_mechanism(schema, epsilon, delta).cost()


def expected_proportion_error(schema: Schema, n_bins: int, *, epsilon: float, delta: float,
                              row_counts: list[int],
                              pooled_sigma: np.ndarray | float | None = None
                              ) -> tuple[str, float]:
    """Return the worst column's expected L1 error of its pooled DP proportions.

    With per-site noise ``sigma_j`` per cell of column ``j`` (:func:`link_noise_sd`), ``S``
    sites and ``N`` pooled rows, a column of ``M`` cells has an expected L1 error of its
    counts of ``M sigma_j sqrt(S) sqrt(2/pi)``, i.e. about that divided by ``N`` on its
    proportions. ``pooled_sigma`` (secure aggregation) is the standard deviation, per column
    or for all, of the one noise draw the pooled sum carries instead. Returns
    (column name, error); used to refuse budgets too small for the schema's cells before
    anything is charged.
    """
    if not row_counts or min(row_counts) < 1:
        raise ValidationError("need the sites' (positive) row counts")
    sizes = histogram_sizes(schema, n_bins)
    if pooled_sigma is None:
        spreads = link_noise_sd(schema, n_bins, epsilon, delta) * math.sqrt(len(row_counts))
    else:
        spreads = np.broadcast_to(np.asarray(pooled_sigma, dtype=np.float64), (len(sizes),))
    n = float(sum(row_counts))
    worst = ("", 0.0)
    for col, size, spread in zip(schema.columns, sizes, spreads, strict=True):
        err = size * float(spread) * math.sqrt(2.0 / math.pi) / n
        if err > worst[1]:
            worst = (col.name, err)
    return worst
