"""Federated synthesis under secure aggregation vs site-level: quality at the same budget.

Data: the 11 mixed columns of bench/synth_federated.py (4 continuous, 3 ordinal, 4 nominal,
from a latent Gaussian with a factor structure), split at random over 4 sites, plus a holdout
of real rows. At epsilon 0.5, 1 and 5 per site (delta 1e-6, the job's default split), on the
same sites' rows in every run:

* ``site``: the job's site-level rounds (each site's Gaussian histograms, each site's DP-PCA
  factor, combined) -- ``fit_federated`` of bench/synth_quality.py;
* ``secure``: the job's secure rounds run in-process with the real code
  (``fit_secure`` of bench/secure_synth_round.py): the job's own run, every site's
  ``synth_counts`` and ``synth_latent`` sums from the rounds' code, its Skellam share and
  its pairwise masks; the coordinator decodes only the sums and post-processes them exactly
  as the job does;
* ``1site``: the site-level pipeline on the pooled rows as ONE site (what a trusted curator
  running the same mechanism would get; the ceiling secure aggregation aims at);
* ``indep``: every column from its own DP histogram (the floor: no joint structure).

Metrics against the holdout (bench/synth_quality.py's): ``tvd1`` mean 1-way TVD, ``tvd2``
mean 2-way TVD over all column pairs, ``corr`` mean |correlation difference|; each the mean
over ``--runs`` runs. Printed side by side with the ratios secure / site and secure / 1site,
and the floor's tvd2 measured in the same run.

Usage: ``python bench/synth_secure.py [--quick] [--runs N] [--rows-per-site N]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from secure_synth_round import federation, fit_secure  # noqa: E402
from synth_federated import BINS, SCHEMA, make_data  # noqa: E402
from synth_quality import Metrics, fit_federated, independent_marginals  # noqa: E402

from dpfed.common.data.encoding import encode_table  # noqa: E402
from dpfed.common.evaluation.utility_metrics import table_correlation_error  # noqa: E402
from dpfed.common.job_params import SYNTH_DEFAULT_SPLIT  # noqa: E402
from dpfed.common.synth.link_release import histogram_sizes  # noqa: E402
from dpfed.common.synth.links import latent_dim  # noqa: E402

#: The job's split without the pair rounds (both paths: this bench compares the sums).
SPLIT = SYNTH_DEFAULT_SPLIT["generative"]


def scores(metrics: Metrics, syn: pd.DataFrame) -> dict[str, float]:
    t1, t2, _ = metrics.tvds(syn)
    return {"tvd1": t1, "tvd2": t2,
            "corr": table_correlation_error(metrics.holdout, syn, SCHEMA).mean_abs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 run, 2,000 rows per site")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rows-per-site", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    runs = 1 if args.quick else args.runs
    per = 2000 if args.quick else args.rows_per_site
    n_sites, delta, epsilons = 4, 1e-6, [0.5, 1.0, 5.0]
    ids = [f"site-{i}" for i in range(n_sites)]
    print(f"synth: {n_sites} sites x {per} rows, {len(SCHEMA.columns)} columns "
          f"({sum(histogram_sizes(SCHEMA, BINS))} histogram cells, latent dimension "
          f"{latent_dim(SCHEMA)}), delta {delta:g}, {runs} run(s); metrics vs a real holdout")
    results: dict[tuple[str, float], list[dict[str, float]]] = {}
    seconds = {"site": 0.0, "secure": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        fed = federation(Path(tmp), ids)
        for run in range(runs):
            frame, _ = make_data((n_sites + 1) * per, args.seed + run)
            train, holdout = frame.iloc[:n_sites * per], frame.iloc[n_sites * per:]
            metrics = Metrics(SCHEMA, "outcome", train, holdout, BINS)
            parts = np.array_split(np.random.default_rng(run).permutation(len(train)), n_sites)
            tables = [encode_table(SCHEMA, train.iloc[np.sort(p)])[0] for p in parts]
            pooled, _ = encode_table(SCHEMA, train)
            n = len(train)
            for eps in epsilons:
                rng = np.random.default_rng(1000 * run + int(eps * 10))
                t0 = time.perf_counter()
                site = fit_federated(SCHEMA, tables, eps, delta, SPLIT, BINS, rng)
                seconds["site"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                secure = fit_secure(SCHEMA, tables, ids, fed, eps, delta, rng, n_bins=BINS,
                                    split=SPLIT)
                seconds["secure"] += time.perf_counter() - t0
                one = fit_federated(SCHEMA, [pooled], eps, delta, SPLIT, BINS, rng)
                floor, _ = independent_marginals(SCHEMA, tables, eps, delta, n, BINS, rng)
                for name, syn in (("site", site.sample(n, rng=rng)),
                                  ("secure", secure.sample(n, rng=rng)),
                                  ("1site", one.sample(n, rng=rng)), ("indep", floor)):
                    results.setdefault((name, eps), []).append(scores(metrics, syn))
            print(f"  run {run + 1}/{runs} done", flush=True)

    def mean(name: str, eps: float, key: str) -> float:
        return float(np.mean([r[key] for r in results[(name, eps)]]))

    print(f"\n{'eps':>5} {'metric':>6} {'site':>8} {'secure':>8} {'1site':>8} {'indep':>8} "
          f"{'secure/site':>12} {'secure/1site':>13}")
    for eps in epsilons:
        for key in ("tvd1", "tvd2", "corr"):
            v = {m: mean(m, eps, key) for m in ("site", "secure", "1site", "indep")}
            print(f"{eps:>5g} {key:>6} {v['site']:>8.4f} {v['secure']:>8.4f} "
                  f"{v['1site']:>8.4f} {v['indep']:>8.4f} "
                  f"{v['secure'] / v['site']:>12.2f} {v['secure'] / v['1site']:>13.2f}")
    fits = runs * len(epsilons)
    print(f"\nfit time per job (4 sites in-process, 1 core): site-level "
          f"{seconds['site'] / fits:.2f} s, secure {seconds['secure'] / fits:.2f} s "
          f"(ratio {seconds['secure'] / max(seconds['site'], 1e-9):.2f})")


if __name__ == "__main__":
    main()
