"""Federated synthesis (``dpfed synth``): quality vs epsilon, generation speed, fit time.

Part 1 -- quality. Data: 11 mixed columns like a small health/insurance table -- 4
continuous (log-normal length of stay, bimodal lab, skewed cost, Gaussian age), 3 ordinal, 3
nominal and a binary ``outcome`` -- from a latent Gaussian with a factor structure
(:func:`make_data`). The table, the methods (independent DP marginals, the central
``FactorModelSynthesizer``, the federated job with IID and non-IID sites), the metrics and the
ratios are those of ``bench/synth_quality.py --table generated``, which also runs the real
tables.

Part 2 -- generation at the coordinator: ``bench/synth_generation.py`` (a model over 20 mixed
columns writes ``--rows`` rows to Parquet; rows/s against a floor measured in the same run --
the normal draws and their product plus writing a pre-built table -- and memory at N and 4N).

Part 3 -- fitting the model (correlation correction included) at latent dimension 200 and
400, and the old ``latent_correlation`` at 200 for the ratio.

Usage: ``python bench/synth_federated.py [--quick] [--rows N] [--skip-quality]``
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import special

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfed.common.data.schema import (  # noqa: E402
    ContinuousColumn,
    NominalColumn,
    OrdinalColumn,
    Schema,
)
from dpfed.common.job_params import SYNTH_DEFAULT_SPLIT  # noqa: E402
from dpfed.common.pca.dppca import PCAEstimate  # noqa: E402
from dpfed.common.synth.factor_model import (  # noqa: E402
    dp_second_moment,
    latent_correlation,
)
from dpfed.common.synth.generative import fit_factor_model  # noqa: E402
from dpfed.common.synth.link_release import (  # noqa: E402
    histogram_sizes,
    links_from_proportions,
)

BINS = 32
SCHEMA = Schema((
    ContinuousColumn("los", 0.0, 60.0), ContinuousColumn("lab", -10.0, 10.0),
    ContinuousColumn("cost", 0.0, 50_000.0), ContinuousColumn("age", 18.0, 95.0),
    OrdinalColumn("severity", ("1", "2", "3", "4")), OrdinalColumn("bmi_band", ("lo", "mid", "hi")),
    OrdinalColumn("visits", ("0", "1-2", "3-5", "6+")),
    NominalColumn("region", ("n", "s", "e", "w")), NominalColumn("plan", ("a", "b", "c")),
    NominalColumn("sex", ("f", "m")), NominalColumn("outcome", ("no", "yes")),
))


# --------------------------------------------------------------------------- data


def make_data(n: int, seed: int) -> tuple[pd.DataFrame, np.ndarray]:
    """Rows and their first latent factor (used for the non-IID split)."""
    rng = np.random.default_rng(seed)
    k = 3
    load = rng.uniform(-0.8, 0.8, (11, k))
    f = rng.standard_normal((n, k))
    z = f @ load.T + rng.standard_normal((n, 11)) * 0.6
    z = (z - z.mean(0)) / z.std(0)
    cut = lambda x, qs: np.digitize(x, special.ndtri(np.asarray(qs)))  # noqa: E731
    frame = pd.DataFrame({
        "los": np.clip(np.exp(1.3 + 0.7 * z[:, 0]), 0, 60),
        "lab": np.clip(np.where(z[:, 1] > 0.3, 3.5, -2.5) + 1.2 * rng.standard_normal(n)
                       + 0.3 * z[:, 1], -10, 10),
        "cost": np.clip(np.exp(8.0 + 0.9 * z[:, 2]), 0, 50_000),
        "age": np.clip(55 + 14 * z[:, 3], 18, 95),
        "severity": np.array(["1", "2", "3", "4"])[cut(z[:, 4], [0.4, 0.75, 0.92])],
        "bmi_band": np.array(["lo", "mid", "hi"])[cut(z[:, 5], [0.25, 0.8])],
        "visits": np.array(["0", "1-2", "3-5", "6+"])[cut(z[:, 6], [0.3, 0.7, 0.9])],
        "region": np.array(["n", "s", "e", "w"])[cut(z[:, 7], [0.2, 0.5, 0.8])],
        "plan": np.array(["a", "b", "c"])[cut(z[:, 8], [0.5, 0.85])],
        "sex": np.array(["f", "m"])[cut(z[:, 9], [0.52])],
        "outcome": np.array(["no", "yes"])[cut(z[:, 10] + 0.0, [0.7])],
    })
    return frame, f[:, 0]


# --------------------------------------------------------------------------- parts


def part_quality(n_per_site: int, epsilons: list[float], seed: int) -> None:
    """Part 1: the quality table of ``bench/synth_quality.py`` on this generated table."""
    import synth_quality

    links = SYNTH_DEFAULT_SPLIT["generative"]["links"]
    synth_quality.run("generated", epsilons, links, BINS, seed, reps=1 if n_per_site < 5000
                      else 3, n_rows=5 * n_per_site)


def part_generation(rows: int) -> None:
    """Generation speed and memory: ``bench/synth_generation.py`` (floor measured in the run)."""
    import synth_generation  # bench/ is on sys.path when this script runs

    print(f"\nPart 2: generation at the coordinator, {rows:,} rows streamed to Parquet")
    synth_generation.run(rows, rounds=2)


def _wide_links(p: int) -> Any:
    cols = []
    for i in range(p):
        if i % 5 == 3:
            cols.append(OrdinalColumn(f"o{i}", ("a", "b", "c", "d")))
        elif i % 5 == 4:
            cols.append(NominalColumn(f"n{i}", ("x", "y")))
        else:
            cols.append(ContinuousColumn(f"c{i}", 0.0, 1.0))
    schema = Schema(tuple(cols))
    props = np.concatenate([np.full(s, 1.0 / s) for s in histogram_sizes(schema, BINS)])
    return links_from_proportions(schema, props, BINS)


def part_fit(dims: list[int], old_at: int | None) -> None:
    print("\nPart 3: fitting the generative model (correlation correction included)")
    for p in dims:
        links = _wide_links(p)
        d = links.dim
        rng = np.random.default_rng(p)
        a = rng.standard_normal((d, 6))
        cov = a @ a.T + np.eye(d)
        sd = np.sqrt(np.diag(cov))
        m = cov / np.outer(sd, sd) / d
        w, v = np.linalg.eigh(m)
        est = PCAEstimate(np.ascontiguousarray(v[:, ::-1].T), w[::-1], float(w.sum()))
        t = time.perf_counter()
        fit_factor_model(est, links, clip_norm=math.sqrt(d), rng=rng)
        new = time.perf_counter() - t
        line = f"  latent dimension {d}: fit {new:.1f}s"
        if old_at is not None and p == old_at:
            t = time.perf_counter()
            latent_correlation(dp_second_moment(est, d), links, clip_norm=math.sqrt(d), rng=rng)
            old = time.perf_counter() - t
            line += f"; the old latent_correlation alone {old:.1f}s (x{old / new:.1f})"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, two epsilons")
    ap.add_argument("--rows", type=int, default=2_000_000, help="rows for part 2")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-fit", action="store_true")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    if not args.skip_quality:
        part_quality(1500 if args.quick else 5000, [1.0, 5.0] if args.quick
                     else [0.5, 1.0, 2.0, 5.0], args.seed)
    part_generation(min(args.rows, 300_000) if args.quick else args.rows)
    if not args.skip_fit:
        part_fit([40] if args.quick else [200, 400], None if args.quick else 200)


if __name__ == "__main__":
    main()
