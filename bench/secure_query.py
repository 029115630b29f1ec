"""Secure aggregation for the matrix mechanism: answers' RMSE, secure vs site-level vs central.

Set-up: one federation of S site processes (real mTLS gRPC on loopback, ledgers on disk, mixed
demo data, default 3 x 20,000 rows); two workloads — all ranges over ``age`` in 32 public bins
and the 2-way marginal ``ward x severity`` — at epsilon 0.5, 1 and 5 (delta 1e-5). For each:

* **site-level**: ``dpfed query --noise gaussian`` — every site adds Gaussian noise calibrated
  to its own rows and the coordinator sums S noisy vectors;
* **secure (Skellam)**: ``--aggregation secure --secure-noise skellam`` — one secure sum of
  ``Ã x_s``, distributed Skellam noise sized for the sites' policy (``--tolerated t``
  colluders, default 1 as in site.toml);
* **secure (discrete Laplace)**: ``--aggregation secure --secure-noise dlaplace --delta 0`` —
  the same sum with Pólya shares of a discrete Laplace (pure epsilon); ``auto`` (what a new
  secure job runs) takes whichever of the two has the lower expected RMSE (column ``auto``);
* **central** (the floor, measured in the same run): a trusted curator's single analytic
  Gaussian release of the pooled histogram through the same strategy (the one the secure job
  chose), reconstructed by least squares — computed here from the true pooled histogram.

Printed per workload and epsilon: observed RMSE over the workload's answers (mean over the
repeats) and the closed-form expected RMSE of each mode, and the ratios Skellam / central and
secure / site-level for both noises. Expected: Skellam / central ~ sqrt(n / (n - t)) (the
shares the t tolerated colluders might know are added on top) times the Skellam accountant's
slack over the analytic Gaussian; discrete Laplace / site-level Laplace ~ sqrt(1 / (n - t))
where both use the same strategy (small marginals).

Run: ``python bench/secure_query.py [--quick] [--sites S] [--rows N] [--repeats R]
[--tolerated T] [--site-noise auto]`` (``auto``: the site level's Laplace or Gaussian, whichever
ranks best -- what ``dpfed simulate --job query`` runs; Laplace wins on the 20-cell marginal).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from dpfed.aggregator.local_federation import LocalFederation, SiteSettings  # noqa: E402
from dpfed.aggregator.query_results import QueryJobResult  # noqa: E402
from dpfed.common.data.data_sources import open_data_source, spec_from_path  # noqa: E402
from dpfed.common.data.schema import Schema  # noqa: E402
from dpfed.common.queries.federated_matrix import (  # noqa: E402
    SiteMatrixRelease,
    per_query_std_error,
)
from dpfed.common.queries.matrix_mechanism import reconstruct  # noqa: E402
from dpfed.common.queries.query_language import compile_query_set  # noqa: E402
from dpfed.common.queries.workload_spec import build_workload, choose_strategy  # noqa: E402

EPSILONS = (0.5, 1.0, 5.0)
DELTA = 1e-5
#: (column, aggregation, secure noise, delta) of the modes compared.
MODES: tuple[tuple[str, str, str, float], ...] = (
    ("site", "site", "auto", DELTA), ("skellam", "secure", "skellam", DELTA),
    ("dlaplace", "secure", "dlaplace", 0.0))
WORKLOADS: tuple[tuple[str, list[str], dict[str, Any], list[Any]], ...] = (
    ("all ranges, age in 32 bins", ["age"], {"bins": {"age": 32}, "workload": "all_range"},
     [{"per": "age", "bins": 32}]),
    ("2-way marginal ward x severity", ["ward", "severity"], {"workload": "marginals", "k": 2},
     [{"cross": ["ward", "severity"]}]),
)


def pooled_truth(fed: LocalFederation, raw: list[Any]) -> np.ndarray:
    """The true pooled histogram (a benchmark may look; a coordinator never does)."""
    schema = Schema.load(fed.schema_path)
    q = compile_query_set(schema, raw)
    total = np.zeros(0)
    for s in fed.site_ids:
        src = open_data_source(spec_from_path(fed.data_paths[s]), schema)
        counts = q.counts(t for t, _ in src.iter_chunks())[0]
        total = counts if total.size == 0 else total + counts
    return total


def workload_of(result: QueryJobResult) -> Any:
    """The workload a result answered, rebuilt from its metadata."""
    w = dict(result.metadata["workload"])
    if w["kind"] != "marginals":
        w.pop("k", None)
    return build_workload(result.domain, w)


def central(result: QueryJobResult, truth: np.ndarray, epsilon: float, draws: int,
            rng: np.random.Generator) -> tuple[float, float]:
    """Observed and expected RMSE of one central analytic Gaussian release of the pooled data."""
    workload = workload_of(result)
    pick = choose_strategy(workload, strategy_name="auto", noises=("gaussian",),
                           epsilon=epsilon, delta=DELTA, n_sites=1)
    a = pick.matrix
    mech = SiteMatrixRelease(a, epsilon, DELTA, "gaussian")
    exact = workload.answer(truth)
    sq = [np.mean((workload.answer(reconstruct(mech.release(truth, rng), a)) - exact) ** 2)
          for _ in range(draws)]
    se = per_query_std_error(workload, a, noise_variance=mech.noise_variance, n_sites=1)
    return float(np.sqrt(np.mean(sq))), float(np.sqrt(np.mean(se ** 2)))


def observed(result: QueryJobResult, truth: np.ndarray) -> float:
    """RMSE of a job's answers against the true pooled answers."""
    exact = workload_of(result).answer(truth)
    return float(np.sqrt(np.mean((result.arrays["answers"] - exact) ** 2)))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 x 5,000 rows, 1 repeat")
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tolerated", type=int, default=1,
                    help="the sites' secure_tolerated_colluders t (their default is 1)")
    ap.add_argument("--site-noise", choices=("gaussian", "auto"), default="gaussian",
                    help="the site-level jobs' noise: gaussian (default), or auto -- Laplace "
                         "or Gaussian, whichever ranks best, as `dpfed query` picks")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.repeats = 5_000, 1
    rng = np.random.default_rng(2026)
    budget = 2 * len(MODES) * sum(EPSILONS) * len(WORKLOADS) * args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        fed = LocalFederation.create(Path(tmp) / "fed", n_sites=args.sites, rows=args.rows,
                                     features=8, seed=3, mixed=True, task_deadline_s=600,
                                     settings=SiteSettings(budget_epsilon=budget,
                                                           budget_delta=0.5,
                                                           connect_timeout_s=120))
        for site in fed.site_ids:  # the sites' policy: how many colluders their shares cover
            path = fed.site_config(site)
            path.write_text(path.read_text().replace(
                "[policy]\n", f"[policy]\nsecure_tolerated_colluders = {args.tolerated}\n", 1))
        fed.start_coordinator()
        fed.start_sites()
        rows: list[tuple[Any, ...]] = []
        t0 = time.perf_counter()
        try:
            fed.wait_for_sites(timeout=300)
            with fed.analyst(timeout=600) as coord:
                for label, cols, kw, raw in WORKLOADS:
                    truth = pooled_truth(fed, raw)
                    for eps in EPSILONS:
                        obs: dict[str, list[float]] = {m: [] for m, *_ in MODES}
                        exp: dict[str, float] = {}
                        results: dict[str, QueryJobResult] = {}
                        for _ in range(args.repeats):
                            for mode, aggregation, secure_noise, delta in MODES:
                                noise = args.site_noise if mode == "site" else "auto"
                                res: QueryJobResult = coord.query(
                                    cols, epsilon=eps, delta=delta, noise=noise,
                                    aggregation=aggregation, secure_noise=secure_noise, **kw)
                                obs[mode].append(observed(res, truth))
                                exp[mode] = res.expected_rmse
                                results[mode] = res
                        c_obs, c_exp = central(results["skellam"], truth, eps, 20, rng)
                        rows.append((label, eps, {m: r.strategy for m, r in results.items()},
                                     {m: float(np.mean(v)) for m, v in obs.items()}, exp,
                                     c_obs, c_exp))
                        print(f"  done: {label}, epsilon {eps:g} "
                              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        finally:
            fed.stop_all()
    print(f"\n{args.sites} sites x {args.rows} rows, delta {DELTA:g}, t = {args.tolerated}, "
          f"{args.repeats} repeat(s), site-level noise {args.site_noise}; RMSE per workload "
          "answer (observed / closed-form expected)")
    head = (f"{'workload':32s} {'eps':>4s} {'site-level':>17s} {'secure Skellam':>17s} "
            f"{'secure DLap':>17s} {'central':>17s} {'Sk/central':>11s} {'Sk/site':>11s} "
            f"{'DLap/site':>11s} {'auto':>8s} {'auto/site':>9s}")
    print(head)
    for label, eps, strat, o, e, co, ce in rows:
        auto = "skellam" if e["skellam"] < e["dlaplace"] else "dlaplace"
        print(f"{label:32s} {eps:4g} {o['site']:8.2f}/{e['site']:8.2f} "
              f"{o['skellam']:8.2f}/{e['skellam']:8.2f} {o['dlaplace']:8.2f}/{e['dlaplace']:8.2f} "
              f"{co:8.2f}/{ce:8.2f} {o['skellam'] / co:5.2f}/{e['skellam'] / ce:5.2f} "
              f"{o['skellam'] / o['site']:5.2f}/{e['skellam'] / e['site']:5.2f} "
              f"{o['dlaplace'] / o['site']:5.2f}/{e['dlaplace'] / e['site']:5.2f} {auto:>8s} "
              f"{e[auto] / e['site']:9.2f}")
        print(f"{'':32s}      strategies: " + ", ".join(f"{m} {s}" for m, s in strat.items()))
    n, t = args.sites, args.tolerated
    print(f"(ratios observed/expected; theory for the expected ratios: Skellam/central ~ "
          f"sqrt(n/(n-t)) = {np.sqrt(n / (n - t)):.2f} x the Skellam accountant's slack; "
          f"DLap/site-level Laplace ~ sqrt(1/(n-t)) = {np.sqrt(1 / (n - t)):.2f} on the same "
          "strategy)")


if __name__ == "__main__":
    main()
