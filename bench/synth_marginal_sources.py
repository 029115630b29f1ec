"""Where a synthetic column's 1-way error comes from: the release, the decode or the sampling.

For every column of a ``bench/real_tables.py`` table (the suite's split, seed 7, IID sites),
the 1-way TVD against the holdout on the suite's evaluation cells
(:mod:`synth_metrics`: quantile cells of the training rows) of

``real``
    the training rows (the floor);
``indep``
    the column's own DP 1-way release with the whole budget, decoded (the suite's ``indep``);
``release``
    the secure job's released 1-way marginal (``--composition zcdp``, the job's defaults)
    decoded by its inverse CDF on independent normals -- the marginal the model was given;
``decode``
    the model's latent rows decoded by its calibrated links, before the pair correction;
``synth``
    the job's synthetic rows (pair correction included);
``syn~rel``
    ``synth`` against ``release`` (both of ``--rows`` rows): 0 up to sampling error when the
    model samples its released marginal.

``--rows`` (default 200 000) rows per decoded table, so the sampling error of the synthetic
rows is small against the release's; every cell is the mean of ``--runs`` runs.

Usage: ``OPENBLAS_NUM_THREADS=1 python bench/synth_marginal_sources.py --tables nmes1988 rwm1984``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_tables import TABLES, load_table, split_sites  # noqa: E402
from secure_synth_round import federation, fit_secure  # noqa: E402
from synth_metrics import Metrics, tvd  # noqa: E402
from synth_quality import independent_marginals  # noqa: E402

from dpfed.common.data.encoding import EncodedTable, encode_table  # noqa: E402
from dpfed.common.synth.missing_cells import from_cells_table  # noqa: E402

DELTA = 1e-6
BINS = 32
SOURCES = ("indep", "release", "decode", "synth", "syn~rel")
SITE_IDS = [f"site-{i}" for i in range(4)]


def sources(name: str, eps: float, runs: int, rows: int, fed: Path) -> None:
    """Print the per-column table of one table and epsilon."""
    schema, frame, target = load_table(name)
    sites, holdout = split_sites(frame, 4, iid=True, seed=7, holdout=0.3)
    train = pd.concat(sites, ignore_index=True)
    metrics = Metrics(schema, target, train, holdout)
    encoded = [encode_table(schema, s)[0] for s in sites]
    real = metrics.column_tvds(metrics.train_enc)[0]
    found: dict[str, list[dict[str, float]]] = {k: [] for k in SOURCES}
    for run in range(runs):
        rng = np.random.default_rng([7, int(round(eps * 1000)), run])
        indep, _ = independent_marginals(schema, [metrics.train_enc], eps, DELTA, rows, BINS,
                                         rng)
        model = fit_secure(schema, encoded, SITE_IDS, fed, eps, DELTA, rng, n_bins=BINS,
                           composition="zcdp")
        release = from_cells_table(
            model.links.from_latent(rng.standard_normal((rows, model.links.dim))), schema)
        decode = from_cells_table(
            model.decode_links.from_latent(model.factor_model.latent(rows, rng)), schema)
        synth = encode_table(schema, model.sample(rows, rng=rng))[0]
        tables: dict[str, EncodedTable] = {
            "indep": encode_table(schema, indep)[0], "release": release, "decode": decode,
            "synth": synth}
        for key, table in tables.items():
            found[key].append(metrics.column_tvds(table)[0])
        a, b = metrics.cells.codes(synth), metrics.cells.codes(release)
        found["syn~rel"].append({c: tvd(a[c][0], b[c][0], a[c][1]) for c in a})
    print(f"\n== {name}, epsilon {eps:g} ({len(train)} training rows; mean of {runs} runs, "
          f"{rows} rows per decoded table): 1-way TVD against the holdout")
    print(f"{'column':>12} {'real':>7} " + " ".join(f"{k:>7}" for k in SOURCES))
    for col in real:
        cells = [float(np.mean([d[col] for d in found[k]])) for k in SOURCES]
        print(f"{col:>12} {real[col]:7.3f} " + " ".join(f"{v:7.3f}" for v in cells))
    means = [float(np.mean([np.mean(list(d.values())) for d in found[k]])) for k in SOURCES]
    print(f"{'mean':>12} {np.mean(list(real.values())):7.3f} "
          + " ".join(f"{v:7.3f}" for v in means), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", nargs="+", default=["nmes1988", "rwm1984"], choices=TABLES)
    ap.add_argument("--eps", nargs="+", type=float, default=[1.0, 5.0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--rows", type=int, default=200_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fed = federation(Path(tmp), SITE_IDS)
        for name in args.tables:
            for eps in args.eps:
                sources(name, eps, args.runs, args.rows, fed)


if __name__ == "__main__":
    main()
