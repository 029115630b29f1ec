"""Check-and-charge latency of a site's ledger holding 10,000 events, per accountant.

Builds a ledger file with N events (default 10,000; inserted directly, as a long-lived site's
history would be), then times, with each accountant (``basic``, ``zcdp``, ``pld``):

``first``  the first check-and-charge after the ledger is opened (``pld`` composes all N)
``next``   the median of the following charges (``pld`` extends its cached composition)
``status`` the spent/remaining figure (``pld`` solves for epsilon at the cap's delta)

Two histories: ``plans`` (the rounds of default jobs: Gaussian, secure Skellam shares, Laplace
queries at a few budgets, SVT sessions) and ``distinct`` (the same, but every Laplace and SVT
event at its own epsilon: the grouped cold composition cannot share work). Timings are wall
clock on a shared machine: compare within one run; the ``basic`` row is the floor (the SQLite
transaction with its fsync).

Run: ``python bench/ledger_latency.py [--events 10000] [--charges 10]``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from dpfed.common.privacy.accounting import BudgetPolicy, PrivacyCost
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.privacy.skellam import skellam_calibrate
from dpfed.site_agent.ledger import Ledger


def history(n: int, distinct: bool, seed: int = 3) -> list[PrivacyCost]:
    rnd = random.Random(seed)
    secure = skellam_calibrate(0.09, 1e-12, 1414.0, 21000.0)
    share = PrivacyCost(secure.epsilon, secure.delta, secure.cost().rho,
                        "secure-skellam[n=3,t=1]", secure.l2_sensitivity,
                        math.sqrt(secure.mu / 2))
    out = []
    for _ in range(n):
        u = rnd.random()
        if u < 0.70:
            eps = rnd.choice([0.001, 0.002, 0.008])
            sens = rnd.choice([1.0, 2.0, math.sqrt(2.0)])
            out.append(PrivacyCost.gaussian(eps, 1e-12, sigma=gaussian_sigma(eps, 1e-12, sens),
                                            sensitivity=sens))
        elif u < 0.85:
            out.append(share)
        elif u < 0.95:
            eps = rnd.uniform(1e-4, 1e-3) if distinct else rnd.choice([2e-4, 5e-4, 1e-3])
            out.append(PrivacyCost.pure(eps, mechanism="matrix-laplace", sensitivity=2.0,
                                        noise_scale=2.0 / eps))
        else:
            eps = rnd.uniform(1e-4, 1e-3) if distinct else 5e-4
            out.append(PrivacyCost.pure(eps, mechanism="svt", sensitivity=1.0,
                                        noise_scale=1.0 / eps))
    return out


def build(path: Path, costs: list[PrivacyCost]) -> None:
    Ledger(path, BudgetPolicy(1e3, 1e-3, accountant="basic")).close()  # the schema
    conn = sqlite3.connect(str(path))
    blob = b"released"
    digest = hashlib.sha256(blob).hexdigest()
    with conn:
        conn.executemany(
            "INSERT INTO ledger_events (task_id, seq, job_id, kind, mechanism, epsilon, delta, "
            "rho, sensitivity, noise_scale, payload_digest, result, result_digest, created_at) "
            "VALUES (?, ?, 'job', 'pca', ?, ?, ?, ?, ?, ?, ?, ?, ?, '2026-01-01T00:00:00+00:00')",
            [(f"t{i}", i + 1, c.mechanism, c.epsilon, c.delta, c.rho, c.sensitivity,
              c.noise_scale, "0" * 64, blob, digest) for i, c in enumerate(costs)])
    conn.close()


def charge(ledger: Ledger, k: int) -> float:
    cost = PrivacyCost.gaussian(0.01, 1e-10, sigma=gaussian_sigma(0.01, 1e-10), sensitivity=1.0)
    start = time.perf_counter()
    ledger.charge_and_release(task_id=f"new-{k}", job_id="j", kind="pca",
                              payload_digest=hashlib.sha256(str(k).encode()).hexdigest(),
                              cost=cost, release=lambda: b"x")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=10_000)
    ap.add_argument("--charges", type=int, default=10)
    a = ap.parse_args()
    print(f"{a.events} events; seconds per check-and-charge\n")
    print(f"{'history':>9s} {'accountant':>10s} {'first':>8s} {'next':>8s} {'status':>8s} "
          f"{'spent eps':>10s}")
    with tempfile.TemporaryDirectory() as tmp:
        for distinct in (False, True):
            costs = history(a.events, distinct)
            for accountant in ("basic", "zcdp", "pld"):
                path = Path(tmp) / f"{distinct}-{accountant}.sqlite"
                build(path, costs)
                with Ledger(path, BudgetPolicy(1e3, 1e-3, accountant=accountant)) as ledger:
                    first = charge(ledger, 0)
                    rest = [charge(ledger, k) for k in range(1, a.charges + 1)]
                    start = time.perf_counter()
                    status = ledger.status()
                    took = time.perf_counter() - start
                print(f"{'distinct' if distinct else 'plans':>9s} {accountant:>10s} "
                      f"{first:8.3f} {statistics.median(rest):8.3f} {took:8.3f} "
                      f"{status.epsilon_spent:10.4g}")


if __name__ == "__main__":
    main()
