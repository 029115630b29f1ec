"""A big site: a partitioned Parquet dataset, every pass of the default PCA job, and its floor.

The site's table is a directory of Parquet files (``--rows`` rows x ``--p`` continuous
columns of the demo model, ``--rows-per-file`` rows per file, Hive-partitioned by file
group). In one run, on the cores this process may use:

* ``floor``: Arrow's threaded reading (the dataset scanner, or each file's threaded
  ``iter_batches``: the faster of the two) -> each batch copied into a reused column-major
  float64 matrix -> one BLAS ``dsyrk`` per batch (the least one pass of a DP-PCA round can do
  on these files with these cores);
* the site's passes, through the real code (``open_data_source`` -> ``CountedData`` ->
  ``PCAHandler.prepare`` for each round of the default job): the row count the agent makes
  after connecting, ``mean`` (DP sum), ``norms`` (DP histogram of centred norms), ``pca``
  (the centred, clipped Gram); each one's seconds and its ratio to the floor;
* ``mean*``, ``pca*``: the same passes with the feature map's one-pass methods
  (``UnitBallMap.column_sums``, ``UnitBallMap.centred``), as the handler would run them;
* memory: the site's peak RSS above its imports, measured in a fresh process at ``--rows`` and
  at a fifth of it (flat in N if the two agree), against the ``3 p^2`` float64 budget.

Run: ``python bench/big_site.py [--rows 10000000] [--p 50] [--rows-per-file 1000000]
[--repeats 2] [--workdir DIR]``. Generated data is cached in ``--workdir``.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    # One BLAS thread: Arrow's threads use the other cores, and a multi-threaded OpenBLAS on a
    # loaded 2-core machine busy-waited (a 2M-row floor took 40 s instead of 6). Not
    # OMP_NUM_THREADS: Arrow sizes its own thread pool from it.
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.dataset as ds  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from dpfed.site_agent.handlers.pca import PCAHandler  # noqa: E402
from scipy.linalg import blas  # noqa: E402

from dpfed.common.data.data_sources import open_data_source, spec_from_path  # noqa: E402
from dpfed.common.data.demo_data import demo_model  # noqa: E402
from dpfed.common.data.schema import Schema  # noqa: E402
from dpfed.common.pca.centring import dp_mean  # noqa: E402
from dpfed.common.pca.clipping import dp_quantile, norm_bound, norm_grid  # noqa: E402
from dpfed.common.pca.dppca import GramAccumulator  # noqa: E402
from dpfed.common.pca.features import UnitBallMap, max_feature_norm  # noqa: E402
from dpfed.common.transport.protocol import Task  # noqa: E402
from dpfed.site_agent.row_count import CountedData  # noqa: E402

SEED = 20260202
CHUNK_ROWS = 65536
ROW_GROUP = 65536


def dataset(workdir: Path, rows: int, p: int, rows_per_file: int) -> tuple[Path, Path]:
    """Write (once) the schema and the partitioned dataset; return their paths."""
    folder = workdir / f"big_p{p}_n{rows}_f{rows_per_file}"
    schema_path, data = folder / "schema.toml", folder / "data"
    if (folder / "done").exists():
        return schema_path, data
    shutil.rmtree(folder, ignore_errors=True)
    data.mkdir(parents=True)
    model = demo_model(p, seed=SEED)
    schema_path.write_text(model.schema.to_toml())
    t = time.perf_counter()
    blocks = model.site_blocks(0, rows)
    written, part = 0, 0
    writer = None
    for block in blocks:
        while block.num_rows:
            if writer is None:
                group = data / f"group={part // 8}"
                group.mkdir(exist_ok=True)
                writer = pq.ParquetWriter(group / f"part-{part:05d}.parquet", block.schema)
                in_file = 0
            take = min(block.num_rows, rows_per_file - in_file)
            writer.write_table(block.slice(0, take), row_group_size=ROW_GROUP)
            block = block.slice(take)
            in_file += take
            written += take
            if in_file == rows_per_file:
                writer.close()
                writer, part = None, part + 1
    if writer is not None:
        writer.close()
    (folder / "done").write_text(str(written))
    size = sum(f.stat().st_size for f in data.rglob("*.parquet"))
    print(f"  wrote {written} rows in {len(list(data.rglob('*.parquet')))} files "
          f"({size / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f}s", flush=True)
    return schema_path, data


def floor(schema: Schema, data: Path, scanner: bool) -> float:
    """Seconds of threaded Arrow reading -> reused column-major float64 -> dsyrk.

    ``scanner``: Arrow's dataset scanner (``use_threads=True``); else each file's
    ``iter_batches(use_threads=True)`` in turn, as the site reads. The smaller is the floor.
    """
    t = time.perf_counter()
    names = list(schema.names)
    p = len(names)
    files = sorted(str(f) for f in data.rglob("*.parquet"))
    if scanner:
        batches = ds.dataset(files, format="parquet").scanner(
            columns=names, batch_size=CHUNK_ROWS, use_threads=True,
            fragment_scan_options=ds.ParquetFragmentScanOptions(pre_buffer=False)).to_batches()
    else:
        batches = (b for f in files for b in pq.ParquetFile(f, pre_buffer=False).iter_batches(
            batch_size=CHUNK_ROWS, columns=names, use_threads=True))
    c = np.zeros((p, p), order="F")
    flat = np.empty(CHUNK_ROWS * p)
    for batch in batches:
        n = batch.num_rows
        x = flat[:n * p].reshape((n, p), order="F")
        for j in range(p):
            x[:, j] = batch.column(j).to_numpy(zero_copy_only=False)
        c = blas.dsyrk(1.0, x, beta=1.0, c=c, trans=1, lower=0, overwrite_c=1)
    return time.perf_counter() - t


def task(stage: str, rank: int, clip: float | str, center: np.ndarray | None) -> Task:
    params = {"n_components": rank // 2, "rank": rank, "clip_norm": clip, "centering": "mean",
              "stage": stage}
    return Task(f"bench/{stage}", "bench", "pca", 1.0, 1e-5, params,
                {} if center is None else {"center": center})


def site_passes(schema: Schema, data: Path, rank: int) -> dict[str, float]:
    """Seconds of each pass of the default job through the real site code."""
    rng = np.random.default_rng(0)
    times: dict[str, float] = {}
    t = time.perf_counter()
    counted = CountedData(open_data_source(spec_from_path(data, chunk_rows=CHUNK_ROWS), schema))
    times["start-up"] = time.perf_counter() - t
    t = time.perf_counter()
    counted.ensure_counted()
    times["count"] = time.perf_counter() - t
    n = counted.row_count or 1
    t = time.perf_counter()
    mean = PCAHandler().prepare(task("mean", rank, "auto", None), counted)
    times["mean"] = time.perf_counter() - t
    center = dp_mean([mean.release(rng).arrays["sum"]], n, max_feature_norm(schema))
    t = time.perf_counter()
    norms = PCAHandler().prepare(task("norms", rank, "auto", center), counted)
    times["norms"] = time.perf_counter() - t
    edges = norm_grid(norm_bound(schema, True))
    clip = dp_quantile([norms.release(rng).arrays["histogram"]], edges, 0.9, n)
    t = time.perf_counter()
    pca = PCAHandler().prepare(task("pca", rank, float(clip), center), counted)
    pca.release(rng)
    times["pca"] = time.perf_counter() - t
    # The same two passes as the handler would run them with the feature map's one-pass
    # methods (column_sums for the mean; centred for the centring and the clip).
    unit = UnitBallMap(schema)
    t = time.perf_counter()
    total = np.zeros(unit.n_features)
    for table, _ in counted.iter_chunks():
        total += unit.column_sums(table)
    times["mean*"] = time.perf_counter() - t
    unit = UnitBallMap(schema, clip_norm=float(clip))
    t = time.perf_counter()
    gram = GramAccumulator(unit.n_features)
    for table, _ in counted.iter_chunks():
        gram.add(unit.centred(table, center)[0])
    gram.gram()
    times["pca*"] = time.perf_counter() - t
    return times


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def child(schema_path: str, data: str, rank: int) -> None:
    schema = Schema.load(schema_path)
    after_imports = _status("VmRSS:")
    times = site_passes(schema, Path(data), rank)
    print(json.dumps({"after_imports": after_imports, "peak": _status("VmHWM:"),
                      "times": times}))


def memory(schema_path: Path, data: Path, rank: int) -> dict[str, float]:
    run = subprocess.run([sys.executable, __file__, "--child", str(schema_path), str(data),
                          str(rank)], capture_output=True, text=True, check=True)
    out: dict[str, float] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--p", type=int, default=50)
    ap.add_argument("--rows-per-file", type=int, default=1_000_000)
    ap.add_argument("--rank", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--no-memory", action="store_true")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dpfed-bigsite-"))
    cores = len(os.sched_getaffinity(0))
    print(f"{args.rows} rows x p={args.p}, {cores} core(s), Arrow threads "
          f"{pa.cpu_count()}, BLAS threads {os.environ['OPENBLAS_NUM_THREADS']}", flush=True)
    try:
        schema_path, data = dataset(workdir, args.rows, args.p, args.rows_per_file)
        schema = Schema.load(schema_path)
        floors: list[float] = []
        passes: list[dict[str, float]] = []
        for _ in range(args.repeats):  # interleaved: both see the same machine load
            floors.append(min(floor(schema, data, True), floor(schema, data, False)))
            passes.append(site_passes(schema, data, args.rank))
        f = min(floors)
        print(f"floor (threaded scan -> float64 -> dsyrk): {f:.2f}s, "
              f"{args.rows / f / 1e6:.2f}M rows/s (best of {args.repeats})")
        total = 0.0
        for name in ("count", "mean", "norms", "pca", "mean*", "pca*"):
            best = min(p[name] for p in passes)
            total += best if "*" not in name else 0.0
            print(f"  {name:6s} {best:7.2f}s  {args.rows / best / 1e6:6.2f}M rows/s  "
                  f"pass / floor {best / f:.2f}")
        print(f"  job: 4 passes (count + 3 rounds) {total:.2f}s = {total / f:.2f} floors; "
              f"start-up {min(p['start-up'] for p in passes) * 1000:.0f} ms")
        print("  (mean*, pca*: the passes with UnitBallMap.column_sums / .centred, which the "
              "pca handler does not call yet)")
        if not args.no_memory:
            budget = 3 * args.p ** 2 * 8 / 2**20
            for rows in (args.rows // 5, args.rows // 2, args.rows):
                sp, dp = dataset(workdir, rows, args.p, args.rows_per_file)
                m = memory(sp, dp, args.rank)
                above = m["peak"] - m["after_imports"]
                print(f"  memory at {rows} rows: peak {m['peak']:.0f} MiB, {above:.0f} MiB above "
                      f"imports (3 p^2 budget {budget:.2f} MiB)", flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
