"""A site's DP-PCA pass against the streaming floor, measured in the same run.

The floor is the least a site can do for one DPdisPCA release: stream the file with Arrow
(Parquet ``iter_batches`` / CSV ``open_csv`` with float64 columns), copy each batch into a
column-major float64 matrix, one BLAS ``dsyrk`` per batch, then the top-R eigenpairs of the
p x p result. The site path is the real one: ``open_data_source`` (start-up checks), then
the ``pca`` round's ``prepare`` (schema validation, unit-ball map, Gram) and the release (noise,
top-R eigenpairs), exactly as the site agent runs a task.

Printed per format: floor seconds, site seconds, their ratio (goal <= 1.2 at 5M rows), and
the start-up time of ``open_data_source`` (no full-data scan: it should be ~0).

Run: ``python bench/site_path.py [--rows 5000000] [--p 50] [--fmt parquet csv]
[--repeats 3] [--workdir DIR] [--profile]``. Data files are cached in ``--workdir``.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.csv as pcsv  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from scipy import linalg  # noqa: E402
from scipy.linalg import blas  # noqa: E402

from dpfed.common.data.data_sources import open_data_source, spec_from_path  # noqa: E402
from dpfed.common.data.demo_data import write_demo  # noqa: E402
from dpfed.common.data.schema import Schema  # noqa: E402
from dpfed.common.jobs.contract import Site  # noqa: E402
from dpfed.common.jobs.pca import MOMENT  # noqa: E402
from dpfed.common.transport.protocol import Task  # noqa: E402

SEED = 20260101
CHUNK_ROWS = 65536


def data_files(workdir: Path, rows: int, p: int, fmt: str) -> tuple[Path, Path]:
    folder = workdir / f"demo_p{p}_n{rows}_{fmt}"
    schema_path, data_path = folder / "schema.toml", folder / f"site_01.{fmt}"
    if not (schema_path.exists() and data_path.exists()):
        t = time.perf_counter()
        schema_path, paths = write_demo(folder, 1, rows, p, seed=SEED, fmt=fmt)
        data_path = paths[0]
        print(f"  wrote {data_path} ({data_path.stat().st_size / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - t:.1f}s", flush=True)
    return schema_path, data_path


def _arrow_batches(path: Path, schema: Schema, fmt: str) -> object:
    names = list(schema.names)
    if fmt == "parquet":
        pf = pq.ParquetFile(str(path), pre_buffer=False)
        return pf.iter_batches(batch_size=CHUNK_ROWS, columns=names, use_threads=False)
    # Blocks of ~1024 rows within 1-8 MiB (1 MiB parses fastest for narrow rows; wide rows
    # need more per block), and the schema's missing markers, as the site reads them
    # (Arrow's default list of null spellings is longer and made the floor slower).
    with open(path, "rb") as fh:
        head = fh.read(1 << 20)
    per_row = len(head) / max(1, head.count(b"\n"))
    block = int(min(max(per_row * 1024, 1 << 20), 8 << 20))
    return pcsv.open_csv(
        str(path), read_options=pcsv.ReadOptions(use_threads=False, block_size=block),
        convert_options=pcsv.ConvertOptions(include_columns=names,
                                            column_types=dict.fromkeys(names, pa.float64()),
                                            null_values=list(schema.missing_values)))


MIN_SYRK_ROWS = 1024  # short batches (wide CSV) are gathered: small dsyrk calls are slow


def floor(schema: Schema, path: Path, fmt: str, rank: int) -> float:
    """Seconds of Arrow batches -> column-major float64 -> dsyrk, then top-R eigenpairs."""
    return floor_times(schema, path, fmt, rank)[0]


def floor_times(schema: Schema, path: Path, fmt: str, rank: int) -> tuple[float, float]:
    """(wall, process CPU) seconds of :func:`floor`."""
    t, cpu = time.perf_counter(), time.process_time()
    names = list(schema.names)
    p = len(names)
    c = np.zeros((p, p), order="F")
    pending: list[pa.RecordBatch] = []

    def syrk(batches: list[pa.RecordBatch]) -> np.ndarray:
        n = sum(b.num_rows for b in batches)
        x = np.empty((n, p), order="F")
        for j in range(p):
            start = 0
            for b in batches:
                x[start:start + b.num_rows, j] = b.column(j).to_numpy(zero_copy_only=False)
                start += b.num_rows
        return blas.dsyrk(1.0, x, beta=1.0, c=c, trans=1, lower=0, overwrite_c=1)

    for batch in _arrow_batches(path, schema, fmt):  # type: ignore[attr-defined]
        pending.append(batch)
        if sum(b.num_rows for b in pending) >= MIN_SYRK_ROWS:
            c = syrk(pending)
            pending = []
    if pending:
        c = syrk(pending)
    linalg.eigh(c, subset_by_index=[p - rank, p - 1], overwrite_a=True, check_finite=False,
                driver="evr")
    return time.perf_counter() - t, time.process_time() - cpu


def site(schema: Schema, path: Path, rank: int) -> tuple[float, float]:
    """(start-up seconds, task seconds) of the real site path."""
    startup, wall, _ = site_times(schema, path, rank)
    return startup, wall


def site_times(schema: Schema, path: Path, rank: int) -> tuple[float, float, float]:
    """(start-up seconds, task wall seconds, task process-CPU seconds) of the site path."""
    t = time.perf_counter()
    source = open_data_source(spec_from_path(path, chunk_rows=CHUNK_ROWS), schema)
    source.check_sample()
    startup = time.perf_counter() - t
    t, cpu = time.perf_counter(), time.process_time()
    # The pca round as DPdisPCA publishes it (uncentred, the schema's worst-case bound): the
    # path the floor bounds. The centred default adds a mean and a norms round before it.
    task = Task("bench/pca", "bench", "pca", 1.0, 1e-5, {
        "n_components": rank // 2, "rank": rank, "centering": "none", "clip_norm": "schema"})
    MOMENT.prepare(task, Site(source)).produce(np.random.default_rng(0))
    return startup, time.perf_counter() - t, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=5_000_000)
    ap.add_argument("--p", type=int, default=50)
    ap.add_argument("--rank", type=int, default=20)
    ap.add_argument("--fmt", nargs="+", default=["parquet", "csv"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of one site pass")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dpfed-sitepath-"))
    try:
        for fmt in args.fmt:
            schema_path, path = data_files(workdir, args.rows, args.p, fmt)
            schema = Schema.load(schema_path)
            floors, sites, startups, floor_cpu, site_cpu = [], [], [], [], []
            for _ in range(args.repeats):  # interleaved: both see the same machine load
                fw, fc = floor_times(schema, path, fmt, args.rank)
                s, w, c = site_times(schema, path, args.rank)
                floors.append(fw)
                floor_cpu.append(fc)
                startups.append(s)
                sites.append(w)
                site_cpu.append(c)
            f, w, s = min(floors), min(sites), min(startups)
            fc, c = min(floor_cpu), min(site_cpu)
            print(f"{fmt}: {args.rows} rows x p={args.p}, best of {args.repeats}: "
                  f"floor {f:.2f}s, site {w:.2f}s, ratio site/floor {w / f:.2f} "
                  f"(goal <= 1.2); process CPU: floor {fc:.2f}s, site {c:.2f}s, ratio "
                  f"{c / fc:.2f}; start-up (columns + 1000-row sample) {s * 1000:.0f} ms",
                  flush=True)
            if args.profile:
                prof = cProfile.Profile()
                prof.runcall(site, schema, path, args.rank)
                pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
