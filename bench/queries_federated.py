"""Federated queries: matrix-mechanism RMSE at 4 sites vs its closed form and vs identity, and
SVT precision/recall of "above T" against the true per-site answers.

1. Matrix mechanism (``dpfed query``), 4 sites, replace-one sensitivities, each site releasing
   ``A x_s + noise`` with the same code the site handler runs
   (:class:`dpfed.common.queries.federated_matrix.SiteMatrixRelease`), the coordinator
   summing and reconstructing by least squares. Workloads: all ranges over n = 256 cells and
   the 2-way marginals of an 8 x 8 x 4 domain (256 cells). For each, the strategy chosen
   from public information (:func:`dpfed.common.queries.workload_spec.choose_strategy`) and
   the identity strategy (the floor every other strategy is compared with, measured in the
   same run) are run ``--runs`` times; printed: observed per-query RMSE, the closed form,
   their ratio with a 95% sampling interval (it must contain 1), and identity / chosen.
2. SVT (``dpfed svt``): 4 sites x 200 counting queries whose true answers straddle T; each
   site runs Alg. 1 (the site's own step, :func:`dpfed.common.queries.svt_stream.answer_batch`)
   with cut-off c; printed: precision and recall of the "above" answers among the examined
   queries, and how many true positives were reached before the cut-off, at several epsilon.

Usage: ``python bench/queries_federated.py [--runs R] [--plot DIR]``.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfed.common.queries.federated_matrix import (  # noqa: E402
    SiteMatrixRelease,
    per_query_std_error,
)
from dpfed.common.queries.matrix_mechanism import reconstruct  # noqa: E402
from dpfed.common.queries.svt_stream import (  # noqa: E402
    SVTSessionParams,
    answer_batch,
    open_session,
)
from dpfed.common.queries.workload_spec import choose_strategy  # noqa: E402
from dpfed.common.queries.workloads import (  # noqa: E402
    Workload,
    all_range_workload,
    marginal_workload,
)

SITES = 4
EPSILON = 1.0
DELTA = 1e-6


def site_histograms(n: int, rng: np.random.Generator) -> np.ndarray:
    """Four sites' histograms over n cells (smooth bumps, different sizes)."""
    grid = np.linspace(0, 1, n)
    out = []
    for s in range(SITES):
        shape = np.exp(-((grid - 0.3 - 0.1 * s) ** 2) / 0.02) + 0.3
        out.append(rng.poisson(2000 * (s + 1) * shape / shape.sum()))
    return np.asarray(out, dtype=np.float64)


def run_strategy(workload: Workload, a: np.ndarray, noise: str, x: np.ndarray, runs: int,
                 rng: np.random.Generator) -> tuple[float, float, float, np.ndarray]:
    """Observed RMSE (and its 95% interval) and the closed form; also the last estimate."""
    delta = DELTA if noise == "gaussian" else 0.0
    mech = SiteMatrixRelease(a, EPSILON, delta, noise)
    truth = workload.answer(x.sum(0))
    mse = np.empty(runs)
    x_hat = np.zeros(a.shape[1])
    for r in range(runs):
        total = sum(mech.release(x[s], rng) for s in range(SITES))
        x_hat = reconstruct(total, a)
        mse[r] = float(np.mean((workload.answer(x_hat) - truth) ** 2))
    se = per_query_std_error(workload, a, noise_variance=mech.noise_variance, n_sites=SITES)
    expected = float(np.sqrt(np.mean(se ** 2)))
    observed = float(np.sqrt(mse.mean()))
    # delta method: sd(sqrt(mean mse)) ~ sd(mse) / (2 sqrt(mean) sqrt(runs))
    half = 1.96 * float(mse.std(ddof=1)) / (2 * observed * math.sqrt(runs))
    return observed, half, expected, x_hat


