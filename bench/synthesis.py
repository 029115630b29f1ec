"""Utility, disclosure risk and throughput of the factor-model DP synthesizer (seed 000).

Data: a generated mixed-type table with 20 columns -- 8 continuous (2 of them skewed), 6
ordinal (3-5 levels, uneven), 6 nominal (3-5 categories) -- drawn from a 4-factor latent
Gaussian model pushed through threshold / probit links (the same structure the synthesizer
assumes, except for the skew). ``n`` training rows and ``n`` holdout rows from the same model.

Part 1 -- utility and risk vs epsilon, both modes (``FactorModelSynthesizer``, default budget
split, delta = 1e-6), evaluated with ``dpfed.common.evaluation.metrics.evaluate_synthetic`` against
the training
rows with the holdout:

* ``tvd`` / ``ks``: mean marginal TVD over the categorical columns / KS over continuous ones;
* ``corr``: mean |difference| of the pairwise correlations (UnitBallMap features);
* ``M_best/row``: seed 003's score per synthetic row (near 0 = linkable; larger = safer);
* ``dcr_tr`` / ``dcr_ho``: median distance to the closest training / holdout row;
  ``closer``: share of synthetic rows closer to train than to holdout (``expected`` when the
  generator does not memorise); ``nn_own``: row-aligned only, share whose nearest training row
  is their own source row (direct re-identification).

Baselines in the same run: ``holdout`` (fresh real rows: the ideal generator), ``shuffled``
(training columns permuted independently: exact marginals, no correlation), and each mode at
epsilon = 1e6 (the method without noise). Variants at the largest epsilon and 1e6:
``gen no-corr`` (generative without the latent-correlation correction) and ``row r=8``
(row-aligned with 8 factors instead of the r(0.8) rule).

Part 2 -- throughput for 1M rows x 20 columns (``--quick``: 200k): fit (encode, DP marginals,
links, latent, DP-PCA, factor release) and synthesis (generative sampling; row-aligned
reconstruction), in rows/s, with and without building the pandas DataFrame.

Timings on a shared machine vary with its load; run it on an idle one for the figures.

Usage: ``python bench/synthesis.py [--quick] [--reps R] [--plot marginals.png]``
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfed.common.data.schema import (  # noqa: E402
    Column,
    ContinuousColumn,
    NominalColumn,
    OrdinalColumn,
    Schema,
)
from dpfed.common.evaluation.metrics import SyntheticReport, evaluate_synthetic  # noqa: E402
from dpfed.common.synth.correlation import fast_latent_correlation  # noqa: E402
from dpfed.common.synth.factor_model import FactorModelSynthesizer  # noqa: E402

EPSILONS = (0.5, 1.0, 2.0, 5.0, 10.0)
N_FACTORS = 4


class MixedModel:
    """A 4-factor latent Gaussian model behind a 20-column mixed-type table."""

    def __init__(self, seed: int = 2024) -> None:
        rng = np.random.default_rng(seed)
        columns: list[Column] = []
        self.continuous: list[tuple[float, float, bool]] = []  # (mean, sd, skewed)
        for j in range(8):
            skewed = j >= 6
            columns.append(ContinuousColumn(f"lab_{j + 1}", 0.0, 200.0))
            self.continuous.append((float(rng.uniform(60, 120)), float(rng.uniform(12, 22)),
                                    skewed))
        self.cuts: list[np.ndarray] = []
        for j in range(6):
            levels = 3 + j % 3
            columns.append(OrdinalColumn(f"grade_{j + 1}",
                                         tuple(f"g{m}" for m in range(levels))))
            # Uneven proportions: cut points drawn around a shifted centre.
            self.cuts.append(np.sort(rng.normal(0.4, 0.8, levels - 1)))
        self.offsets: list[np.ndarray] = []
        for j in range(6):
            q = 3 + j % 3
            columns.append(NominalColumn(f"site_{j + 1}", tuple(f"c{m}" for m in range(q))))
            self.offsets.append(rng.normal(-0.3, 0.6, q - 1))
        self.schema = Schema(tuple(columns), name="bench: 20 mixed columns")
        self.q = 8 + 6 + sum(len(o) for o in self.offsets)
        loadings = np.linalg.qr(rng.standard_normal((self.q, N_FACTORS)))[0] * math.sqrt(self.q)
        factor_sd = 0.8 ** (np.arange(N_FACTORS) / 2.0)
        communality = rng.uniform(0.5, 0.85, self.q)
        explained = (loadings ** 2) @ factor_sd ** 2
        self.loadings = loadings * np.sqrt(communality / explained)[:, None]
        self.factor_sd = factor_sd
        self.noise_sd = np.sqrt(1.0 - communality)

    def sample(self, n: int, rng: np.random.Generator) -> pd.DataFrame:
        w = rng.standard_normal((n, N_FACTORS)) * self.factor_sd
        z = w @ self.loadings.T + rng.standard_normal((n, self.q)) * self.noise_sd
        data: dict[str, Any] = {}
        j = 0
        cols = self.schema.columns
        for (mean, sd, skewed), col in zip(self.continuous, cols[:8], strict=True):
            x = mean * np.exp(0.35 * z[:, j]) if skewed else mean + sd * z[:, j]
            data[col.name] = np.clip(np.round(x, 1), 0.0, 200.0)
            j += 1
        for cuts, col in zip(self.cuts, cols[8:14], strict=True):
            assert isinstance(col, OrdinalColumn)
            codes = np.searchsorted(cuts, z[:, j]).astype(np.int64)
            data[col.name] = pd.Categorical.from_codes(codes, dtype=pd.CategoricalDtype(
                list(col.levels), ordered=True))
            j += 1
        for off, col in zip(self.offsets, cols[14:], strict=True):
            assert isinstance(col, NominalColumn)
            u = z[:, j:j + off.size] + off[None, :]
            codes = np.where(u.max(axis=1) <= 0, 0, 1 + u.argmax(axis=1)).astype(np.int64)
            data[col.name] = pd.Categorical.from_codes(codes, dtype=pd.CategoricalDtype(
                list(col.categories)))
            j += off.size
        return pd.DataFrame(data)


def shuffled(frame: pd.DataFrame, rng: np.random.Generator) -> pd.DataFrame:
    """Every column permuted independently: exact marginals, correlations destroyed."""
    return pd.DataFrame({c: frame[c].to_numpy()[rng.permutation(len(frame))]
                         for c in frame.columns})


def summarise(report: SyntheticReport) -> dict[str, float]:
    dcr = report.dcr
    return {
        "tvd": report.mean_tvd or 0.0,
        "ks": report.mean_ks or 0.0,
        "corr": report.correlation.mean_abs,
        "M_best/row": report.disclosure.m_best_per_row,
        "dcr_tr": dcr.train_median,
        "dcr_ho": dcr.holdout_median if dcr.holdout_median is not None else math.nan,
        "closer": dcr.share_closer_to_train if dcr.share_closer_to_train is not None
        else math.nan,
        "expected": dcr.expected_share if dcr.expected_share is not None else math.nan,
        "nn_own": report.nearest_match_rate if report.nearest_match_rate is not None
        else math.nan,
    }


COLUMNS = ("tvd", "ks", "corr", "M_best/row", "dcr_tr", "dcr_ho", "closer", "nn_own")


def print_table(rows: list[tuple[str, str, dict[str, float]]]) -> None:
    head = f"{'method':<13}{'epsilon':>8}" + "".join(f"{c:>11}" for c in COLUMNS)
    print(head)
    print("-" * len(head))
    for method, eps, m in rows:
        cells = "".join(f"{m[c]:>11.4f}" if not math.isnan(m[c]) else f"{'-':>11}"
                        for c in COLUMNS)
        print(f"{method:<13}{eps:>8}{cells}")


def mean_metrics(items: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([d[k] for d in items])) for k in items[0]}


def utility(n: int, epsilons: tuple[float, ...], reps: int) -> None:
    model = MixedModel()
    data_rng = np.random.default_rng(1)
    train = model.sample(n, data_rng)
    holdout = model.sample(n, data_rng)
    schema = model.schema
    print(f"\n== Utility and risk vs epsilon: n_train = n_holdout = {n}, 20 columns "
          f"(8 continuous, 6 ordinal, 6 nominal), delta = 1e-6, {reps} rep(s) averaged ==")
    rows: list[tuple[str, str, dict[str, float]]] = []
    t0 = time.perf_counter()
    base = evaluate_synthetic(train, holdout, schema, holdout=model.sample(n, data_rng))
    rows.append(("holdout", "-", summarise(base)))
    rows.append(("shuffled", "-", summarise(
        evaluate_synthetic(train, shuffled(train, np.random.default_rng(2)), schema,
                           holdout=holdout))))
    ranks: dict[str, list[int]] = {}
    variants: list[tuple[str, str, dict[str, Any], tuple[float, ...]]] = [
        ("generative", "generative", {}, (*epsilons, 1e6)),
        ("gen no-corr", "generative", {"correct_correlation": False}, (epsilons[-1], 1e6)),
        ("row_aligned", "row_aligned", {}, (*epsilons, 1e6)),
        ("row r=8", "row_aligned", {"rank": 8}, (epsilons[-1], 1e6)),
    ]
    for label, mode, kwargs, eps_grid in variants:
        for eps in eps_grid:
            results = []
            for rep in range(reps):
                synth = FactorModelSynthesizer(schema, epsilon=eps, delta=1e-6, mode=mode,
                                               rng=np.random.default_rng(100 + rep), **kwargs)
                synth.fit(train)
                report = evaluate_synthetic(train, synth.sample(), schema, holdout=holdout,
                                            row_aligned=mode == "row_aligned")
                results.append(summarise(report))
                ranks.setdefault(f"{label}@{eps:g}", []).append(synth.rank_)
            rows.append((label, "1e6" if eps == 1e6 else f"{eps:g}", mean_metrics(results)))
    print_table(rows)
    print(f"(expected 'closer' for a generator that does not memorise: "
          f"{base.dcr.expected_share:.3f}; ranks chosen: "
          + ", ".join(f"{k}={sorted(set(r))}" for k, r in ranks.items())
          + f"; {time.perf_counter() - t0:.0f} s)")


def throughput(n: int) -> None:
    model = MixedModel()
    frame = model.sample(n, np.random.default_rng(3))
    print(f"\n== Throughput: {n} rows x 20 columns (latent dim {model.q}), "
          f"1 process, {os.cpu_count()} CPU(s) visible ==")
    print(f"{'step':<52}{'seconds':>9}{'rows/s':>13}")
    for mode in ("generative", "row_aligned"):
        synth = FactorModelSynthesizer(model.schema, epsilon=1.0, mode=mode,
                                       rng=np.random.default_rng(4))
        t0 = time.perf_counter()
        synth.fit(frame)
        fit_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        enc = synth.sample_encoded()
        syn_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        enc.to_frame()
        frame_s = time.perf_counter() - t0
        what = "generative sampling" if mode == "generative" else "row-aligned reconstruction"
        correction_s = None
        if mode == "generative":
            # The correction's share of the fit, timed by re-running it on the fitted model.
            t0 = time.perf_counter()
            assert synth.latent_correlation_ is not None
            fast_latent_correlation(synth.latent_correlation_, synth.links_,
                                    clip_norm=synth.clip_norm_, rng=np.random.default_rng(5))
            correction_s = time.perf_counter() - t0
        for step, s in ((f"{mode}: fit (encode..DP release), r={synth.rank_}", fit_s),
                        (f"{mode}: {what}", syn_s),
                        (f"{mode}: {what} + DataFrame", syn_s + frame_s),
                        (f"{mode}: end to end (fit + sample + frame)",
                         fit_s + syn_s + frame_s)):
            print(f"{step:<52}{s:>9.2f}{n / s:>13,.0f}")
            if correction_s is not None and "fit" in step and "end" not in step:
                print(f"{'  of which the correlation correction':<52}{correction_s:>9.2f}"
                      f"{'-':>13}")


def plot_marginals(path: str, n: int, epsilon: float) -> None:
    """Real vs synthetic marginals (generative and row-aligned) for six columns, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = MixedModel()
    rng = np.random.default_rng(7)
    real = model.sample(n, rng)
    synth = {mode: FactorModelSynthesizer(model.schema, epsilon=epsilon, mode=mode,
                                          rng=np.random.default_rng(8)).fit(real).sample()
             for mode in ("generative", "row_aligned")}
    names = ["lab_1", "lab_7", "grade_2", "grade_6", "site_1", "site_6"]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    for ax, name in zip(axes.ravel(), names, strict=True):
        col = model.schema.column(name)
        if isinstance(col, ContinuousColumn):
            bins = np.linspace(float(real[name].quantile(0.001)),
                               float(real[name].quantile(0.999)), 40)
            ax.hist(real[name], bins=bins, density=True, alpha=0.45, label="real")
            for mode, frame in synth.items():
                ax.hist(frame[name], bins=bins, density=True, histtype="step", lw=1.6,
                        label=mode)
        else:
            labels = list(real[name].cat.categories)
            x = np.arange(len(labels))
            width = 0.27
            for i, (label, frame) in enumerate([("real", real), *synth.items()]):
                share = frame[name].value_counts(normalize=True).reindex(labels).fillna(0)
                ax.bar(x + (i - 1) * width, share.to_numpy(), width, label=label)
            ax.set_xticks(x, labels)
        ax.set_title(f"{name} ({col.type})")
    axes[0, 0].legend(loc="upper right", fontsize=8)
    fig.suptitle(f"Marginals, real vs DP synthetic (epsilon = {epsilon:g}, n = {n})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="5k rows, epsilon in {1, 10}, 200k-row throughput")
    parser.add_argument("--reps", type=int, default=None,
                        help="synthesizer runs averaged per point (default 2; quick 1)")
    parser.add_argument("--plot", help="save real-vs-synthetic marginals (epsilon = 1) as "
                        "this PNG and exit")
    args = parser.parse_args()
    if args.plot:
        plot_marginals(args.plot, 5000 if args.quick else 20_000, 1.0)
        return
    reps = args.reps or (1 if args.quick else 2)
    if args.quick:
        utility(5000, (1.0, 10.0), reps)
        throughput(200_000)
    else:
        utility(20_000, EPSILONS, reps)
        throughput(1_000_000)


if __name__ == "__main__":
    main()
