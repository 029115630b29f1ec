"""A small declarative language of counting queries over the federation schema.

Analysts describe *what to count*, never code: a query set is plain data (TOML or JSON),
validated against the public schema before anything is sent or charged, and each site turns
it into counts over its own rows with vectorised numpy (no ``eval``, no SQL). The format
(predicate queries, ``per`` and ``cross`` shorthands, predicates) and its limits:
docs/queries.md, "The query language". A predicate no schema-valid row satisfies is refused
as contradictory; the check is exact because predicates are piecewise constant on a finite
grid of representative values per column. :meth:`CompiledQuerySet.counts` streams encoded
chunks: predicate queries become boolean masks, shorthands one ``np.bincount``.
"""

from __future__ import annotations

import itertools
import json
import math
import tomllib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import (
    Column,
    ContinuousColumn,
    NominalColumn,
    OrdinalColumn,
    Schema,
)
from dpfed.common.errors import ValidationError

__all__ = [
    "MAX_CELLS",
    "MAX_GRID_WORK",
    "MAX_QUERIES",
    "MAX_SET_NODES",
    "CompiledQuerySet",
    "Domain",
    "Predicate",
    "compile_query_set",
    "load_query_file",
    "parse_domain",
]

#: Most counts one query set may produce (bounds the task and each site's work).
MAX_QUERIES = 20_000
#: Most cells of one shorthand or domain (cross products grow fast).
MAX_CELLS = 20_000
#: Largest predicate nesting depth and number of nodes, and most nodes in one query set.
MAX_DEPTH = 16
MAX_NODES = 512
MAX_SET_NODES = 10_000
#: Representative grid points above which satisfiability is not decided (then accepted).
_MAX_GRID = 200_000
#: Most grid work (grid points x predicate nodes) spent deciding satisfiability or implication
#: for one query set (about a second of numpy); the rest is not decided.
MAX_GRID_WORK = 50_000_000


class GridBudget:
    """What is left of ``MAX_GRID_WORK`` for one query set (or one chain check)."""

    def __init__(self, work: int = MAX_GRID_WORK) -> None:
        self.left = work

    def spend(self, work: int) -> bool:
        """Take ``work`` if that much is left; False (and nothing taken) otherwise."""
        if work > self.left:
            return False
        self.left -= work
        return True

OPS: tuple[str, ...] = ("<", "<=", ">", ">=", "==", "!=")
_LOGIC = ("all", "any", "not")


# --------------------------------------------------------------------------- predicates


