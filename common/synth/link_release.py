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

Every function takes the job's ``resolution`` layout (:mod:`dpfed.common.synth.column_cells`):
``"bins"`` (one level of ``n_bins`` equal-width bins per continuous column, as jobs made before
the parameter existed) or ``"fine"`` (coarse cells with the bounds as point cells, or one cell
per whole number, plus leaves inside every bin; the estimate of
:mod:`dpfed.common.synth.marginal_estimate`). The release layout (per column: coarse cells,
then leaves) and the proportions' layout (per column: its leaves) differ under "fine".

The links are a deterministic function of (schema, continuous link kind, layout, DP
proportions), so sending the proportions and the digest is sending the links.
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
from dpfed.common.synth.column_cells import (
    ColumnCells,
    check_resolution,
    release_counts,
    schema_cells,
    sub_bins,
)
from dpfed.common.synth.dp_marginals import proportions_from_counts
from dpfed.common.synth.links import LatentLinks, Link, NominalLink, OrdinalLink
from dpfed.common.synth.marginal_estimate import column_masses
from dpfed.common.synth.quantile_link import QuantileLink, identity_link_from_bins
from dpfed.common.validation import check_choice, check_finite_array, check_int

CONTINUOUS_LINKS: tuple[str, ...] = ("quantile", "identity")
#: Replace-one L2 sensitivity of one column's histogram: one count down, another up.
HISTOGRAM_L2_SENSITIVITY = math.sqrt(2.0)
#: Floor of every continuous bin's DP proportion (keeps the quantile link's CDF increasing).
CONTINUOUS_BIN_FLOOR = 1e-7
#: Under "fine", the share of a column's squared noise weight its leaves get (the rest goes to
#: its coarse cells): the leaves place point masses and shapes inside bins, which needs far
#: less accuracy than the bins' own masses.
FINE_SHARE = 0.2


def _vector(values: object, name: str, size: int) -> np.ndarray:
    v = check_finite_array(values, name, ndim=1)
    if v.shape[0] != size:
        raise ValidationError(f"{name} must have {size} entries, got {v.shape[0]}")
    return v


def _cells(schema: Schema, n_bins: int, resolution: str) -> dict[str, ColumnCells]:
    return schema_cells(schema, check_int(n_bins, "n_bins", minimum=2),
                        check_resolution(resolution))


def _categories(col: OrdinalColumn | NominalColumn) -> int:
    return col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories


def histogram_sizes(schema: Schema, n_bins: int, resolution: str = "bins") -> tuple[int, ...]:
    """Cells per column of the link round's release, in schema order.

    Levels, categories, or a continuous column's cells (``n_bins`` bins; under "fine" its
    coarse cells and then its leaves, :attr:`ColumnCells.release_size`).
    """
    cells = _cells(schema, n_bins, resolution)
    return tuple(cells[c.name].release_size if isinstance(c, ContinuousColumn)
                 else _categories(c) for c in schema.columns)


def link_sizes(schema: Schema, n_bins: int, resolution: str = "bins") -> tuple[int, ...]:
    """Cells per column of the DP proportions (the links' cells: a continuous column's leaves)."""
    cells = _cells(schema, n_bins, resolution)
    return tuple(cells[c.name].n_leaves if isinstance(c, ContinuousColumn)
                 else _categories(c) for c in schema.columns)


def link_noise_weights(schema: Schema, n_bins: int, resolution: str = "bins") -> np.ndarray:
    """Per-column weights ``w_j`` of the link histograms (public: schema and layout only).

    Column ``j`` of ``M_j`` (coarse) cells gets ``w_j`` proportional to ``M_j^(1/3)``, scaled so
    that ``sum_j w_j^2`` is the number of columns. :func:`release_link_histograms` adds the same
    Gaussian noise to every cell of the weighted vector and divides by the weights, so column
    ``j``'s counts carry noise ``sigma / w_j``. Under a fixed sensitivity budget
    (``sum_j 2 w_j^2``) these weights minimise the expected total L1 error
    ``sum_j M_j sigma / w_j`` of the columns' counts (Lagrange: ``M_j / w_j^2`` proportional
    to ``w_j``): a 32-bin continuous column gets 2.5 times less noise than a binary one,
    instead of the same. Under "fine" a column with leaves splits ``w_j^2``: a share
    :data:`FINE_SHARE` to its leaves, the rest to its coarse cells (:func:`cell_weights`).
    Returns one weight per column, in schema order.
    """
    sizes = np.asarray(_coarse_sizes(schema, n_bins, resolution), dtype=np.float64)
    w = np.cbrt(sizes)
    return np.asarray(w / math.sqrt(float((w * w).mean())))


