"""Small dense linear-algebra helpers shared by the privacy core and the algorithms."""

from __future__ import annotations

import numpy as np

#: Elements of the temporary used per block by :func:`mirror_upper` (~32 MiB of float64).
_BLOCK_ELEMENTS = 1 << 22


def mirror_upper(a: np.ndarray) -> np.ndarray:
    """Copy the strict upper triangle of square ``a`` onto its lower triangle, in place.

    Works a block of rows at a time, so the only temporaries are ``block x p`` (about 32 MiB)
    whatever p is -- ``np.triu(a) + np.triu(a, 1).T`` would make three p x p matrices (5.6 GiB
    at p = 5000). Returns ``a``.
    """
    p = a.shape[0]
    if a.ndim != 2 or a.shape[1] != p:
        raise ValueError(f"a must be square, got shape {a.shape}")
    block = max(1, min(p, _BLOCK_ELEMENTS // max(p, 1)))
    for i0 in range(0, p, block):
        i1 = min(p, i0 + block)
        a[i0:i1, :i0] = a[:i0, i0:i1].T
        diag = a[i0:i1, i0:i1]
        diag[...] = np.triu(diag) + np.triu(diag, 1).T
    return a
