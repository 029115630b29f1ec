"""Where noise comes from.

Production releases draw from a fresh :class:`numpy.random.Generator` seeded with 256 bits
from the operating system's CSPRNG (``os.urandom``) for every release (docs/privacy.md, invariant
5). Nothing in dpfed calls the global ``np.random`` functions, and no RPC lets a caller pick
a seed: only library callers and tests pass an explicit generator.
"""

from __future__ import annotations

import os

import numpy as np

from dpfed.common.errors import ValidationError


def production_rng() -> np.random.Generator:
    """Return a generator seeded from 256 bits of ``os.urandom`` (one per release)."""
    entropy = int.from_bytes(os.urandom(32), "little")
    return np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(entropy)))


def resolve_rng(rng: np.random.Generator | None) -> np.random.Generator:
    """Return ``rng`` if given (tests, reproducible demos), else a fresh production generator."""
    if rng is None:
        return production_rng()
    if not isinstance(rng, np.random.Generator):
        raise ValidationError(
            f"rng must be a numpy.random.Generator or None, got {type(rng).__name__}"
        )
    return rng


def derived_rng(parent: np.random.Generator) -> np.random.Generator:
    """Return a generator seeded with 256 bits drawn from ``parent``.

    For work split into pieces that may run in any order or in parallel threads (e.g. the
    chunks of synthetic rows): each piece gets its own derived generator, drawn from the
    parent in piece order, so the result depends on the parent only -- never on which thread
    ran a piece or when. Deterministic for a seeded parent (tests); from
    :func:`production_rng` it is as unpredictable as the parent.
    """
    parent = resolve_rng(parent)
    seed = parent.integers(0, 2**32, size=8, dtype=np.uint32)
    return np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(seed)))
