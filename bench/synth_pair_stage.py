"""The pair stage on wide schemas: time per candidate pair at 50, 200 and 400 columns.

Every column pair whose table is small enough is a candidate (C (C - 1) / 2 of them), so the
pair stage must cost a constant per candidate pair: building the grid from the DP
proportions, listing the candidates, the site's exact tables and dependence scores over its
rows, and the coordinator's forest. (Listing the candidates once recomputed every column's
group count for every pair it looked at -- O(C^3): 155-186 s at 396 columns.)

Usage: ``OPENBLAS_NUM_THREADS=1 python bench/synth_pair_stage.py [--columns 50 200 400]
[--rows 2000]``; prints seconds per step and microseconds per candidate pair.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfed.common.data.demo_data import generate_demo  # noqa: E402
from dpfed.common.data.encoding import encode_table  # noqa: E402
from dpfed.common.synth import pair_marginals as pm  # noqa: E402
from dpfed.common.synth.link_release import (  # noqa: E402
    LinkHistogramAccumulator,
    proportions_from_histograms,
    release_noise_sd,
)

BINS = 32


def run(n_columns: int, rows: int, resolution: str) -> dict[str, float]:
    schema, frames = generate_demo(1, rows, n_columns, seed=1, mixed=True)
    table = encode_table(schema, frames[0])[0]
    acc = LinkHistogramAccumulator(schema, BINS, resolution)
    acc.add(table)
    props = proportions_from_histograms(acc.counts.astype(float), schema, BINS,
                                        n_rows=table.n_rows, resolution=resolution,
                                        noise_sd=release_noise_sd(schema, BINS, 1.0, resolution))
    out: dict[str, float] = {}
    t = time.perf_counter()
    grid = pm.PairGrid.from_proportions(schema, props, BINS, pm.DEFAULT_GROUPS, resolution)
    out["grid"] = time.perf_counter() - t
    t = time.perf_counter()
    cands = grid.candidate_pairs()
    out["candidates"] = time.perf_counter() - t
    t = time.perf_counter()
    tables = pm.PairTableAccumulator(grid, cands)
    tables.add(table)
    out["site tables"] = time.perf_counter() - t
    t = time.perf_counter()
    scores = pm.dependence_scores(tables.counts, grid, cands, props, table.n_rows)
    out["site scores"] = time.perf_counter() - t
    t = time.perf_counter()
    pm.choose_forest(scores, cands, len(schema.columns), len(schema.columns) - 1)
    out["forest"] = time.perf_counter() - t
    out["pairs"] = float(len(cands))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--columns", type=int, nargs="+", default=[50, 200, 400])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--resolution", choices=("fine", "bins"), default="fine")
    args = ap.parse_args()
    steps = ("grid", "candidates", "site tables", "site scores", "forest")
    print(f"{'columns':>8} {'pairs':>8} " + " ".join(f"{s:>12}" for s in steps)
          + f" {'total s':>8} {'us/pair':>8}")
    for c in args.columns:
        r = run(c, args.rows, args.resolution)
        total = sum(r[s] for s in steps)
        print(f"{c:>8} {int(r['pairs']):>8} " + " ".join(f"{r[s]:>12.3f}" for s in steps)
              + f" {total:>8.2f} {1e6 * total / r['pairs']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
