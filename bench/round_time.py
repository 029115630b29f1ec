"""Wall time of a federated DP-PCA round against its compute floor.

Set-up (docs/architecture.md "Performance model"): 4 site processes x 200k rows x 100 columns
(CSV), one
coordinator, real mTLS gRPC on loopback, ledgers on disk. The physical floor of a round is
the slowest site's read + Gram + eigendecomposition, done in-process without the network.

This machine runs all four sites on 2 shared cores, so a site computing inside the federation
competes with the other three. The floor is therefore measured the same way: the four
in-process computations run concurrently (one process each) and the slowest counts
(``floor, concurrent``) -- the apples-to-apples baseline. The floor of one site alone
(``floor, isolated``) is printed too. Target: round / concurrent floor <= 1.5.

Run: ``python bench/round_time.py [--quick] [--rows N] [--features P] [--sites S]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # same BLAS threading in every process

import numpy as np  # noqa: E402

from dpfed.aggregator.local_federation import LocalFederation, SiteSettings  # noqa: E402
from dpfed.common.data.data_sources import open_data_source, spec_from_path  # noqa: E402
from dpfed.common.data.schema import Schema  # noqa: E402
from dpfed.common.pca.dppca import GramAccumulator, site_release  # noqa: E402
from dpfed.common.pca.features import UnitBallMap  # noqa: E402


def site_floor(schema_path: str, data_path: str, k: int) -> float:
    """Seconds for one site's read + Gram + eigendecomposition, in-process."""
    t0 = time.perf_counter()
    schema = Schema.load(schema_path)
    unit_ball = UnitBallMap(schema)
    acc = GramAccumulator(unit_ball.n_features)
    for table, _ in open_data_source(spec_from_path(data_path), schema).iter_chunks():
        acc.add(unit_ball.transform(table)[0])
    site_release(acc.gram(), acc.n_rows, epsilon=1.0, delta=1e-5, rank=2 * k,
                 rng=np.random.default_rng(0))
    return time.perf_counter() - t0


def _floor_worker(schema: str, path: str, k: int, ready: Any, start: Any,
                  results: Any) -> None:
    ready.release()
    start.wait()  # every worker has finished importing before any starts computing
    results.put(site_floor(schema, path, k))


def concurrent_floor(schema: Path, paths: list[Path], k: int) -> list[float]:
    """Run every site's floor computation at once, one process each, started together."""
    ctx = mp.get_context("spawn")
    ready, start, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_floor_worker, args=(str(schema), str(p), k, ready, start,
                                                     results)) for p in paths]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.acquire()
    start.set()
    times = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 x 50k rows x 50 columns")
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--features", type=int, default=100)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the generated federation")
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
        fed.start_sites()
        fed.wait_for_sites(timeout=300)
        rounds, floors_c, floors_i = [], [], []
        with fed.analyst(timeout=600) as coord:
            for _ in range(args.repeats):
                t = time.perf_counter()
                coord.pca(args.k, epsilon=1.0, delta=1e-5)
                rounds.append(time.perf_counter() - t)
                floors_c.append(max(concurrent_floor(fed.schema_path, paths, args.k)))
                floors_i.append(site_floor(str(fed.schema_path), str(paths[0]), args.k))
        fed.stop_all()
        r, fc, fi = np.median(rounds), np.median(floors_c), np.median(floors_i)
        print(f"round wall time (submit -> result fetched), median of {args.repeats}: {r:.2f}s "
              f"(runs: {', '.join(f'{x:.2f}' for x in rounds)})")
        print(f"floor, concurrent (slowest of {args.sites} in-process sites at once): {fc:.2f}s")
        print(f"floor, isolated (one site alone): {fi:.2f}s")
        print(f"ratio round / concurrent floor: {r / fc:.2f}  (target <= 1.5)")
        print(f"ratio round / isolated floor:   {r / fi:.2f}  ({args.sites} sites share "
              f"{os.cpu_count()} cores here)")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
