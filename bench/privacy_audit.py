"""Empirical-epsilon audit of dpfed's mechanisms and of known-broken SVT variants.

Runs dpfed.common.privacy.audit at 10^6 draws per input (``--quick``: 10^5) and prints, for each
mechanism, the 99% lower confidence bound on epsilon (Clopper-Pearson, union bound over the
tested events) as a multiple of the claimed epsilon. Targets (docs/testing.md,
test targets 1, 2, 5): correct mechanisms <= 1.05 x claim; broken copies flagged (> 1.2 x).

Sections
  1. Laplace (3 scales) and a half-scale copy; fixed event family chosen a priori.
  2. Gaussian (delta-aware) and a half-sigma copy; events selected on a first batch.
  3. Exact discrete Laplace / discrete Gaussian mechanisms (pure-Python samplers).
  4. SVT: dpfed's sparse_vector_runs, Lyu, Su & Li's Alg. 2-6, StatDP's iSVT1-4 and our own
     broken copies, each over 10 StatDP-style neighbour pairs (the worst pair is reported).
  5. Throughput of the samplers, with numpy's Laplace as the baseline in the same run.

The SVT variants are re-implemented here from their published descriptions, for testing
only; they are not part of dpfed.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfed.common.privacy.audit import (  # noqa: E402
    Sampler,
    additive_noise_sampler,
    audit,
    quantile_thresholds,
    threshold_events,
    top_events,
)
from dpfed.common.privacy.exact_samplers import (  # noqa: E402
    DiscreteGaussianMechanism,
    DiscreteLaplaceMechanism,
    sample_discrete_gaussian_many,
    sample_discrete_laplace_many,
)
from dpfed.common.privacy.mechanisms import GaussianMechanism, LaplaceMechanism  # noqa: E402
from dpfed.common.queries.svt import SparseVector, SVTCalibration, sparse_vector_runs  # noqa: E402
from dpfed.common.queries.svt_audit import (  # noqa: E402
    svt_outputs,
    svt_pattern_events,
    svt_sampler,
    svt_value_events,
)

CONFIDENCE = 0.99


def row(cols: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))


def verdict(lcb: float, claim: float) -> str:
    return "VIOLATION" if lcb > claim else "ok"


# --------------------------------------------------------------------------- 1-3 additive


def section_additive(n: int, n_select: int, seed: int) -> None:
    print(f"\n## 1-3. Additive noise (n = {n:,} draws per input, confidence {CONFIDENCE})\n")
    widths = [54, 6, 7, 9, 7, 9, 6]
    print(row(["mechanism", "claim", "lcb", "lcb/claim", "point", "verdict", "time"], widths))
    rng = np.random.default_rng(seed)

    def report(name: str, claim: float, res: Any, t0: float) -> None:
        print(row([name, f"{claim:g}", f"{res.epsilon_lcb:.3f}",
                   f"{res.epsilon_lcb / claim:.3f}", f"{res.epsilon_point:.3f}",
                   verdict(res.epsilon_lcb, claim), f"{time.perf_counter() - t0:.1f}s"], widths))

    for eps in (0.5, 1.0, 2.0):
        b = 1.0 / eps
        # 50 thresholds fixed a priori from the claimed scale (quantiles of Lap(0, b), + shift).
        qs = np.linspace(0.001, 0.999, 50)
        lap_q = np.where(qs < 0.5, b * np.log(2 * qs), -b * np.log(2 * (1 - qs)))
        events = threshold_events(np.unique(np.r_[lap_q, lap_q + 1.0]))
        for label, mech in ((f"Laplace eps={eps:g}", LaplaceMechanism(eps)),
                            (f"  broken: half scale b/2 (eps={eps:g})", LaplaceMechanism(2 * eps))):
            t0 = time.perf_counter()
            res = audit(additive_noise_sampler(mech), (0.0, 1.0), events, n_samples=n,
                        confidence=CONFIDENCE, rng=rng)
            report(label, eps, res, t0)

    for eps, delta in ((1.0, 1e-5), (1.0, 1e-3), (2.0, 1e-5)):
        sel = top_events(quantile_thresholds(200, lower=1e-5, upper=1 - 1e-5), 20, delta=delta)
        for label, mech in ((f"Gaussian eps={eps:g} delta={delta:g}",
                             GaussianMechanism(eps, delta)),
                            ("  broken: sigma/2", GaussianMechanism(eps, delta, 0.5))):
            t0 = time.perf_counter()
            res = audit(additive_noise_sampler(mech), (0.0, 1.0), sel, n_samples=n,
                        selection_samples=n_select, confidence=CONFIDENCE, delta=delta, rng=rng)
            report(label, eps, res, t0)

    # Exact samplers are pure Python (~10^5 draws/s): a tenth of the draws.
    n_exact = max(n // 10, 10_000)
    for label, eps, mech_fn in (
        ("discrete Laplace eps=1 (exact)", 1.0, lambda: DiscreteLaplaceMechanism(1.0)),
        ("  broken: half scale", 1.0, lambda: DiscreteLaplaceMechanism(2.0)),
        ("discrete Gaussian eps=1 delta=1e-3 (exact)", 1.0,
         lambda: DiscreteGaussianMechanism(1.0, 1e-3)),
        ("  broken: sigma/2", 1.0, lambda: DiscreteGaussianMechanism(1.0, 1e-3, 0.5)),
    ):
        mech = mech_fn()
        delta = getattr(mech, "delta", 0.0)

        def sample(x: Any, m: int, r: np.random.Generator, mech: Any = mech) -> np.ndarray:
            source = random.Random(int(r.integers(2**63)))
            return np.asarray(mech.release_many([int(x)] * m, source), dtype=np.float64)

        t0 = time.perf_counter()
        res = audit(sample, (0, 1), threshold_events(np.arange(-12, 14) - 0.5),
                    n_samples=n_exact, confidence=CONFIDENCE, delta=delta, rng=rng)
        report(f"{label} [n={n_exact:,}]", eps, res, t0)


# --------------------------------------------------------------------------- 4 SVT


@dataclass(frozen=True)
class Variant:
    name: str
    claim: float  # epsilon the variant claims
    true_epsilon: str  # what the literature proves
    sampler: Sampler
    numeric: bool = False
    monotone_only: bool = False


def svt_template(*, rho_scale: float, nu_scale: float, cutoff: int | None,
                 redraw_rho: bool = False, strict: bool = False,
                 values: str = "none", value_scale: float = 1.0) -> Sampler:
    """Generic SVT (threshold 0) covering Lyu's Alg. 1-6 and StatDP's iSVT1-4."""

    def sample(x: Any, n: int, rng: np.random.Generator) -> np.ndarray:
        a = np.asarray(x, dtype=np.float64)
        k = a.size
        rho = rng.laplace(0.0, rho_scale, size=n)
        nu = rng.laplace(0.0, nu_scale, size=(n, k)) if nu_scale > 0 else np.zeros((n, k))
        noisy = a + nu
        if redraw_rho:  # Lyu Alg. 2: a fresh rho after every positive answer
            above = np.zeros((n, k), dtype=bool)
            for j in range(k):
                above[:, j] = noisy[:, j] > rho if strict else noisy[:, j] >= rho
                rho = np.where(above[:, j], rng.laplace(0.0, rho_scale, size=n), rho)
        else:
            above = noisy > rho[:, None] if strict else noisy >= rho[:, None]
        if cutoff is None:
            positive, n_examined = above, np.full(n, k)
        else:
            examined = (np.cumsum(above, axis=1) - above) < cutoff
            positive, n_examined = above & examined, examined.sum(axis=1)
        if values == "nu":
            return svt_outputs(positive, n_examined, noisy)
        if values == "fresh":
            return svt_outputs(positive, n_examined,
                               a + rng.laplace(0.0, value_scale, size=(n, k)))
        return svt_outputs(positive, n_examined)

    return sample


def svt_variants(eps: float) -> list[Variant]:
    out: list[Variant] = []
    for c in (1, 2):
        cal = SVTCalibration(eps, c)
        out.append(Variant(f"dpfed SVT (Lyu Alg. 1) c={c}", eps, f"{eps:g}",
                           svt_sampler(threshold=0.0, epsilon=eps, cutoff=c)))
    out.append(Variant("dpfed SVT monotonic c=1 (monotone pairs)", eps, f"{eps:g}",
                       svt_sampler(threshold=0.0, epsilon=eps, cutoff=1, monotonic=True),
                       monotone_only=True))
    out.append(Variant("dpfed SVT c=1 + numeric eps3=eps/2", 1.5 * eps, f"{1.5 * eps:g}",
                       svt_sampler(threshold=0.0, epsilon=eps, cutoff=1,
                                   numeric_epsilon=eps / 2), numeric=True))
    half = eps / 2
    for c in (1, 2):
        out.append(Variant(f"Lyu Alg. 2 (rho redrawn) c={c}", eps, f"{eps:g}",
                           svt_template(rho_scale=c / half, nu_scale=2 * c / half, cutoff=c,
                                        redraw_rho=True)))
    c = 1
    out.append(Variant("Lyu Alg. 3 (outputs q+nu) c=1", eps, "inf",
                       svt_template(rho_scale=1 / half, nu_scale=c / half, cutoff=c,
                                    values="nu"), numeric=True))
    for c in (1, 2):
        e1, e2 = eps / 4, 3 * eps / 4
        out.append(Variant(f"Lyu Alg. 4 (Lee-Clifton) c={c}", eps, f"{(1 + 6 * c) / 4 * eps:g}",
                           svt_template(rho_scale=1 / e1, nu_scale=1 / e2, cutoff=c)))
    out.append(Variant("Lyu Alg. 5 (no query noise)", eps, "inf",
                       svt_template(rho_scale=1 / half, nu_scale=0.0, cutoff=None)))
    out.append(Variant("Lyu Alg. 6 (no cut-off)", eps, "inf",
                       svt_template(rho_scale=1 / half, nu_scale=1 / half, cutoff=None)))
    out.append(Variant("StatDP iSVT1 (no query noise)", eps, "inf",
                       svt_template(rho_scale=2 / eps, nu_scale=0.0, cutoff=None)))
    out.append(Variant("StatDP iSVT2 (noise not scaled, no cap)", eps, "inf",
                       svt_template(rho_scale=2 / eps, nu_scale=2 / eps, cutoff=None)))
    out.append(Variant("StatDP iSVT3 (noise 4/(3eps)) N=1", eps, f"{1.75 * eps:g}",
                       svt_template(rho_scale=4 / eps, nu_scale=4 / (3 * eps), cutoff=1,
                                    strict=True)))
    out.append(Variant("StatDP iSVT4 (outputs q+nu) N=1", eps, "inf",
                       svt_template(rho_scale=2 / eps, nu_scale=2 / eps, cutoff=1, strict=True,
                                    values="nu"), numeric=True))
    cal = SVTCalibration(eps, 1)
    out.append(Variant("dpfed copy: no query noise", eps, "inf",
                       svt_template(rho_scale=cal.threshold_scale, nu_scale=0.0, cutoff=1)))
    out.append(Variant("dpfed copy: no cut-off", eps, "inf",
                       svt_template(rho_scale=cal.threshold_scale, nu_scale=cal.query_scale,
                                    cutoff=None)))
    out.append(Variant("dpfed copy: values = q+nu, free", eps, "inf",
                       svt_template(rho_scale=cal.threshold_scale, nu_scale=cal.query_scale,
                                    cutoff=1, values="nu"), numeric=True))
    return out


def svt_pairs(k: int) -> dict[str, tuple[np.ndarray, np.ndarray, bool]]:
    """StatDP's neighbour pairs (generators.py, ALL_DIFFER) shifted to T = 0, plus two more.

    The bool says whether the pair is monotone (all queries move the same way).
    """
    h = k // 2
    z = np.zeros(k)
    return {
        "one below": (z, np.r_[-1.0, np.zeros(k - 1)], True),
        "one above": (z, np.r_[1.0, np.zeros(k - 1)], True),
        "one above rest below": (z, np.r_[1.0, -np.ones(k - 1)], False),
        "one below rest above": (z, np.r_[-1.0, np.ones(k - 1)], False),
        "half half": (z, np.r_[np.ones(h), -np.ones(k - h)], False),
        "all above": (z, np.ones(k), True),
        "all below": (z, -np.ones(k), True),
        "x shape": (np.r_[np.ones(h), z[h:]], np.r_[z[:h], np.ones(k - h)], False),
        "above-below": (np.r_[np.ones(h), -np.ones(k - h)], z, False),
        "below run": (z, np.r_[np.ones(k - 1), -1.0], False),
    }


def section_svt(n: int, n_select: int, seed: int, eps: float, k: int) -> None:
    print(f"\n## 4. SVT (eps = {eps:g}, {k} queries, T = 0, Delta = 1, n = {n:,} per input, "
          f"events selected on {n_select:,} draws; worst of the neighbour pairs)\n")
    widths = [42, 6, 8, 8, 9, 10, 20, 6]
    print(row(["variant", "claim", "true", "lcb", "lcb/claim", "verdict", "worst pair", "time"],
              widths))
    rng = np.random.default_rng(seed)
    pairs = svt_pairs(k)
    for v in svt_variants(eps):
        t0 = time.perf_counter()
        best, best_pair = 0.0, "-"
        for pname, (x1, x2, monotone) in pairs.items():
            if v.monotone_only and not monotone:
                continue
            family = (svt_value_events(k, n_thresholds=12) if v.numeric
                      else svt_pattern_events(k))
            res = audit(v.sampler, (x1, x2), top_events(family, 10), n_samples=n,
                        selection_samples=n_select, confidence=CONFIDENCE, rng=rng)
            if res.epsilon_lcb > best:
                best, best_pair = res.epsilon_lcb, pname
        print(row([v.name, f"{v.claim:g}", v.true_epsilon, f"{best:.3f}", f"{best / v.claim:.3f}",
                   verdict(best, v.claim), best_pair, f"{time.perf_counter() - t0:.0f}s"],
                  widths), flush=True)


# --------------------------------------------------------------------------- 5 throughput


def timed(fn: Callable[[], Any], count: int, repeat: int = 3) -> float:
    """Return operations per second, best of ``repeat`` runs (the machine is shared)."""
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return count / best


def section_throughput(quick: bool) -> None:
    print("\n## 5. Throughput (same run; numpy Laplace is the baseline)\n")
    m = 20_000 if quick else 100_000
    rng = np.random.default_rng(0)
    base = timed(lambda: rng.laplace(0.0, 1.0, size=m), m)
    rows = [("numpy Generator.laplace (float, vectorised)", base)]
    for label, fn in (
        ("exact discrete Laplace, scale 1 (random.Random)",
         lambda: sample_discrete_laplace_many(1, m, rng=random.Random(1))),
        ("exact discrete Laplace, scale 1/0.3 (float eps)",
         lambda: sample_discrete_laplace_many(1 / 0.3, m, rng=random.Random(1))),
        ("exact discrete Laplace, scale 1 (secrets)",
         lambda: sample_discrete_laplace_many(1, m)),
        ("exact discrete Gaussian, sigma2 = 4 (random.Random)",
         lambda: sample_discrete_gaussian_many(4, m, rng=random.Random(1))),
        ("exact discrete Gaussian, sigma2 = 4 (secrets)",
         lambda: sample_discrete_gaussian_many(4, m)),
    ):
        rows.append((label, timed(fn, m)))
    answers = np.linspace(-2, 2, 20)
    rows.append(("SVT runs, 20 queries (sparse_vector_runs)",
                 timed(lambda: sparse_vector_runs(answers, m, threshold=0.0, epsilon=1.0,
                                                  cutoff=2, rng=rng), m)))

    def interactive() -> None:
        for _ in range(m // 20):
            sv = SparseVector(threshold=0.0, epsilon=1.0, cutoff=20, rng=rng)
            for q in answers:
                sv.test(float(q))

    rows.append(("SVT interactive queries (SparseVector.test)", timed(interactive, m)))
    widths = [52, 14, 14]
    print(row(["operation", "per second", "vs baseline"], widths))
    for label, rate in rows:
        print(row([label, f"{rate:,.0f}", f"{rate / base:.2e}"], widths))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10^5 draws instead of 10^6")
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--only", choices=("additive", "svt", "throughput"), default=None)
    args = parser.parse_args()
    n = 100_000 if args.quick else 1_000_000
    n_select = 20_000 if args.quick else 200_000
    print(f"# Privacy audit ({'quick' if args.quick else 'full'}): 99% lower confidence bounds "
          "on epsilon")
    t0 = time.perf_counter()
    if args.only in (None, "additive"):
        section_additive(n, n_select, args.seed)
    if args.only in (None, "svt"):
        section_svt(n, n_select, args.seed + 1, eps=1.0, k=10)
    if args.only in (None, "throughput"):
        section_throughput(args.quick)
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
