"""Peak memory of a site computing its DP-PCA release: flat in the number of rows?

A site streams its table (``dpfed.common.data.data_sources``) through the unit-ball map and the Gram
accumulator, then makes its DPdisPCA release. Its memory should depend on the chunk size and
the number of columns p, not on the number of rows N_s (docs/architecture.md, "Performance model").

Each case runs in a fresh subprocess that reports its own peak resident set size (VmHWM from
/proc/self/status, falling back to ``ru_maxrss``):

* ``baseline``: the interpreter with numpy/pyarrow/pandas/scipy and dpfed imported;
* ``small`` and ``large``: the full site pipeline over N_small and N_large rows with the same
  p and chunk size (default 200k vs 2M rows, p = 50, demo data written as CSV in chunks).

Printed: both peaks, their ratio (flat memory gives ~1), the peak above the baseline, and
rows/s. Then the CSV reading comparison of ``dpfed.common.data.data_sources``: Arrow reading of a
200k x 100 numeric CSV as float64 vs as text, and the data source end to end (read + encode)
with the typed fast path vs text only.

Usage: ``python bench/site_memory.py [--quick] [--p P] [--rows-small N] [--rows-large N]
[--chunk-rows C] [--fmt csv|parquet] [--workdir DIR]``. Generated files are cached in
``--workdir`` (default: a temporary directory removed at the end).

BLAS threads: unless OPENBLAS_NUM_THREADS / OMP_NUM_THREADS are set, this script sets them to
1 (as the other benches do) so timings on the shared 2-core machine measure the pipeline, not
thread contention.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EPSILON = 1.0
DELTA = 1e-5
SEED = 20260101


def peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


# --------------------------------------------------------------------------- child side
def child(args: argparse.Namespace) -> None:
    import numpy as np  # noqa: F401  (the baseline includes every import of the pipeline)
    import pandas as pd  # noqa: F401
    import pyarrow as pa  # noqa: F401

    from dpfed.common.data.data_sources import open_data_source, spec_from_path
    from dpfed.common.data.encoding import EncodingReport
    from dpfed.common.data.schema import Schema
    from dpfed.common.pca.dppca import GramAccumulator, site_release
    from dpfed.common.pca.features import UnitBallMap
    from dpfed.common.privacy.rng import production_rng

    out: dict[str, Any] = {"rss_after_imports": current_rss_mib()}
    if args.child == "pca":
        schema = Schema.load(args.schema)
        source = open_data_source(spec_from_path(args.data, chunk_rows=args.chunk_rows),
                                  schema)
        feature_map = UnitBallMap(schema)
        accumulator = GramAccumulator(feature_map.n_features)
        report = EncodingReport()
        start = time.perf_counter()
        for table, chunk_report in source.iter_chunks():
            x, _ = feature_map.transform(table)
            accumulator.add(x)
            report.merge(chunk_report)
        stream_seconds = time.perf_counter() - start
        rank = min(feature_map.n_features, 20)
        release = site_release(accumulator.gram(), accumulator.n_rows, epsilon=EPSILON,
                               delta=DELTA, rank=rank, rng=production_rng())
        out.update(rows=accumulator.n_rows, rows_read=report.rows_read,
                   p=feature_map.n_features, factor_shape=list(release.factor.shape),
                   stream_seconds=stream_seconds,
                   total_seconds=time.perf_counter() - start)
    out["peak_rss"] = peak_rss_mib()
    print(json.dumps(out))


def run_child(*extra: str) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"child {' '.join(extra)} failed:\n{proc.stderr}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# --------------------------------------------------------------------------- parent side
def demo_files(workdir: Path, rows: int, p: int, fmt: str) -> tuple[Path, Path]:
    from dpfed.common.data.demo_data import write_demo

    folder = workdir / f"demo_p{p}_n{rows}_{fmt}"
    schema_path, data_path = folder / "schema.toml", folder / f"site_01.{fmt}"
    if not (schema_path.exists() and data_path.exists()):
        start = time.perf_counter()
        schema_path, paths = write_demo(folder, 1, rows, p, seed=SEED, fmt=fmt)
        data_path = paths[0]
        size = data_path.stat().st_size / 2**20
        print(f"  wrote {data_path} ({rows} x {p}, {size:.0f} MiB) in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    return schema_path, data_path


def best_of(repeats: int, fn: Any) -> tuple[float, float]:
    """Best wall-clock and best process-CPU seconds of ``repeats`` calls."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return min(wall), min(cpu)


