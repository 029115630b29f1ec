"""Small dense linear-algebra helpers shared by the privacy core and the algorithms."""

from __future__ import annotations

import numpy as np
from scipy.linalg import blas

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


def syrk_upper(x: np.ndarray, into: np.ndarray | None = None) -> np.ndarray:
    """Return ``x^T x`` (upper triangle filled; plus ``into`` if given) with BLAS ``dsyrk``.

    ``x`` (n x p, float64) is passed in whichever memory order it has, never copied: a
    column-major ``x`` as ``A`` with ``trans = 1``, a row-major one as the column-major
    ``A = x^T`` with ``trans = 0`` (f2py would copy a row-major ``A`` to column order).
    ``into`` (p x p, column-major) is updated in place.
    """
    if x.flags.f_contiguous:
        a, trans = x, 1
    else:
        a, trans = (x.T if x.T.flags.f_contiguous else np.asfortranarray(x.T)), 0
    if into is None:
        out: np.ndarray = blas.dsyrk(1.0, a, trans=trans, lower=0)
        return out
    out = blas.dsyrk(1.0, a, beta=1.0, c=into, trans=trans, lower=0, overwrite_c=1)
    return out