def _coarse_sizes(schema: Schema, n_bins: int, resolution: str) -> tuple[int, ...]:
    cells = _cells(schema, n_bins, resolution)
    return tuple(cells[c.name].n_coarse if isinstance(c, ContinuousColumn)
                 else _categories(c) for c in schema.columns)


def _level_weights(schema: Schema, n_bins: int, resolution: str
                   ) -> list[tuple[float, float, int, int]]:
    """Per column: (coarse weight, leaf weight, coarse cells, released leaves)."""
    cells = _cells(schema, n_bins, resolution)
    out = []
    for col, w in zip(schema.columns, link_noise_weights(schema, n_bins, resolution),
                      strict=True):
        c = cells.get(col.name)
        if c is None:
            assert not isinstance(col, ContinuousColumn)
            out.append((float(w), 0.0, _categories(col), 0))
        elif not c.has_fine:
            out.append((float(w), 0.0, c.n_coarse, 0))
        else:
            out.append((float(w) * math.sqrt(1.0 - FINE_SHARE), float(w) * math.sqrt(FINE_SHARE),
                        c.n_coarse, c.release_size - c.n_coarse))
    return out


def cell_weights(schema: Schema, n_bins: int, resolution: str = "bins") -> np.ndarray:
    """Return the weight of every cell of the release (coarse cells and leaves; public).

    The squared weights of one column add up to its ``w_j^2`` (:func:`link_noise_weights`), so
    the weighted vector's replace-one L2 sensitivity stays ``sqrt(2 n_columns)``.
    """
    parts = [np.concatenate([np.full(nc, wc), np.full(nf, wf)])
             for wc, wf, nc, nf in _level_weights(schema, n_bins, resolution)]
    return np.concatenate(parts)


#: Integer weights of the secure link round: ``round(SECURE_WEIGHT_SCALE w)`` (at least 1).
SECURE_WEIGHT_SCALE = 8.0


def secure_link_weights(schema: Schema, n_bins: int, resolution: str = "bins") -> np.ndarray:
    """Integer per-column weights ``m_j`` of the secure link round (public, >= 1).

    :func:`link_noise_weights` times :data:`SECURE_WEIGHT_SCALE`, rounded: the secure sum adds
    integers, so every row adds ``m_j`` (not ``w_j``) to its cell of column ``j``, and the
    decoded pooled counts are divided by ``m_j`` (noise ``sqrt(mu) / m_j`` on column ``j``).
    Under "fine" these are the coarse cells' weights (:func:`secure_cell_weights` has the
    leaves' too). The plan's ``row_norm`` is :func:`secure_link_row_norm`.
    """
    return np.array([_secure(wc) for wc, _, _, _ in _level_weights(schema, n_bins, resolution)],
                    dtype=np.int64)


