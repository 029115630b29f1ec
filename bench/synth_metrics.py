"""How the synthesis benchmarks score a synthetic table against real rows (bench-only).

Evaluation cells. A continuous column is compared on cells cut at quantiles of the real
*training* rows -- 20 for 1-way, 5 for 2-way comparisons -- with every cut placed halfway
between two neighbouring distinct real values (``dpfed.common.synth.fidelity.quantile_cuts``,
the cells of the simulation's and the sites' reports). So a column's point masses (zero
visits, a floor, values recorded in half years) sit inside their cells, at least half a gap
from an edge: a synthetic value at the point mass counts as right, one smeared across the gap counts
as wrong, and a smooth column is compared on 20 (5) about equally likely cells. Categorical
columns are compared on their categories. The same cells score every method (they depend on
the training rows only).

Metrics (:meth:`Metrics.evaluate`): ``tvd1`` mean and ``tvd1_max`` worst 1-way TVD (per
column in ``columns``), ``tvd2`` mean and ``tvd2max`` worst 2-way TVD over all column pairs,
``corr`` mean absolute difference of the Pearson correlations of the numeric view (continuous
values, categorical codes), ``auc`` of an L2-regularised logistic regression for the table's
binary target trained on the synthetic rows and tested on the holdout, and per continuous
column the 1st, 50th and 99th percentiles and the standard deviation (``tails``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import special

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfed.common.data.encoding import EncodedTable, encode_table  # noqa: E402
from dpfed.common.data.schema import ContinuousColumn, OrdinalColumn, Schema  # noqa: E402
from dpfed.common.pca.features import UnitBallMap, feature_names  # noqa: E402
from dpfed.common.synth.fidelity import quantile_cuts  # noqa: E402

ONE_WAY_CELLS = 20
TWO_WAY_CELLS = 5


@dataclass(frozen=True)
class EvalCells:
    """The evaluation cells of every column (from the real training rows)."""

    schema: Schema
    one_way: dict[str, np.ndarray]
    two_way: dict[str, np.ndarray]

    @classmethod
    def from_training(cls, schema: Schema, train: EncodedTable) -> EvalCells:
        one, two = {}, {}
        for col in schema.columns:
            if isinstance(col, ContinuousColumn):
                one[col.name] = quantile_cuts(train.columns[col.name], ONE_WAY_CELLS)
                two[col.name] = quantile_cuts(train.columns[col.name], TWO_WAY_CELLS)
        return cls(schema, one, two)

    def codes(self, table: EncodedTable, two_way: bool = False) -> dict[str, tuple[np.ndarray,
                                                                                   int]]:
        """Per column (codes, number of cells) of ``table``'s values."""
        cuts = self.two_way if two_way else self.one_way
        out = {}
        for col in self.schema.columns:
            v = table.columns[col.name]
            if isinstance(col, ContinuousColumn):
                c = cuts[col.name]
                out[col.name] = (np.searchsorted(c, v, side="right"), c.size + 1)
            else:
                size = col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories
                out[col.name] = (np.asarray(v, dtype=np.intp), size)
        return out


def tvd(a: np.ndarray, b: np.ndarray, size: int) -> float:
    """TVD between the cell histograms of codes ``a`` and ``b`` (``size`` cells)."""
    pa = np.bincount(a, minlength=size) / max(a.size, 1)
    pb = np.bincount(b, minlength=size) / max(b.size, 1)
    return 0.5 * float(np.abs(pa - pb).sum())


