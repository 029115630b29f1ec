"""Secure PCA with dropout recovery vs site-level, at 4 to 32 sites, small data; and the cost
of sites dropping mid-sum.

Set-up: S site processes x N rows x P columns (CSV), one coordinator, real mTLS gRPC on
loopback, ledgers on disk (default 2,000 x 20 per site). For each S, both modes run on the
same federation, alternating, median of the repeats; the ratio secure / site-level is the
figure (both see the same machine load). Then one more secure round during which ``d`` sites
are SIGKILLed once they have dealt their shares (the coordinator announced the masked sum):
its time against the secure median of the same S, and whether it completed in one attempt.

Bytes: what one site released in each mode (its ledger stores exactly the serialized answer it
sent: ``P_s`` site-level, the masked vector secure), plus the secure protocol's other messages
from one site, whose sizes follow from the stage formats (keys with the certificate ~1 KB,
sealed shares and commitments ``(S - 1) x 224`` bytes, a view signature ~72 bytes, revealed
shares ``S x 66``).

Run: ``python bench/secure_dropouts.py [--sites 4 8 16 32] [--rows N] [--features P]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from dpfed.aggregator.local_federation import LocalFederation, SiteSettings  # noqa: E402
from dpfed.common.privacy.accounting import BudgetPolicy  # noqa: E402
from dpfed.site_agent.ledger import Ledger  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--rows", type=int, default=2_000)
    ap.add_argument("--features", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}; {os.cpu_count()} cores")
    print("sites | site-level s | secure s | ratio | dropout s (d) | ratio to secure | "
          "attempts | site-level B/site | secure B/site")
    for n in args.sites:
        print(" | ".join(_one(n, args)), flush=True)
    print(f"load average at end: {os.getloadavg()}")


def _one(n: int, args: argparse.Namespace) -> list[str]:
    drops = 1 if n < 8 else 2
    with tempfile.TemporaryDirectory() as tmp:
        fed = LocalFederation.create(
            Path(tmp) / "fed", n_sites=n, rows=args.rows, features=args.features, seed=1,
            task_deadline_s=600, min_sites=max(2, n - drops),
            settings=SiteSettings(budget_epsilon=1e6, budget_delta=0.5, connect_timeout_s=600,
                                  secure_tolerated_dropouts=drops))
        fed.start_coordinator()
        fed.start_sites()
        times: dict[str, list[float]] = {"site": [], "secure": []}
        try:
            fed.wait_for_sites(timeout=900)
            with fed.analyst(timeout=1200) as coord:
                for _ in range(args.repeats):
                    for mode in ("site", "secure"):
                        t = time.perf_counter()
                        coord.pca(5, epsilon=1.0, delta=1e-5, aggregation=mode,
                                  centering="none", clip_norm="schema")
                        times[mode].append(time.perf_counter() - t)
                victims = fed.site_ids[-drops:]
                killed: list[str] = []

                def kill(event: Any) -> None:
                    if "attempt 1:" in str(getattr(event, "message", "")) and not killed:
                        for site in victims:
                            fed.signal(site, signal.SIGKILL)
                            killed.append(site)

                t = time.perf_counter()
                result = coord.pca(5, epsilon=1.0, delta=1e-5, aggregation="secure",
                                   centering="none", clip_norm="schema", on_event=kill)
                dropout_time = time.perf_counter() - t
                attempts = result.metadata["secure"]["attempts"]
        finally:
            fed.stop_all()
        site_bytes = _released(fed, fed.site_ids[0], secure=False)
        secure_bytes = _released(fed, fed.site_ids[0], secure=True)
    other = 1024 + (n - 1) * 224 + 72 + n * 66  # keys, shares, view signature, reveal
    site, secure = statistics.median(times["site"]), statistics.median(times["secure"])
    return [f"{n:5d}", f"{site:.2f}", f"{secure:.2f}", f"{secure / site:.2f}",
            f"{dropout_time:.2f} ({drops})", f"{dropout_time / secure:.2f}", str(attempts),
            f"{site_bytes}", f"{secure_bytes} + {other}"]


def _released(fed: LocalFederation, site_id: str, *, secure: bool) -> int:
    """Bytes of the site's first secure (or first site-level) release."""
    with Ledger(fed.ledger_path(site_id), BudgetPolicy(1e9, 0.99)) as ledger:
        for e in ledger.events():
            if e.mechanism.startswith("secure-skellam") == secure:
                return len(ledger.stored_result(e.task_id))
    return 0


if __name__ == "__main__":
    main()
