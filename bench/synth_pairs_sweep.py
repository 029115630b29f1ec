"""The pair rounds' two knobs on real tables: ``pair_groups`` and the pairs round's share.

For each table (flchain, health_insurance), epsilon (``--eps``, default 0.5 and 1) and setting
(``--groups`` x ``--pairs-shares``; the links round gives or takes the difference to the job's
default pairs share, :func:`synth_quality.pairs_split`), ``central+pairs``
(``FactorModelSynthesizer`` on the pooled rows) and ``fed-iid+pairs`` (4 IID sites) are fitted
``--reps`` times with fresh noise (the same noise seeds for every setting) and scored against
the real holdout (``Metrics`` of ``bench/synth_quality.py``). The same rows without the pair rounds
(the job's split with ``pairs`` = 0) are the floor measured in the same run: each cell prints
tvd2 / tvd2max / auc and the tvd2 ratio to that floor (< 1: the pairs help).

Usage: ``python bench/synth_pairs_sweep.py [--tables flchain health_insurance] [--eps 0.5 1]
[--groups 4 6 8] [--pairs-shares 0.08 0.12 0.2] [--reps 3]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_tables import TABLES, load_table, split_sites  # noqa: E402
from synth_quality import (  # noqa: E402
    NO_PAIRS_SPLIT,
    Metrics,
    fit_central,
    fit_federated,
    pairs_split,
)

from dpfed.common.data.encoding import encode_table  # noqa: E402
from dpfed.common.synth.factor_model import FactorModelSynthesizer  # noqa: E402
from dpfed.common.synth.pair_marginals import DEFAULT_GROUPS  # noqa: E402
from dpfed.common.synth.quantile_link import DEFAULT_BINS  # noqa: E402

DELTA = 1e-6
KEYS = ("tvd1", "tvd2", "tvd2max", "auc")


def scores(metrics: Metrics, fit: Any, n: int, reps: int, key: list[int]) -> dict[str, float]:
    """Mean metrics of ``reps`` fits (noise seeds ``key + [rep]``)."""
    out = []
    for rep in range(reps):
        rng = np.random.default_rng([*key, rep])
        model = fit(rng)  # FactorModelSynthesizer samples with its own generator (rng)
        syn = (model.sample(n) if isinstance(model, FactorModelSynthesizer)
               else model.sample(n, rng=rng))
        t1, t2, t2m = metrics.tvds(syn)
        out.append((t1, t2, t2m, metrics.auc(syn)))
    return dict(zip(KEYS, np.mean(out, axis=0).tolist(), strict=True))


def run(table: str, epsilons: list[float], groups: list[int], shares: list[float], reps: int,
        seed: int) -> None:
    """Print one block per (table, epsilon)."""
    schema, frame, target = load_table(table)
    sites, holdout = split_sites(frame, 4, iid=True, seed=seed)
    train = pd.concat(sites, ignore_index=True)
    metrics = Metrics(schema, target, train, holdout, DEFAULT_BINS)
    parts = {"central": [encode_table(schema, train)[0]],
             "fed-iid": [encode_table(schema, s)[0] for s in sites]}
    n = len(train)

    def fit(method: str, tables: list[Any], eps: float, split: Any, groups: int,
            rng: np.random.Generator) -> Any:
        """``central``: FactorModelSynthesizer; ``fed-iid``: the job's rounds over 4 sites."""
        if method == "central":
            return fit_central(schema, train, eps, DELTA, split, DEFAULT_BINS, rng,
                               pair_groups=groups)
        return fit_federated(schema, tables, eps, DELTA, split, DEFAULT_BINS, rng,
                             pair_groups=groups)

    for eps in epsilons:
        print(f"\n{table}, epsilon {eps:g}, mean of {reps}: tvd1 / tvd2 / tvd2max / auc "
              "(tvd2 ratio to the same method without pairs)")
        for method, tables in parts.items():
            key = [seed, int(round(eps * 1000)), len(tables)]
            base = scores(metrics, lambda rng, m=method, t=tables, e=eps: fit(
                m, t, e, NO_PAIRS_SPLIT, DEFAULT_GROUPS, rng), n, reps, key)
            print(f"  {method:>8} {'no pairs':<24} " + " / ".join(
                f"{base[k]:.4f}" for k in KEYS), flush=True)
            for g in groups:
                for share in shares:
                    split = pairs_split(share)
                    got = scores(metrics, lambda rng, m=method, t=tables, e=eps, s=split,
                                 g=g: fit(m, t, e, s, g, rng), n, reps, key)
                    label = f"groups {g:>2} pairs {share:.2f}"
                    print(f"  {method:>8} {label:<24} " + " / ".join(
                        f"{got[k]:.4f}" for k in KEYS)
                        + f"  (x{got['tvd2'] / base['tvd2']:.2f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", nargs="+", default=list(TABLES), choices=TABLES)
    ap.add_argument("--eps", nargs="+", type=float, default=[0.5, 1.0])
    ap.add_argument("--groups", nargs="+", type=int, default=[4, 6, 8])
    ap.add_argument("--pairs-shares", nargs="+", type=float, default=[0.08, 0.12, 0.2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    for share in args.pairs_shares:
        try:
            pairs_split(share)
        except ValueError as exc:
            raise SystemExit(f"--pairs-shares: {exc}") from None
    for table in args.tables:
        run(table, args.eps, args.groups, args.pairs_shares, args.reps, args.seed)


if __name__ == "__main__":
    main()
