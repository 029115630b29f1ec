"""The synthesis benchmark suite: every table, IID and non-IID sites, against MST and AIM.

Tables: ``bench/real_tables.py`` -- the tuning tables and the held-out ones (``--tables``,
default all, held-out first), each split (seed 7) into a real holdout (30 %) and 4 sites,
IID or non-IID (sorted along the first principal component); the pooled training rows are
the same for both splits. At every epsilon (delta 1e-6) and run:

``indep``
    every column from its own DP 1-way release with the whole budget on the pooled rows
    (the job's link release and estimate, ``resolution="fine"``): the 1-way reference;
``central``
    :class:`FactorModelSynthesizer` on the pooled rows, zCDP composition, the job's defaults;
``secure-iid`` / ``secure-noniid``
    ``dpfed synth --aggregation secure --composition zcdp`` with the job's defaults over the
    4 sites: the sites' real secure sources, Skellam shares and masks, in process
    (``secure_synth_round.fit_secure``);
``fed-iid`` (``--site-level``)
    the job's site-level rounds (each site adds its own noise), zCDP;
``MST``, ``AIM``
    read from ``bench/dp_baselines.py``'s cache (``--baselines``; run there, in their own
    environment, on the same split and cells).

Metrics: ``bench/synth_metrics.py`` (against the holdout, on cells cut at quantiles of the
training rows). Every cell is the mean over ``--runs`` runs. The goals checked per table and
epsilon (secure rows): 2-way TVD <= 1.1 x AIM's, AUC >= AIM's - 0.01, 1-way TVD <= 1.2 x
``indep``'s, time <= AIM's / 50, and at the largest epsilon no column's 1-way TVD above twice
the real training rows' (against the same holdout). ``--json`` writes every row.

Usage: ``OPENBLAS_NUM_THREADS=1 python bench/synth_suite.py --tables rwm1984 --eps 1``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_tables import HELD_OUT, TABLES, TUNING, load_table, split_sites  # noqa: E402
from secure_synth_round import federation, fit_secure  # noqa: E402
from synth_metrics import Metrics  # noqa: E402
from synth_quality import PAIRS_SPLIT, fit_federated, independent_marginals  # noqa: E402

from dpfed.common.data.encoding import encode_table  # noqa: E402
from dpfed.common.synth.factor_model import FactorModelSynthesizer  # noqa: E402

DELTA = 1e-6
BINS = 32
SITE_IDS = [f"site-{i}" for i in range(4)]
METRICS = ("tvd1", "tvd1_max", "tvd2", "tvd2max", "corr", "auc", "s")


def baseline_runs(root: Path, table: str, method: str, eps: float,
                  metrics: Metrics) -> list[dict[str, Any]]:
    """Score the cached runs of MST or AIM (``bench/dp_baselines.py``)."""
    out = []
    for path in sorted((root / table).glob(f"{method}-eps{eps:g}-run*.parquet")):
        meta = json.loads(path.with_suffix(".json").read_text())
        row = metrics.evaluate(method.upper(), pd.read_parquet(path), float(meta["seconds"]))
        row["finished"] = bool(meta.get("finished", True))
        out.append(row)
    return out


def mean_row(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of every metric over runs (per-column TVDs too) and the run count."""
    row: dict[str, Any] = {"method": name, "runs": len(runs)}
    for k in METRICS:
        row[k] = float(np.mean([r[k] for r in runs]))
    row["tvd2_sd"] = float(np.std([r["tvd2"] for r in runs], ddof=1)) if len(runs) > 1 else 0.0
    row["columns"] = {c: float(np.mean([r["columns"][c] for r in runs]))
                      for c in runs[0]["columns"]}
    row["tails"] = {c: tuple(float(x) for x in np.mean([r["tails"][c] for r in runs], axis=0))
                    for c in runs[0]["tails"]}
    if "finished" in runs[0]:
        row["finished"] = all(r["finished"] for r in runs)
    return row


def show(row: dict[str, Any]) -> None:
    cells = [f"{row[k]:.4f}" for k in METRICS[:-1]] + [f"{row['s']:.1f}"]
    worst = max(row["columns"], key=row["columns"].get)
    print(f"  {row['method']:>16} x{row['runs']} " + " ".join(f"{c:>8}" for c in cells)
          + f"  worst column {worst} {row['columns'][worst]:.3f}", flush=True)


def goals(table: str, eps: float, rows: dict[str, dict[str, Any]], largest: bool,
          real: dict[str, Any]) -> list[dict[str, Any]]:
    """Check the issue's goals for the secure rows; print and return them."""
    out = []
    aim, indep = rows.get("AIM"), rows.get("indep")
    for name in ("secure-iid", "secure-noniid"):
        row = rows.get(name)
        if row is None:
            continue
        checks: dict[str, tuple[float, bool]] = {}
        if aim is not None:
            checks["tvd2/AIM"] = (row["tvd2"] / aim["tvd2"], row["tvd2"] <= 1.1 * aim["tvd2"])
            checks["auc-AIM"] = (row["auc"] - aim["auc"], row["auc"] >= aim["auc"] - 0.01)
            checks["time/AIM"] = (row["s"] / aim["s"], row["s"] <= aim["s"] / 50)
        if indep is not None:
            checks["tvd1/indep"] = (row["tvd1"] / indep["tvd1"],
                                    row["tvd1"] <= 1.2 * indep["tvd1"])
        if largest:
            ratio = {c: v / max(real["columns"][c], 1e-12) for c, v in row["columns"].items()}
            worst = max(ratio, key=ratio.get)
            checks[f"col/real ({worst})"] = (ratio[worst], ratio[worst] <= 2.0)
        missed = [k for k, (_, ok) in checks.items() if not ok]
        print(f"  goals {name}: " + ", ".join(f"{k} {v:.3g}{'' if ok else ' MISSED'}"
                                              for k, (v, ok) in checks.items()), flush=True)
        out.append({"table": table, "eps": eps, "method": name,
                    "checks": {k: [v, ok] for k, (v, ok) in checks.items()},
                    "met": not missed})
    return out


