"""Centred DP-PCA on wide data: today's round order against a clip radius first, by library calls.

The DPdisPCA paper's set-up (Imtiaz & Sarwate 2018; as bench/dppca_utility.py): D = 200,
S = 10 sites x N_s = 1000 rows in the unit ball (every column in [-1, 1], so the box bound is
B = sqrt(200) = 14.1), K = 50, R = 100, delta = 0.01, epsilon in {0.5, 1, 5}. Quality: the
captured variance ``tr(V_K^T C V_K) / tr(U_K^T C U_K)`` with C the covariance of the pooled
rows (true mean removed) and U_K its top-K eigenvectors.

Rows, each through the library's round functions (the calls the site handlers and the
coordinator make, in process):

``uncentred, clip 1``      ``--centering none --clip-norm 1``: one round at the full budget.
``today (box mean)``       the job's default today: mean of u/B (sensitivity 2B in u), then the
                           DP 0.9-quantile of the centred norms, then centred PCA; basic split
                           10 % / 10 % / 80 % of (epsilon, delta).
``clip first, basic``      norms of the uncentred rows first (DP 0.9-quantile ``c``), then the
                           mean of rows clipped to ``c`` (sensitivity 2c), then PCA of
                           ``clip_c(u - mu)/c``; the same basic 10/10/80 split.
``clip first, gdp``        the same rounds, the budget split in GDP (shares of mu^2:
                           :func:`dpfed.common.privacy.composition.gdp_split`), with the shares
                           of :func:`dpfed.common.pca.centring.centred_round_split` -- charged
                           exactly the job's (epsilon, delta) by the tight (pld) accountant.

Run: ``python bench/pca_centring.py [--runs 5]``.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from dpfed.common.pca.centring import (
    centre_rows,
    centred_pca_mechanism,
    centred_round_split,
    clip_to_radius,
    clipped_mean,
    clipped_mean_sum_mechanism,
    dp_mean,
    mean_sum_mechanism,
)
from dpfed.common.pca.clipping import (
    dp_quantile,
    norm_grid,
    norm_histogram,
    norm_histogram_mechanism,
)
from dpfed.common.pca.dppca import captured_energy, combine, site_release, top_components
from dpfed.common.pca.features import UnitBallMap
from dpfed.common.privacy.composition import gdp_split

D, S, N_S, K, R, DELTA = 200, 10, 1000, 50, 100, 0.01
BOX = math.sqrt(D)
QUANTILE = 0.9


def make_sites(rng: np.random.Generator) -> list[np.ndarray]:
    """The paper's generator widened to D = 200 (bench/dppca_utility.py), max row norm 1."""
    spectrum = np.concatenate([np.linspace(10, 1, 20), 0.5 * rng.random(D - 20)])
    basis = np.linalg.qr(rng.standard_normal((D, D)))[0]
    x = (rng.standard_normal((S * N_S, D)) * np.sqrt(spectrum)) @ basis.T
    x /= np.linalg.norm(x, axis=1).max()
    return np.split(x, S)


class _Ball(UnitBallMap):
    """A unit-ball map for rows already in feature space (only its radius is used here)."""

    def __init__(self, radius: float) -> None:  # noqa: D107
        object.__setattr__(self, "norm", float(radius))


def pca_round(rows: list[np.ndarray], eps: float, delta: float, rng: np.random.Generator,
              centred: bool) -> np.ndarray:
    factors = []
    for z in rows:
        mech = centred_pca_mechanism(len(z), eps, delta) if centred else None
        out = site_release(z.T @ z, len(z), epsilon=eps, delta=delta, rank=R, rng=rng,
                           mechanism=mech)
        factors.append(out.factor)
    return combine(factors, K).components


def quantile_round(norms: list[np.ndarray], top: float, eps: float, delta: float,
                   rng: np.random.Generator) -> float:
    edges = norm_grid(top)
    mech = norm_histogram_mechanism(eps, delta)
    noisy = [mech.release(norm_histogram(n, edges), rng) for n in norms]
    return dp_quantile(noisy, edges, QUANTILE, S * N_S)


def uncentred(sites: list[np.ndarray], eps: float, rng: np.random.Generator) -> np.ndarray:
    return pca_round(sites, eps, DELTA, rng, centred=False)