@dataclass(frozen=True)
class Predicate:
    """A validated predicate node (canonical, JSON-serialisable via :meth:`to_json`).

    ``kind`` is ``"cmp"`` (column, op, value), ``"in"`` (column, codes), ``"all"``, ``"any"``
    or ``"not"`` (children), or ``"true"``. Continuous values are floats; ordinal and
    nominal values are stored as integer codes.
    """

    kind: str
    column: str = ""
    op: str = ""
    value: float = 0.0
    codes: tuple[int, ...] = ()
    children: tuple[Predicate, ...] = ()

    def size(self) -> int:
        """Return the number of nodes (one evaluation costs that many array operations)."""
        return 1 + sum(c.size() for c in self.children)

    def columns(self) -> set[str]:
        """Columns the predicate reads."""
        out = {self.column} if self.column else set()
        for c in self.children:
            out |= c.columns()
        return out

    def constants(self) -> dict[str, set[float]]:
        """Comparison constants per continuous column (for the satisfiability grid)."""
        out: dict[str, set[float]] = {}
        if self.kind == "cmp":
            out.setdefault(self.column, set()).add(self.value)
        for c in self.children:
            for k, v in c.constants().items():
                out.setdefault(k, set()).update(v)
        return out

    def evaluate(self, table: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        """Boolean mask of the rows of ``table`` (column name -> array) that satisfy it."""
        if self.kind == "true":
            return np.ones(n, dtype=bool)
        if self.kind == "cmp":
            x = table[self.column]
            v = self.value
            if self.op == "<":
                return np.asarray(x < v)
            if self.op == "<=":
                return np.asarray(x <= v)
            if self.op == ">":
                return np.asarray(x > v)
            if self.op == ">=":
                return np.asarray(x >= v)
            if self.op == "==":
                return np.asarray(x == v)
            return np.asarray(x != v)
        if self.kind == "in":
            return np.isin(table[self.column], np.asarray(self.codes))
        if self.kind == "not":
            return ~self.children[0].evaluate(table, n)
        masks = (c.evaluate(table, n) for c in self.children)
        if self.kind == "all":
            out = np.ones(n, dtype=bool)
            for m in masks:
                out &= m
            return out
        out = np.zeros(n, dtype=bool)
        for m in masks:
            out |= m
        return out

    def to_json(self) -> Any:
        """Canonical plain-data form (codes, not labels)."""
        if self.kind == "true":
            return {"true": True}
        if self.kind == "cmp":
            return {"column": self.column, "op": self.op, "value": self.value}
        if self.kind == "in":
            return {"column": self.column, "in_codes": list(self.codes)}
        if self.kind == "not":
            return {"not": self.children[0].to_json()}
        return {self.kind: [c.to_json() for c in self.children]}


TRUE = Predicate("true")


class _Parser:
    """Turns raw predicate data into :class:`Predicate` nodes, naming the query on error."""

    def __init__(self, schema: Schema, query: str) -> None:
        self.schema = schema
        self.by_name = {c.name: c for c in schema.columns}
        self.query = query
        self.nodes = 0

    def fail(self, msg: str) -> ValidationError:
        return ValidationError(f"query {self.query!r}: {msg}")

    def column(self, name: Any) -> Column:
        if not isinstance(name, str) or name not in self.by_name:
            raise self.fail(f"unknown column {name!r}; the schema's columns are "
                            f"{list(self.schema.names)}")
        return self.by_name[name]

    def label_code(self, col: OrdinalColumn | NominalColumn, value: Any) -> int:
        labels = col.levels if isinstance(col, OrdinalColumn) else col.categories
        what = "level" if isinstance(col, OrdinalColumn) else "category"
        text = value
        if isinstance(value, float) and value.is_integer():
            text = str(int(value))
        elif isinstance(value, int) and not isinstance(value, bool):
            text = str(value)
        if not isinstance(text, str) or text not in labels:
            raise self.fail(f"column {col.name!r} ({col.type}) has no {what} {value!r}; valid: "
                            f"{list(labels)}")
        return labels.index(text)

    def number(self, col: ContinuousColumn, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"column {col.name!r} is continuous: compare it with a number, got "
                            f"{value!r}")
        v = float(value)
        if not math.isfinite(v):
            raise self.fail(f"column {col.name!r}: the value must be finite, got {value!r}")
        return v

    def parse(self, raw: Any, depth: int = 0) -> Predicate:
        self.nodes += 1
        if depth > MAX_DEPTH or self.nodes > MAX_NODES:
            raise self.fail(f"the predicate is too large (at most {MAX_NODES} nodes, nesting "
                            f"depth {MAX_DEPTH})")
        if not isinstance(raw, Mapping):
            raise self.fail(f"a predicate must be a table/object, got {type(raw).__name__} "
                            f"{raw!r}")
        logic = [k for k in _LOGIC if k in raw]
        if logic:
            if len(raw) != 1:
                raise self.fail(f"a {logic[0]!r} node takes no other keys, got {sorted(raw)}")
            key = logic[0]
            if key == "not":
                return Predicate("not", children=(self.parse(raw["not"], depth + 1),))
            items = raw[key]
            if not isinstance(items, list) or not items:
                raise self.fail(f"{key!r} needs a non-empty list of predicates, got {items!r}")
            return Predicate(key, children=tuple(self.parse(p, depth + 1) for p in items))
        if "column" not in raw:
            raise self.fail(f"a predicate needs 'column' (with 'op'/'value', 'in' or 'between') "
                            f"or one of {list(_LOGIC)}; got keys {sorted(raw)}")
        col = self.column(raw["column"])
        forms = [k for k in ("op", "in", "between") if k in raw]
        if len(forms) != 1:
            raise self.fail(f"column {col.name!r}: give exactly one of 'op' (with 'value'), 'in' "
                            f"or 'between', got keys {sorted(raw)}")
        form = forms[0]
        allowed = {"column", form} | ({"value"} if form == "op" else set())
        extra = sorted(set(raw) - allowed)
        if extra:
            raise self.fail(f"column {col.name!r}: unknown key(s) {extra}")
        if form == "op":
            return self._comparison(col, raw.get("op"), raw.get("value", None), "value" in raw)
        if form == "in":
            return self._membership(col, raw["in"])
        return self._between(col, raw["between"])

    def _comparison(self, col: Column, op: Any, value: Any, has_value: bool) -> Predicate:
        if op not in OPS:
            raise self.fail(f"column {col.name!r}: op must be one of {list(OPS)}, got {op!r}")
        if not has_value:
            raise self.fail(f"column {col.name!r}: op {op!r} needs a 'value'")
        if isinstance(col, ContinuousColumn):
            return Predicate("cmp", col.name, op, self.number(col, value))
        if isinstance(col, NominalColumn) and op not in ("==", "!="):
            raise self.fail(f"column {col.name!r} is nominal (unordered): use '==', '!=' or "
                            f"'in', not {op!r}")
        return Predicate("cmp", col.name, op, float(self.label_code(col, value)))

    def _membership(self, col: Column, values: Any) -> Predicate:
        if isinstance(col, ContinuousColumn):
            raise self.fail(f"column {col.name!r} is continuous: use 'op' or 'between', not 'in'")
        if not isinstance(values, list) or not values:
            raise self.fail(f"column {col.name!r}: 'in' needs a non-empty list, got {values!r}")
        codes = sorted({self.label_code(col, v) for v in values})
        return Predicate("in", col.name, codes=tuple(codes))

    def _between(self, col: Column, bounds: Any) -> Predicate:
        if isinstance(col, NominalColumn):
            raise self.fail(f"column {col.name!r} is nominal (unordered): use 'in', not "
                            "'between'")
        if not isinstance(bounds, list) or len(bounds) != 2:
            raise self.fail(f"column {col.name!r}: 'between' needs [low, high], got {bounds!r}")
        if isinstance(col, ContinuousColumn):
            lo, hi = self.number(col, bounds[0]), self.number(col, bounds[1])
        else:
            lo, hi = (float(self.label_code(col, b)) for b in bounds)
        if lo > hi:
            raise self.fail(f"column {col.name!r}: 'between' has low {bounds[0]!r} above high "
                            f"{bounds[1]!r}")
        return Predicate("all", children=(Predicate("cmp", col.name, ">=", lo),
                                          Predicate("cmp", col.name, "<=", hi)))


def _grid(schema: Schema, pred: Predicate) -> dict[str, np.ndarray] | None:
    """Return representative values per column read by ``pred`` (None when the grid is too big)."""
    consts = pred.constants()
    axes: dict[str, np.ndarray] = {}
    for name in sorted(pred.columns()):
        col = schema.column(name)
        if isinstance(col, ContinuousColumn):
            pts = {col.min, col.max} | {v for v in consts.get(name, set())
                                         if col.min <= v <= col.max}
            s = sorted(pts)
            mids = [(a + b) / 2 for a, b in itertools.pairwise(s)]
            axes[name] = np.array(sorted(set(s) | set(mids)), dtype=np.float64)
        elif isinstance(col, OrdinalColumn):
            axes[name] = np.arange(col.n_levels, dtype=np.float64)
        else:
            axes[name] = np.arange(col.n_categories, dtype=np.float64)
    size = math.prod(len(a) for a in axes.values()) if axes else 1
    if size > _MAX_GRID:
        return None
    return axes


def _grid_table(axes: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    if not axes:
        return {}, 1
    mesh = np.meshgrid(*axes.values(), indexing="ij")
    table = {k: m.ravel() for k, m in zip(axes, mesh, strict=True)}
    return table, int(mesh[0].size)


def satisfiable(schema: Schema, pred: Predicate,
                budget: GridBudget | None = None) -> bool | None:
    """True/False if some schema-valid row satisfies ``pred``; None if not decided.

    Exact: on each continuous column the predicate only changes value at its comparison
    constants, so it is constant between consecutive grid points (and the grid holds those
    points, the midpoints and the bounds); categorical columns are enumerated. Not decided
    when the grid is too big, or when its work (points x nodes) exceeds what is left of
    ``budget``.
    """
    axes = _grid(schema, pred)
    if axes is None:
        return None
    points = math.prod(len(a) for a in axes.values()) if axes else 1
    if budget is not None and not budget.spend(points * pred.size()):
        return None
    table, n = _grid_table(axes)
    return bool(pred.evaluate(table, n).any())


def implies(schema: Schema, a: Predicate, b: Predicate,
            budget: GridBudget | None = None) -> bool:
    """Return True only if every schema-valid row satisfying ``a`` satisfies ``b`` (exact)."""
    combined = Predicate("all", children=(a, Predicate("not", children=(b,))))
    return satisfiable(schema, combined, budget) is False


# --------------------------------------------------------------------------- domains


@dataclass(frozen=True)
class Domain:
    """A histogram domain: the cross product of 1-3 columns (continuous ones binned publicly).

    Attributes
    ----------
    columns : tuple of str
        The columns, in order (the histogram is the C-order flattening).
    edges : dict
        For continuous columns: the public bin edges (k+1 increasing numbers).
    shape : tuple of int
        Cells per column.
    labels : tuple of tuple of str
        Cell labels per column (categories, levels or ``[a, b)`` intervals).
    """

    columns: tuple[str, ...]
    edges: Mapping[str, tuple[float, ...]]
    shape: tuple[int, ...]
    labels: tuple[tuple[str, ...], ...]

    @property
    def n_cells(self) -> int:
        """Number of cells ``n``."""
        return math.prod(self.shape)

    def cell_names(self) -> list[str]:
        """One readable name per cell, e.g. ``ward=icu & severity=mild``."""
        parts = [[f"{c}={lab}" for lab in labs] for c, labs in zip(self.columns, self.labels,
                                                                    strict=True)]
        return [" & ".join(p) for p in itertools.product(*parts)]

    def cell_index(self, table: Mapping[str, np.ndarray]) -> np.ndarray:
        """C-order cell index of every row (int64)."""
        idx: np.ndarray | None = None
        for name, size in zip(self.columns, self.shape, strict=True):
            x = table[name]
            if name in self.edges:
                e = np.asarray(self.edges[name])
                # bins [e_i, e_{i+1}), the last one closed; rows are inside [e_0, e_k].
                code = np.clip(np.searchsorted(e, x, side="right") - 1, 0, size - 1)
            else:
                code = np.asarray(x, dtype=np.int64)
            idx = code.astype(np.int64) if idx is None else idx * size + code
        assert idx is not None
        return idx

    def to_json(self) -> dict[str, Any]:
        """Canonical plain-data form (sent to the sites)."""
        return {"columns": list(self.columns),
                "bins": {k: list(v) for k, v in sorted(self.edges.items())}}


def _bins_for(col: ContinuousColumn, raw: Any, where: str) -> tuple[float, ...]:
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < 1 or raw > MAX_CELLS:
            raise ValidationError(f"{where}: bins for {col.name!r} must be 1..{MAX_CELLS}, got "
                                  f"{raw}")
        return tuple(float(v) for v in np.linspace(col.min, col.max, raw + 1))
    if not isinstance(raw, list) or len(raw) < 2:
        raise ValidationError(f"{where}: bins for continuous column {col.name!r} must be a count "
                              f"or a list of >= 2 increasing edges, got {raw!r}")
    edges = []
    for v in raw:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValidationError(f"{where}: bin edges for {col.name!r} must be finite numbers, "
                                  f"got {v!r}")
        edges.append(float(v))
    if any(b <= a for a, b in itertools.pairwise(edges)):
        raise ValidationError(f"{where}: bin edges for {col.name!r} must be strictly "
                              f"increasing, got {raw!r}")
    if edges[0] > col.min or edges[-1] < col.max:
        raise ValidationError(
            f"{where}: bin edges for {col.name!r} must cover the schema's range "
            f"[{col.min:g}, {col.max:g}] (every row must fall in a bin), got "
            f"[{edges[0]:g}, {edges[-1]:g}]")
    if len(edges) - 1 > MAX_CELLS:
        raise ValidationError(f"{where}: at most {MAX_CELLS} bins for {col.name!r}")
    return tuple(edges)


def parse_domain(schema: Schema, columns: Any, bins: Any = None, *,
                 where: str = "domain", max_columns: int = 3,
                 max_cells: int = MAX_CELLS) -> Domain:
    """Validate a histogram domain of 1-``max_columns`` columns against ``schema``.

    Continuous columns need public ``bins`` (a count of equal-width bins over the schema's
    bounds, or explicit edges covering them); nominal/ordinal columns use their categories.
    """
    if isinstance(columns, str):
        columns = [columns]
    if not isinstance(columns, list | tuple) or not columns:
        raise ValidationError(f"{where}: columns must be a non-empty list of column names, got "
                              f"{columns!r}")
    if len(columns) > max_columns:
        raise ValidationError(f"{where}: at most {max_columns} columns in a cross product, got "
                              f"{len(columns)}")
    if len(set(columns)) != len(columns):
        raise ValidationError(f"{where}: a column appears twice in {list(columns)}")
    bins = {} if bins is None else bins
    if not isinstance(bins, Mapping):
        raise ValidationError(f"{where}: bins must map column names to edges, got {bins!r}")
    unknown_bins = sorted(set(bins) - set(columns))
    if unknown_bins:
        raise ValidationError(f"{where}: bins given for column(s) {unknown_bins} not in the "
                              f"domain {list(columns)}")
    edges: dict[str, tuple[float, ...]] = {}
    shape: list[int] = []
    labels: list[tuple[str, ...]] = []
    for name in columns:
        if not isinstance(name, str) or name not in schema.names:
            raise ValidationError(f"{where}: unknown column {name!r}; the schema's columns are "
                                  f"{list(schema.names)}")
        col = schema.column(name)
        if isinstance(col, ContinuousColumn):
            if name not in bins:
                raise ValidationError(
                    f"{where}: continuous column {name!r} needs public bins (a number of "
                    f"equal-width bins over [{col.min:g}, {col.max:g}] or a list of edges)")
            e = _bins_for(col, bins[name], where)
            edges[name] = e
            shape.append(len(e) - 1)
            last = len(e) - 2
            labels.append(tuple(f"[{a:g}, {b:g}{']' if i == last else ')'}"
                                for i, (a, b) in enumerate(itertools.pairwise(e))))
        else:
            if name in bins:
                raise ValidationError(f"{where}: column {name!r} is {col.type}; bins apply only "
                                      "to continuous columns")
            labs = col.levels if isinstance(col, OrdinalColumn) else col.categories
            shape.append(len(labs))
            labels.append(tuple(labs))
    n = math.prod(shape)
    if n > max_cells:
        raise ValidationError(f"{where}: the domain has {n:,} cells ({' x '.join(map(str, shape))}"
                              f"); at most {max_cells:,} are allowed (use fewer columns or fewer "
                              "bins)")
    return Domain(tuple(columns), edges, tuple(shape), tuple(labels))


# --------------------------------------------------------------------------- query sets


@dataclass(frozen=True)
class _Block:
    """One entry after compilation: a predicate (one count) or a domain (one per cell)."""

    name: str
    where: Predicate
    domain: Domain | None

    @property
    def size(self) -> int:
        return 1 if self.domain is None else self.domain.n_cells


@dataclass(frozen=True)
class CompiledQuerySet:
    """A validated query set: names of its counts and how to compute them.

    Attributes
    ----------
    names : tuple of str
        One readable name per count, in order.
    canonical : list
        The plain-data form sent to sites (:func:`compile_query_set` accepts it back).
    """

    names: tuple[str, ...]
    canonical: tuple[Any, ...]
    blocks: tuple[_Block, ...]

    @property
    def n_queries(self) -> int:
        """Number of counts."""
        return len(self.names)

    def chunk_counts(self, table: EncodedTable) -> np.ndarray:
        """Return the counts of one chunk (float64, one per query)."""
        cols = table.columns
        n = table.n_rows
        out = []
        for b in self.blocks:
            mask = b.where.evaluate(cols, n) if b.where.kind != "true" else None
            if b.domain is None:
                out.append(np.array([float(n if mask is None else int(mask.sum()))]))
                continue
            idx = b.domain.cell_index(cols)
            if mask is not None:
                idx = idx[mask]
            out.append(np.bincount(idx, minlength=b.domain.n_cells).astype(np.float64))
        return np.concatenate(out) if out else np.zeros(0)

    def counts(self, chunks: Iterable[EncodedTable]) -> tuple[np.ndarray, int]:
        """Exact counts over a stream of chunks, and the number of rows seen."""
        total = np.zeros(self.n_queries)
        rows = 0
        for t in chunks:
            total += self.chunk_counts(t)
            rows += t.n_rows
        return total, rows

    def predicates(self) -> list[Predicate]:
        """One predicate per count (shorthand cells become conjunctions); for analysis."""
        out: list[Predicate] = []
        for b in self.blocks:
            if b.domain is None:
                out.append(b.where)
                continue
            per_col: list[list[Predicate]] = []
            for name, size in zip(b.domain.columns, b.domain.shape, strict=True):
                if name in b.domain.edges:
                    e = b.domain.edges[name]
                    per_col.append([
                        Predicate("all", children=(
                            Predicate("cmp", name, ">=", e[i]),
                            Predicate("cmp", name, "<=" if i == size - 1 else "<", e[i + 1])))
                        for i in range(size)])
                else:
                    per_col.append([Predicate("in", name, codes=(i,)) for i in range(size)])
            for cell in itertools.product(*per_col):
                out.append(Predicate("all", children=(b.where, *cell)))
        return out

    def one_directional(self, schema: Schema) -> bool:
        """Return True if the counts provably move in one direction under replace-one.

        A replacement x -> y changes count q by ``1[y in q] - 1[x in q]``. If the query sets
        form a chain (each contains the next), two counts can never move in opposite
        directions; otherwise some pair of rows makes one go up and another down. Decided
        exactly with :func:`implies` (False when undecidable within the grid limit).
        """
        preds = self.predicates()
        if len(preds) > 64:
            return False
        budget = GridBudget()
        for a, b in itertools.combinations(preds, 2):
            if not (implies(schema, a, b, budget) or implies(schema, b, a, budget)):
                return False
        return True


def _check_name(raw: Any, default: str, where: str) -> str:
    if raw is None:
        return default
    if not isinstance(raw, str) or not raw.strip() or len(raw) > 200:
        raise ValidationError(f"{where}: name must be a non-empty string of at most 200 "
                              f"characters, got {raw!r}")
    return raw


def _entry(schema: Schema, raw: Any, index: int, budget: GridBudget) -> tuple[_Block, Any]:
    where = f"queries[{index}]"
    if not isinstance(raw, Mapping):
        raise ValidationError(f"{where} must be a table/object, got {type(raw).__name__}")
    forms = [k for k in ("per", "cross") if k in raw]
    if len(forms) > 1:
        raise ValidationError(f"{where}: give 'per' or 'cross', not both")
    if not forms:
        extra = sorted(set(raw) - {"name", "where"})
        if extra:
            raise ValidationError(f"{where}: unknown key(s) {extra}; a predicate query has "
                                  "'name' and 'where', a shorthand 'per' or 'cross'")
        name = _check_name(raw.get("name"), f"q{index}", where)
        parser = _Parser(schema, name)
        pred = TRUE if raw.get("where") is None else parser.parse(raw["where"])
        if pred.kind != "true" and satisfiable(schema, pred, budget) is False:
            raise ValidationError(f"query {name!r}: the predicate is contradictory (no "
                                  f"schema-valid row can satisfy it); columns: "
                                  f"{sorted(pred.columns())}")
        return _Block(name, pred, None), {"name": name, "where": pred.to_json()}
    form = forms[0]
    extra = sorted(set(raw) - {form, "bins", "where", "name"})
    if extra:
        raise ValidationError(f"{where}: unknown key(s) {extra} for a {form!r} shorthand "
                              "(valid: bins, where, name)")
    cols = raw[form]
    if form == "per" and not isinstance(cols, str):
        raise ValidationError(f"{where}: 'per' takes one column name, got {cols!r}")
    if form == "cross" and (not isinstance(cols, list) or not 2 <= len(cols) <= 3):
        raise ValidationError(f"{where}: 'cross' takes a list of 2 or 3 column names, got "
                              f"{cols!r}")
    bins = raw.get("bins")
    if form == "per" and bins is not None:
        bins = {cols: bins}
    label = _check_name(raw.get("name"), f"{form} {cols}", where)
    domain = parse_domain(schema, cols, bins, where=f"{where} ({label})")
    pred = TRUE
    if raw.get("where") is not None:
        pred = _Parser(schema, label).parse(raw["where"])
        if satisfiable(schema, pred, budget) is False:
            raise ValidationError(f"query {label!r}: the 'where' predicate is contradictory "
                                  "(no schema-valid row can satisfy it)")
    canonical: dict[str, Any] = {"name": label, "domain": domain.to_json(),
                                 "where": pred.to_json()}
    return _Block(label, pred, domain), canonical


def _from_canonical(schema: Schema, raw: Mapping[str, Any], index: int) -> tuple[_Block, Any]:
    """Re-validate the canonical form (what a site receives)."""
    where = f"queries[{index}]"
    name = _check_name(raw.get("name"), f"q{index}", where)
    pred = _CanonicalParser(schema, name).parse(raw.get("where"), 0)
    if "domain" in raw:
        d = raw["domain"]
        if not isinstance(d, Mapping):
            raise ValidationError(f"{where}: domain must be an object")
        domain = parse_domain(schema, d.get("columns"), d.get("bins"), where=where)
        return _Block(name, pred, domain), {"name": name, "domain": domain.to_json(),
                                            "where": pred.to_json()}
    return _Block(name, pred, None), {"name": name, "where": pred.to_json()}


class _CanonicalParser:
    """Parses the canonical (code-based) predicate form, validating every field and its size."""

    def __init__(self, schema: Schema, query: str) -> None:
        self.by_name = {c.name: c for c in schema.columns}
        self.query = query
        self.nodes = 0

    def fail(self, msg: str) -> ValidationError:
        return ValidationError(f"query {self.query!r}: {msg}")

    def parse(self, raw: Any, depth: int) -> Predicate:
        self.nodes += 1
        if depth > MAX_DEPTH or self.nodes > MAX_NODES:
            raise self.fail(f"the predicate is too large (at most {MAX_NODES} nodes, nesting "
                            f"depth {MAX_DEPTH})")
        if raw is None:
            return TRUE
        if not isinstance(raw, Mapping):
            raise self.fail(f"invalid predicate {str(raw)[:80]!r}")
        if raw.get("true") is True and len(raw) == 1:
            return TRUE
        for key in ("all", "any"):
            if key in raw:
                items = raw[key]
                if not isinstance(items, list) or not items or len(raw) != 1:
                    raise self.fail(f"{key!r} needs a non-empty list")
                return Predicate(key, children=tuple(self.parse(p, depth + 1) for p in items))
        if "not" in raw and len(raw) == 1:
            return Predicate("not", children=(self.parse(raw["not"], depth + 1),))
        name = raw.get("column")
        if not isinstance(name, str) or name not in self.by_name:
            raise self.fail(f"unknown column {name!r}")
        col = self.by_name[name]
        if "in_codes" in raw:
            codes = raw["in_codes"]
            size = (col.n_levels if isinstance(col, OrdinalColumn) else
                    col.n_categories if isinstance(col, NominalColumn) else 0)
            if (not isinstance(codes, list) or not codes or
                    not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < size
                            for c in codes)):
                raise self.fail(f"invalid codes for column {name!r}")
            return Predicate("in", name, codes=tuple(sorted(set(codes))))
        op, value = raw.get("op"), raw.get("value")
        if op not in OPS or isinstance(value, bool) or not isinstance(value, int | float) or (
                not math.isfinite(value)):
            raise self.fail(f"invalid comparison on column {name!r}")
        if isinstance(col, NominalColumn) and op not in ("==", "!="):
            raise self.fail(f"column {name!r} is nominal")
        return Predicate("cmp", name, str(op), float(value))


def compile_query_set(schema: Schema, raw: Any, *, canonical: bool = False,
                      max_queries: int = MAX_QUERIES) -> CompiledQuerySet:
    """Validate a query set against ``schema`` and compile it.

    Parameters
    ----------
    schema : Schema
        The federation schema.
    raw : list or dict
        The entries (see the module docstring), or a dict with a ``queries`` list.
    canonical : bool
        True when ``raw`` is the canonical form a coordinator sends (sites use this).
    max_queries : int
        Upper bound on the number of counts.

    Raises
    ------
    ValidationError
        Naming the query, the column and what is valid.
    """
    if isinstance(raw, Mapping):
        extra = sorted(set(raw) - {"queries"})
        if extra:
            raise ValidationError(f"a query file has one key 'queries' (a list); got also "
                                  f"{extra}")
        raw = raw.get("queries")
    if not isinstance(raw, list | tuple) or not raw:
        raise ValidationError("the query set is empty: give at least one entry under 'queries'")
    blocks: list[_Block] = []
    canon: list[Any] = []
    total = nodes = 0
    budget = GridBudget()
    for i, entry in enumerate(raw):
        if canonical:
            if not isinstance(entry, Mapping):
                raise ValidationError(f"queries[{i}] must be an object")
            block, c = _from_canonical(schema, entry, i)
        else:
            block, c = _entry(schema, entry, i, budget)
        total += block.size
        if total > max_queries:
            raise ValidationError(f"the query set has more than {max_queries} counts (at "
                                  f"queries[{i}], {block.name!r})")
        nodes += block.where.size()
        if nodes > MAX_SET_NODES:
            raise ValidationError(f"the query set's predicates have more than {MAX_SET_NODES} "
                                  f"nodes in all (at queries[{i}], {block.name!r}); split it "
                                  "into batches (dpfed svt --session continues a session)")
        blocks.append(block)
        canon.append(c)
    names: list[str] = []
    for b in blocks:
        if b.domain is None:
            names.append(b.name)
        else:
            names.extend(f"{b.name}: {c}" for c in b.domain.cell_names())
    dupes = sorted(n for n, count in Counter(names).items() if count > 1)
    if dupes:
        raise ValidationError(f"query names must be unique; repeated: {dupes[:5]}")
    return CompiledQuerySet(tuple(names), tuple(canon), tuple(blocks))


def load_query_file(path: str | Path) -> Any:
    """Read a query set from a ``.toml`` or ``.json`` file (raw, not yet validated)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValidationError(f"cannot read query file {p}: {exc.strerror or exc}") from None
    try:
        if p.suffix.lower() == ".json":
            return json.loads(text)
        return tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        fmt = "JSON" if p.suffix.lower() == ".json" else "TOML"
        raise ValidationError(f"query file {p} is not valid {fmt}: {exc}") from None

