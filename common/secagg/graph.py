"""The neighbour graph of one secure sum (SecAgg+, Bell et al., CCS 2020), from public randomness.

A site masks with, and deals its Shamir shares to, only its ``k`` neighbours. The graph is the
Harary graph ``H(k, n)`` (even ``k``: each site is joined to the ``k / 2`` sites before and
after it on a ring) over a ring order that every party derives alike: the dealers sorted by
SHA-256 of a seed that hashes the sum's context and every dealer's id and signed round key.
``k`` is the smallest even degree of at least ``2 ceil(log2 n)`` whose graph tolerates the
sum's colluders ``t`` and drops ``d`` (:func:`drop_capacity`); when that reaches ``n - 1`` the
graph is complete, exactly the protocol of a full graph. docs/secure-aggregation.md, "The
neighbour graph", states what the graph guarantees and why the coordinator cannot steer it.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

from dpfed.common.errors import ValidationError
from dpfed.common.secagg.masking import MaskContext

__all__ = [
    "NeighbourGraph",
    "choose_degree",
    "derive_graph",
    "drop_capacity",
    "graph_seed",
    "min_degree",
    "threshold",
]

_SEED = b"dpfed-secagg-graph-v1"


def threshold(holders: int, tolerated: int) -> int:
    """Return the Shamir threshold ``T = floor((m + t) / 2) + 1`` among ``m`` share holders.

    No two sets of ``T`` holders with ``t`` colluders among them are disjoint in honest
    holders, and ``t`` colluders alone cannot rebuild a secret.
    """
    return (holders + tolerated) // 2 + 1


def min_degree(n: int) -> int:
    """Return the smallest degree a sparse graph of ``n`` dealers may have: ``2 ceil(log2 n)``."""
    return 2 * max(1, math.ceil(math.log2(max(n, 2))))


def drop_capacity(n: int, degree: int, tolerated: int) -> int:
    """Return the drops a sum of ``n`` dealers on a graph of ``degree`` survives securely.

    Complete graph (``degree >= n - 1``): ``min(n - T(n), n - t - 1)``, as before sparse graphs.
    Sparse: every neighbourhood (a site and its ``k`` neighbours, ``m = k + 1`` holders) keeps
    ``T(m)`` holders, the graph minus ``t`` colluders and the drops stays connected (``H(k, n)``
    is ``k``-connected: ``t + d <= k - 1``), and ``T(n)`` survivors remain to sign the view.
    Negative: the graph does not even tolerate ``t`` colluders without drops.
    """
    if degree >= n - 1:
        return min(n - threshold(n, tolerated), n - tolerated - 1)
    m = degree + 1
    return min(m - threshold(m, tolerated), degree - tolerated - 1, n - threshold(n, tolerated))


def choose_degree(n: int, tolerated: int, dropouts: int) -> int:
    """Return ``k``: the smallest even degree ``>= min_degree(n)`` that survives ``dropouts``.

    ``n - 1`` (the complete graph) when no sparse degree does.
    """
    k = min_degree(n)
    while k < n - 1 and drop_capacity(n, k, tolerated) < dropouts:
        k += 2
    return min(k, n - 1)


def graph_seed(context: MaskContext, publics: Mapping[str, bytes]) -> bytes:
    """Return SHA-256 of the sum's context and every dealer's id and signed round key (sorted)."""
    h = hashlib.sha256(_SEED + context.encode() + len(publics).to_bytes(4, "big"))
    for site in sorted(publics):
        raw, key = site.encode("utf-8"), publics[site]
        h.update(len(raw).to_bytes(4, "big") + raw + len(key).to_bytes(4, "big") + key)
    return h.digest()


@dataclass(frozen=True)
class NeighbourGraph:
    """The graph of one sum: ``ring`` (the dealers in ring order) and the even ``degree``.

    ``degree == len(ring) - 1`` is the complete graph.
    """

    ring: tuple[str, ...]
    degree: int

    def __post_init__(self) -> None:
        n = len(self.ring)
        if len(set(self.ring)) != n or n < 2:
            raise ValidationError("a neighbour graph needs at least two distinct sites")
        if not (self.degree == n - 1 or (self.degree % 2 == 0 and 2 <= self.degree < n - 1)):
            raise ValidationError(f"a neighbour graph of {n} sites has degree {n - 1} "
                                  f"(complete) or an even degree in [2, {n - 2}], got "
                                  f"{self.degree}")

    @property
    def complete(self) -> bool:
        """Whether every site neighbours every other (the protocol of a full graph)."""
        return self.degree == len(self.ring) - 1

    @functools.cached_property
    def _position(self) -> dict[str, int]:
        return {s: i for i, s in enumerate(self.ring)}

    @property
    def holders(self) -> int:
        """Share holders of one site's secrets: the site and its neighbours."""
        return self.degree + 1

    def neighbours(self, site: str) -> tuple[str, ...]:
        """Return the sorted neighbours of ``site``."""
        n = len(self.ring)
        if self.complete:
            return tuple(sorted(s for s in self.ring if s != site))
        i = self._position[site]
        half = self.degree // 2
        return tuple(sorted(self.ring[(i + j) % n] for j in range(-half, half + 1) if j))

    def share_threshold(self, tolerated: int) -> int:
        """Return the Shamir threshold of every site's secrets: ``T(k + 1)``."""
        return threshold(self.holders, tolerated)

    def view_threshold(self, tolerated: int) -> int:
        """Return the signatures on one view a site needs before it reveals: ``T(n)``."""
        return threshold(len(self.ring), tolerated)

    def capacity(self, tolerated: int) -> int:
        """:func:`drop_capacity` of this graph."""
        return drop_capacity(len(self.ring), self.degree, tolerated)


def derive_graph(context: MaskContext, publics: Mapping[str, bytes], degree: int
                 ) -> NeighbourGraph:
    """Return the graph of ``degree`` over the dealers of ``publics`` (id -> signed round key).

    The ring sorts the dealers by SHA-256 of the seed and the id: a uniformly random order
    that neither the order the keys arrive in nor anything but the keys themselves affects.
    """
    seed = graph_seed(context, publics)

    def rank(site: str) -> bytes:
        raw = site.encode("utf-8")
        return hashlib.sha256(seed + len(raw).to_bytes(4, "big") + raw).digest()

    return NeighbourGraph(tuple(sorted(publics, key=rank)), degree)
