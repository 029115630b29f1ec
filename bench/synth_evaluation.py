"""The synthesis job's evaluation holdout and DP evaluation summary: cost and signal.

Part 1 -- cost at one site (demo mixed table, 12 columns, N rows in 65 536-row chunks),
against a floor measured in the same run: the links round's exact pass over every row
(``LinkHistogramAccumulator``). Timed: the same pass through the holdout view
(``TrainingRows``: the round of a job with ``--evaluate``), and the DP summary's exact
statistic (``exact_summary`` of the ``evaluate_summary`` round: histograms of the training rows plus
nearest-synthetic-row queries for up to 20 000 training and 20 000 held-out rows, 2 000
synthetic rows). Also the absolute time to draw the holdout positions at N = 10^7.

Part 2 -- signal: does the summary see memorisation? Three synthetic samples of 2 000 rows:
``fresh`` (new rows from the demo generator: what an ideal model would produce),
``copies`` (rows copied from the site's *training* rows: a model that memorised) and
``copies-old-split`` (rows copied from all of the site's rows, holdout included: what the old
evaluation, whose "holdout" had also trained the model, would have seen of the same
memorising model). Printed: the exact ``near_train`` / ``near_holdout`` shares, their ratio,
and one DP release of each at epsilon 1 (delta 1e-6) with its noise sd.

Usage: ``python bench/synth_evaluation.py [--rows N]``
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dpfed.common.data.demo_data import generate_demo
from dpfed.common.data.encoding import EncodedTable, EncodingReport, encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.evaluation.dp_summary import excess_near_copies, release_summary
from dpfed.common.evaluation.holdout import holdout_positions, job_key
from dpfed.common.evaluation.site_holdout import KEY_FILE, TrainingRows, site_secret
from dpfed.common.jobs.contract import Site
from dpfed.common.jobs.synth_evaluation import exact_summary
from dpfed.common.synth.link_release import LinkHistogramAccumulator
from dpfed.common.transport.protocol import Task

CHUNK = 65_536
N_BINS = 32


class Frame:
    """An encoded table as a site's DataAccess (chunked)."""

    def __init__(self, schema: Schema, table: EncodedTable) -> None:
        self._schema, self.table = schema, table

    @property
    def schema(self) -> Schema:
        return self._schema

    @property
    def row_count(self) -> int:
        """As a site's data: the count its first pass recorded (no extra counting pass)."""
        return self.table.n_rows

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        t = self.table
        for s in range(0, t.n_rows, CHUNK):
            n = min(CHUNK, t.n_rows - s)
            yield EncodedTable(t.schema, {k: v[s:s + n] for k, v in t.columns.items()},
                               n), EncodingReport()


def best_of(fn, repeat: int = 3) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def arrays_of(table: EncodedTable, idx: np.ndarray) -> dict[str, np.ndarray]:
    return {f"col:{k}": np.ascontiguousarray(v[idx]) for k, v in table.columns.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    args = ap.parse_args()
    schema, frames = generate_demo(2, args.rows, 12, seed=3, mixed=True)
    table, _ = encode_table(schema, frames[0])
    fresh, _ = encode_table(schema, frames[1])
    data = Frame(schema, table)
    state = Path(tempfile.mkdtemp())
    (state / KEY_FILE).write_bytes(bytes(range(32)))  # a fixed secret: reproducible figures
    site = Site(data, state / "ledger.sqlite")
    key = job_key(site_secret(state), "bench")

    def floor() -> None:
        acc = LinkHistogramAccumulator(schema, N_BINS)
        for t, _ in data.iter_chunks():
            acc.add(t)

    def holdout_pass() -> None:
        acc = LinkHistogramAccumulator(schema, N_BINS)
        for t, _ in TrainingRows(data, key).iter_chunks():
            acc.add(t)

    rng = np.random.default_rng(0)
    sample = arrays_of(fresh, rng.choice(fresh.n_rows, 2000, replace=False))
    task = Task("bench/evaluate_summary", "bench", "synth_eval_dp", 1.0, 1e-6,
                {"schema_digest": schema.digest(), "n_bins": N_BINS}, sample)
    t_floor = best_of(floor)
    t_hold = best_of(holdout_pass)
    t_summary = best_of(lambda: exact_summary(task, site), repeat=2)
    t_pos = best_of(lambda: holdout_positions(key, 10_000_000), repeat=2)
    print(f"Part 1 -- cost at one site, N = {table.n_rows}, {len(schema.columns)} columns")
    print(f"  floor (links pass over every row)        {t_floor * 1e3:8.1f} ms   1.00")
    print(f"  links pass through the holdout view      {t_hold * 1e3:8.1f} ms   "
          f"{t_hold / t_floor:.2f} x floor (+{(t_hold - t_floor) / table.n_rows * 1e9:.0f} "
          "ns per row)")
    print(f"  DP summary exact statistic (2000 synth)  {t_summary * 1e3:8.1f} ms   "
          f"{t_summary / t_floor:.2f} x floor")
    print(f"  holdout positions at N = 10^7 (20000)    {t_pos * 1e3:8.1f} ms")

    held = set(TrainingRows(data, key).positions.tolist())
    train_idx = np.array([i for i in range(table.n_rows) if i not in held])
    print("\nPart 2 -- signal: near shares (exact), ratio, and one DP release at eps 1")
    print(f"  {'sample':<18} {'near_train':>10} {'near_hold':>10} {'ratio':>7} "
          f"{'DP train':>9} {'DP hold':>9} {'sd':>7} {'excess':>7} {'DP excess':>9}")
    cases = {"fresh": sample,
             "copies": arrays_of(table, rng.choice(train_idx, 2000, replace=False)),
             "copies-old-split": arrays_of(table, rng.choice(table.n_rows, 2000,
                                                            replace=False))}
    for name, arrays in cases.items():
        t = Task("bench/evaluate_summary", "bench", "synth_eval_dp", 1.0, 1e-6,
                 {"schema_digest": schema.digest(), "n_bins": N_BINS}, arrays)
        exact = exact_summary(t, site)
        a_t = exact.scaled[-2] / exact.n_compared
        a_h = exact.scaled[-1] / exact.n_holdout
        out, meta = release_summary(exact, epsilon=1.0, delta=1e-6,
                                    rng=np.random.default_rng(5))
        ex = excess_near_copies(a_t, a_h, n_train=exact.n_train, n_synthetic=2000)
        dp_ex = excess_near_copies(float(out["near"][0]), float(out["near"][1]),
                                   n_train=exact.n_train, n_synthetic=2000)
        print(f"  {name:<18} {a_t:>10.4f} {a_h:>10.4f} {a_t / max(a_h, 1e-12):>7.2f} "
              f"{out['near'][0]:>9.4f} {out['near'][1]:>9.4f} "
              f"{meta['sigma_near_train']:>7.4f} {ex:>7.2f} {dp_ex:>9.2f}")
    print("\n(copies-old-split is what the old evaluation measured for a memorising model: "
          "when the 'holdout' also trained it, the two shares cannot differ.)")


if __name__ == "__main__":
    main()
