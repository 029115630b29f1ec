"""The sparse neighbour graph: its degree and thresholds, what it survives, and that only the
signed round keys decide it -- not the order or the subset the coordinator lists, and not a
coordinator's wish for neighbours (planted builders that let either in are caught)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping

import numpy as np
import pytest

from dpfed.common.errors import ValidationError
from dpfed.common.secagg.graph import (
    NeighbourGraph,
    choose_degree,
    derive_graph,
    drop_capacity,
    min_degree,
    threshold,
)
from dpfed.common.secagg.masking import MaskContext

CTX = MaskContext("job-1", "pca-sum-1", "job-1/pca-sum-1")
Builder = Callable[[MaskContext, Mapping[str, bytes], int], NeighbourGraph]


def _keys(n: int, rng: np.random.Generator) -> dict[str, bytes]:
    return {f"site-{i:02d}": rng.bytes(64) for i in range(n)}


def _connected(graph: NeighbourGraph, removed: set[str]) -> bool:
    left = [s for s in graph.ring if s not in removed]
    seen, todo = {left[0]}, [left[0]]
    while todo:
        for peer in graph.neighbours(todo.pop()):
            if peer not in removed and peer not in seen:
                seen.add(peer)
                todo.append(peer)
    return len(seen) == len(left)


def test_small_federations_keep_the_complete_graph_and_large_ones_grow_like_log_n() -> None:
    for n in range(2, 8):
        assert choose_degree(n, 1, 0) == n - 1
    assert [choose_degree(n, 1, 0) for n in (8, 16, 32, 64, 128, 1000)] == [6, 8, 10, 12, 14, 20]
    for n in range(8, 300):
        for t, d in ((0, 0), (1, 0), (1, 2), (3, 3)):
            k = choose_degree(n, t, d)
            assert k == n - 1 or (k % 2 == 0 and k >= min_degree(n))
            assert drop_capacity(n, k, t) >= min(d, drop_capacity(n, n - 1, t))
            if k < n - 1:  # the smallest such degree
                assert k == min_degree(n) or drop_capacity(n, k - 2, t) < d
    # the complete graph's limits are those of the full-graph protocol
    for n in range(2, 40):
        for t in range(n):
            assert drop_capacity(n, n - 1, t) == min(n - threshold(n, t), n - t - 1)


def test_the_graph_survives_any_colluders_and_drops_within_its_capacity() -> None:
    rng = np.random.default_rng(5)
    for n, t, d in ((16, 1, 2), (13, 2, 1)):
        k = choose_degree(n, t, d)
        graph = derive_graph(CTX, _keys(n, rng), k)
        cap = graph.capacity(t)
        assert 0 <= d <= cap and k < n - 1
        # every set of t colluders and cap drops (exhaustively) leaves the rest connected
        big_t = graph.share_threshold(t)
        assert big_t > t  # t colluders hold too few shares of anything
        for removed in itertools.combinations(graph.ring, t + cap):
            assert _connected(graph, set(removed))
        # every set of cap drops leaves T holders of a survivor's self-mask seed (itself and
        # its neighbours) and of a dropped site's mask key (its neighbours), and T(n) signers
        for drops in itertools.combinations(graph.ring, cap):
            gone = set(drops)
            for site in graph.ring:
                assert len({site, *graph.neighbours(site)} - gone) >= big_t
            assert n - cap >= graph.view_threshold(t)
        # and the bound is tight for connectivity: k removed sites can isolate one
        site = graph.ring[0]
        assert not _connected(graph, set(graph.neighbours(site)))


def test_the_graph_is_a_k_regular_ring_lattice() -> None:
    graph = derive_graph(CTX, _keys(20, np.random.default_rng(1)), 6)
    for site in graph.ring:
        near = graph.neighbours(site)
        assert len(near) == 6 and site not in near
        assert all(site in graph.neighbours(peer) for peer in near)
    complete = NeighbourGraph(("a", "b", "c"), 2)
    assert complete.complete and complete.neighbours("b") == ("a", "c")
    for bad in (3, 5, 1, 20):
        with pytest.raises(ValidationError, match="even degree"):
            NeighbourGraph(tuple(f"s{i}" for i in range(20)), bad)


def _bias(builder: Builder, *, n: int = 16, runs: int = 600) -> list[str]:
    """Return what a graph builder lets the coordinator decide (empty: nothing found).

    Checks that the graph is the same whatever order or copy of the keys it is given, that
    one changed key or another round gives another graph, and that over many random key sets
    every pair of sites is adjacent with frequency k / (n - 1) (binomial, within 5 sd).
    """
    problems = []
    rng = np.random.default_rng(2024)
    k = choose_degree(n, 1, 0)
    keys = _keys(n, rng)
    base = builder(CTX, keys, k)
    for perm in (list(reversed(keys)), [str(s) for s in rng.permutation(list(keys))]):
        if builder(CTX, {s: keys[s] for s in perm}, k) != base:
            problems.append("the order the keys are listed in changes the graph")
            break
    other = dict(keys, **{"site-03": rng.bytes(64)})
    if builder(CTX, other, k).ring == base.ring:
        problems.append("a changed key leaves the graph as it was")
    if builder(MaskContext("job-1", "pca-sum-2", "job-1/pca-sum-2"), keys, k).ring == base.ring:
        problems.append("another sum gets the same graph")
    counts = np.zeros((n, n))
    index = {s: i for i, s in enumerate(keys)}
    for _ in range(runs):
        graph = builder(CTX, _keys(n, rng), k)
        for s in graph.ring:
            for peer in graph.neighbours(s):
                counts[index[s], index[peer]] += 1
    p = k / (n - 1)
    sd = math.sqrt(runs * p * (1 - p))
    off = counts[~np.eye(n, dtype=bool)]
    if np.max(np.abs(off - runs * p)) > 5 * sd:
        problems.append(f"pairs are adjacent with frequencies {off.min() / runs:.3f}-"
                        f"{off.max() / runs:.3f}, not {p:.3f}")
    return problems


def test_only_the_keys_decide_the_graph() -> None:
    assert _bias(derive_graph) == []


def test_planted_builders_that_let_the_coordinator_steer_the_graph_are_caught() -> None:
    def listed_order(context: MaskContext, publics: Mapping[str, bytes],
                     degree: int) -> NeighbourGraph:  # the ring in the order relayed
        return NeighbourGraph(tuple(publics), degree)

    def sorted_ids(context: MaskContext, publics: Mapping[str, bytes],
                   degree: int) -> NeighbourGraph:  # a fixed ring: no randomness
        return NeighbourGraph(tuple(sorted(publics)), degree)

    def chosen_neighbours(context: MaskContext, publics: Mapping[str, bytes],
                          degree: int) -> NeighbourGraph:  # random, but two sites kept adjacent
        ring = list(derive_graph(context, publics, degree).ring)
        ring.remove("site-01")
        ring.insert(ring.index("site-00") + 1, "site-01")
        return NeighbourGraph(tuple(ring), degree)

    def seed_without_keys(context: MaskContext, publics: Mapping[str, bytes],
                          degree: int) -> NeighbourGraph:  # randomness the coordinator knows
        return derive_graph(context, dict.fromkeys(publics, b""), degree)

    assert "the order the keys are listed in changes the graph" in _bias(listed_order)
    assert any("frequencies" in p for p in _bias(sorted_ids))
    assert any("frequencies" in p for p in _bias(chosen_neighbours))
    assert "a changed key leaves the graph as it was" in _bias(seed_without_keys)


def test_a_subset_the_coordinator_chooses_gives_no_pair_a_better_chance() -> None:
    # Leaving a site out reseeds the whole ring: over the subsets a coordinator can choose by
    # leaving one site out, a given pair is adjacent about as often as in any random graph.
    rng = np.random.default_rng(7)
    n, hits, tries = 24, 0, 0
    for _ in range(30):
        keys = _keys(n, rng)
        for left_out in list(keys)[2:]:
            subset = {s: v for s, v in keys.items() if s != left_out}
            graph = derive_graph(CTX, subset, choose_degree(n - 1, 1, 0))
            hits += "site-01" in graph.neighbours("site-00")
            tries += 1
    p = choose_degree(n - 1, 1, 0) / (n - 2)
    assert abs(hits / tries - p) < 5 * math.sqrt(p * (1 - p) / tries)
