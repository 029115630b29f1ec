"""DP 2-way marginals of privately chosen column pairs, and the correction fitting rows to them.

A Gaussian copula carries every dependence between two columns through one latent
correlation, so some pairs are out of its reach: a category that exists only when another
column says so (a cause of death only for the dead), a follow-up time bounded by the year of
enrolment. MST (McKenna, Miklau & Sheldon 2021) and AIM measure such pairs directly as 2-way
marginals. dpfed keeps its factor model and adds two rounds and one post-processing step:

``pair_scores`` (site)
    For every column pair ``(a, b)``, the L1 distance between the site's 2-way table on the
    :class:`PairGrid` cells and the independence table ``N_s p_a p_b`` of the DP 1-way
    marginals the links carry (:func:`dependence_scores`), plus Gaussian noise
    (:func:`score_mechanism`). A large score says "this pair is far from independent".
``pairs`` (site)
    The coordinator picks a maximum-weight spanning forest of the summed noisy scores
    (:func:`choose_forest`, at most ``max_pairs`` edges, MST's choice); every site releases
    the forest's 2-way tables with Gaussian noise (:func:`pair_table_mechanism`).
Correction (coordinator, post-processing)
    The summed tables are projected onto the public row count and raked to the DP 1-way
    marginals (:func:`fit_pair_tables`). :class:`PairCorrection` then fits generated rows to
    them edge by edge, parents before children: in every parent cell it moves just enough of
    the child's rows from cells where the model has too many to cells where it has too few
    (the smallest change in distribution that makes the pair's table exact), redrawing a
    moved row's child value inside its new cell from the DP 1-way proportions. Each row is
    corrected on its own, so generation stays streamed; rows never moved keep every
    dependence the factor model gave them.

Cells. :class:`PairGrid` coarsens each column's link cells (public bins of a continuous
column, levels of an ordinal one) into at most ``max_groups`` groups of about equal DP
probability; nominal columns keep their categories. The grid is a deterministic function of
the DP proportions, so site and coordinator build the same one from the links.

Privacy (replace-one at one site; ``N_s`` and the DP proportions are public)
    Scores: replacing one row moves one count down and one up in each pair's table; the
    independence table does not move (it depends on public values only), so each score moves
    by at most 2 (triangle inequality): L2 sensitivity ``2 sqrt(P)`` over the ``P`` pairs,
    L1 ``2 P``. Flooring to integers (secure sums) keeps the per-pair bound 2.
    Tables: one count down and one up in each of the ``K`` chosen tables: L2 ``sqrt(2 K)``,
    L1 ``2 K`` (the ``counts`` statistic of secure aggregation with ``C = K``).
    The choice of pairs, the raking and the correction are post-processing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import ContinuousColumn, NominalColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.privacy.mechanisms import GaussianMechanism
from dpfed.common.synth.column_cells import ColumnCells, schema_cells
from dpfed.common.synth.link_release import link_sizes, project_counts, split_proportions
from dpfed.common.synth.quantile_link import point_values
from dpfed.common.validation import check_finite_array, check_int

#: Default most groups per ordinal/continuous column in a pair table.
DEFAULT_GROUPS = 6
#: Most groups a caller may ask for.
MAX_GROUPS = 64
#: Replace-one sensitivity of one pair's dependence score (L1 distance of count tables).
SCORE_SENSITIVITY = 2.0
#: Most cells one pair table may have (keeps tables and the correction's arrays small).
MAX_PAIR_CELLS = 4096
#: Most raking sweeps (it stops earlier once both margins hold to :data:`_RAKE_TOL`).
_RAKE_STEPS = 10_000
_RAKE_TOL = 1e-10
#: Weight of the independence table mixed into a projected pair table before raking:
#: every cell keeps some mass, so raking can reach every DP margin (a group the
#: projection emptied would otherwise stay empty), while the noisy table dominates.
INDEPENDENCE_WEIGHT = 1e-3

Pair = tuple[int, int]


@dataclass(frozen=True, eq=False)
class PairGrid:
    """Cells of the pair tables: every column's link cells merged into groups.

    Attributes
    ----------
    schema, n_bins
        The table's schema and the links' public bins per continuous column.
    groups : tuple of ndarray
        Per column, the group of each link cell (0..size-1, non-decreasing for ordered columns).
    max_groups : int
        The most groups of an ordinal or continuous column (the grid's one parameter).
    resolution : str
        The links' layout (:mod:`dpfed.common.synth.column_cells`): a continuous column's link
        cells are its leaves.
    """

    schema: Schema
    n_bins: int
    groups: tuple[np.ndarray, ...]
    max_groups: int
    resolution: str = "bins"
    sizes: tuple[int, ...] = field(init=False)
    _cells: dict[str, ColumnCells] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Computed once: callers read the sizes once per pair (O(columns^2) reads).
        object.__setattr__(self, "sizes", tuple(int(m.max()) + 1 for m in self.groups))
        object.__setattr__(self, "_cells", schema_cells(self.schema, self.n_bins,
                                                        self.resolution))

    @classmethod
    def from_proportions(cls, schema: Schema, proportions: np.ndarray, n_bins: int,
                         max_groups: int = DEFAULT_GROUPS, resolution: str = "bins") -> PairGrid:
        """Group each ordered column's cells into about equally likely groups (post-processing).

        Ordinal and continuous columns with more than ``max_groups`` cells are cut at the
        ``j / max_groups`` quantiles of their DP proportions (a cell goes to the group of its
        midpoint); nominal columns keep one group per category. A column's missing cell
        (``missing_cell``) is a group of its own, after its values' groups.
        """
        g = check_int(max_groups, "pair_groups", minimum=2, maximum=MAX_GROUPS)
        blocks = split_proportions(proportions, schema, n_bins, resolution)
        maps = []
        for col in schema.columns:
            p = np.asarray(blocks[col.name], dtype=np.float64)
            if isinstance(col, NominalColumn):
                maps.append(np.arange(p.size, dtype=np.intp))
                continue
            values = _value_groups(p[:-1] if col.missing_cell else p, g)
            if col.missing_cell:
                values = np.append(values, values[-1] + 1)
            maps.append(values)
        return cls(schema, int(n_bins), tuple(maps), g, resolution)

    def all_pairs(self) -> list[Pair]:
        """Every column pair ``(a, b)``, ``a < b``, in lexicographic order."""
        return list(itertools.combinations(range(len(self.schema.columns)), 2))

    def candidate_pairs(self) -> list[Pair]:
        """Return the pairs whose table has at most :data:`MAX_PAIR_CELLS` cells.

        Linear in the number of pairs (the sizes are computed once).
        """
        s = self.sizes
        return [(a, b) for a, b in self.all_pairs() if s[a] * s[b] <= MAX_PAIR_CELLS]

    def cells(self, pair: Pair) -> int:
        """Cells of one pair's table."""
        s = self.sizes
        return s[pair[0]] * s[pair[1]]

    def column_cells(self, column: int) -> ColumnCells:
        """Return the public cells of continuous column ``column`` (index)."""
        return self._cells[self.schema.columns[column].name]

    def fine_codes(self, table: EncodedTable) -> list[np.ndarray]:
        """Link cell of every value (a continuous column's leaf, codes otherwise)."""
        if table.schema.digest() != self.schema.digest():
            raise ValidationError("chunk was encoded with a different schema")
        out = []
        for col in self.schema.columns:
            values = table.columns[col.name]
            out.append(self._cells[col.name].codes(values) if isinstance(col, ContinuousColumn)
                       else np.asarray(values, dtype=np.intp))
        return out

    def group_codes(self, fine: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Group of every value, from :meth:`fine_codes`."""
        return [m[f] for m, f in zip(self.groups, fine, strict=True)]

    def group_proportions(self, proportions: np.ndarray) -> list[np.ndarray]:
        """Return the DP 1-way proportions summed over each column's groups."""
        blocks = split_proportions(proportions, self.schema, self.n_bins, self.resolution)
        return [np.bincount(m, weights=blocks[c.name], minlength=s)
                for c, m, s in zip(self.schema.columns, self.groups, self.sizes, strict=True)]


def _value_groups(p: np.ndarray, g: int) -> np.ndarray:
    """Group of every cell of an ordered column: ``g`` about equally likely runs of cells."""
    if p.size <= g:
        return np.arange(p.size, dtype=np.intp)
    total = float(p.sum())
    mid = (np.cumsum(p) - p / 2.0) / (total if total > 0 else 1.0)
    raw = np.minimum((mid * g).astype(np.intp), g - 1)
    _, dense = np.unique(raw, return_inverse=True)
    return np.asarray(dense, dtype=np.intp)


def check_pairs(pairs: Iterable[Sequence[int]], n_columns: int) -> list[Pair]:
    """Validate column pairs (distinct indices in range, no pair twice)."""
    out: list[Pair] = []
    seen = set()
    for raw in pairs:
        if not isinstance(raw, Sequence | np.ndarray) or isinstance(raw, str) or len(raw) != 2:
            raise ValidationError(f"a column pair has two indices, got {raw!r}")
        a = check_int(raw[0], "pair column", minimum=0, maximum=n_columns - 1)
        b = check_int(raw[1], "pair column", minimum=0, maximum=n_columns - 1)
        key = (min(a, b), max(a, b))
        if a == b or key in seen:
            raise ValidationError(f"column pairs must be distinct pairs of distinct columns, "
                                  f"got {list(raw)!r} twice or with itself")
        seen.add(key)
        out.append((a, b))
    return out


def check_edges(edges: Iterable[Sequence[int]], n_columns: int) -> list[Pair]:
    """Validate correction edges: (parent, child) pairs in the order they are applied.

    Every column is the child of at most one edge (a second edge would undo the first), and
    a parent that is some edge's child comes after that edge (its values are final before a
    child is fitted to them) -- the order :func:`choose_forest` returns.
    """
    checked = check_pairs(edges, n_columns)
    children: set[int] = set()
    for _, child in checked:
        if child in children:
            raise ValidationError(f"column {child} is the child of two pair edges; every "
                                  f"column may be the child of at most one")
        children.add(child)
    later = [b for _, b in checked]
    for i, (parent, _) in enumerate(checked):
        if parent in later[i:]:
            raise ValidationError(f"pair edge {checked[i]} comes before the edge that fits its "
                                  f"parent column {parent}; edges must list parents first")
    return checked


class PairTableAccumulator:
    """Exact 2-way count tables of the given pairs over streamed chunks (site-internal)."""

    def __init__(self, grid: PairGrid, pairs: Sequence[Pair]) -> None:
        self.grid = grid
        self.pairs = check_pairs(pairs, len(grid.schema.columns))
        self.cells = [grid.cells(p) for p in self.pairs]
        self.counts = np.zeros(sum(self.cells), dtype=np.int64)
        self.n_rows = 0

    def add(self, table: EncodedTable) -> None:
        """Add one encoded chunk."""
        codes = self.grid.group_codes(self.grid.fine_codes(table))
        sizes = self.grid.sizes
        start = 0
        for (a, b), n_cells in zip(self.pairs, self.cells, strict=True):
            idx = codes[a] * sizes[b] + codes[b]
            self.counts[start:start + n_cells] += np.bincount(idx, minlength=n_cells)
            start += n_cells
        self.n_rows += table.n_rows

    def tables(self) -> list[np.ndarray]:
        """Return the counts cut into one flat table per pair."""
        return split_tables(self.counts, self.cells)


def split_tables(vector: np.ndarray, cells: Sequence[int]) -> list[np.ndarray]:
    """Cut a concatenated vector into one block per pair (sizes checked)."""
    v = np.asarray(vector)
    if v.ndim != 1 or v.shape[0] != sum(cells):
        raise ValidationError(f"pair tables must be a vector of {sum(cells)} cells, got shape "
                              f"{v.shape}")
    bounds = np.cumsum([0, *cells])
    return [v[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def dependence_scores(counts: np.ndarray, grid: PairGrid, pairs: Sequence[Pair],
                      proportions: np.ndarray, n_rows: int) -> np.ndarray:
    """Per pair, ``sum |n_ab - N_s p_a p_b|`` (site-internal, never sent without noise).

    ``counts`` are the exact tables of ``pairs`` (:class:`PairTableAccumulator`; the
    candidates are :meth:`PairGrid.candidate_pairs`), ``p`` the DP 1-way proportions of the
    links (grouped) and ``N_s`` the site's public row count.
    """
    tables = split_tables(counts, [grid.cells(p) for p in pairs])
    marg = grid.group_proportions(proportions)
    n = float(n_rows)
    return np.array([float(np.abs(t - n * np.outer(marg[a], marg[b]).ravel()).sum())
                     for (a, b), t in zip(pairs, tables, strict=True)])


def score_mechanism(n_pairs: int, epsilon: float, delta: float) -> GaussianMechanism:
    """Gaussian mechanism of the dependence scores: L2 sensitivity ``2 sqrt(P)``.

    Privacy
    -------
    Relation: replace-one row at this site (``N_s`` and the DP proportions public).
    Sensitivity: each of the ``P`` scores moves by at most :data:`SCORE_SENSITIVITY` (one
    count down and one up in its table; the independence table is fixed), so L2
    ``2 sqrt(P)``. Calibration: analytic Gaussian for (epsilon, delta) on every score.
    """
    p = check_int(n_pairs, "number of pairs", minimum=1)
    return GaussianMechanism(epsilon, delta, SCORE_SENSITIVITY * math.sqrt(p))


def pair_table_mechanism(n_pairs: int, epsilon: float, delta: float) -> GaussianMechanism:
    """Gaussian mechanism of ``K`` pair tables: L2 sensitivity ``sqrt(2 K)``.

    Privacy
    -------
    Relation: replace-one row at this site. Sensitivity: one count down and one up in each
    of the ``K`` tables (the row is in exactly one cell of each), so L2 ``sqrt(2 K)``.
    Calibration: analytic Gaussian for (epsilon, delta) on every cell.
    """
    k = check_int(n_pairs, "number of pairs", minimum=1)
    return GaussianMechanism(epsilon, delta, math.sqrt(2.0 * k))


#: Expected L1 error of a typical pair table (in proportions) above which the pair tables are
#: mostly noise: the correction then leaves most pairs at the model's tables, and the budget
#: they took from the links is better left there (``--pairs 0``).
NOISY_PAIR_TABLES = 1.0


def typical_pair_cells(schema: Schema, n_bins: int, max_groups: int) -> int:
    """Median cells of a candidate pair table, from the schema alone (before any release).

    An ordinal or continuous column has at most ``max_groups`` groups (fewer levels or bins
    if it has fewer), a nominal column one per category; pairs above
    :data:`MAX_PAIR_CELLS` are not candidates.
    """
    sizes = [min(s, max_groups) if not isinstance(c, NominalColumn) else s
             for c, s in zip(schema.columns, link_sizes(schema, n_bins), strict=True)]
    cells = [a * b for a, b in itertools.combinations(sizes, 2) if a * b <= MAX_PAIR_CELLS]
    return int(np.median(cells)) if cells else 0


def expected_pair_table_error(cells: int, pooled_sigma: float, n_rows: int) -> float:
    """Return the expected L1 error, in proportions, of a pair table of ``cells`` cells.

    ``pooled_sigma`` is the noise's standard deviation on every summed cell (``sqrt(S)``
    times one site's Gaussian sigma at site level; the Skellam noise's under secure
    aggregation) and ``n_rows`` the public pooled row count: ``cells sigma sqrt(2/pi) / N``.
    """
    n = check_int(n_rows, "n_rows", minimum=1)
    return float(cells) * float(pooled_sigma) * math.sqrt(2.0 / math.pi) / n


def choose_forest(scores: np.ndarray, pairs: Sequence[Pair], n_columns: int,
                  max_pairs: int) -> list[Pair]:
    """Maximum-weight spanning forest of the noisy scores, as (parent, child) edges.

    Kruskal on the scores of ``pairs`` (the candidates that were scored), stopped after
    ``max_pairs`` edges; every tree is then oriented from its best-connected column outwards,
    and the edges are returned parents first (the order :class:`PairCorrection` applies them in).
    Post-processing of the noisy scores.
    """
    d = check_int(n_columns, "number of columns", minimum=2)
    k = check_int(max_pairs, "pairs", minimum=0)
    pairs = check_pairs(pairs, d)
    s = check_finite_array(scores, "pair scores", ndim=1)
    if s.shape[0] != len(pairs):
        raise ValidationError(f"need {len(pairs)} pair scores, got {s.shape[0]}")
    parent = list(range(d))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    edges: list[Pair] = []
    for i in np.argsort(-s, kind="stable"):
        if len(edges) >= k:
            break
        a, b = pairs[int(i)]
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[ra] = rb
            edges.append((a, b))
    adjacent: dict[int, list[int]] = {i: [] for i in range(d)}
    for a, b in edges:
        adjacent[a].append(b)
        adjacent[b].append(a)
    seen: set[int] = set()
    ordered: list[Pair] = []
    for start in sorted(range(d), key=lambda i: (-len(adjacent[i]), i)):
        if start in seen:
            continue
        seen.add(start)
        queue = [start]
        while queue:
            x = queue.pop(0)
            for y in sorted(adjacent[x]):
                if y not in seen:
                    seen.add(y)
                    ordered.append((x, y))
                    queue.append(y)
    return ordered


def rake_table(table: np.ndarray, rows: np.ndarray, cols: np.ndarray,
               steps: int = _RAKE_STEPS) -> np.ndarray:
    """Rake a non-negative table to row and column sums (iterative proportional fitting).

    Stops after ``steps`` sweeps or once the row sums are within :data:`_RAKE_TOL` of
    ``rows`` (the column sums hold exactly after every sweep). A row or column without any
    mass cannot be raked up: callers give every cell some mass (:func:`fit_pair_tables`).
    """
    t = np.array(table, dtype=np.float64)
    for _ in range(steps):
        s = t.sum(axis=1)
        t *= np.divide(rows, s, out=np.zeros_like(s), where=s > 0)[:, None]
        s = t.sum(axis=0)
        t *= np.divide(cols, s, out=np.zeros_like(s), where=s > 0)[None, :]
        if float(np.abs(t.sum(axis=1) - rows).max(initial=0.0)) <= _RAKE_TOL:
            break
    return t


def fit_pair_tables(total: np.ndarray, grid: PairGrid, pairs: Sequence[Pair],
                    proportions: np.ndarray, n_rows: float) -> list[np.ndarray]:
    """Turn summed noisy tables into joint proportions per pair, shape (k_a, k_b).

    Each table is projected onto the non-negative counts summing to the public ``n_rows``
    (:func:`dpfed.common.synth.link_release.project_counts`), mixed with a little
    (:data:`INDEPENDENCE_WEIGHT`) of the independence table of the DP 1-way proportions --
    the projection sets every cell whose noisy count falls below a threshold to 0, and a
    parent or child group left without any mass could never be raked back to its DP
    proportion -- and raked to the DP 1-way proportions (grouped), so the pair tables agree
    with the marginals the links release. Post-processing.
    """
    checked = check_pairs(pairs, len(grid.schema.columns))
    tables = split_tables(check_finite_array(total, "pair tables", ndim=1),
                          [grid.cells(p) for p in checked])
    marg = grid.group_proportions(proportions)
    sizes = grid.sizes
    out = []
    for (a, b), t in zip(checked, tables, strict=True):
        counts = project_counts(t, float(n_rows)).reshape(sizes[a], sizes[b])
        start = ((1.0 - INDEPENDENCE_WEIGHT) * counts / max(float(n_rows), 1.0)
                 + INDEPENDENCE_WEIGHT * np.outer(marg[a], marg[b]))
        joint = rake_table(start, marg[a], marg[b])
        s = float(joint.sum())
        out.append(joint / s if s > 0 else np.outer(marg[a], marg[b]))
    return out


def shrunk_target(target: np.ndarray, model: np.ndarray, noise_sd: float) -> np.ndarray:
    """Shrink a released joint table towards the model's by the noise it carries.

    With ``D = sum (target - model)^2`` over the ``m`` cells and ``m noise_sd^2`` the part of
    it the noise explains on average, the kept share is ``w = max(0, 1 - m noise_sd^2 / D)``
    (a James-Stein-type estimate of how much of the difference is real) and the result is
    ``model + w (target - model)``, renormalised. ``noise_sd = 0`` returns ``target``.
    Post-processing of DP releases and public noise levels.
    """
    t = np.asarray(target, dtype=np.float64)
    sd = float(noise_sd)
    if not (math.isfinite(sd) and sd >= 0.0):
        raise ValidationError(f"noise_sd must be finite and >= 0, got {noise_sd!r}")
    if sd == 0.0:
        return t
    q = np.asarray(model, dtype=np.float64)
    diff = float(((t - q) ** 2).sum())
    if diff <= 0.0:
        return t
    w = max(0.0, 1.0 - t.size * sd * sd / diff)
    out = np.clip(q + w * (t - q), 0.0, None)
    total = float(out.sum())
    return out / total if total > 0 else t


@dataclass(frozen=True, eq=False)
class PairStep:
    """One edge of the correction.

    In parent group i, a child row in group j moves with probability ``move[i, j]`` to a
    group drawn from ``dest[i]``.
    """

    parent: int
    child: int
    move: np.ndarray
    dest: np.ndarray


def _move_rows(step: PairStep, groups: dict[int, np.ndarray],
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Apply one step to the group codes (the child's updated in place).

    Returns the moved rows and their new child groups.
    """
    ga, gb = groups[step.parent], groups[step.child]
    k = step.move.shape[1]
    flat_move = step.move.ravel()
    cell = ga * k
    cell += gb
    # Only rows in cells with something to move draw a uniform (most cells move nothing).
    candidates = np.flatnonzero((flat_move > 0.0)[cell])
    moved = candidates[rng.random(candidates.size) < flat_move[cell[candidates]]]
    if moved.size == 0:
        return moved, np.zeros(0, dtype=np.int32)
    cum = np.cumsum(step.dest[ga[moved]], axis=1)
    u = rng.random(moved.size)[:, None] * cum[:, -1:]
    new_group = np.minimum((u > cum).sum(axis=1), k - 1).astype(np.int32)
    gb[moved] = new_group
    return moved, new_group


@dataclass(frozen=True)
class _Redraw:
    """One column's public tables for redrawing a moved row's cell inside its new group."""

    keys: np.ndarray         # group + cumulative DP share of each cell inside its group
    first: np.ndarray        # first cell of every group
    last: np.ndarray         # last cell of every group
    edges: np.ndarray | None  # continuous: the lowest value of every group but the first
    points: np.ndarray | None  # continuous: point-mass values of the cells (NaN: none)


@dataclass(frozen=True, eq=False)
class PairCorrection:
    """Fits rows to DP pair tables edge by edge (see the module docstring); post-processing.

    Attributes
    ----------
    grid : PairGrid
    steps : tuple of PairStep
        In application order (parents before children).
    proportions : ndarray
        The DP 1-way proportions (concatenated link cells) a moved value is redrawn from.
    """

    grid: PairGrid
    steps: tuple[PairStep, ...]
    proportions: np.ndarray
    _redraw: dict[int, _Redraw] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Built once per model: every generated chunk reuses them.
        grid = self.grid
        blocks = split_proportions(self.proportions, grid.schema, grid.n_bins, grid.resolution)
        columns = {c for step in self.steps for c in (step.parent, step.child)}
        tables = {}
        for j in sorted(columns):
            col = grid.schema.columns[j]
            members = grid.groups[j]
            p = np.clip(np.asarray(blocks[col.name], dtype=np.float64), 0.0, None)
            # Groups of an ordered column are runs of consecutive cells, so ``group +
            # (cumulative share of the cell inside its group)`` increases along the cells:
            # one searchsorted draws every row's cell inside its group.
            n_groups = int(members.max()) + 1
            per_group = np.bincount(members, weights=p, minlength=n_groups)
            share = np.divide(p, per_group[members], out=np.zeros_like(p),
                              where=per_group[members] > 0)
            runs = np.bincount(members, minlength=n_groups)
            flat = per_group[members] <= 0  # a group without DP mass: uniform over its cells
            share[flat] = 1.0 / runs[members[flat]]
            start = np.concatenate([[0], np.cumsum(runs)[:-1]])
            cum = np.cumsum(share)
            within = cum - (cum[start] - share[start])[members]
            edges = points = None
            if isinstance(col, ContinuousColumn):
                cells = grid.column_cells(j)
                edges = cells.lo[start[1:]]
                points = point_values(cells, p)
            tables[j] = _Redraw(members + np.minimum(within, 1.0) - 1e-12, start,
                                start + runs - 1, edges, points)
        object.__setattr__(self, "_redraw", tables)

    @classmethod
    def fit(cls, grid: PairGrid, edges: Sequence[Pair], tables: Sequence[np.ndarray],
            calibration: EncodedTable, proportions: np.ndarray,
            rng: np.random.Generator, *, noise_sd: float = 0.0) -> PairCorrection:
        """Build the steps on ``calibration`` rows drawn from the model (post-processing).

        ``edges`` are (parent, child) in application order (:func:`choose_forest`), each with
        its joint proportions in ``tables`` (:func:`fit_pair_tables`), shape
        ``(groups of parent, groups of child)``.

        ``noise_sd`` is the public standard deviation of the noise on every cell of the
        released tables, in proportions (pooled noise sd / pooled N). Each target is then
        shrunk towards the model's own table by the share of their squared difference that
        the noise does not explain (:func:`shrunk_target`): a pair the model already gets
        right up to noise is left alone instead of being fitted to noise.
        """
        checked = check_edges(edges, len(grid.schema.columns))
        if len(tables) != len(checked):
            raise ValidationError(f"{len(checked)} edges but {len(tables)} tables")
        sizes = grid.sizes
        marg = grid.group_proportions(proportions)
        fine = grid.fine_codes(calibration)
        groups = {c: np.asarray(grid.groups[c][f], dtype=np.int32) for c, f in
                  enumerate(fine)}
        steps: list[PairStep] = []
        for (a, b), joint in zip(checked, tables, strict=True):
            target = np.asarray(joint, dtype=np.float64)
            if target.shape != (sizes[a], sizes[b]):
                raise ValidationError(f"table of pair ({a}, {b}) has shape {target.shape}, "
                                      f"expected {(sizes[a], sizes[b])}")
            ga, gb = groups[a], groups[b]
            model = np.bincount(ga * sizes[b] + gb, minlength=sizes[a] * sizes[b]).reshape(
                sizes[a], sizes[b]) / max(calibration.n_rows, 1)
            # The rows decode to the DP 1-way marginals (exactly in distribution) and every
            # step keeps them, so only the rows' dependence is estimated from them: their
            # table raked to those marginals has no sampling error in its margins, which
            # the moves (and the shrinkage towards it) would otherwise copy into every
            # generated table.
            model = rake_table(model, marg[a], marg[b])
            target = shrunk_target(target, model, noise_sd)
            move = np.divide(target, model, out=np.ones_like(model), where=model > 0)
            move = np.clip(1.0 - move, 0.0, 1.0)
            deficit = np.clip(target - model, 0.0, None)
            room = deficit.sum(axis=1, keepdims=True)
            dest = np.divide(deficit, room, out=np.full_like(deficit, 1.0 / sizes[b]),
                             where=room > 0)
            # Parent groups without deficit keep their rows (nothing to move to).
            move[room[:, 0] <= 0, :] = 0.0
            step = PairStep(a, b, move, dest)
            steps.append(step)
            _move_rows(step, groups, rng)
        return cls(grid, tuple(steps), np.asarray(proportions, dtype=np.float64))

    @property
    def edges(self) -> list[Pair]:
        """(parent, child) of every step."""
        return [(s.parent, s.child) for s in self.steps]

    def _groups(self, table: EncodedTable, column: int) -> np.ndarray:
        """Return the group of every value of one column (int32; from the values)."""
        col = self.grid.schema.columns[column]
        values = table.columns[col.name]
        redraw = self._redraw[column]
        if redraw.edges is None:
            return np.asarray(self.grid.groups[column][np.asarray(values, dtype=np.intp)],
                              dtype=np.int32)
        # The groups of a continuous column are runs of cells in value order: one search on
        # their lowest values (a value on a boundary opens the higher group, as its cell
        # does; the lower bound's point cell always belongs to the first group).
        assert isinstance(col, ContinuousColumn)
        if redraw.edges.shape[0] > 8:
            g = np.searchsorted(redraw.edges, values, side="right").astype(np.int32)
        else:  # a few groups: one comparison per edge is faster than a search
            g = np.zeros(values.shape[0], dtype=np.int32)
            for edge in redraw.edges:
                g += values >= edge
        g[values <= col.min] = 0
        if col.missing_cell:  # NaN: the missing cell, the last group
            g[np.isnan(values)] = self.grid.sizes[column] - 1
        return g

    def _draw_cell(self, column: int, group: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Draw a link cell inside each ``group`` from the DP 1-way proportions."""
        redraw = self._redraw[column]
        cells = np.searchsorted(redraw.keys, group + rng.random(group.shape[0]), side="left")
        # Rounding cannot leave the group: clip into its run of cells.
        return np.asarray(np.clip(cells, redraw.first[group], redraw.last[group]),
                          dtype=np.intp)

    def apply(self, table: EncodedTable, rng: np.random.Generator, *,
              in_place: bool = False) -> EncodedTable:
        """Return ``table`` with the correction applied (each row on its own).

        ``in_place``: write the moved values into ``table``'s own arrays (the sampler's
        freshly decoded chunks) instead of copies of the columns that change.
        """
        if not self.steps:
            return table
        grid = self.grid
        groups: dict[int, np.ndarray] = {}
        # Every column is the child of at most one step (a forest), so each moved set is final.
        changed: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for step in self.steps:
            for c in (step.parent, step.child):
                if c not in groups:
                    groups[c] = self._groups(table, c)
            moved, new_group = _move_rows(step, groups, rng)
            if moved.size:
                changed[step.child] = (moved, new_group)
        if not changed:
            return table
        columns = dict(table.columns)
        for j, (rows, new_group) in changed.items():
            col = grid.schema.columns[j]
            cells_drawn = self._draw_cell(j, new_group, rng)
            values = columns[col.name] if in_place else np.array(columns[col.name])
            if isinstance(col, ContinuousColumn):
                drawn = grid.column_cells(j).values(cells_drawn, rng.random(rows.size))
                points = self._redraw[j].points
                assert points is not None
                point = points[cells_drawn]  # point masses decode as the links do
                heaped = ~np.isnan(point)
                drawn[heaped] = point[heaped]
                values[rows] = drawn
            else:
                values[rows] = cells_drawn.astype(values.dtype)
            columns[col.name] = values
        return EncodedTable(table.schema, columns, table.n_rows)

    # ------------------------------------------------------------------ persistence
    def arrays(self) -> dict[str, np.ndarray]:
        """Return the steps as named arrays (edges; every step's move/dest tables flattened)."""
        if not self.steps:
            return {"pair_edges": np.zeros((0, 2), dtype=np.int64)}
        return {
            "pair_edges": np.array(self.edges, dtype=np.int64),
            "pair_move": np.concatenate([s.move.ravel() for s in self.steps]),
            "pair_dest": np.concatenate([s.dest.ravel() for s in self.steps]),
        }

    @classmethod
    def from_arrays(cls, grid: PairGrid, arrays: dict[str, np.ndarray],
                    proportions: np.ndarray) -> PairCorrection:
        """Rebuild from :meth:`arrays` (shapes and values checked)."""
        raw = np.asarray(arrays.get("pair_edges", np.zeros((0, 2))))
        if raw.ndim != 2 or raw.shape[1] != 2:
            raise ValidationError(f"pair_edges must have shape (edges, 2), got {raw.shape}")
        edges = check_edges(raw.tolist(), len(grid.schema.columns))
        if not edges:
            return cls(grid, (), np.asarray(proportions, dtype=np.float64))
        sizes = grid.sizes
        cells = [sizes[a] * sizes[b] for a, b in edges]
        move = split_tables(check_finite_array(arrays.get("pair_move"), "pair_move", ndim=1),
                            cells)
        dest = split_tables(check_finite_array(arrays.get("pair_dest"), "pair_dest", ndim=1),
                            cells)
        steps = []
        for (a, b), m, t in zip(edges, move, dest, strict=True):
            if np.any(m < 0) or np.any(m > 1) or np.any(t < 0):
                raise ValidationError(f"pair correction of ({a}, {b}) has values out of range")
            steps.append(PairStep(a, b, m.reshape(sizes[a], sizes[b]),
                                  t.reshape(sizes[a], sizes[b])))
        return cls(grid, tuple(steps), np.asarray(proportions, dtype=np.float64))
