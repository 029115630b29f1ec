"""Shamir secret sharing of 32-byte secrets over the prime field GF(2^521 - 1).

A secret ``s < 2^256`` is the constant term of a random polynomial of degree ``threshold - 1``
whose other coefficients are drawn from ``secrets`` (os.urandom); share ``i`` (``x = i``,
``1 <= i``) is the polynomial's value there. Any ``threshold`` shares give ``s`` back by
Lagrange interpolation at 0; fewer are jointly uniform and say nothing about ``s``. The field
is the Mersenne prime ``2^521 - 1``, comfortably larger than any 32-byte secret, so a secret
is one field element (no splitting into limbs). Shares travel as 66 big-endian bytes.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping

from dpfed.common.errors import ProtocolError, ValidationError

__all__ = ["PRIME", "SECRET_BYTES", "SHARE_BYTES", "reconstruct", "split"]

PRIME = 2 ** 521 - 1
SECRET_BYTES = 32
SHARE_BYTES = 66


def split(secret: bytes, *, n_shares: int, threshold: int,
          only: Collection[int] | None = None) -> dict[int, bytes]:
    """Return shares ``x -> f(x)`` for ``x = 1 .. n_shares`` (or the ``x`` in ``only``).

    ``only``: the holders' points, when a secret is shared among some of ``n_shares`` sites.

    Raises
    ------
    ValidationError
        The secret is not 32 bytes, ``1 <= threshold <= n_shares`` does not hold, or ``only``
        has fewer than ``threshold`` points or one outside ``1 .. n_shares``.
    """
    if len(secret) != SECRET_BYTES:
        raise ValidationError(f"a shared secret has {SECRET_BYTES} bytes, got {len(secret)}")
    if not 1 <= threshold <= n_shares:
        raise ValidationError(f"threshold must be in [1, n_shares={n_shares}], got {threshold}")
    xs = sorted(set(range(1, n_shares + 1) if only is None else only))
    if len(xs) < threshold or not 1 <= xs[0] <= xs[-1] <= n_shares:
        raise ValidationError(f"shares go to at least threshold={threshold} distinct points "
                              f"in [1, {n_shares}], got {xs[:8]}")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME)
                                                     for _ in range(threshold - 1)]
    out = {}
    for x in xs:
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        out[x] = y.to_bytes(SHARE_BYTES, "big")
    return out


def reconstruct(shares: Mapping[int, bytes], *, threshold: int) -> bytes:
    """Return the secret from at least ``threshold`` shares (the first ``threshold`` by x).

    Raises
    ------
    ProtocolError
        Too few shares, a share that is not a field element, or a result that is not a
        32-byte secret (the shares do not belong together).
    """
    if len(shares) < threshold or threshold < 1:
        raise ProtocolError(f"{len(shares)} shares cannot rebuild a secret of threshold "
                            f"{threshold}")
    points = []
    for x in sorted(shares)[:threshold]:
        raw = shares[x]
        y = int.from_bytes(raw, "big")
        if len(raw) != SHARE_BYTES or y >= PRIME or not 1 <= x < PRIME:
            raise ProtocolError(f"share {x} is not an element of the field")
        points.append((x, y))
    secret = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _yj) in enumerate(points):
            if i != j:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    if secret >= 2 ** (8 * SECRET_BYTES):
        raise ProtocolError("the shares do not rebuild a 32-byte secret (they do not belong "
                            "together)")
    return secret.to_bytes(SECRET_BYTES, "big")