def secure_link_groups(schema: Schema, n_bins: int, resolution: str = "bins"
                       ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
    """Return the secure link sum's groups of cells, their integer weights, and which are partial.

    Every row adds its column's coarse weight to one coarse cell (a group that sums to ``N``
    times it); under "fine" a row inside a bin also adds the leaf weight to one released leaf,
    a row on a point cell to none (a partial group: at most ``N`` times it). Public; what
    :func:`dpfed.common.secagg.secure_sum.check_decoded` checks the decoded sum against.
    """
    groups: list[int] = []
    weights: list[int] = []
    partial: list[bool] = []
    for wc, wf, nc, nf in _level_weights(schema, n_bins, resolution):
        groups.append(nc)
        weights.append(_secure(wc))
        partial.append(False)
        if nf:
            groups.append(nf)
            weights.append(_secure(wf))
            partial.append(True)
    return tuple(groups), tuple(weights), tuple(partial)


def _secure(weight: float) -> int:
    return max(int(np.rint(SECURE_WEIGHT_SCALE * weight)), 1)


def secure_link_row_norm(schema: Schema, n_bins: int, resolution: str = "bins") -> float:
    """``sqrt(sum m^2)`` over one row's weighted cells: coarse and leaf of every column.

    Every row adds its column ``j``'s coarse weight to one coarse cell and (under "fine",
    columns with leaves) its leaf weight to at most one leaf, so this bounds the norm of one
    row's contribution (it is exact unless the row sits on a bound's point cell).
    """
    total = 0
    for wc, wf, _, nf in _level_weights(schema, n_bins, resolution):
        total += _secure(wc) ** 2 + (_secure(wf) ** 2 if nf else 0)
    return math.sqrt(float(total))


def secure_cell_weights(schema: Schema, n_bins: int, resolution: str = "bins") -> np.ndarray:
    """Return the secure round's integer weight of every release cell (int64)."""
    parts = [np.concatenate([np.full(nc, _secure(wc)), np.full(nf, _secure(wf) if nf else 1)])
             for wc, wf, nc, nf in _level_weights(schema, n_bins, resolution)]
    return np.concatenate(parts).astype(np.int64)


def secure_pooled_counts(weighted_total: np.ndarray, schema: Schema, n_bins: int,
                         resolution: str = "bins") -> np.ndarray:
    """Return the decoded secure link sum divided by the weights (post-processing)."""
    return np.asarray(np.asarray(weighted_total, dtype=np.float64)
                      / secure_cell_weights(schema, n_bins, resolution))


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


def link_noise_sd(schema: Schema, n_bins: int, epsilon: float, delta: float,
                  resolution: str = "bins") -> np.ndarray:
    """Per-column standard deviation of one site's noise on its released (coarse) counts."""
    sigma = link_histogram_mechanism(schema, epsilon, delta).sigma
    return np.asarray([sigma / wc for wc, _, _, _ in _level_weights(schema, n_bins, resolution)])


def release_noise_sd(schema: Schema, n_bins: int, pooled_sigma: float,
                     resolution: str = "bins", *, secure: bool = False) -> np.ndarray:
    """Public noise standard deviation of every cell of the summed release.

    ``pooled_sigma`` is the standard deviation of the noise on each cell of the summed
    *weighted* vector: ``sqrt(S)`` times one site's Gaussian sigma at site level, the decoded
    Skellam noise's under secure aggregation (``secure``: integer weights). Dividing by the
    cells' weights gives each count's noise -- what the "fine" estimate needs.
    """
    weights = (secure_cell_weights(schema, n_bins, resolution) if secure
               else cell_weights(schema, n_bins, resolution))
    return np.asarray(float(pooled_sigma) / weights.astype(np.float64))


class LinkHistogramAccumulator:
    """Exact per-column histograms over streamed chunks (site-internal, never sent).

    Under "fine" a continuous column's block is its coarse cells' counts then its leaves'
    (:func:`dpfed.common.synth.column_cells.release_counts`).
    """

    def __init__(self, schema: Schema, n_bins: int, resolution: str = "bins") -> None:
        self.schema = schema
        self.n_bins = check_int(n_bins, "n_bins", minimum=2)
        self.resolution = check_resolution(resolution)
        self.sizes = histogram_sizes(schema, self.n_bins, self.resolution)
        self._cells = _cells(schema, self.n_bins, self.resolution)
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
                cells = self._cells[col.name]
                leaves = np.bincount(cells.codes(values), minlength=cells.n_leaves)
                block = release_counts(cells, leaves).astype(np.int64)
            else:
                block = np.bincount(np.asarray(values, dtype=np.intp), minlength=size)[:size]
            self.counts[start:start + size] += block
            start += size
        self.n_rows += table.n_rows


def weighted_histograms(counts: np.ndarray, schema: Schema, n_bins: int,
                        resolution: str = "bins") -> np.ndarray:
    """Return the vector the link round's noise is added to: every count times its cell weight.

    :func:`link_histogram_sensitivity` bounds how far it moves when one row is replaced.
    """
    return _weighted(counts, cell_weights(schema, n_bins, resolution))


def _weighted(counts: np.ndarray, cell_weights: np.ndarray) -> np.ndarray:
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 1 or c.shape[0] != cell_weights.shape[0]:
        raise ValidationError(f"counts must be a 1-d vector of {cell_weights.shape[0]} cells, "
                              f"got shape {c.shape}")
    return np.asarray(c * cell_weights)


def release_link_histograms(counts: np.ndarray, schema: Schema, n_bins: int, *,
                            epsilon: float, delta: float, rng: np.random.Generator,
                            resolution: str = "bins") -> np.ndarray:
    """Site step: the concatenated histograms plus Gaussian noise, ``sigma / w`` in every cell.

    Privacy
    -------
    See :func:`link_histogram_mechanism`: replace-one, L2 sensitivity ``sqrt(2 n_cols)`` of
    :func:`weighted_histograms` (under "fine" a row moves one coarse count and one leaf count
    of every column down and up, and each column's squared weights add up to its ``w_j^2``),
    analytic Gaussian, (epsilon, delta)-DP; the division by the public weights
    (:func:`cell_weights`) is post-processing.
    """
    w = cell_weights(schema, n_bins, resolution)
    noisy = link_histogram_mechanism(schema, epsilon, delta).release(_weighted(counts, w), rng)
    return np.asarray(noisy / w)


def sum_histograms(releases: list[np.ndarray], schema: Schema, n_bins: int,
                   resolution: str = "bins") -> np.ndarray:
    """Coordinator step: add the sites' released vectors (each checked: shape, finite)."""
    size = sum(histogram_sizes(schema, n_bins, resolution))
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
                                n_rows: float | None = None, resolution: str = "bins",
                                noise_sd: np.ndarray | None = None,
                                heaps: bool = False) -> np.ndarray:
    """Floored DP proportions, one block per column (its link cells), concatenated.

    With ``n_rows`` (the public pooled row count) every categorical block -- and under
    "bins" every continuous one -- is first projected onto the counts that sum to it
    (:func:`project_counts`); under "fine" a continuous column's leaves are estimated from
    its coarse and leaf counts and ``noise_sd`` (required then: the public noise standard
    deviation of every release cell, :func:`release_noise_sd`) by
    :func:`dpfed.common.synth.marginal_estimate.column_masses` (``heaps``: its heaps placed
    first, the job parameter of the same name). Each block then goes through
    :func:`dpfed.common.synth.dp_marginals.proportions_from_counts` (negative counts to 0,
    mixed with the uniform distribution up to the floor). The floor is ``min_proportion`` for
    categorical columns and :data:`CONTINUOUS_BIN_FLOOR` for continuous cells, capped at a
    tenth of the uniform share so blocks with many cells stay valid. Post-processing.
    """
    kind = check_resolution(resolution)
    sizes = histogram_sizes(schema, n_bins, kind)
    t = _vector(total, "histograms", sum(sizes))
    sd: np.ndarray | None = None
    if kind == "fine":
        if noise_sd is None or n_rows is None:
            raise ValidationError("resolution='fine' needs the pooled row count and the noise "
                                  "level of every cell (n_rows, noise_sd)")
        sd = _vector(noise_sd, "noise_sd", sum(sizes))
    cells = _cells(schema, n_bins, kind)
    out = []
    start = 0
    for col, size in zip(schema.columns, sizes, strict=True):
        block = t[start:start + size]
        if isinstance(col, ContinuousColumn) and sd is not None:
            assert n_rows is not None
            c = cells[col.name]
            block = column_masses(c, block, sd[start:start + size], n_rows, heaps=heaps)
            floor = min(CONTINUOUS_BIN_FLOOR, 0.1 / c.n_leaves)
        else:
            # Continuous bins only need a strictly increasing CDF: a much smaller floor keeps
            # empty tail bins from pulling mass away from the bulk.
            base = CONTINUOUS_BIN_FLOOR if isinstance(col, ContinuousColumn) else min_proportion
            floor = min(base, 0.1 / size)
            if n_rows is not None:
                block = project_counts(block, n_rows)
        out.append(proportions_from_counts(block, min_proportion=floor))
        start += size
    return np.concatenate(out)


