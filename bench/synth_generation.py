"""Synthetic row generation at the coordinator: rows/s against a floor, memory against N.

A generative model over 20 mixed columns (16 continuous with quantile links, 2 ordinal, 2
nominal: latent dimension 24) fitted to the mixed demo table writes ``--rows`` rows to Parquet
with :meth:`dpfed.aggregator.synth_model.SynthModel.write`; so does the same model with the
pair correction of 19 pair tables (the ``synth`` job's default ``pairs``), and the ratio of
the two times is printed, with each one-thread stage's share of the time (latent draw,
decode, pair correction, Arrow, Parquet).

The floor, measured in the same run and in the same process (the machine is shared and noisy):
drawing the ``N x p`` standard normals (float32) and the ``N x p`` by ``p x p`` product that
correlates them, plus pyarrow writing an already-built table of the output's shape and types
(16 float64 columns, 4 dictionary columns) to Parquet with the same writer options -- the
work no sampler of this model can skip, done on one thread. Our figure includes everything
else (decoding every column through its link, building the Arrow arrays) and may use several
threads, so a ratio below 1 is possible on an idle multi-core machine. Each of ``--rounds``
rounds measures the floor and our write back to back; the median ratio is printed.

Memory: child processes write N and 4N rows; each reports its peak RSS and the peak traced
(Python/numpy) memory. ``--big`` writes that many rows once (e.g. 10 000 000) and reports
time and peak RSS.

Usage: ``python bench/synth_generation.py [--rows N] [--rounds R] [--big ROWS] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfed.aggregator.synth_model import (  # noqa: E402
    PARQUET_OPTIONS,
    SynthModel,
    arrow_dictionaries,
    arrow_table,
)
from dpfed.common.data.demo_data import generate_demo  # noqa: E402
from dpfed.common.data.encoding import encode_table  # noqa: E402
from dpfed.common.pca import dppca  # noqa: E402
from dpfed.common.synth.generative import (  # noqa: E402
    CHUNK_ROWS,
    default_workers,
    fit_factor_model,
)
from dpfed.common.synth.link_release import (  # noqa: E402
    LinkHistogramAccumulator,
    links_from_proportions,
    proportions_from_histograms,
    release_noise_sd,
)
from dpfed.common.synth.links import clip_to_unit_ball, default_clip_norm  # noqa: E402
from dpfed.common.synth.pair_marginals import (  # noqa: E402
    DEFAULT_GROUPS,
    PairTableAccumulator,
    dependence_scores,
    fit_pair_tables,
)
from dpfed.common.synth.pipeline import pair_forest  # noqa: E402

BINS = 32
RESOLUTION = "fine"  # the job's default 1-way cells


def write_seconds(model: SynthModel, path: Path, rows: int, seed: int,
                  workers: int | None = None) -> float:
    """Wall seconds of ``model.write`` of ``rows`` rows (default workers, or ``workers``)."""
    t = time.perf_counter()
    model.write(path, rows, rng=np.random.default_rng(seed), workers=workers)
    return time.perf_counter() - t


def build_model(seed: int = 3, pairs: bool = False) -> SynthModel:
    """The 20-column mixed model (fitted at epsilon 1 on one site of 20 000 demo rows).

    ``pairs``: the same model with the pair correction of a spanning forest (19 edges, the
    job's default ``pairs`` = columns - 1, :data:`DEFAULT_GROUPS` groups) fitted to the exact
    pair tables of the demo rows (this bench measures speed: the correction's cost does not
    depend on the noise of its tables).
    """
    schema, frames = generate_demo(1, 20_000, 20, seed=seed, mixed=True)
    table, _ = encode_table(schema, frames[0])
    rng = np.random.default_rng(0)
    acc = LinkHistogramAccumulator(schema, BINS, RESOLUTION)
    acc.add(table)
    # the job's default cells and estimate; noise-free counts (a tiny public noise level)
    props = proportions_from_histograms(acc.counts.astype(float), schema, BINS,
                                        n_rows=table.n_rows, resolution=RESOLUTION,
                                        noise_sd=release_noise_sd(schema, BINS, 1e-6,
                                                                  RESOLUTION))
    links = links_from_proportions(schema, props, BINS, "quantile", RESOLUTION)
    dim = links.dim
    clip = default_clip_norm(dim)
    unit, _ = clip_to_unit_ball(links.to_latent(table, rng), clip)
    g = dppca.GramAccumulator(dim)
    g.add(unit)
    est = dppca.combine([dppca.site_release(g.gram(), table.n_rows, epsilon=1.0, delta=1e-6,
                                            rank=dim, rng=rng).factor], dim)
    fm, corr = fit_factor_model(est, links, clip_norm=clip, rng=rng, n_rows=table.n_rows)
    model = SynthModel.build(schema, mode="generative", continuous_link="quantile",
                             n_bins=BINS, proportions=props, factor_model=fm,
                             dp_correlation=np.eye(dim), rng=rng, latent_correlation=corr,
                             resolution=RESOLUTION)
    if not pairs:
        return model
    grid = model.pair_grid(DEFAULT_GROUPS)
    cands = grid.candidate_pairs()
    acc2 = PairTableAccumulator(grid, cands)
    acc2.add(table)
    d = len(schema.columns)
    edges = pair_forest(dependence_scores(acc2.counts, grid, cands, props, table.n_rows),
                        grid, d - 1)
    acc2 = PairTableAccumulator(grid, edges)
    acc2.add(table)
    joint = fit_pair_tables(acc2.counts.astype(np.float64), grid, edges, props, table.n_rows)
    return model.with_pairs(grid, edges, joint, rng)


def floor_seconds(model: SynthModel, rows: int, path: Path) -> tuple[float, float, float]:
    """Seconds of (normals + product, Parquet write of a pre-built table) for ``rows`` rows on
    one thread, and the CPU seconds of both."""
    p = model.factor_model.dim
    rng = np.random.default_rng(1)
    root = rng.standard_normal((p, p)).astype(np.float32)
    cpu = time.process_time()
    t = time.perf_counter()
    for start in range(0, rows, CHUNK_ROWS):
        n = min(CHUNK_ROWS, rows - start)
        root @ rng.standard_normal((p, n), dtype=np.float32)
    draw = time.perf_counter() - t
    cpu = time.process_time() - cpu
    chunk = next(model.iter_encoded(CHUNK_ROWS, rng=rng, workers=1))
    labels = arrow_dictionaries(model.schema)
    table = arrow_table(chunk, labels)
    cpu_write = time.process_time()
    t = time.perf_counter()
    with pq.ParquetWriter(path, table.schema, use_dictionary=list(labels),
                          **PARQUET_OPTIONS) as writer:
        for start in range(0, rows, CHUNK_ROWS):
            n = min(CHUNK_ROWS, rows - start)
            writer.write_table(table if n == CHUNK_ROWS else table.slice(0, n))
    write = time.perf_counter() - t
    return draw, write, cpu + time.process_time() - cpu_write


def stages(model: SynthModel, rows: int) -> dict[str, float]:
    """Seconds per stage of our path on one thread (draw, decode, Arrow, Parquet)."""
    rng = np.random.default_rng(2)
    fm, decode = model.factor_model, model.decode_links
    labels = arrow_dictionaries(model.schema)
    correction = model.pair_correction
    out = {"latent draw": 0.0, "decode": 0.0, "pair correction": 0.0, "arrow": 0.0,
           "parquet": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        writer: pq.ParquetWriter | None = None
        for start in range(0, rows, CHUNK_ROWS):
            n = min(CHUNK_ROWS, rows - start)
            t0 = time.perf_counter()
            x = fm.latent(n, rng)
            t1 = time.perf_counter()
            enc = decode.from_latent(x)
            t2 = time.perf_counter()
            if correction is not None:
                enc = correction.apply(enc, rng)
            t2c = time.perf_counter()
            table = arrow_table(enc, labels)
            t3 = time.perf_counter()
            if writer is None:
                writer = pq.ParquetWriter(Path(tmp) / "s.parquet", table.schema,
                                          use_dictionary=list(labels), **PARQUET_OPTIONS)
            writer.write_table(table)
            t4 = time.perf_counter()
            for key, dt in zip(out, (t1 - t0, t2 - t1, t2c - t2, t3 - t2c, t4 - t3),
                               strict=True):
                out[key] += dt
        assert writer is not None
        writer.close()
    return out


def rss_mib() -> float:
    """Current resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class RssPeak(threading.Thread):
    """Samples the RSS every 5 ms until stopped; ``peak`` is the largest sample."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = rss_mib()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, rss_mib())


def child(model_path: str, rows: int, trace: bool) -> None:
    """Write ``rows`` rows; print JSON with seconds, RSS before/peak (MiB), peak traced MiB."""
    model = SynthModel.load(model_path)
    with tempfile.TemporaryDirectory() as tmp:
        if trace:
            tracemalloc.start()
        before = rss_mib()
        sampler = RssPeak()
        sampler.start()
        t = time.perf_counter()
        model.write(Path(tmp) / "synth.parquet", rows, rng=np.random.default_rng(5))
        seconds = time.perf_counter() - t
        sampler.done.set()
        sampler.join()
        size = (Path(tmp) / "synth.parquet").stat().st_size
        traced = tracemalloc.get_traced_memory()[1] / 2**20 if trace else float("nan")
    print(json.dumps({"rows": rows, "seconds": seconds, "rss_mib": sampler.peak,
                      "rss_before_mib": before, "traced_mib": traced, "bytes": size}))


def run_child(model_path: Path, rows: int, trace: bool) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", str(rows), "--model", str(model_path)] + (
        ["--trace"] if trace else [])
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000, help="rows per timed write")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--big", type=int, default=0, help="also write this many rows once")
    ap.add_argument("--quick", action="store_true", help="300 000 rows, 2 rounds")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, args.child, args.trace)
        return
    run(300_000 if args.quick else args.rows, 2 if args.quick else args.rounds, args.big)


def run(rows: int, rounds: int, big_rows: int = 0) -> None:
    """Print the figures (see the module docstring)."""
    model = build_model()
    paired = build_model(pairs=True)
    p = model.factor_model.dim
    print(f"generation: {len(model.schema.columns)} mixed columns (latent dimension {p}), "
          f"{rows:,} rows to Parquet per write, chunks of {CHUNK_ROWS:,} rows, "
          f"{default_workers()} worker thread(s), {os.cpu_count()} CPUs")
    ratios, ratios_1, cpu_ratios = [], [], []
    pair_ratios, pair_ratios_1 = [], []
    best = best_1 = best_floor = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        model_path = model.save(Path(tmp) / "model.npz")
        for r in range(rounds):
            draw, write, floor_cpu = floor_seconds(model, rows, Path(tmp) / "floor.parquet")
            floor = draw + write
            cpu, t = time.process_time(), time.perf_counter()
            model.write(Path(tmp) / "ours.parquet", rows, rng=np.random.default_rng(r))
            ours, ours_cpu = time.perf_counter() - t, time.process_time() - cpu
            one = write_seconds(model, Path(tmp) / "one.parquet", rows, r, workers=0)
            ratios.append(ours / floor)
            ratios_1.append(one / floor)
            cpu_ratios.append(ours_cpu / floor_cpu)
            best, best_1 = max(best, rows / ours), max(best_1, rows / one)
            best_floor = max(best_floor, rows / floor)
            print(f"  round {r + 1}: floor {rows / floor:>10,.0f} rows/s (normals + product "
                  f"{draw:.2f}s, Parquet {write:.2f}s); ours {rows / ours:>10,.0f} rows/s "
                  f"(x{ours / floor:.2f} the floor's time), one thread {rows / one:>10,.0f} "
                  f"rows/s (x{one / floor:.2f}); CPU seconds ours/floor "
                  f"{ours_cpu / floor_cpu:.2f}", flush=True)
            ours_p = write_seconds(paired, Path(tmp) / "pairs.parquet", rows, r)
            one_p = write_seconds(paired, Path(tmp) / "pairs1.parquet", rows, r, workers=0)
            pair_ratios.append(ours_p / ours)
            pair_ratios_1.append(one_p / one)
            print(f"           with pairs ({len(paired.pair_correction.steps)} edges): "
                  f"{rows / ours_p:>10,.0f} rows/s (x{ours_p / floor:.2f} the floor's time, "
                  f"x{ours_p / ours:.2f} without pairs), one thread {rows / one_p:>10,.0f} "
                  f"rows/s (x{one_p / floor:.2f} the floor, x{one_p / one:.2f} without pairs)",
                  flush=True)
        print(f"  best: floor {best_floor:,.0f} rows/s, ours {best:,.0f} rows/s, one thread "
              f"{best_1:,.0f} rows/s; median time ratio ours/floor "
              f"{statistics.median(ratios):.2f} (one thread {statistics.median(ratios_1):.2f});"
              f" median CPU-time ratio {statistics.median(cpu_ratios):.2f}")
        print(f"  with pairs: median time ratio with/without pairs "
              f"{statistics.median(pair_ratios):.2f} (one thread "
              f"{statistics.median(pair_ratios_1):.2f})")
        for label, m in (("without pairs", model), ("with pairs", paired)):
            st = stages(m, min(rows, 1_000_000))
            total = sum(st.values())
            print(f"  one-thread stages {label}: " + ", ".join(
                f"{k} {v / total:.0%}" for k, v in st.items()))
        small, large = max(rows // 4, 4 * CHUNK_ROWS), 4 * max(rows // 4, 4 * CHUNK_ROWS)
        mem = [run_child(model_path, n, trace=True) for n in (small, large)]
        rss = [run_child(model_path, n, trace=False) for n in (small, large)]
        paired_path = paired.save(Path(tmp) / "paired.npz")
        mem_p = [run_child(paired_path, n, trace=True) for n in (small, large)]
        big = run_child(model_path, big_rows, trace=False) if big_rows else None
    print(f"  peak traced memory: {mem[0]['traced_mib']:.0f} MiB at {small:,} rows, "
          f"{mem[1]['traced_mib']:.0f} MiB at {large:,} rows (ratio "
          f"{mem[1]['traced_mib'] / max(mem[0]['traced_mib'], 1e-9):.2f}; 1 = independent of N)")
    print(f"  with pairs (model saved and loaded): peak traced memory "
          f"{mem_p[0]['traced_mib']:.0f} MiB at {small:,} rows, {mem_p[1]['traced_mib']:.0f} MiB "
          f"at {large:,} rows (ratio "
          f"{mem_p[1]['traced_mib'] / max(mem_p[0]['traced_mib'], 1e-9):.2f})")
    grow = [r["rss_mib"] - r["rss_before_mib"] for r in rss]
    print(f"  peak RSS while writing: {rss[0]['rss_mib']:.0f} MiB at {small:,} rows, "
          f"{rss[1]['rss_mib']:.0f} MiB at {large:,} rows (ratio "
          f"{rss[1]['rss_mib'] / rss[0]['rss_mib']:.2f}); above the "
          f"{rss[0]['rss_before_mib']:.0f} MiB of the loaded model: {grow[0]:.0f} and "
          f"{grow[1]:.0f} MiB")
    if big is not None:
        print(f"  {big_rows:,} rows: {big['seconds']:.1f}s ({big_rows / big['seconds']:,.0f} "
              f"rows/s), peak RSS {big['rss_mib']:.0f} MiB ({big['rss_before_mib']:.0f} MiB "
              f"before writing), {big['bytes'] / 2**30:.2f} GiB "
              f"({big['bytes'] / big_rows:.0f} bytes/row)")


if __name__ == "__main__":
    main()
