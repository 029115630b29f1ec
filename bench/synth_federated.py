"""Federated synthesis (``dpfed synth``): quality vs epsilon, generation speed, fit time.

Part 1 -- quality. Data: 11 mixed columns like a small health/insurance table -- 4
continuous (log-normal length of stay, bimodal lab, skewed cost, Gaussian age), 3 ordinal, 3
nominal and a binary ``outcome`` -- from a latent Gaussian with a factor structure. Pooled
training rows split over 4 sites (IID: at random; non-IID: sorted by the first latent factor,
so sites differ systematically), plus a holdout of real rows. At every epsilon in
{0.5, 1, 2, 5} (per site; delta 1e-6) and in one run:

* ``indep``: every column sampled independently from its own DP histogram (the same Gaussian
  histogram release, all of the budget, pooled rows as one site) -- the "independent DP
  marginals" baseline; ``indep-fed``: the same with the 4 IID sites each releasing (the
  baseline the federated rows' ``tvd1/indep`` ratio uses);
* ``central-FM``: the library's central ``FactorModelSynthesizer`` (generative, identity links)
  on the pooled rows;
* ``ours-1site``: this job's pipeline (quantile links, correction, calibration) on the pooled
  rows as one site;
* ``fed-iid`` / ``fed-noniid``: the same pipeline with 4 sites, run through the site and
  coordinator functions the job uses.

Metrics (against the real holdout unless said otherwise): ``tvd1`` mean 1-way TVD (continuous
columns on 20 equal-width bins), ``tvd2``/``tvd2max`` mean/max 2-way TVD over all column pairs
(continuous on 5 bins), ``corr`` mean |correlation difference| (UnitBallMap encoding), ``auc``
of a logistic regression for ``outcome`` trained on the synthetic rows and tested on the
holdout (``real`` row: trained on the training rows), ``dcr`` median distance to the closest
training row over the median distance of holdout rows to the training rows (1 = as close as
fresh data; < 1 closer), ``nndr`` median nearest-neighbour distance ratio. Ratios printed:
``tvd1 / tvd1(indep)`` (goal <= 1.2) and federated / ours-1site.

Part 2 -- generation at the coordinator: ``bench/synth_generation.py`` (a model over 20 mixed
columns writes ``--rows`` rows to Parquet; rows/s against a floor measured in the same run --
the normal draws and their product plus writing a pre-built table -- and memory at N and 4N).

Part 3 -- fitting the model (correlation correction included) at latent dimension 200 and
400, and the old ``latent_correlation`` at 200 for the ratio.

Usage: ``python bench/synth_federated.py [--quick] [--rows N] [--skip-quality]``
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import special

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfed.aggregator.synth_model import SynthModel  # noqa: E402
from dpfed.common.data.encoding import EncodedTable, encode_table  # noqa: E402
from dpfed.common.data.schema import (  # noqa: E402
    ContinuousColumn,
    NominalColumn,
    OrdinalColumn,
    Schema,
)
from dpfed.common.evaluation.disclosure import (  # noqa: E402
    nearest_neighbours,
    neighbour_distance_ratio,
    standardize,
)
from dpfed.common.evaluation.utility_metrics import table_correlation_error  # noqa: E402
from dpfed.common.pca import dppca  # noqa: E402
from dpfed.common.pca.dppca import PCAEstimate  # noqa: E402
from dpfed.common.pca.features import UnitBallMap, feature_names  # noqa: E402
from dpfed.common.synth.factor_model import (  # noqa: E402
    FactorModelSynthesizer,
    dp_second_moment,
    latent_correlation,
)
from dpfed.common.synth.generative import fit_factor_model  # noqa: E402
from dpfed.common.synth.link_release import (  # noqa: E402
    LinkHistogramAccumulator,
    histogram_sizes,
    links_from_proportions,
    proportions_from_histograms,
    release_link_histograms,
    sum_histograms,
)
from dpfed.common.synth.links import clip_to_unit_ball, default_clip_norm  # noqa: E402

SPLIT = {"links": (0.6, 0.5), "pca": (0.4, 0.5)}
BINS = 32
SCHEMA = Schema((
    ContinuousColumn("los", 0.0, 60.0), ContinuousColumn("lab", -10.0, 10.0),
    ContinuousColumn("cost", 0.0, 50_000.0), ContinuousColumn("age", 18.0, 95.0),
    OrdinalColumn("severity", ("1", "2", "3", "4")), OrdinalColumn("bmi_band", ("lo", "mid", "hi")),
    OrdinalColumn("visits", ("0", "1-2", "3-5", "6+")),
    NominalColumn("region", ("n", "s", "e", "w")), NominalColumn("plan", ("a", "b", "c")),
    NominalColumn("sex", ("f", "m")), NominalColumn("outcome", ("no", "yes")),
))


# --------------------------------------------------------------------------- data


def make_data(n: int, seed: int) -> tuple[pd.DataFrame, np.ndarray]:
    """Rows and their first latent factor (used for the non-IID split)."""
    rng = np.random.default_rng(seed)
    k = 3
    load = rng.uniform(-0.8, 0.8, (11, k))
    f = rng.standard_normal((n, k))
    z = f @ load.T + rng.standard_normal((n, 11)) * 0.6
    z = (z - z.mean(0)) / z.std(0)
    cut = lambda x, qs: np.digitize(x, special.ndtri(np.asarray(qs)))  # noqa: E731
    frame = pd.DataFrame({
        "los": np.clip(np.exp(1.3 + 0.7 * z[:, 0]), 0, 60),
        "lab": np.clip(np.where(z[:, 1] > 0.3, 3.5, -2.5) + 1.2 * rng.standard_normal(n)
                       + 0.3 * z[:, 1], -10, 10),
        "cost": np.clip(np.exp(8.0 + 0.9 * z[:, 2]), 0, 50_000),
        "age": np.clip(55 + 14 * z[:, 3], 18, 95),
        "severity": np.array(["1", "2", "3", "4"])[cut(z[:, 4], [0.4, 0.75, 0.92])],
        "bmi_band": np.array(["lo", "mid", "hi"])[cut(z[:, 5], [0.25, 0.8])],
        "visits": np.array(["0", "1-2", "3-5", "6+"])[cut(z[:, 6], [0.3, 0.7, 0.9])],
        "region": np.array(["n", "s", "e", "w"])[cut(z[:, 7], [0.2, 0.5, 0.8])],
        "plan": np.array(["a", "b", "c"])[cut(z[:, 8], [0.5, 0.85])],
        "sex": np.array(["f", "m"])[cut(z[:, 9], [0.52])],
        "outcome": np.array(["no", "yes"])[cut(z[:, 10] + 0.0, [0.7])],
    })
    return frame, f[:, 0]


# --------------------------------------------------------------------------- methods


def fit_federated(tables: list[EncodedTable], eps: float, delta: float,
                  rng: np.random.Generator) -> SynthModel:
    """The job's rounds, run through the same site and coordinator functions."""
    el, dl = SPLIT["links"][0] * eps, SPLIT["links"][1] * delta
    ep, dp = SPLIT["pca"][0] * eps, SPLIT["pca"][1] * delta
    rels = []
    for t in tables:
        acc = LinkHistogramAccumulator(SCHEMA, BINS)
        acc.add(t)
        rels.append(release_link_histograms(acc.counts, SCHEMA, epsilon=el, delta=dl, rng=rng))
    props = proportions_from_histograms(sum_histograms(rels, SCHEMA, BINS), SCHEMA, BINS,
                                        n_rows=sum(t.n_rows for t in tables))
    links = links_from_proportions(SCHEMA, props, BINS)
    dim = links.dim
    clip = default_clip_norm(dim)
    factors = []
    for t in tables:
        unit, _ = clip_to_unit_ball(links.to_latent(t, rng), clip)
        g = dppca.GramAccumulator(dim)
        g.add(unit)
        factors.append(dppca.site_release(g.gram(), t.n_rows, epsilon=ep, delta=dp, rank=dim,
                                          rng=rng).factor)
    est = dppca.combine(factors, dim)
    fm, corr = fit_factor_model(est, links, clip_norm=clip, rng=rng)
    dpc = dp_second_moment(est, dim)
    d = np.sqrt(np.diag(dpc))
    return SynthModel.build(SCHEMA, mode="generative", continuous_link="quantile", n_bins=BINS,
                            proportions=props, factor_model=fm, dp_correlation=dpc / np.outer(d, d),
                            rng=rng, latent_correlation=corr)


