"""Secure aggregation's utility: pooled-data noise without trusting the coordinator.

Set-up: the DPdisPCA paper's synthetic data (D = 200, S = 10 sites x 1,000 rows, K = 50, R = 100,
delta = 0.01; the generator of bench/dppca_utility.py), 5 runs per epsilon. Four releases of the
same data at the same (epsilon, delta) under the replace-one relation:

- *central*: a trusted curator's Gaussian mechanism on the pooled rows (the ceiling):
  G/N + symmetric noise with sensitivity sqrt(2)/N, analytic calibration;
- *secure*: dpfed's secure sum, run in-process with the real code: every site rounds its rows
  to the fixed-point grid, adds its Skellam share and its pairwise masks (real X25519 keys
  signed with certificates from dpfed's CA), the sum is decoded; the masks cancel;
- *site-level*: DPdisPCA, each site noised for its own rows (sensitivity sqrt(2)/N_s), P_s of
  rank R combined by the coordinator;
- the random-subspace floor.

Utility is the captured energy of the pooled second moment relative to non-private PCA
(q / q_o). Run: ``python bench/secure_aggregation.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys  # noqa: E402  (bench scripts import their sibling by path)
import tempfile
import time
from pathlib import Path

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from dpfed.common.pca.dppca import captured_energy, combine, top_components
from dpfed.common.privacy.mechanisms import gaussian_sigma, symmetric_gaussian_noise
from dpfed.common.secagg.keys import generate_ephemeral, sign_ephemeral
from dpfed.common.secagg.masking import MaskContext
from dpfed.common.secagg.secure_sum import (
    SecureSumPlan,
    decode_sum,
    integer_gram_upper,
    plan_gram,
    site_contribution,
)
from dpfed.common.transport.certs import init_federation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dppca_utility import make_sites, site_factor  # noqa: E402


def masked_shares(statistics: dict[str, np.ndarray], plan: SecureSumPlan, fed: Path,
                  context: MaskContext, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every site's masked share of a secure sum, through the real key exchange and masking.

    ``statistics`` maps site id -> its integer statistic; each site signs an ephemeral key with
    its certificate from ``fed`` (written by :func:`~dpfed.common.transport.certs.
    init_federation`), and every share is checked against the federation's CA.
    """
    ids = list(statistics)
    ca = x509.load_pem_x509_certificate((fed / "ca.pem").read_bytes())
    keys = {s: generate_ephemeral() for s in ids}
    signed = {}
    for s in ids:
        kit = fed / "sites" / s
        signing = serialization.load_pem_private_key((kit / "site.key").read_bytes(), None)
        signed[s] = sign_ephemeral(site_id=s, public_key=keys[s][1], context=context,
                                   signing_key=signing,  # type: ignore[arg-type]
                                   certificate_pem=(kit / "site.pem").read_bytes())
    return {s: site_contribution(stat, plan=plan, own_id=s, own_key=keys[s][0],
                                 signed_keys=signed, context=context, ca=ca,
                                 min_participants=2, tolerated=0, rng=rng)
            for s, stat in statistics.items()}


def secure_release(sites: list[np.ndarray], ids: list[str], fed: Path, epsilon: float,
                   delta: float, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """The pooled G/N from a real secure sum; also the bytes one site sends."""
    d = sites[0].shape[1]
    n = sum(len(x) for x in sites)
    plan = plan_gram(dim=d, total_rows=n, epsilon=epsilon, delta=delta, participants=ids)
    ctx = MaskContext("bench", "pca", f"bench/pca/{rng.integers(1 << 30)}")
    masked = masked_shares({s: integer_gram_upper([x], plan, rng)
                            for s, x in zip(ids, sites, strict=True)}, plan, fed, ctx, rng)
    upper = decode_sum(masked, plan) / n
    a = np.zeros((d, d))
    a[np.triu_indices(d)] = upper
    a = a + np.triu(a, 1).T
    return a, float(masked[ids[0]].nbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 runs, epsilon 1 only")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=12)
    args = ap.parse_args()
    d, n_sites, n_per, k, r, delta = 200, 10, 1000, 50, 100, 0.01
    epsilons = [1.0] if args.quick else [0.5, 1.0, 5.0]
    runs = 2 if args.quick else args.runs
    rng = np.random.default_rng(args.seed)
    ids = [f"site-{i:02d}" for i in range(n_sites)]
    results: dict[tuple[str, float], list[float]] = {}
    timing = {"secure": 0.0, "site-level": 0.0}
    sent = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        fed = Path(tmp) / "fed"
        init_federation(fed, coordinator_hosts=["localhost"], sites=ids, analysts=[])
        for _ in range(runs):
            sites = make_sites(rng, d, n_sites, n_per)
            n = n_sites * n_per
            a = sum(x.T @ x for x in sites) / n
            q_o = captured_energy(top_components(a, k), a)
            floor = captured_energy(np.linalg.qr(rng.standard_normal((d, k)))[0].T, a) / q_o
            for eps in epsilons:
                results.setdefault(("floor", eps), []).append(floor)
                sigma_c = gaussian_sigma(eps, delta, np.sqrt(2.0)) / n
                central = a + symmetric_gaussian_noise(d, sigma_c, rng)
                results.setdefault(("central", eps), []).append(
                    captured_energy(top_components(central, k), a) / q_o)
                t0 = time.perf_counter()
                secure, sent = secure_release(sites, ids, fed, eps, delta, rng)
                timing["secure"] += time.perf_counter() - t0
                results.setdefault(("secure", eps), []).append(
                    captured_energy(top_components(secure, k), a) / q_o)
                t0 = time.perf_counter()
                factors = [site_factor(x.T @ x / n_per,
                                       gaussian_sigma(eps, delta, np.sqrt(2.0)) / n_per, r, rng)
                           for x in sites]
                est = combine(factors, k)
                timing["site-level"] += time.perf_counter() - t0
                results.setdefault(("site-level", eps), []).append(
                    captured_energy(est.components, a) / q_o)
    print(f"D={d} S={n_sites} N_s={n_per} K={k} R={r} delta={delta} runs={runs} "
          "(q/q_o, mean +- sd)")
    print(f"{'epsilon':>8} {'central':>14} {'secure':>14} {'site-level':>14} {'floor':>8} "
          f"{'secure-central':>15}")
    for eps in epsilons:
        def cell(name: str, e: float = eps) -> str:
            v = np.array(results[(name, e)])
            return f"{v.mean():.3f}+-{v.std():.3f}"
        gap = np.mean(results[("secure", eps)]) - np.mean(results[("central", eps)])
        print(f"{eps:>8g} {cell('central'):>14} {cell('secure'):>14} {cell('site-level'):>14} "
              f"{np.mean(results[('floor', eps)]):>8.3f} {gap:>+15.3f}")
    per = runs * len(epsilons)
    print(f"time per release (all sites, in-process, 1 core): secure {timing['secure'] / per:.2f}"
          f" s, site-level {timing['site-level'] / per:.2f} s; one site sends "
          f"{sent / 1e6:.2f} MB (secure, p(p+1)/2 uint64) vs {d * r * 8 / 1e6:.2f} MB (P_s)")


if __name__ == "__main__":
    main()