def split_proportions(proportions: np.ndarray, schema: Schema, n_bins: int,
                      resolution: str = "bins") -> dict[str, np.ndarray]:
    """Cut the concatenated proportions into one block per column name (its link cells)."""
    sizes = link_sizes(schema, n_bins, resolution)
    p = _vector(proportions, "proportions", sum(sizes))
    blocks: dict[str, np.ndarray] = {}
    start = 0
    for col, size in zip(schema.columns, sizes, strict=True):
        blocks[col.name] = p[start:start + size]
        start += size
    return blocks


def links_from_proportions(schema: Schema, proportions: np.ndarray, n_bins: int,
                           continuous_link: str = "quantile",
                           resolution: str = "bins") -> LatentLinks:
    """Build every link from DP proportions (post-processing, deterministic).

    Continuous columns get a :class:`~dpfed.common.synth.quantile_link.QuantileLink` on their
    cells (``continuous_link="quantile"``) or the identity link with the DP mean/sd of that
    density (``"identity"``); ordinal columns the threshold link; nominal the probit link.
    """
    kind = check_choice(continuous_link, "continuous_link", CONTINUOUS_LINKS)
    layout = check_resolution(resolution)
    blocks = split_proportions(proportions, schema, n_bins, layout)
    cells = _cells(schema, n_bins, layout)
    links: list[Link] = []
    for col in schema.columns:
        p = blocks[col.name]
        if isinstance(col, ContinuousColumn):
            q = QuantileLink(col, proportions=p, cells=cells[col.name])
            links.append(q if kind == "quantile" else identity_link_from_bins(col, p, q))
        elif isinstance(col, OrdinalColumn):
            links.append(OrdinalLink(col, p))
        else:
            assert isinstance(col, NominalColumn)
            links.append(NominalLink(col, p))
    return LatentLinks(schema, tuple(links))