class Metrics:
    """Every metric of one table: schema, binary target, training rows, holdout."""

    def __init__(self, schema: Schema, target: str, train: pd.DataFrame,
                 holdout: pd.DataFrame) -> None:
        self.schema, self.target = schema, target
        self.train, self.holdout = train, holdout
        self.train_enc = encode_table(schema, train)[0]
        self.hold_enc = encode_table(schema, holdout)[0]
        self.cells = EvalCells.from_training(schema, self.train_enc)
        self.fmap = UnitBallMap(schema)
        names = feature_names(schema)
        self.keep = [i for i, nm in enumerate(names) if not nm.startswith(target)]
        self._hold_one = self.cells.codes(self.hold_enc)
        self._hold_two = self.cells.codes(self.hold_enc, two_way=True)
        self._hold_corr = self._correlation(self.hold_enc)
        self._xt, self._yt = self._features(self.hold_enc)

    # ------------------------------------------------------------------ distances
    def _encoded(self, syn: pd.DataFrame | EncodedTable) -> EncodedTable:
        return syn if isinstance(syn, EncodedTable) else encode_table(self.schema, syn)[0]

    def tvds(self, syn: pd.DataFrame | EncodedTable) -> tuple[float, float, float]:
        """Mean 1-way TVD, mean and max 2-way TVD, against the holdout."""
        per_col, t2, t2m = self.column_tvds(self._encoded(syn))
        return float(np.mean(list(per_col.values()))), t2, t2m

    def column_tvds(self, syn: EncodedTable) -> tuple[dict[str, float], float, float]:
        """Per-column 1-way TVD, mean and max 2-way TVD, against the holdout."""
        one = self.cells.codes(syn)
        per_col = {c: tvd(self._hold_one[c][0], one[c][0], one[c][1]) for c in one}
        two = self.cells.codes(syn, two_way=True)
        names = self.schema.names
        pairs = []
        for i in range(len(names)):
            for j in range(i + 1, len(names)):
                (ra, sa), (rb, sb) = self._hold_two[names[i]], self._hold_two[names[j]]
                ya, yb = two[names[i]][0], two[names[j]][0]
                pairs.append(tvd(ra * sb + rb, ya * sb + yb, sa * sb))
        return per_col, float(np.mean(pairs)), float(np.max(pairs))

    def _numeric(self, table: EncodedTable) -> np.ndarray:
        return np.column_stack([np.asarray(table.columns[c.name], dtype=np.float64)
                                for c in self.schema.columns])

    def _correlation(self, table: EncodedTable) -> np.ndarray:
        x = self._numeric(table)
        sd = x.std(axis=0)
        x = (x - x.mean(axis=0)) / np.where(sd > 0, sd, 1.0)
        c = (x.T @ x) / max(x.shape[0], 1)
        np.fill_diagonal(c, 1.0)
        return np.asarray(c)

    def correlation_error(self, syn: EncodedTable) -> float:
        """Mean |difference| of the off-diagonal Pearson correlations (numeric view)."""
        d = np.abs(self._correlation(syn) - self._hold_corr)
        iu = np.triu_indices(d.shape[0], 1)
        return float(d[iu].mean())

    # ------------------------------------------------------------------ utility
    def _features(self, table: EncodedTable) -> tuple[np.ndarray, np.ndarray]:
        y = (table.columns[self.target] == 1).astype(float)
        return self.fmap.scaled(table)[:, self.keep], y

    def auc(self, train: pd.DataFrame | EncodedTable) -> float:
        """L2-regularised logistic regression (Newton steps) trained on ``train``; holdout AUC."""
        x, y = self._features(self._encoded(train))
        xt, yt = self._xt, self._yt
        if y.min() == y.max():
            return 0.5
        x1 = np.hstack([x, np.ones((x.shape[0], 1))])
        w = np.zeros(x1.shape[1])
        lam = 1e-3 * x1.shape[0]
        for _ in range(25):
            pr = special.expit(x1 @ w)
            grad = x1.T @ (pr - y) + lam * w
            hess = (x1 * (pr * (1 - pr))[:, None]).T @ x1 + lam * np.eye(x1.shape[1])
            w -= np.linalg.solve(hess, grad)
        score = np.hstack([xt, np.ones((xt.shape[0], 1))]) @ w
        ranks = pd.Series(score).rank().to_numpy()
        pos = yt == 1
        n_pos, n_neg = pos.sum(), (~pos).sum()
        return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))

    def tails(self, table: EncodedTable) -> dict[str, tuple[float, float, float, float]]:
        """Per continuous column (p1, p50, p99, sd)."""
        out = {}
        for col in self.schema.columns:
            if isinstance(col, ContinuousColumn):
                v = np.asarray(table.columns[col.name], dtype=np.float64)
                p1, p50, p99 = np.quantile(v, [0.01, 0.5, 0.99])
                out[col.name] = (float(p1), float(p50), float(p99), float(v.std()))
        return out

    def evaluate(self, name: str, syn: pd.DataFrame | EncodedTable,
                 seconds: float = 0.0) -> dict[str, Any]:
        """Every metric of one synthetic table (a dict; ``columns``: per-column 1-way TVD)."""
        enc = self._encoded(syn)
        per_col, t2, t2m = self.column_tvds(enc)
        return {"method": name, "tvd1": float(np.mean(list(per_col.values()))),
                "tvd1_max": float(max(per_col.values())), "tvd2": t2, "tvd2max": t2m,
                "corr": self.correlation_error(enc), "auc": self.auc(enc), "s": seconds,
                "columns": per_col, "tails": self.tails(enc)}

    def real(self) -> dict[str, Any]:
        """The training rows scored as if they were synthetic: the floor of every metric."""
        out = self.evaluate("real (train rows)", self.train_enc)
        return out