def csv_reading(workdir: Path, rows: int, p: int, repeats: int) -> None:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    from dpfed.common.data.data_sources import CsvSource, scan, spec_from_path
    from dpfed.common.data.schema import Schema

    schema_path, data_path = demo_files(workdir, rows, p, "csv")
    schema = Schema.load(schema_path)
    names = list(schema.names)
    size = data_path.stat().st_size / 2**20

    def arrow_read(kind: Any) -> None:
        reader = pcsv.open_csv(
            str(data_path),
            read_options=pcsv.ReadOptions(use_threads=False),
            convert_options=pcsv.ConvertOptions(
                include_columns=names, column_types=dict.fromkeys(names, kind),
                null_values=list(schema.missing_values), strings_can_be_null=True))
        for _ in reader:
            pass

    def source_scan(fast: bool) -> None:
        report = scan(CsvSource(spec_from_path(data_path), schema, typed_fast_path=fast))
        assert report.rows_kept == rows

    cases = [
        ("Arrow read, float64 columns", lambda: arrow_read(pa.float64())),
        ("Arrow read, string columns", lambda: arrow_read(pa.string())),
        ("data source, typed fast path (read + encode)", lambda: source_scan(True)),
        ("data source, text only (read + encode)", lambda: source_scan(False)),
    ]
    results = [best_of(repeats, fn) for _, fn in cases]
    print(f"\nCSV reading: {rows} rows x {p} numeric columns ({size:.0f} MiB), "
          f"best of {repeats} (wall clock, and CPU time of the process: steadier when other "
          "jobs share the machine)")
    print(f"  {'case':<46} {'wall s':>7} {'cpu s':>7} {'MiB/s':>7} {'rows/s':>9}")
    for (label, _), (wall, cpu) in zip(cases, results, strict=True):
        print(f"  {label:<46} {wall:7.2f} {cpu:7.2f} {size / wall:7.0f} {rows / wall:9.0f}")
    for label, a, b in (("string/float64, Arrow read only", 1, 0),
                        ("text-only/fast-path, read + encode", 3, 2)):
        print(f"  ratio {label:<36} wall {results[a][0] / results[b][0]:5.2f}x   "
              f"cpu {results[a][1] / results[b][1]:5.2f}x")


def memory(workdir: Path, args: argparse.Namespace) -> None:
    baseline = run_child("--child", "baseline")
    results = {}
    for label, rows in (("small", args.rows_small), ("large", args.rows_large)):
        schema_path, data_path = demo_files(workdir, rows, args.p, args.fmt)
        results[label] = run_child("--child", "pca", "--schema", str(schema_path),
                                   "--data", str(data_path),
                                   "--chunk-rows", str(args.chunk_rows))
        assert results[label]["rows"] == rows
    base = baseline["peak_rss"]
    print(f"\nSite DP-PCA memory: p = {args.p}, {args.fmt}, chunk_rows = {args.chunk_rows}, "
          f"rank {results['small']['factor_shape'][1]}")
    print(f"  interpreter + imports: RSS {baseline['rss_after_imports']:.0f} MiB, "
          f"peak {base:.0f} MiB")
    print(f"  {'case':<6} {'rows':>9} {'peak MiB':>9} {'above base':>11} {'stream s':>9} "
          f"{'rows/s':>10}")
    for label, r in results.items():
        print(f"  {label:<6} {r['rows']:9d} {r['peak_rss']:9.0f} {r['peak_rss'] - base:11.0f} "
              f"{r['stream_seconds']:9.2f} {r['rows'] / r['stream_seconds']:10.0f}")
    small, large = results["small"], results["large"]
    print(f"  rows ratio large/small:          {large['rows'] / small['rows']:6.1f}x")
    print(f"  peak RSS ratio large/small:      {large['peak_rss'] / small['peak_rss']:6.2f}x")
    above_small = max(small["peak_rss"] - base, 1e-9)
    print(f"  above-baseline ratio large/small: "
          f"{(large['peak_rss'] - base) / above_small:6.2f}x")
    if args.fmt == "csv":
        print("  (CSV: Arrow reads a fixed number of 1 MiB blocks ahead of the parser, a few tens "
              "of MiB; a file smaller than that read-ahead peaks lower)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="20k vs 200k rows, p = 20, chunks of 8192 rows")
    parser.add_argument("--p", type=int, default=None, help="columns (default 50; quick 20)")
    parser.add_argument("--rows-small", type=int, default=None)
    parser.add_argument("--rows-large", type=int, default=None)
    parser.add_argument("--chunk-rows", type=int, default=None,
                        help="rows per chunk (default 65536; quick 8192)")
    parser.add_argument("--fmt", choices=("csv", "parquet"), default="csv")
    parser.add_argument("--csv-rows", type=int, default=None,
                        help="rows of the CSV reading comparison (default 200k; quick 20k)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where to cache generated data (default: a temporary dir)")
    parser.add_argument("--skip-csv", action="store_true")
    parser.add_argument("--child", choices=("baseline", "pca"), help=argparse.SUPPRESS)
    parser.add_argument("--schema", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    args.p = args.p or (20 if args.quick else 50)
    args.chunk_rows = args.chunk_rows or (8192 if args.quick else 65536)
    args.rows_small = args.rows_small or (20_000 if args.quick else 200_000)
    args.rows_large = args.rows_large or (200_000 if args.quick else 2_000_000)
    csv_rows = args.csv_rows or (20_000 if args.quick else 200_000)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dpfed_site_memory_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        memory(workdir, args)
        if not args.skip_csv:
            csv_reading(workdir, csv_rows, 100, args.repeats)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
