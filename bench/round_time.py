"""Wall time of a federated DP-PCA round against the streaming floor, in one run.

Set-up (docs/architecture.md "Performance model"): S site processes x N rows x p columns
(CSV), one coordinator, real mTLS gRPC on loopback, ledgers on disk.

The floor of one site is the streaming floor of ``bench/site_path.py``: Arrow batches ->
float64 -> one ``dsyrk`` per batch, then the top-R eigenpairs -- the least any site
implementation can do -- measured in this process, one site after the other, right after
each round (so the same machine load). Printed:

* round / slowest site's floor: what a round costs over its slowest site's bare compute
  (meaningful when every site has its own core);
* round / (sum of floors / cores): the round against the floor of the whole federation's
  compute spread over this machine's cores (all sites share them here).

The job timed is one round (``centering="none"``, the schema's bound): one pass over each
site's data, like the floor. ``--centred`` times the default job instead (a mean round, a
norms round and the pca round: three passes).

Run: ``python bench/round_time.py [--quick] [--rows N] [--features P] [--sites S]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # same BLAS threading in every process
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from site_path import floor  # noqa: E402

from dpfed.aggregator.local_federation import LocalFederation, SiteSettings  # noqa: E402
from dpfed.common.data.schema import Schema  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 x 50k rows x 50 columns")
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--features", type=int, default=100)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the generated federation")
    ap.add_argument("--centred", action="store_true",
                    help="time the default centred job (three rounds, three passes) instead "
                         "of the one-round job")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.features = 50_000, 50
    root = Path(tempfile.mkdtemp(prefix="dpfed-round-"))
    try:
        t0 = time.perf_counter()
        fed = LocalFederation.create(root, n_sites=args.sites, rows=args.rows,
                                     features=args.features, seed=1,
                                     settings=SiteSettings(budget_epsilon=1e6))
        paths = [fed.data_paths[s] for s in fed.site_ids]
        size = sum(p.stat().st_size for p in paths) / 2**20
        print(f"{args.sites} sites x {args.rows} rows x {args.features} columns "
              f"({size:.0f} MiB of CSV), generated in {time.perf_counter() - t0:.1f}s")
        fed.start_coordinator()
        t0 = time.perf_counter()
        fed.start_sites()
        fed.wait_for_sites(timeout=300)  # connected, and their row counts sent
        counted = time.perf_counter() - t0
        schema = Schema.load(fed.schema_path)
        rank = 2 * args.k
        rounds, slowest, totals = [], [], []
        with fed.analyst(timeout=600) as coord:
            print(f"sites connected and counted {counted:.2f}s after start (processes "
                  "start, connect before reading the table, then count their rows)")
            for _ in range(args.repeats):
                t = time.perf_counter()
                if args.centred:  # the default job: mean, norms and pca rounds
                    coord.pca(args.k, epsilon=1.0, delta=1e-5)
                else:  # one round, one pass over the data: what the floor bounds
                    coord.pca(args.k, epsilon=1.0, delta=1e-5, centering="none",
                              clip_norm="schema")
                rounds.append(time.perf_counter() - t)
                floors = [floor(schema, p, "csv", rank) for p in paths]
                slowest.append(max(floors))
                totals.append(sum(floors))
        fed.stop_all()
        cores = os.cpu_count() or 1
        r, fs, ft = np.median(rounds), np.median(slowest), np.median(totals)
        print(f"round wall time (submit -> result fetched), median of {args.repeats}: {r:.2f}s "
              f"(runs: {', '.join(f'{x:.2f}' for x in rounds)})")
        print(f"streaming floor: slowest site {fs:.2f}s, sum over {args.sites} sites {ft:.2f}s "
              f"({cores} cores)")
        print(f"ratio round / slowest site's floor:     {r / fs:.2f}")
        print(f"ratio round / (sum of floors / cores):  {r / (ft / cores):.2f}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
