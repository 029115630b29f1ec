"""Speed and memory of the disclosure metrics at 10k, 50k and 100k rows (p = 20).

Measures, for n synthetic rows against n real rows:

* DCR/NNDR: ``nearest_neighbours(k=2)`` -- the blocked BLAS search with a running top-2
  (float32 search + float64 refinement; and float64 throughout where noted), with one and
  with two worker threads (``n_jobs``; OpenBLAS itself is held at one thread);
* seed 003's ``M_best``: ``disclosure_risk`` (covariance, the blocked correlation search for P,
  and the distances);
* baselines measured in the same run: a naive full n×n matrix (``scipy.spatial.distance.cdist``
  + ``np.partition`` for the top-2; the full cosine matrix for P) where it fits (10k rows:
  800 MB per float64 matrix), and ``scipy.spatial.cKDTree`` (the exact tree the "auto" method
  uses in low dimension);
* a sweep over the number of columns p for tree vs blocked search, which sets
  ``KDTREE_MAX_DIM``.

Time is wall-clock of an untraced call; peak memory is the tracemalloc peak of a second,
traced call (numpy reports its buffers to tracemalloc), so timing carries no tracing overhead.

Usage: ``python bench/metrics_speed.py [--quick]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from scipy.spatial import cKDTree
from scipy.spatial.distance import cdist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfed.common.evaluation.disclosure import (  # noqa: E402
    DEFAULT_MAX_BLOCK_BYTES,
    KDTREE_MAX_DIM,
    disclosure_risk,
    nearest_neighbours,
)

MB = 2**20


def measure(fn: Callable[..., Any], *args: Any, trace: bool = True,
            **kwargs: Any) -> tuple[float, float | None, Any]:
    """Return (seconds of an untraced call, tracemalloc peak MiB of a traced call, result)."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    seconds = time.perf_counter() - t0
    peak = None
    if trace:
        tracemalloc.start()
        try:
            fn(*args, **kwargs)
            peak = tracemalloc.get_traced_memory()[1] / MB
        finally:
            tracemalloc.stop()
    return seconds, peak, out


def naive_top2(q: np.ndarray, r: np.ndarray) -> np.ndarray:
    d = cdist(q, r)  # the full n×m float64 matrix
    return np.sort(np.partition(d, 1, axis=1)[:, :2], axis=1)


def kdtree_top2(q: np.ndarray, r: np.ndarray) -> Any:
    return cKDTree(r).query(q, k=2)


def naive_m_best(a: np.ndarray, b: np.ndarray) -> float:
    u = a - a.mean(axis=0)
    v = b - b.mean(axis=0)
    c = (v @ u.T) / np.outer(np.linalg.norm(v, axis=1), np.linalg.norm(u, axis=1))  # n×m
    mx = c.max(axis=1)
    p = np.clip(mx - (c.sum(axis=1) - mx) / (a.shape[0] - 1), 0.0, 1.0)
    prec = np.linalg.pinv(np.cov(a, rowvar=False))
    d = v @ prec
    d1 = np.einsum("ij,ij->i", d, v)
    return float(np.sum(d1 * (1.0 - p) ** 2))


def row(label: str, n: int, seconds: float, peak: float | None, extra: str = "") -> None:
    pairs = float(n) * n
    mem = "-" if peak is None else f"{peak:9.1f}"
    print(f"{label:<44} {n:>7} {seconds:9.2f} {pairs / seconds / 1e9:9.2f} "
          f"{seconds / pairs * 1e9:8.2f} {mem:>9}  {extra}")


def header(title: str) -> None:
    print(f"\n{title}")
    print(f"{'what':<44} {'rows':>7} {'time s':>9} {'Gpair/s':>9} {'ns/pair':>8} "
          f"{'peak MiB':>9}  notes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    args = parser.parse_args()
    sizes = [2000, 5000] if args.quick else [10_000, 50_000, 100_000]
    naive_max = 5000 if args.quick else 10_000
    p = 20
    rng = np.random.default_rng(0)
    print(f"dpfed metrics bench: p={p}, cores={os.cpu_count()}, numpy {np.__version__}, "
          f"block {DEFAULT_MAX_BLOCK_BYTES // MB} MiB, KDTREE_MAX_DIM={KDTREE_MAX_DIM}, "
          f"load average {os.getloadavg()[0]:.1f} (shared machine: figures scale with it)")

    warm = rng.standard_normal((2000, p))
    nearest_neighbours(warm, warm)  # warm up BLAS threads and allocator before timing
    disclosure_risk(warm, warm)

    header("DCR/NNDR: k=2 nearest real rows of every synthetic row")
    for n in sizes:
        real = rng.standard_normal((n, p))
        syn = real + 0.3 * rng.standard_normal((n, p))
        s32, m32, nb = measure(nearest_neighbours, syn, real, k=2, method="blocked")
        row("blocked float32 (+ float64 refinement)", n, s32, m32,
            f"input {2 * real.nbytes / MB:.0f} MiB")
        s2, _, _ = measure(nearest_neighbours, syn, real, k=2, method="blocked", n_jobs=2,
                           trace=False)
        row("blocked float32, n_jobs=2", n, s2, None, f"x{s32 / s2:.2f} vs n_jobs=1")
        if n <= sizes[1]:
            s64, m64, nb64 = measure(nearest_neighbours, syn, real, k=2, method="blocked",
                                     precision="float64")
            same = float(np.mean(nb64.indices == nb.indices))
            row("blocked float64", n, s64, m64, f"float32/64 same neighbours: {same:.6f}")
        if n <= naive_max:
            sn, mn, ref = measure(naive_top2, syn, real)
            err = float(np.max(np.abs(ref - nb.distances)))
            row("naive full matrix (cdist + partition)", n, sn, mn,
                f"x{sn / s32:.1f} slower than blocked; max |Δd| {err:.1e}")
            sk, mk, _ = measure(kdtree_top2, syn, real, trace=False)
            row("cKDTree (exact)", n, sk, mk, f"x{sk / s32:.1f} vs blocked")

    header("seed 003 M_best (correlation P + Mahalanobis d1)")
    for n in sizes:
        real = rng.standard_normal((n, p))
        syn = real + 0.3 * rng.standard_normal((n, p))
        sb, mb, risk = measure(disclosure_risk, real, syn)
        row("blocked float32 (disclosure_risk)", n, sb, mb, f"M_best={risk.m_best:.6g}")
        if n <= naive_max:
            sn, mn, ref = measure(naive_m_best, real, syn)
            row("naive full cosine matrix", n, sn, mn,
                f"x{sn / sb:.1f} vs blocked; rel diff {abs(ref - risk.m_best) / ref:.1e}")

    n_sweep = 5000 if args.quick else 20_000
    header(f"tree vs blocked by number of columns (k=2, {n_sweep} rows)")
    for dim in (3, 5, 6, 8, 10, 20):
        real = rng.standard_normal((n_sweep, dim))
        syn = rng.standard_normal((n_sweep, dim))
        sb, _, _ = measure(nearest_neighbours, syn, real, method="blocked", trace=False)
        sk, _, _ = measure(nearest_neighbours, syn, real, method="kdtree", trace=False)
        winner = "kdtree" if sk < sb else "blocked"
        row(f"p={dim:<3} blocked", n_sweep, sb, None,
            f"kdtree {sk:.2f}s -> {winner} faster")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