def run_table(name: str, args: argparse.Namespace, fed: Path) -> list[dict[str, Any]]:
    schema, frame, target = load_table(name)
    sites_iid, holdout = split_sites(frame, 4, iid=True, seed=args.seed, holdout=args.holdout)
    sites_non, _ = split_sites(frame, 4, iid=False, seed=args.seed, holdout=args.holdout)
    train = pd.concat(sites_iid, ignore_index=True)
    metrics = Metrics(schema, target, train, holdout)
    pooled = metrics.train_enc
    enc_iid = [encode_table(schema, s)[0] for s in sites_iid]
    enc_non = [encode_table(schema, s)[0] for s in sites_non]
    n = len(train)
    role = "held out" if name in HELD_OUT else "tuning"
    print(f"\n== {name} ({role}): {n} training rows at 4 sites, {len(holdout)} holdout rows, "
          f"{len(schema.columns)} columns, target {target!r}")
    print(f"  {'method':>16}    " + " ".join(f"{m:>8}" for m in METRICS))
    real = metrics.real()
    real_row = mean_row("real", [real])
    show(real_row)
    out: list[dict[str, Any]] = [{"table": name, "eps": None, **real_row}]
    largest = max(args.eps)
    for eps in args.eps:
        print(f" -- epsilon {eps:g}")
        methods: dict[str, Any] = {
            "indep": lambda rng, e=eps: independent_marginals(schema, [pooled], e, DELTA, n,
                                                              BINS, rng)[0],
            "central": lambda rng, e=eps: FactorModelSynthesizer(
                schema, epsilon=e, delta=DELTA, rng=rng, composition="zcdp").fit(
                    train).sample(n),
            "secure-iid": lambda rng, e=eps: fit_secure(
                schema, enc_iid, SITE_IDS, fed, e, DELTA, rng, n_bins=BINS,
                composition="zcdp").sample(n, rng=rng),
            "secure-noniid": lambda rng, e=eps: fit_secure(
                schema, enc_non, SITE_IDS, fed, e, DELTA, rng, n_bins=BINS,
                composition="zcdp").sample(n, rng=rng),
        }
        if args.site_level:
            methods["fed-iid"] = lambda rng, e=eps: fit_federated(
                schema, enc_iid, e, DELTA, PAIRS_SPLIT, BINS, rng,
                composition="zcdp").sample(n, rng=rng)
        rows: dict[str, dict[str, Any]] = {}
        for index, (method, fit) in enumerate(methods.items()):
            if method not in args.methods:
                continue
            kept = args.reused.get((name, eps, method))
            if kept is not None:  # --reuse: this row of an earlier run of the same code
                rows[method] = kept
                show(kept)
                continue
            runs = []
            for r in range(args.runs):
                rng = np.random.default_rng([args.seed, int(round(eps * 1000)), index, r])
                start = time.perf_counter()
                syn = fit(rng)
                runs.append(metrics.evaluate(method, syn, time.perf_counter() - start))
            rows[method] = mean_row(method, runs)
            show(rows[method])
        for method in ("mst", "aim"):
            runs = baseline_runs(args.baselines, name, method, eps, metrics)
            if runs:
                rows[method.upper()] = mean_row(method.upper(), runs)
                show(rows[method.upper()])
        for row in rows.values():
            out.append({"table": name, "eps": eps, **row})
        out += [{"goal": g} for g in goals(name, eps, rows, eps == largest, real_row)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", nargs="+", default=list(HELD_OUT + TUNING), choices=TABLES)
    ap.add_argument("--eps", nargs="+", type=float, default=[0.5, 1.0, 5.0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=["indep", "central", "secure-iid",
                                                      "secure-noniid", "fed-iid"])
    ap.add_argument("--site-level", action="store_true", help="also the site-level job")
    ap.add_argument("--baselines", type=Path, default=Path("bench/results/baselines"))
    ap.add_argument("--holdout", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None, help="write every row here")
    ap.add_argument("--reuse", type=Path, default=None,
                    help="take dpfed's rows from this earlier --json (same code) and score "
                         "only what is missing, e.g. baselines that finished since")
    args = ap.parse_args()
    args.reused = {}
    if args.reuse is not None:
        for row in json.loads(args.reuse.read_text()):
            if "method" in row and row.get("eps") is not None and row["method"] not in (
                    "MST", "AIM"):
                args.reused[(row["table"], row["eps"], row["method"])] = row
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        fed = federation(Path(tmp), SITE_IDS)
        for name in args.tables:
            rows += run_table(name, args, fed)
            if args.json is not None:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(rows, indent=1, default=str))
    met = [r["goal"] for r in rows if "goal" in r]
    print(f"\ngoals met in {sum(g['met'] for g in met)} of {len(met)} (table, epsilon, secure "
          "row) cells")


if __name__ == "__main__":
    main()
