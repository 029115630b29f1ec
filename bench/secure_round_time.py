"""Cost of secure aggregation: a federated DP-PCA round, secure vs site-level, same data.

Set-up: S site processes x N rows x P columns (CSV), one coordinator, real mTLS gRPC on
loopback, ledgers on disk (default 4 x 200k x 100). Both modes run on the same federation, one
after the other, alternating, median of the repeats; the ratio secure / site-level is the
figure (both see the same machine load). Also printed: what one site sends in each mode.

``--sites 4 8 16 32 64`` sweeps federation sizes (one fresh federation each) and ends with a
table: wall time per round in each mode and their ratio, and per site (median over the sites)
the CPU seconds its process spent in the round and the bytes it released (from its ledger), so
that a site's work can be read against log n whatever the machine's load. ``--dropouts d``
sets every site's ``secure_tolerated_dropouts`` (shares dealt, the larger noise share).

Also printed: the bytes one site actually released per round (its ledger stores exactly the
serialized answer it sent) and every process's peak resident memory. With ``--features 1000``
this is the p = 1000 end-to-end check (a 4 MB masked vector per site, sent in 1 MiB chunks; a
bench rather than a test: its data and Gram take too long for CI).

Run: ``python bench/secure_round_time.py [--quick] [--rows N] [--features P] [--sites S]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from dpfed.aggregator.local_federation import LocalFederation, SiteSettings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 x 20k x 50, 2 repeats")
    ap.add_argument("--sites", type=int, nargs="+", default=[4])
    ap.add_argument("--dropouts", type=int, default=0,
                    help="every site's secure_tolerated_dropouts")
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--features", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=10)
    args = ap.parse_args()
    if args.quick:
        args.rows, args.features, args.repeats = 20_000, 50, 2
    rows = [_run(args, n) for n in args.sites]
    if rows:
        print("\nsites | round s: site-level / secure / ratio | per-site CPU s: site-level / "
              "secure / ratio | per-site bytes released: site-level / secure")
        for r in rows:
            print(f"{r['n']:5d} | {r['site']:7.2f} / {r['secure']:7.2f} / "
                  f"{r['secure'] / r['site']:5.2f} | {r['cpu_site']:6.3f} / "
                  f"{r['cpu_secure']:6.3f} / {r['cpu_secure'] / r['cpu_site']:5.2f} | "
                  f"{r['bytes_site']:,} / {r['bytes_secure']:,}")


def _run(args: argparse.Namespace, n_sites: int) -> dict[str, float]:
    """One federation of ``n_sites``: alternate the two modes, print and return the medians."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        fed = LocalFederation.create(
            Path(tmp) / "fed", n_sites=n_sites, rows=args.rows, features=args.features,
            seed=1, task_deadline_s=1800,
            settings=SiteSettings(budget_epsilon=1e6, budget_delta=0.5, connect_timeout_s=600,
                                  secure_tolerated_dropouts=args.dropouts))
        print(f"data: {n_sites} sites x {args.rows} rows x {args.features} columns "
              f"({time.perf_counter() - t0:.0f} s to generate)", flush=True)
        fed.start_coordinator()
        fed.start_sites()
        times: dict[str, list[float]] = {"site": [], "secure": []}
        cpu: dict[str, list[float]] = {"site": [], "secure": []}
        try:
            fed.wait_for_sites(timeout=1800)
            site_pids = [fed.procs[s][0].pid for s in fed.site_ids]
            with fed.analyst(timeout=1800) as coord:
                for _ in range(args.repeats):
                    for mode in ("site", "secure"):
                        before = [_cpu_seconds(pid) for pid in site_pids]
                        t = time.perf_counter()
                        # like for like: one uncentred Gram each (site-level: one round;
                        # secure: the key exchange, then the masked sum)
                        result = coord.pca(args.k, epsilon=1.0, delta=1e-5, aggregation=mode,
                                           centering="none", clip_norm="schema")
                        times[mode].append(time.perf_counter() - t)
                        after = [_cpu_seconds(pid) for pid in site_pids]
                        cpu[mode].append(statistics.median(
                            a - b for a, b in zip(after, before, strict=True)))
                        if mode == "secure":
                            secure_meta = result.metadata["secure"]
            peaks = {name: _peak_rss_mb(proc.pid) for name, (proc, _log) in fed.procs.items()}
        finally:
            fed.stop_all()
        released = {s: _released_bytes(fed, s) for s in fed.site_ids}
    site, secure = statistics.median(times["site"]), statistics.median(times["secure"])
    p, r = args.features, 2 * args.k
    print(f"round wall time, median of {args.repeats}: site-level {site:.2f} s, secure "
          f"{secure:.2f} s, ratio secure/site {secure / site:.2f} (target <= 1.5)")
    print(f"one site sends: site-level P_s {p * r * 8 / 1e6:.2f} MB (p x R float64); secure "
          f"{p * (p + 1) // 2 * 8 / 1e6:.2f} MB (p(p+1)/2 uint64) plus a signed key "
          f"(~0.6 KB with its certificate); secure attempts {secure_meta['attempts']}")
    first = fed.site_ids[0]
    print(f"{first} released (serialized, from its ledger): "
          + ", ".join(f"{mech} {size / 1e6:.3f} MB" for mech, size in released[first]))
    print("peak resident memory: " + ", ".join(f"{name} {mb:.0f} MB"
                                               for name, mb in sorted(peaks.items())),
          flush=True)

    def per_round(secure_mode: bool) -> int:
        sizes = [sum(size for mech, size in rel if mech.startswith("secure") == secure_mode)
                 for rel in released.values()]
        return int(statistics.median(sizes)) // args.repeats

    return {"n": n_sites, "site": site, "secure": secure,
            "cpu_site": statistics.median(cpu["site"]),
            "cpu_secure": statistics.median(cpu["secure"]),
            "bytes_site": per_round(False), "bytes_secure": per_round(True)}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mb(pid: int) -> float:
    """Peak resident set size of a live process (Linux /proc), in MB; NaN elsewhere."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _released_bytes(fed: LocalFederation, site_id: str) -> list[tuple[str, int]]:
    """(mechanism, serialized size) of every release the site's ledger recorded."""
    from dpfed.common.privacy.accounting import BudgetPolicy
    from dpfed.site_agent.ledger import Ledger

    with Ledger(fed.ledger_path(site_id), BudgetPolicy(1e9, 0.99)) as ledger:
        return [(e.mechanism, len(ledger.stored_result(e.task_id))) for e in ledger.events()]


if __name__ == "__main__":
    main()
