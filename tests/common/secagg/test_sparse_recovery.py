"""Dropout recovery on the sparse graph, in process, for 16 to 64 dealers: each site deals to and
masks with its neighbours only (through the protocol's own deal, open, mask and recovery
functions), sites vanish before dealing and after masking, and the coordinator's correction
leaves exactly the survivors' sum. A site's work -- shares sealed, streams expanded -- is
counted: it follows the degree, about 2 log2 n, not n."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from dpfed.common.errors import ProtocolError
from dpfed.common.secagg.dropouts import (
    RoundKeys,
    deal,
    mask_public,
    open_share,
    recovery_correction,
    self_mask,
)
from dpfed.common.secagg.graph import NeighbourGraph, choose_degree, derive_graph
from dpfed.common.secagg.masking import MaskContext, apply_masks, derive_pair_seed
from tests.support.secure_driver import count_mask_streams

CTX = MaskContext("job-3", "pca-sum-1", "job-3/pca-sum-1")
VALUES = 16


class Sum:
    """One sum of ``n`` dealers' random vectors, stage by stage, counting each site's work."""

    def __init__(self, n: int, tolerated: int, wanted: int, rng: np.random.Generator,
                 graph: NeighbourGraph | None = None) -> None:
        self.ids = [f"site-{i:02d}" for i in range(n)]
        self.keys = {s: RoundKeys.generate() for s in self.ids}
        self.publics = {s: self.keys[s].public for s in self.ids}
        self.graph = graph or derive_graph(CTX, self.publics, choose_degree(n, tolerated,
                                                                            wanted))
        self.threshold = self.graph.share_threshold(tolerated)
        self.inputs = {s: rng.integers(0, 2 ** 40, VALUES, dtype=np.uint64) for s in self.ids}
        self.sealed: dict[str, int] = {}
        self.streams: dict[str, int] = {}

    def run(self, lost: set[str], dropped: set[str]) -> tuple[np.ndarray, list[str]]:
        """``lost`` never deal; ``dropped`` deal but never send their vector. Return the
        decoded sum and the survivors."""
        dealers = [s for s in self.ids if s not in lost]
        seeds, dealt, own, commits = {}, {}, {}, {}
        for u in dealers:
            seeds[u] = os.urandom(32)
            dealt[u], own[u], commits[(u, u, "self")] = deal(
                self.keys[u], seeds[u], own_id=u, publics=self.publics, context=CTX,
                threshold_=self.threshold, neighbours=self.graph.neighbours(u))
            self.sealed[u] = len(dealt[u])
            for v, d in dealt[u].items():
                commits[(u, v, "self")], commits[(u, v, "key")] = d.commit_self, d.commit_key
        held: dict[str, dict[str, tuple[bytes, bytes]]] = {}
        masked = {}
        for v in dealers:
            near = [u for u in self.graph.neighbours(v) if u in dealers]
            held[v] = {u: open_share(self.keys[v], dealt[u][v], own_id=v, dealer=u,
                                     dealer_public=self.publics[u], context=CTX) for u in near}
            pair = {u: derive_pair_seed(self.keys[v].mask, mask_public(self.publics[u]),
                                        own_id=v, peer_id=u, context=CTX) for u in near}
            self.streams[v] = len(pair) + 1
            masked[v] = apply_masks(self.inputs[v], own_id=v, seeds=pair) + self_mask(
                seeds[v], VALUES)
        survivors = [s for s in dealers if s not in dropped]
        revealed: dict[str, dict[str, dict[str, bytes]]] = {}
        for r in survivors:
            holding = {r, *self.graph.neighbours(r)}
            revealed[r] = {
                "self": {v: own[r] if v == r else held[r][v][0]
                         for v in survivors if v in holding},
                "key": {u: held[r][u][1] for u in dealers if u in dropped and u in holding}}
        correction = recovery_correction(
            n_values=VALUES, order=dealers, survivors=survivors,
            mask_publics={s: mask_public(self.publics[s]) for s in self.ids},
            revealed=revealed, commitments=commits, threshold_=self.threshold, context=CTX,
            graph=self.graph)
        total = np.zeros(VALUES, dtype=np.uint64)
        for s in survivors:
            total += masked[s]
        return total - correction, survivors


@pytest.mark.parametrize("n", [16, 24, 32, 64])
def test_sparse_sums_of_16_to_64_sites_recover_from_drops(n: int) -> None:
    rng = np.random.default_rng(n)
    wanted = 3
    s = Sum(n, 1, wanted, rng)
    graph = s.graph
    assert not graph.complete and graph.capacity(1) >= wanted
    # one site never deals; then the full tolerance of drops after masking, all around one
    # site (the worst case for its neighbourhood)
    centre = graph.ring[0]
    near = list(graph.neighbours(centre))
    lost = {near[0]}
    dropped = set(near[1:graph.capacity(1)])
    total, survivors = s.run(lost, dropped)
    assert len(lost) + len(dropped) == graph.capacity(1)
    assert np.array_equal(total, sum((s.inputs[v] for v in survivors),
                                     np.zeros(VALUES, dtype=np.uint64)))


def test_too_many_drops_around_one_site_cannot_be_recovered() -> None:
    s = Sum(32, 1, 2, np.random.default_rng(3))
    centre = s.graph.ring[5]
    # the centre drops with so many neighbours that fewer than T hold its key
    near = list(s.graph.neighbours(centre))
    gone = {centre, *near[:s.graph.holders - s.threshold]}
    with pytest.raises(ProtocolError, match="shares cannot rebuild"):
        s.run(set(), gone)


def test_a_complete_graph_recovers_when_a_dealer_vanished_before_dealing() -> None:
    # Shares sit at the dealer's position among all dealers; recovery placed them at the
    # position among the participants, so a vanished dealer broke every later reconstruction.
    s = Sum(6, 1, 1, np.random.default_rng(8))
    assert s.graph.complete
    total, survivors = s.run({"site-01"}, {"site-04"})
    assert np.array_equal(total, sum((s.inputs[v] for v in survivors),
                                     np.zeros(VALUES, dtype=np.uint64)))


def test_per_site_work_grows_like_log_n(monkeypatch: pytest.MonkeyPatch) -> None:
    expanded = count_mask_streams(monkeypatch)
    work = {}
    for n in (16, 32, 64):
        s = Sum(n, 1, 0, np.random.default_rng(n))
        expanded["n"] = 0
        s.run(set(), set())
        k = s.graph.degree
        assert set(s.sealed.values()) == {k} and set(s.streams.values()) == {k + 1}
        # every site expands its k pairwise streams and its self-mask; the coordinator one
        # self-mask per survivor
        assert expanded["n"] == n * (k + 1) + n
        work[n] = k + 1
    assert work == {16: 9, 32: 11, 64: 13}  # 2 log2 n + 1: +2 per doubling of n
    for n, w in work.items():
        assert w <= 2 * math.log2(n) + 1 < n
