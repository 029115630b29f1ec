"""Quality and disclosure metrics of a synthetic table against real rows (bench-only).

Shared by the synthesis benchmarks (``bench/synth_federated.py`` on its generated table,
``bench/dp_baselines.py`` on the real tables); every function takes the table's public
``schema`` and, where a model is trained, its binary ``target`` column.

* ``tvds``: mean 1-way TVD (continuous columns on 20 equal-width bins of the schema bounds),
  mean and max 2-way TVD over all column pairs (continuous on 5 bins);
* ``logistic_auc``: an L2-regularised logistic regression for ``target`` (second level = 1),
  trained on one frame and scored by AUC on another;
* ``privacy``: DCR (median distance of synthetic rows to their closest training row over the
  median distance of holdout rows to theirs; 1 = as close as fresh data) and the median
  nearest-neighbour distance ratio;
* ``evaluate``: all of the above plus the mean |correlation difference| for one method.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from scipy import special

from dpfed.common.data.encoding import encode_table
from dpfed.common.data.schema import ContinuousColumn, OrdinalColumn, Schema
from dpfed.common.evaluation.disclosure import (
    nearest_neighbours,
    neighbour_distance_ratio,
    standardize,
)
from dpfed.common.evaluation.utility_metrics import table_correlation_error
from dpfed.common.pca.features import UnitBallMap, feature_names


def _binned(schema: Schema, frame: pd.DataFrame, bins: int) -> dict[str, np.ndarray]:
    table, _ = encode_table(schema, frame)
    out = {}
    for col in schema.columns:
        v = table.columns[col.name]
        if isinstance(col, ContinuousColumn):
            w = (col.max - col.min) / bins
            out[col.name] = np.clip(((v - col.min) / w).astype(int), 0, bins - 1)
        else:
            out[col.name] = v.astype(int)
    return out


def _tvd(a: np.ndarray, b: np.ndarray, size: int) -> float:
    pa = np.bincount(a, minlength=size) / a.size
    pb = np.bincount(b, minlength=size) / b.size
    return 0.5 * float(np.abs(pa - pb).sum())


def _size(col: Any, bins: int) -> int:
    if isinstance(col, ContinuousColumn):
        return bins
    return int(col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories)


def tvds(schema: Schema, real: pd.DataFrame, syn: pd.DataFrame) -> tuple[float, float, float]:
    """Return (mean 1-way TVD, mean 2-way TVD, max 2-way TVD)."""
    r1, s1 = _binned(schema, real, 20), _binned(schema, syn, 20)
    one = [_tvd(r1[c.name], s1[c.name], _size(c, 20)) for c in schema.columns]
    r2, s2 = _binned(schema, real, 5), _binned(schema, syn, 5)
    two = []
    cols = schema.columns
    for i in range(len(cols)):
        for j in range(i + 1, len(cols)):
            a, b = cols[i], cols[j]
            sb = _size(b, 5)
            size = _size(a, 5) * sb
            two.append(_tvd(r2[a.name] * sb + r2[b.name], s2[a.name] * sb + s2[b.name], size))
    return float(np.mean(one)), float(np.mean(two)), float(np.max(two))


def _features(schema: Schema, target: str,
              frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    table, _ = encode_table(schema, frame)
    y = (table.columns[target] == 1).astype(float)
    x = UnitBallMap(schema).scaled(table)
    names = feature_names(schema)
    keep = [i for i, nm in enumerate(names) if not nm.startswith(target)]
    return x[:, keep], y


def logistic_auc(schema: Schema, target: str, train: pd.DataFrame, test: pd.DataFrame) -> float:
    """L2-regularised logistic regression (Newton steps, numpy) -> AUC on ``test``."""
    x, y = _features(schema, target, train)
    xt, yt = _features(schema, target, test)
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


def privacy(schema: Schema, train: pd.DataFrame, syn: pd.DataFrame, holdout: pd.DataFrame,
            m: int = 3000) -> tuple[float, float]:
    """Return (DCR ratio, median NNDR) on at most ``m`` rows of each frame."""
    fmap = UnitBallMap(schema)
    enc = [fmap.scaled(encode_table(schema, f.iloc[:m])[0]) for f in (train, syn, holdout)]
    tr, sy, ho = standardize(*enc)
    nb = nearest_neighbours(sy, tr, k=2)
    ref = nearest_neighbours(ho, tr, k=1)
    dcr = float(np.median(nb.distances[:, 0]) / max(np.median(ref.distances[:, 0]), 1e-12))
    return dcr, float(np.median(neighbour_distance_ratio(nb)))


def evaluate(schema: Schema, target: str, name: str, syn: pd.DataFrame, train: pd.DataFrame,
             holdout: pd.DataFrame, seconds: float) -> dict[str, Any]:
    """Every metric of one method's synthetic rows, as a row of the printed table."""
    t1, t2, t2m = tvds(schema, holdout, syn)
    corr = table_correlation_error(holdout, syn, schema).mean_abs
    dcr, nndr = privacy(schema, train, syn, holdout)
    return {"method": name, "tvd1": t1, "tvd2": t2, "tvd2max": t2m, "corr": corr,
            "auc": logistic_auc(schema, target, syn, holdout), "dcr": dcr, "nndr": nndr,
            "s": seconds}
