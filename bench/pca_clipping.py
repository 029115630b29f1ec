"""Centred DP-PCA with ``clip_norm="auto"`` vs today's uncentred worst-case-bound PCA.

Three tables, every one through the *library's* round functions (the same calls the site
handler and the coordinator job make, in process, without the network):

``demo``      ``dpfed demo-data`` (3 sites x 20,000 rows, 20 vitals/labs-like columns).
``scales``    10 columns whose declared bounds are 1x to 1000x wider than their spread (a
              table whose columns have very different scales), 3 sites x 20,000 rows.
``unequal``   two sites of 9,000 and 1,000 rows with different structure (non-IID), for the
              site-weighting comparison.

Quality is the captured variance ``tr(V_K^T C V_K) / tr(U_K^T C U_K)`` where ``C`` is the
covariance of the REAL pooled rows (all sites' rows together, each column scaled to [-1, 1] by
the schema bounds, centred at their true mean) and ``U_K`` its exact top-K eigenvectors: what
an analyst's non-private PCA would capture. Printed as the mean over runs, each with fresh noise.

Rows per table (all at delta = 1e-5, K = 5, R = 10, eps per site in {0.5, 1, 2, 5}):
    uncentred, bound sqrt(p)            today's job (``--centering none --clip-norm schema``)
    centred, bound 2 sqrt(p)            worst-case bound, nothing clipped
    centred, auto q                     DP quantile q of the centred row norms (10 % of eps)
    centred, oracle max                 the true largest centred row norm (not DP, reference)

Run: ``python bench/pca_clipping.py [--runs N] [--quick] [--plot FILE.png]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dpfed.common.data.demo_data import generate_demo
from dpfed.common.data.encoding import encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.job_params import PCAParams
from dpfed.common.pca.centring import (
    centre_rows,
    centred_pca_mechanism,
    dp_mean,
    mean_sum_mechanism,
)
from dpfed.common.pca.clipping import (
    dp_quantile,
    norm_grid,
    norm_histogram,
    norm_histogram_mechanism,
)
from dpfed.common.pca.dppca import (
    captured_energy,
    combine,
    pca_mechanism,
    site_release,
    site_weights,
    top_components,
)
from dpfed.common.pca.features import UnitBallMap

EPSILONS = (0.5, 1.0, 2.0, 5.0)
DELTA = 1e-5
K = 5


def run_job(sites: list[np.ndarray], bound: float, *, epsilon: float, centering: str,
            clip: float | str | None, quantile: float, weighting: str,
            rng: np.random.Generator) -> np.ndarray:
    """One ``pca`` job on rows ``u`` (each column in [-1, 1]); return the components (K x p)."""
    params = PCAParams(K, 2 * K, "analytic", clip, centering, quantile, weighting)
    budget = {n: (e, d) for n, e, d in params.rounds(epsilon, DELTA)}
    n = [len(u) for u in sites]
    p = sites[0].shape[1]
    center = np.zeros(p)
    if centering == "mean":
        mech = mean_sum_mechanism(*budget["mean"])
        sums = [mech.release(u.sum(axis=0) / bound, rng) for u in sites]
        center = dp_mean(sums, sum(n), bound)
    top = 2 * bound if centering == "mean" else bound
    if clip == "auto":
        edges = norm_grid(top)
        hmech = norm_histogram_mechanism(*budget["norms"])
        hists = [hmech.release(norm_histogram(np.linalg.norm(u - center, axis=1), edges), rng)
                 for u in sites]
        radius = dp_quantile(hists, edges, quantile, sum(n))
    else:
        radius = top if clip is None else float(clip)
    unit_ball = UnitBallMap(box_schema(p), clip_norm=radius)
    eps, dl = budget["pca"]
    factors = []
    for u in sites:
        z, _ = centre_rows(u.copy(), center, unit_ball)
        mech = (centred_pca_mechanism(len(u), eps, dl) if centering == "mean"
                else pca_mechanism(len(u), eps, dl))
        factors.append(site_release(z.T @ z, len(u), epsilon=eps, delta=dl, rank=2 * K,
                                    rng=rng, mechanism=mech).factor)
    return combine(factors, K, list(site_weights(n, weighting))).components


def box_schema(p: int) -> Schema:
    """p continuous columns declared in [-1, 1] (the rows here are already in that space)."""
    return Schema.from_toml("".join(f'[[columns]]\nname = "c{j}"\ntype = "continuous"\n'
                                    'min = -1\nmax = 1\n' for j in range(p)))


def quality(components: np.ndarray, cov: np.ndarray, exact: np.ndarray) -> float:
    """Captured variance of the pooled covariance relative to its exact top-K subspace."""
    return captured_energy(components, cov) / captured_energy(exact, cov)


def demo_table(rows: int) -> tuple[list[np.ndarray], float]:
    schema, frames = generate_demo(3, rows, 20, seed=7)
    ub = UnitBallMap(schema)
    return [ub.scaled(encode_table(schema, f)[0]) for f in frames], ub.norm


def scales_table(rows: int, rng: np.random.Generator) -> tuple[list[np.ndarray], float]:
    """Columns with spread 1/1000 .. 1 of their declared half-range, correlated in pairs."""
    p = 10
    spread = np.geomspace(1e-3, 0.5, p)
    latent = rng.standard_normal((3 * rows, 4)) @ rng.standard_normal((4, p))
    latent /= latent.std(axis=0)
    u = np.clip(latent * spread + 0.2 * spread, -1.0, 1.0)
    return np.split(u, 3), float(np.sqrt(p))


def unequal_table(rng: np.random.Generator) -> tuple[list[np.ndarray], float]:
    """Site A: 9,000 rows with structure 1; site B: 1,000 rows with another structure."""
    p = 12
    out = []
    for n in (9000, 1000):
        basis = np.linalg.qr(rng.standard_normal((p, p)))[0][:, :3]
        x = (rng.standard_normal((n, 3)) * [0.5, 0.35, 0.25]) @ basis.T
        out.append(np.clip(x + rng.uniform(-0.2, 0.2, p), -1, 1))
    return out, float(np.sqrt(p))


def pooled(sites: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Covariance of the real pooled rows and its exact top-K components."""
    x = np.vstack(sites)
    cov = np.cov(x, rowvar=False, bias=True)
    return cov, top_components(cov, K)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 runs, 5,000 rows per site")
    ap.add_argument("--quantiles", default="0.5,0.75,0.9,0.95,0.99")
    ap.add_argument("--plot", help="also save captured variance vs epsilon per table as a PNG")
    args = ap.parse_args()
    runs = 2 if args.quick else args.runs
    rows = 5000 if args.quick else 20_000
    rng = np.random.default_rng(2026)
    t0 = time.perf_counter()
    quantiles = [float(q) for q in args.quantiles.split(",")]
    tables = {"demo": demo_table(rows), "scales": scales_table(rows, rng)}
    curves: dict[str, dict[str, list[float]]] = {}
    for name, (sites, bound) in tables.items():
        cov, exact = pooled(sites)
        oracle = max(float(np.linalg.norm(u - np.vstack(sites).mean(axis=0), axis=1).max())
                     for u in sites)
        configs: list[tuple[str, str, float | str | None, float]] = [
            ("uncentred, bound sqrt(p) (today)", "none", None, 0.9),
            ("centred, bound 2 sqrt(p)", "mean", None, 0.9),
            *[(f"centred, auto q={q:g}", "mean", "auto", q) for q in quantiles],
            (f"centred, oracle max {oracle:.3g}", "mean", oracle, 0.9),
        ]
        print(f"\n[{name}] {len(sites)} sites x {len(sites[0])} rows, p={cov.shape[0]}, K={K}, "
              f"delta={DELTA:g}, {runs} runs; captured variance of the real pooled rows' "
              "covariance, DP / exact top-K")
        print(f"{'configuration':<36}" + "".join(f"{'eps=' + format(e, 'g'):>11}"
                                                 for e in EPSILONS))
        floor = np.mean([quality(np.linalg.qr(rng.standard_normal((cov.shape[0], K)))[0].T,
                                 cov, exact) for _ in range(20)])
        print(f"{'(random K-subspace, floor)':<36}" + f"{floor:>11.3f}" * len(EPSILONS))
        for label, centering, clip, q in configs:
            cells = []
            for eps in EPSILONS:
                vals = [quality(run_job(sites, bound, epsilon=eps, centering=centering,
                                        clip=clip, quantile=q, weighting="size", rng=rng),
                                cov, exact) for _ in range(runs)]
                cells.append(f"{np.mean(vals):>11.3f}")
                curves.setdefault(name, {}).setdefault(label, []).append(float(np.mean(vals)))
            print(f"{label:<36}" + "".join(cells))
    sites, bound = unequal_table(rng)
    cov, exact = pooled(sites)
    print(f"\n[unequal] sites of {len(sites[0])} and {len(sites[1])} rows, different structure; "
          "centred, auto q=0.9; captured variance of the real pooled covariance")
    print(f"{'site weighting':<36}" + "".join(f"{'eps=' + format(e, 'g'):>11}"
                                              for e in EPSILONS))
    for weighting in ("size", "equal"):
        cells = []
        for eps in EPSILONS:
            vals = [quality(run_job(sites, bound, epsilon=eps, centering="mean", clip="auto",
                                    quantile=0.9, weighting=weighting, rng=rng), cov, exact)
                    for _ in range(runs)]
            cells.append(f"{np.mean(vals):>11.3f}")
        label = weighting + (" (N_s/N)" if weighting == "size" else " (1/S, paper)")
        print(f"{label:<36}" + "".join(cells))
        curves.setdefault("unequal", {})[label] = [float(c) for c in cells]
    print(f"({time.perf_counter() - t0:.1f}s)")
    if args.plot:
        save_plot(args.plot, curves)


def save_plot(path: str, curves: dict[str, dict[str, list[float]]]) -> None:
    """One panel per table: captured variance vs epsilon for each configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 4.2))
    for ax, (name, by_label) in zip(np.atleast_1d(axes), curves.items(), strict=True):
        for label, values in by_label.items():
            ax.plot(EPSILONS, values, "o-", ms=3, label=label)
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(EPSILONS, [format(e, "g") for e in EPSILONS])
        ax.set_xlabel("epsilon per site (delta = 1e-5)")
        ax.set_ylabel("captured variance, DP / exact (real pooled rows)")
        ax.set_title(f"{name} table")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper right", fontsize=7)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
