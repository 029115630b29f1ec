"""Secure PCA against a central analytic Gaussian curator, side by side in one run.

The DPdisPCA paper's set-up (as bench/pca_job_centring.py): D = 200, S = 10 sites x 1,000 rows
in the unit ball, K = 50, R = 100, delta = 0.01, epsilon in {0.5, 1, 5}. Quality: the captured
variance ``tr(V_K^T C V_K) / tr(U_K^T C U_K)``, C the covariance of the pooled rows about their
true mean, U_K its top-K eigenvectors (mean and smallest over the runs).

Every job is the default pca job (centred, ``clip_norm auto``), validated, settled on the sites'
public facts (``pld`` ledgers) and run in-process through the coordinator's
:func:`dpfed.aggregator.jobs.pca.run` and the rounds' own site and pooling code
(bench/pca_job_centring.py's ``InProcessJob``; a secure round is one in-process secure sum with
real signed keys and pairwise masks, decoded and checked as the coordinator does):

* ``central``: a trusted curator holding every row -- the same job at site level over one site
  with the pooled 10,000 rows: analytic Gaussian noise on each pooled release, its own settled
  split (one release per round);
* ``secure t=1``: the secure job under the sites' default policy (t = 1 colluder: every share
  is ``mu / (n - 1)``, so the pooled noise is ``n / (n - 1)`` times ``mu``), settled split;
* ``secure t=1, fixed``: the same job stored without a split (jobs made before: 10 / 10 / 80 %
  of epsilon and delta, basic composition);
* ``secure t=0``: the settled secure job when no colluder is tolerated.

Then, with ``--demo-runs``, the demo data (generated like ``dpfed simulate``: S sites x 20,000
rows, 20 columns, K = 5, delta = 1e-5, t = 1) at 3 and 4 sites: secure against site level.

Run: ``nice -n 19 python bench/secure_pca_central.py [--runs 5] [--demo-runs 3]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pca_job_centring import (  # noqa: E402
    DELTA,
    EPSILONS,
    D,
    K,
    covariance,
    paper_data,
    run_job,
    schema_of,
    tables_of,
)

from dpfed.common.pca.dppca import captured_energy, top_components  # noqa: E402
from dpfed.common.transport.certs import init_federation  # noqa: E402

DEFAULT = {"n_components": K}
SECURE = {"n_components": K, "aggregation": "secure"}


def row(name: str, values: dict[float, list[float]], central: dict[float, list[float]]) -> str:
    """One table row: mean (min) per epsilon, and the gap of the means to ``central``."""
    cells = "".join(f"{np.mean(values[e]):>8.3f} ({np.min(values[e]):.3f})" for e in EPSILONS)
    gaps = "".join(f"{np.mean(values[e]) - np.mean(central[e]):>+8.3f}" for e in EPSILONS)
    return f"{name:<22}{cells}   {gaps}"


def paper(runs: int, seed: int, fed_dir: Path) -> None:
    """The DPdisPCA set-up: central, secure (t = 1 settled and fixed, t = 0 settled)."""
    rng = np.random.default_rng(seed)
    schema = schema_of(D)
    names = ["central", "secure t=1", "secure t=1, fixed", "secure t=0"]
    results: dict[str, dict[float, list[float]]] = {n: {e: [] for e in EPSILONS} for n in names}
    splits: dict[str, Any] = {}
    fed = fed_dir / "paper"
    started = time.perf_counter()
    for _ in range(runs):
        sites, tables, cov, best = paper_data(rng, schema)
        if not fed.exists():
            init_federation(fed, coordinator_hosts=["localhost"], sites=list(tables),
                            analysts=[])
        central_table = tables_of(schema, [np.vstack(sites)])
        jobs: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]] = {
            "central": (central_table, DEFAULT, {}),
            "secure t=1": (tables, SECURE, {"fed": fed, "tolerated": 1}),
            "secure t=1, fixed": (tables, SECURE, {"fed": fed, "tolerated": 1,
                                                   "settle": False}),
            "secure t=0": (tables, SECURE, {"fed": fed}),
        }
        for eps in EPSILONS:
            for name, (on, params, options) in jobs.items():
                comps, meta = run_job(schema, on, eps, DELTA, params, **options)
                results[name][eps].append(captured_energy(comps, cov) / best)
                splits[f"{name} {eps:g}"] = (meta.get("split"), meta.get("clip_norm"))
    print(f"D={D}, S=10, N_s=1000, K={K}, R={2 * K}, delta={DELTA}, {runs} runs, pld ledgers; "
          "captured variance / non-private, mean (min)")
    print(f"{'':<22}" + "".join(f"{f'eps {e:g}':>17}" for e in EPSILONS)
          + "   " + "".join(f"{f'-central {e:g}':>8}" for e in EPSILONS))
    for name in names:
        print(row(name, results[name], results["central"]))
    print("settled splits (shares of mu^2 / of delta) and the clip radius, last run:")
    for key, (split, clip) in splits.items():
        shares = ("none (10/10/80 % of epsilon and delta)" if split is None else
                  ", ".join(f"{n} {s:.3f}/{d:.2f}" for n, (s, d) in split.items()))
        print(f"  {key}: {shares}; clip {clip:.3f}")
    print(f"({time.perf_counter() - started:.0f} s)")


def demo(runs: int, fed_dir: Path) -> None:
    """The demo data at 3 and 4 sites, t = 1: secure against site level (module docstring)."""
    from dpfed.common.data.demo_data import generate_demo
    from dpfed.common.data.encoding import encode_table
    from dpfed.common.pca.features import UnitBallMap

    k = 5
    print(f"\ndemo data: S sites x 20000 rows, 20 columns, K={k}, delta=1e-5, t=1, {runs} runs;"
          " captured variance / non-private, mean (min)")
    print(f"{'':<22}" + "".join(f"{f'eps {e:g}':>17}" for e in EPSILONS)
          + "   " + "".join(f"{f'-site {e:g}':>8}" for e in EPSILONS))
    for n_sites in (3, 4):
        schema, frames = generate_demo(n_sites, 20_000, 20, seed=n_sites)
        tables = {f"hospital-{i + 1}": encode_table(schema, f)[0] for i, f in enumerate(frames)}
        cov = covariance(np.vstack([UnitBallMap(schema).scaled(t) for t in tables.values()]))
        best = captured_energy(top_components(cov, k), cov)
        fed = fed_dir / f"demo{n_sites}"
        init_federation(fed, coordinator_hosts=["localhost"], sites=list(tables), analysts=[])
        vals: dict[str, dict[float, list[float]]] = {"site": {}, "secure": {}}
        for eps in EPSILONS:
            for _ in range(runs):
                vals["site"].setdefault(eps, []).append(captured_energy(run_job(
                    schema, tables, eps, 1e-5, {"n_components": k}, tolerated=1)[0],
                    cov) / best)
                vals["secure"].setdefault(eps, []).append(captured_energy(run_job(
                    schema, tables, eps, 1e-5, {"n_components": k, "aggregation": "secure"},
                    fed=fed, tolerated=1)[0], cov) / best)
        for mode in ("site", "secure"):
            print(row(f"{n_sites} sites, {mode}", vals[mode], vals["site"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=2018)
    ap.add_argument("--demo-runs", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.runs:
            paper(a.runs, a.seed, Path(tmp))
        if a.demo_runs:
            demo(a.demo_runs, Path(tmp))


if __name__ == "__main__":
    main()
