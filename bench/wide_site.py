"""Wide tables (p = 2000, 5000): a site's DP-PCA pass, its peak memory, and the top-R solver.

For each p, in one run:

* ``floor``: the streaming floor of bench/site_path.py (Arrow batches -> float64 -> dsyrk,
  then the top-R eigenpairs), in this process;
* ``site``: the real site path (``open_data_source`` + ``PCAHandler.prepare`` + release) in a
  fresh subprocess that reports its peak RSS (VmHWM) and its RSS after imports; the budget
  is ``3 p x p float64 + one data chunk`` (chunk = the source's ``chunk_rows`` x columns x 8
  bytes) above the imports;
* ``solver``: the top-R eigenpairs (``scipy.linalg.eigh(subset_by_index=..., driver="evr")``,
  as the site release calls it) against the full ``eigh`` on the same noisy p x p matrix:
  seconds and the largest eigenvalue difference (goal: <= 1e-12).

Run: ``python bench/wide_site.py [--p 2000 5000] [--rows 20000] [--fmt csv|parquet]
[--rank 20] [--workdir DIR]``.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
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

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def child(schema_path: str, data_path: str, rank: int) -> None:
    from site_path import site

    from dpfed.common.data.data_sources import open_data_source, spec_from_path
    from dpfed.common.data.schema import Schema

    schema = Schema.load(schema_path)
    chunk_rows = open_data_source(spec_from_path(data_path), schema).chunk_rows
    after_imports = _status("VmRSS:")
    startup, seconds = site(schema, Path(data_path), rank)
    print(json.dumps({"after_imports": after_imports, "peak": _status("VmHWM:"),
                      "seconds": seconds, "startup": startup, "chunk_rows": chunk_rows}))


def solver(p: int, rank: int) -> tuple[float, float, float]:
    """(top-R seconds, full eigh seconds, max |eigenvalue difference|) on a noisy Gram."""
    from scipy import linalg

    from dpfed.common.privacy.mechanisms import symmetric_gaussian_noise

    rng = np.random.default_rng(1)
    x = rng.standard_normal((3 * p, p)) / np.sqrt(p)
    a = (x.T @ x) / (3 * p) + symmetric_gaussian_noise(p, 1e-3, rng)
    t = time.perf_counter()
    top, _ = linalg.eigh(a.copy().T, subset_by_index=[p - rank, p - 1], overwrite_a=True,
                         check_finite=False, driver="evr")
    t_top = time.perf_counter() - t
    t = time.perf_counter()
    full = linalg.eigh(a, eigvals_only=False)[0]
    t_full = time.perf_counter() - t
    return t_top, t_full, float(np.max(np.abs(top - full[p - rank:])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, nargs="+", default=[2000, 5000])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--rank", type=int, default=20)
    ap.add_argument("--fmt", default="csv", choices=["csv", "parquet"])
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    from site_path import data_files, floor

    from dpfed.common.data.schema import Schema

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dpfed-wide-"))
    try:
        for p in args.p:
            schema_path, path = data_files(workdir, args.rows, p, args.fmt)
            f = floor(Schema.load(schema_path), path, args.fmt, args.rank)
            proc = subprocess.run([sys.executable, __file__, "--child", str(schema_path),
                                   str(path), str(args.rank)], capture_output=True, text=True,
                                  check=False)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            pxp = p * p * 8 / 2**20
            chunk = r["chunk_rows"] * p * 8 / 2**20
            above = r["peak"] - r["after_imports"]
            print(f"p={p}, {args.rows} rows ({args.fmt}): site {r['seconds']:.2f}s, floor "
                  f"{f:.2f}s, ratio {r['seconds'] / f:.2f}; start-up {r['startup']:.2f}s")
            print(f"  memory: peak {r['peak']:.0f} MiB, {above:.0f} MiB above the imports; "
                  f"budget 3 p x p + one chunk = 3 x {pxp:.0f} + {chunk:.0f} = "
                  f"{3 * pxp + chunk:.0f} MiB; ratio {above / (3 * pxp + chunk):.2f} "
                  "(goal <= 1)")
            t_top, t_full, diff = solver(p, args.rank)
            print(f"  solver: top-{args.rank} eigh {t_top:.2f}s vs full eigh {t_full:.2f}s "
                  f"(ratio {t_top / t_full:.2f}); max eigenvalue difference {diff:.1e} "
                  "(goal <= 1e-12)", flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