def independent_marginals(tables: list[EncodedTable], eps: float, delta: float, n: int,
                          rng: np.random.Generator) -> pd.DataFrame:
    """Every column from its own DP histogram (all of the budget; summed over the sites)."""
    rels = []
    for t in tables:
        acc = LinkHistogramAccumulator(SCHEMA, BINS)
        acc.add(t)
        rels.append(release_link_histograms(acc.counts, SCHEMA, epsilon=eps, delta=delta,
                                            rng=rng))
    props = proportions_from_histograms(sum_histograms(rels, SCHEMA, BINS), SCHEMA, BINS,
                                        n_rows=sum(t.n_rows for t in tables))
    links = links_from_proportions(SCHEMA, props, BINS)
    # Independent standard normal latent: every column from its own DP marginal, no joint.
    return links.from_latent(rng.standard_normal((n, links.dim))).to_frame()


# --------------------------------------------------------------------------- metrics


def _binned(frame: pd.DataFrame, bins: int) -> dict[str, np.ndarray]:
    table, _ = encode_table(SCHEMA, frame)
    out = {}
    for col in SCHEMA.columns:
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
    return col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories


def tvds(real: pd.DataFrame, syn: pd.DataFrame) -> tuple[float, float, float]:
    r1, s1 = _binned(real, 20), _binned(syn, 20)
    one = [_tvd(r1[c.name], s1[c.name], _size(c, 20)) for c in SCHEMA.columns]
    r2, s2 = _binned(real, 5), _binned(syn, 5)
    two = []
    cols = SCHEMA.columns
    for i in range(len(cols)):
        for j in range(i + 1, len(cols)):
            a, b = cols[i], cols[j]
            sb = _size(b, 5)
            size = _size(a, 5) * sb
            two.append(_tvd(r2[a.name] * sb + r2[b.name], s2[a.name] * sb + s2[b.name], size))
    return float(np.mean(one)), float(np.mean(two)), float(np.max(two))