def today(sites: list[np.ndarray], eps: float, rng: np.random.Generator) -> np.ndarray:
    e_mean, e_norms, e_pca = 0.1 * eps, 0.1 * eps, 0.8 * eps
    d_mean, d_norms, d_pca = 0.1 * DELTA, 0.1 * DELTA, 0.8 * DELTA
    mech = mean_sum_mechanism(e_mean, d_mean)
    mu = dp_mean([mech.release(x.sum(axis=0) / BOX, rng) for x in sites], S * N_S, BOX)
    c = quantile_round([np.linalg.norm(x - mu, axis=1) for x in sites], 2 * BOX, e_norms,
                       d_norms, rng)
    rows = [centre_rows(x.copy(), mu, _Ball(c))[0] for x in sites]
    return pca_round(rows, e_pca, d_pca, rng, centred=True)


def clip_first(sites: list[np.ndarray], rounds: dict[str, tuple[float, float]],
               rng: np.random.Generator) -> tuple[np.ndarray, float, float]:
    c = quantile_round([np.linalg.norm(x, axis=1) for x in sites], BOX, *rounds["norms"], rng)
    mech = clipped_mean_sum_mechanism(c, *rounds["mean"])
    mu = clipped_mean([mech.release(clip_to_radius(x, c)[0].sum(axis=0), rng) for x in sites],
                      S * N_S, c)
    rows = [centre_rows(x.copy(), mu, _Ball(c))[0] for x in sites]
    return pca_round(rows, *rounds["pca"], rng, centred=True), c, float(np.linalg.norm(mu))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=2018)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    started = time.perf_counter()
    names = ["uncentred, clip 1", "today (box mean)", "clip first, basic", "clip first, gdp"]
    results: dict[tuple[str, float], list[float]] = {}
    notes: dict[float, list[tuple[float, float]]] = {}
    for _ in range(a.runs):
        sites = make_sites(rng)
        pooled = np.vstack(sites)
        centred = pooled - pooled.mean(axis=0)
        cov = centred.T @ centred / len(pooled)
        best = captured_energy(top_components(cov, K), cov)
        for eps in (0.5, 1.0, 5.0):
            basic = {"norms": (0.1 * eps, 0.1 * DELTA), "mean": (0.1 * eps, 0.1 * DELTA),
                     "pca": (0.8 * eps, 0.8 * DELTA)}
            split = centred_round_split(D, S * N_S, eps, DELTA)
            gdp = {n: (e, d) for n, e, d in gdp_split(eps, DELTA, split)}
            comps = {"uncentred, clip 1": uncentred(sites, eps, rng),
                     "today (box mean)": today(sites, eps, rng),
                     "clip first, basic": clip_first(sites, basic, rng)[0]}
            comps["clip first, gdp"], c, mu_norm = clip_first(sites, gdp, rng)
            notes.setdefault(eps, []).append((c, mu_norm))
            for name in names:
                results.setdefault((name, eps), []).append(
                    captured_energy(comps[name], cov) / best)
    print(f"D={D}, S={S}, N_s={N_S}, K={K}, R={R}, delta={DELTA}, {a.runs} runs; captured "
          "variance / non-private\n")
    print(f"{'epsilon':>8}" + "".join(f"{n:>20}" for n in names) + f"{'gdp - uncentred':>17}")
    for eps in (0.5, 1.0, 5.0):
        vals = [np.mean(results[(n, eps)]) for n in names]
        print(f"{eps:>8g}" + "".join(f"{v:>20.3f}" for v in vals) + f"{vals[3] - vals[0]:>+17.3f}")
    print("\nround split (shares of mu^2 for gdp; the pair each round is handed):")
    for eps in (0.5, 1.0, 5.0):
        split = centred_round_split(D, S * N_S, eps, DELTA)
        pairs = gdp_split(eps, DELTA, split)
        c = np.mean([n[0] for n in notes[eps]])
        m = np.mean([n[1] for n in notes[eps]])
        print(f"  epsilon {eps:g}: " + ", ".join(
            f"{n} {s:.3f} -> ({e:.3g}, {d:.3g})" for (n, s, _), (_, e, d) in zip(
                split, pairs, strict=True)) + f"; clip radius {c:.3f}, ||mu|| {m:.4f}")
    print(f"({time.perf_counter() - started:.0f}s)")


if __name__ == "__main__":
    main()
