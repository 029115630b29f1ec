"""Per-site work and traffic of one secure sum: the sparse neighbour graph against the complete one.

For n = 4, 8, 16, 32, 64 dealers (t = 1, d = 0 and d = 2), one site's part of a sum of
``--values`` ring elements (default 5,050: the Gram of 100 columns), through the protocol's own
functions (:mod:`dpfed.common.secagg.dropouts`, ``masking``): dealing (Shamir split and
sealing), opening the shares dealt to it, deriving pair seeds and expanding its masks. Counts:
shares sealed, mask streams expanded, the bytes of its shares answer, of the shares relayed to
it, of its reveal and of its masked vector. Times are the fastest of ``--repeats`` runs (on a
shared machine the minimum is the least disturbed by other processes), printed as ratios to a
floor measured the same way just before each row: one ChaCha20 stream of the same length (the
least mask work any site does: its self-mask); one numpy draw of as many uint64 is printed for
reference.
Key verification (every peer's certificate and signature, O(n) in both graphs) is not included.
Last, the margin beyond the policy (docs/secure-aggregation.md, "The neighbour graph"): the
chance that a random ring puts ``T`` of ``c`` colluding sites next to some honest site.

Run: ``nice -n 19 python bench/secagg_scale.py [--values 5050] [--repeats 7]``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
from scipy.stats import hypergeom

from dpfed.common.secagg.dropouts import (
    SEALED_BYTES,
    RoundKeys,
    deal,
    mask_public,
    open_share,
    self_mask,
)
from dpfed.common.secagg.graph import NeighbourGraph, choose_degree, derive_graph, threshold
from dpfed.common.secagg.masking import MaskContext, apply_masks, derive_pair_seed, mask_stream
from dpfed.common.secagg.shamir import SHARE_BYTES

CTX = MaskContext("bench", "pca-sum-1", "bench/pca-sum-1")
COMMIT_BYTES = 32


def best_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def site_work(graph: NeighbourGraph, keys: dict[str, RoundKeys], tolerated: int,
              values: int, repeats: int) -> dict[str, float]:
    """One site's counts, bytes and (fastest) seconds in a sum on ``graph``."""
    publics = {s: k.public for s, k in keys.items()}
    me = graph.ring[0]
    near = graph.neighbours(me)
    threshold = graph.share_threshold(tolerated)
    dealt_to_me = {u: deal(keys[u], os.urandom(32), own_id=u, publics=publics, context=CTX,
                           threshold_=threshold, neighbours=graph.neighbours(u))[0][me]
                   for u in near}
    seed = os.urandom(32)
    stat = np.random.default_rng(0).integers(0, 2 ** 40, values, dtype=np.uint64)

    def dealing() -> None:
        deal(keys[me], seed, own_id=me, publics=publics, context=CTX, threshold_=threshold,
             neighbours=near)

    def opening() -> None:
        for u in near:
            open_share(keys[me], dealt_to_me[u], own_id=me, dealer=u, dealer_public=publics[u],
                       context=CTX)

    def masking() -> None:
        pair = {u: derive_pair_seed(keys[me].mask, mask_public(publics[u]), own_id=me,
                                    peer_id=u, context=CTX) for u in near}
        apply_masks(stat, own_id=me, seeds=pair) + self_mask(seed, values)

    k = len(near)
    return {"k": k, "T": threshold, "shares": k, "streams": k + 1,
            "shares_out": k * (SEALED_BYTES + 2 * COMMIT_BYTES) + COMMIT_BYTES,
            "shares_in": k * (SEALED_BYTES + 2 * COMMIT_BYTES),
            "reveal": (k + 1) * SHARE_BYTES, "masked": 8 * values,
            "deal_s": best_time(dealing, repeats), "open_s": best_time(opening, repeats),
            "mask_s": best_time(masking, repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--values", type=int, default=5050)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    values, repeats = args.values, args.repeats
    rng = np.random.default_rng()

    def floor() -> float:
        return best_time(lambda: mask_stream(os.urandom(32), values), 4 * repeats)

    draws = best_time(lambda: rng.integers(0, 2 ** 63, values, dtype=np.uint64), 4 * repeats)
    print(f"floor: one ChaCha20 stream of {values} uint64 {floor() * 1e6:.0f} us, one numpy "
          f"draw of as many {draws * 1e6:.0f} us (fastest of {4 * repeats}); os.cpu_count() = "
          f"{os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")
    print("Per site. deal/open/mask/work: seconds / the ChaCha20 floor (re-measured per row); "
          "bytes: shares answer / shares relayed to it / reveal (no drops) / masked vector")
    header = (f"{'n':>3} {'t':>2} {'d':>2} {'graph':>9} {'k':>3} {'T':>3} {'streams':>7} "
              f"{'deal':>7} {'open':>7} {'mask':>7} {'work':>7} {'out B':>7} {'in B':>7} "
              f"{'reveal':>6} {'masked':>7} {'work vs complete':>16}")
    print(header)
    for tolerated, drops in ((1, 0), (1, 2)):
        for n in (4, 8, 16, 32, 64):
            keys = {f"site-{i:02d}": RoundKeys.generate() for i in range(n)}
            publics = {s: k.public for s, k in keys.items()}
            degree = choose_degree(n, tolerated, drops)
            graphs = {"dpfed": derive_graph(CTX, publics, degree),
                      "complete": NeighbourGraph(tuple(sorted(keys)), n - 1)}
            chacha = floor()
            rows = {name: site_work(g, keys, tolerated, values, repeats)
                    for name, g in graphs.items()}
            for name, r in rows.items():
                work = (r["deal_s"] + r["open_s"] + r["mask_s"]) / chacha
                full = rows["complete"]
                full_work = (full["deal_s"] + full["open_s"] + full["mask_s"]) / chacha
                label = name if name == "complete" or degree < n - 1 else "=complete"
                print(f"{n:>3} {tolerated:>2} {drops:>2} {label:>9} {r['k']:>3} {r['T']:>3} "
                      f"{r['streams']:>7} {r['deal_s'] / chacha:>7.2f} "
                      f"{r['open_s'] / chacha:>7.2f} {r['mask_s'] / chacha:>7.2f} "
                      f"{work:>7.2f} {r['shares_out']:>7} {r['shares_in']:>7} "
                      f"{r['reveal']:>6} {r['masked']:>7} {work / full_work:>16.2f}")
    print("Beyond the policy (t = 1, d = 0): n * P[Hyp(n - 1, c, k) >= T], c colluding sites")
    for n in (16, 32, 64, 100, 1000):
        k = choose_degree(n, 1, 0)
        big_t = threshold(k + 1, 1)
        risk = {c: n * float(hypergeom.sf(big_t - 1, n - 1, c, k)) for c in (n // 8, n // 4)}
        print(f"  n={n:>4} k={k:>2} T={big_t:>2}: "
              + ", ".join(f"c={c}: {p:.2g}" for c, p in risk.items()))


if __name__ == "__main__":
    main()