def _features(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    table, _ = encode_table(SCHEMA, frame)
    y = (table.columns["outcome"] == 1).astype(float)
    x = UnitBallMap(SCHEMA).scaled(table)
    names = feature_names(SCHEMA)
    keep = [i for i, nm in enumerate(names) if not nm.startswith("outcome")]
    return x[:, keep], y


def logistic_auc(train: pd.DataFrame, test: pd.DataFrame) -> float:
    """L2-regularised logistic regression (Newton steps, numpy) -> AUC on ``test``."""
    x, y = _features(train)
    xt, yt = _features(test)
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


def privacy(train: pd.DataFrame, syn: pd.DataFrame, holdout: pd.DataFrame,
            m: int = 3000) -> tuple[float, float]:
    fmap = UnitBallMap(SCHEMA)
    enc = [fmap.scaled(encode_table(SCHEMA, f.iloc[:m])[0]) for f in (train, syn, holdout)]
    tr, sy, ho = standardize(*enc)
    nb = nearest_neighbours(sy, tr, k=2)
    ref = nearest_neighbours(ho, tr, k=1)
    dcr = float(np.median(nb.distances[:, 0]) / max(np.median(ref.distances[:, 0]), 1e-12))
    return dcr, float(np.median(neighbour_distance_ratio(nb)))


def evaluate(name: str, syn: pd.DataFrame, train: pd.DataFrame, holdout: pd.DataFrame,
             seconds: float) -> dict[str, Any]:
    t1, t2, t2m = tvds(holdout, syn)
    corr = table_correlation_error(holdout, syn, SCHEMA).mean_abs
    dcr, nndr = privacy(train, syn, holdout)
    return {"method": name, "tvd1": t1, "tvd2": t2, "tvd2max": t2m, "corr": corr,
            "auc": logistic_auc(syn, holdout), "dcr": dcr, "nndr": nndr, "s": seconds}


# --------------------------------------------------------------------------- parts


def part_quality(n_per_site: int, epsilons: list[float], seed: int) -> None:
    frame, factor = make_data(5 * n_per_site, seed)
    train, holdout = frame.iloc[:4 * n_per_site], frame.iloc[4 * n_per_site:]
    f_train = factor[:4 * n_per_site]
    pooled, _ = encode_table(SCHEMA, train)
    iid = np.array_split(np.random.default_rng(seed).permutation(len(train)), 4)
    order = np.argsort(f_train + 0.5 * np.random.default_rng(seed + 1).standard_normal(
        len(train)))
    noniid = np.array_split(order, 4)
    splits = {"fed-iid": iid, "fed-noniid": noniid}
    n = len(train)
    delta = 1e-6
    print(f"\nPart 1: quality, {n} training rows (4 sites x {n_per_site}), {len(holdout)} "
          f"holdout rows, {len(SCHEMA.columns)} columns, delta {delta:g}")
    base = evaluate("holdout-vs-holdout(real train)", train.iloc[:len(holdout)], train,
                    holdout, 0.0)
    base["auc"] = logistic_auc(train, holdout)
    header = ("eps", "method", "tvd1", "tvd2", "tvd2max", "corr", "auc", "dcr", "nndr", "s",
              "tvd1/indep", "vs 1site")
    print(" ".join(f"{h:>10}" for h in header))

    def show(eps: float | str, row: dict[str, Any], indep: float | None,
             one: dict[str, Any] | None) -> None:
        r1 = "" if indep is None else f"{row['tvd1'] / indep:.2f}"
        vs = ""
        if one is not None:
            vs = "/".join(f"{row[k] / one[k]:.2f}" for k in ("tvd1", "tvd2", "corr"))
        cells = [str(eps), row["method"][:10]] + [f"{row[k]:.4f}" for k in (
            "tvd1", "tvd2", "tvd2max", "corr", "auc", "dcr", "nndr")] + [f"{row['s']:.1f}",
                                                                        r1, vs]
        print(" ".join(f"{c:>10}" for c in cells), flush=True)

    show("real", base, None, None)
    for eps in epsilons:
        rng = np.random.default_rng(seed + int(eps * 100))
        t = time.perf_counter()
        indep = independent_marginals([pooled], eps, delta, n, rng)
        ind = evaluate("indep", indep, train, holdout, time.perf_counter() - t)
        show(eps, ind, ind["tvd1"], None)
        t = time.perf_counter()
        iid_tables = [encode_table(SCHEMA, train.iloc[np.sort(p)])[0] for p in iid]
        indep_fed = independent_marginals(iid_tables, eps, delta, n, rng)
        ind_fed = evaluate("indep-fed", indep_fed, train, holdout, time.perf_counter() - t)
        show(eps, ind_fed, ind_fed["tvd1"], None)
        t = time.perf_counter()
        fm = FactorModelSynthesizer(SCHEMA, epsilon=eps, delta=delta, rng=rng).fit(train)
        cen = evaluate("central-FM", fm.sample(n), train, holdout, time.perf_counter() - t)
        show(eps, cen, ind["tvd1"], None)
        t = time.perf_counter()
        one_model = fit_federated([pooled], eps, delta, rng)
        one = evaluate("ours-1site", one_model.sample(n, rng=rng), train, holdout,
                       time.perf_counter() - t)
        show(eps, one, ind["tvd1"], None)
        for name, parts in splits.items():
            tables = [encode_table(SCHEMA, train.iloc[np.sort(p)])[0] for p in parts]
            t = time.perf_counter()
            model = fit_federated(tables, eps, delta, rng)
            row = evaluate(name, model.sample(n, rng=rng), train, holdout,
                           time.perf_counter() - t)
            show(eps, row, ind_fed["tvd1"], one)


def part_generation(rows: int) -> None:
    """Generation speed and memory: ``bench/synth_generation.py`` (floor measured in the run)."""
    import synth_generation  # bench/ is on sys.path when this script runs

    print(f"\nPart 2: generation at the coordinator, {rows:,} rows streamed to Parquet")
    synth_generation.run(rows, rounds=2)


def _wide_links(p: int) -> Any:
    cols = []
    for i in range(p):
        if i % 5 == 3:
            cols.append(OrdinalColumn(f"o{i}", ("a", "b", "c", "d")))
        elif i % 5 == 4:
            cols.append(NominalColumn(f"n{i}", ("x", "y")))
        else:
            cols.append(ContinuousColumn(f"c{i}", 0.0, 1.0))
    schema = Schema(tuple(cols))
    props = np.concatenate([np.full(s, 1.0 / s) for s in histogram_sizes(schema, BINS)])
    return links_from_proportions(schema, props, BINS)


def part_fit(dims: list[int], old_at: int | None) -> None:
    print("\nPart 3: fitting the generative model (correlation correction included)")
    for p in dims:
        links = _wide_links(p)
        d = links.dim
        rng = np.random.default_rng(p)
        a = rng.standard_normal((d, 6))
        cov = a @ a.T + np.eye(d)
        sd = np.sqrt(np.diag(cov))
        m = cov / np.outer(sd, sd) / d
        w, v = np.linalg.eigh(m)
        est = PCAEstimate(np.ascontiguousarray(v[:, ::-1].T), w[::-1], float(w.sum()))
        t = time.perf_counter()
        fit_factor_model(est, links, clip_norm=math.sqrt(d), rng=rng)
        new = time.perf_counter() - t
        line = f"  latent dimension {d}: fit {new:.1f}s"
        if old_at is not None and p == old_at:
            t = time.perf_counter()
            latent_correlation(dp_second_moment(est, d), links, clip_norm=math.sqrt(d), rng=rng)
            old = time.perf_counter() - t
            line += f"; the old latent_correlation alone {old:.1f}s (x{old / new:.1f})"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, two epsilons")
    ap.add_argument("--rows", type=int, default=2_000_000, help="rows for part 2")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-fit", action="store_true")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    if not args.skip_quality:
        part_quality(1500 if args.quick else 5000, [1.0, 5.0] if args.quick
                     else [0.5, 1.0, 2.0, 5.0], args.seed)
    part_generation(min(args.rows, 300_000) if args.quick else args.rows)
    if not args.skip_fit:
        part_fit([40] if args.quick else [200, 400], None if args.quick else 200)


if __name__ == "__main__":
    main()