def matrix_part(runs: int, plot: Path | None) -> list[tuple[str, str, str, float, float, float,
                                                              float]]:
    rng = np.random.default_rng(2026)
    rows = []
    cases = (("all ranges, n=256", all_range_workload(256)),
             ("2-way marginals, 8x8x4", marginal_workload((8, 8, 4), 2)))
    print(f"== matrix mechanism: {SITES} sites, epsilon={EPSILON} per site (Gaussian: "
          f"delta={DELTA}), least squares, {runs} runs ==")
    print(f"{'workload':<24} {'noise':<9} {'chosen':<10} {'observed':>9} {'+-95%':>7} "
          f"{'expected':>9} {'obs/exp':>8} {'identity':>9} {'id/chosen':>9}")
    for label, w in cases:
        x = site_histograms(w.n, rng)
        for noise in ("laplace", "gaussian"):
            t0 = time.perf_counter()
            pick = choose_strategy(w, strategy_name="auto", noises=(noise,), epsilon=EPSILON,
                                   delta=DELTA, n_sites=SITES)
            obs, half, exp_, x_hat = run_strategy(w, pick.matrix, noise, x, runs, rng)
            id_obs, id_half, id_exp, _ = run_strategy(w, np.eye(w.n), noise, x, runs, rng)
            print(f"{label:<24} {noise:<9} {pick.name:<10} {obs:9.3f} {half:7.3f} {exp_:9.3f} "
                  f"{obs / exp_:8.3f} {id_obs:9.3f} {id_obs / obs:9.2f}   "
                  f"({time.perf_counter() - t0:.1f}s; identity {id_obs:.3f} +- {id_half:.3f} "
                  f"vs expected {id_exp:.3f}, obs/exp {id_obs / id_exp:.3f})")
            rows.append((label, noise, pick.name, obs, half, exp_, id_obs))
            if plot is not None and noise == "laplace" and w.kind == "all_ranges":
                _plot_histogram(plot, x.sum(0), x_hat, pick.name)
    return rows


def _plot_histogram(out: Path, truth: np.ndarray, est: np.ndarray, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(truth, "k-", lw=1, label="true pooled histogram")
    ax.plot(est, ".", ms=3, label=f"DP estimate ({name}, Laplace, eps=1 per site, 4 sites)")
    ax.set_xlabel("cell")
    ax.set_ylabel("count")
    ax.legend(loc="upper right", fontsize=8)
    fig.savefig(out / "query_histogram.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def svt_part(plot: Path | None) -> None:
    rng = np.random.default_rng(7)
    k, threshold, cutoff, reps = 200, 500.0, 20, 200
    # True per-site answers straddling T: 10% clearly above, the rest spread below/near T.
    truth = np.stack([np.where(rng.random(k) < 0.1, rng.uniform(520, 700, k),
                               rng.uniform(300, 540, k)) for _ in range(SITES)])
    truth = np.round(truth)
    print(f"\n== SVT: {SITES} sites x {k} queries, T={threshold:g}, c={cutoff}, {reps} "
          "sessions per epsilon (non-monotonic noise) ==")
    print(f"{'epsilon':>8} {'precision':>10} {'recall':>8} {'examined':>9} {'halted':>7} "
          f"{'recall(all)':>11}")
    curves = []
    for eps in (0.25, 0.5, 1.0, 2.0, 4.0, 8.0):
        sp = SVTSessionParams(threshold, cutoff, eps)
        tp = fp = fn = fn_all = examined = halted = 0
        for _ in range(reps):
            for s in range(SITES):
                out = answer_batch(sp, open_session(sp, rng), truth[s], rng)
                m = out.above.size
                real = truth[s][:m] >= threshold
                tp += int(np.sum(out.above & real))
                fp += int(np.sum(out.above & ~real))
                fn += int(np.sum(~out.above & real))
                fn_all += int(np.sum(truth[s][m:] >= threshold))
                examined += m
                halted += int(out.halted)
        prec = tp / max(1, tp + fp)
        rec = tp / max(1, tp + fn)
        rec_all = tp / max(1, tp + fn + fn_all)
        curves.append((eps, prec, rec, rec_all))
        print(f"{eps:8.2f} {prec:10.3f} {rec:8.3f} {examined / (reps * SITES):9.1f} "
              f"{halted / (reps * SITES):7.2f} {rec_all:11.3f}")
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        e = [c[0] for c in curves]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.semilogx(e, [c[1] for c in curves], "o-", label="precision (examined)")
        ax.semilogx(e, [c[2] for c in curves], "s-", label="recall (examined)")
        ax.semilogx(e, [c[3] for c in curves], "^-", label="recall (all queries)")
        ax.set_xticks(e)
        ax.set_xticklabels([f"{v:g}" for v in e])
        ax.minorticks_off()
        ax.set_xlabel("session epsilon per site")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"SVT 'above T': {k} queries, c={cutoff}")
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(True, alpha=0.3)
        fig.savefig(plot / "svt_precision_recall.png", dpi=110, bbox_inches="tight")
        plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--plot", type=Path, help="directory for PNG figures")
    args = parser.parse_args()
    if args.plot is not None:
        args.plot.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = matrix_part(args.runs, args.plot)
    bad = [r for r in rows if abs(r[3] - r[5]) > max(r[4], 0.0) + 0.01 * r[5]]
    svt_part(args.plot)
    print(f"\ntotal {time.perf_counter() - t0:.1f}s; observed RMSE within its 95% interval of "
          f"the closed form in {len(rows) - len(bad)}/{len(rows)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