def links_digest(schema: Schema, proportions: np.ndarray, n_bins: int,
                 continuous_link: str, resolution: str = "bins") -> str:
    """SHA-256 over everything that defines the links (schema, kind, layout, proportions).

    The "bins" layout hashes as it did before ``resolution`` existed (resumed jobs match).
    """
    h = hashlib.sha256()
    h.update(schema.digest().encode())
    h.update(f"|{continuous_link}|{int(n_bins)}|".encode())
    if check_resolution(resolution) != "bins":
        h.update(f"{resolution}|{sub_bins(schema, n_bins)}|".encode())
    h.update(np.ascontiguousarray(proportions, dtype="<f8").tobytes())
    return h.hexdigest()


def link_round_cost(schema: Schema, epsilon: float, delta: float) -> PrivacyCost:
    """Cost of the link round at one site (before any noise is drawn)."""
    return link_histogram_mechanism(schema, epsilon, delta).cost()


def expected_proportion_error(schema: Schema, n_bins: int, *, epsilon: float, delta: float,
                              row_counts: list[int],
                              pooled_sigma: np.ndarray | float | None = None,
                              resolution: str = "bins") -> tuple[str, float]:
    """Return the worst column's expected L1 error of its pooled DP proportions.

    With per-site noise ``sigma_j`` per (coarse) cell of column ``j`` (:func:`link_noise_sd`),
    ``S`` sites and ``N`` pooled rows, a column of ``M`` cells has an expected L1 error of its
    counts of ``M sigma_j sqrt(S) sqrt(2/pi)``, i.e. about that divided by ``N`` on its
    proportions. ``pooled_sigma`` (secure aggregation) is the standard deviation, per column
    or for all, of the one noise draw the pooled sum carries instead. Under "fine" ``M`` is
    the coarse cells (the leaves only refine them). Returns (column name, error); used to
    refuse budgets too small for the schema's cells before anything is charged.
    """
    if not row_counts or min(row_counts) < 1:
        raise ValidationError("need the sites' (positive) row counts")
    sizes = _coarse_sizes(schema, n_bins, check_resolution(resolution))
    if pooled_sigma is None:
        spreads = (link_noise_sd(schema, n_bins, epsilon, delta, resolution)
                   * math.sqrt(len(row_counts)))
    else:
        spreads = np.broadcast_to(np.asarray(pooled_sigma, dtype=np.float64), (len(sizes),))
    n = float(sum(row_counts))
    worst = ("", 0.0)
    for col, size, spread in zip(schema.columns, sizes, spreads, strict=True):
        err = size * float(spread) * math.sqrt(2.0 / math.pi) / n
        if err > worst[1]:
            worst = (col.name, err)
    return worst
