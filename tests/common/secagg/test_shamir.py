"""Shamir sharing over GF(2^521 - 1): any threshold of shares rebuilds the secret, fewer do not
(a planted polynomial of too low a degree is caught), and foreign or malformed shares are
refused."""

from __future__ import annotations

import itertools
import os

import pytest

from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.secagg.shamir import PRIME, SHARE_BYTES, reconstruct, split


def test_every_threshold_subset_rebuilds_the_secret() -> None:
    secret = os.urandom(32)
    shares = split(secret, n_shares=6, threshold=4)
    assert sorted(shares) == [1, 2, 3, 4, 5, 6]
    assert all(len(s) == SHARE_BYTES for s in shares.values())
    for subset in itertools.combinations(shares, 4):
        assert reconstruct({x: shares[x] for x in subset}, threshold=4) == secret
    assert reconstruct(shares, threshold=4) == secret  # surplus shares are fine


def test_fewer_than_threshold_shares_do_not_rebuild_it() -> None:
    for _ in range(20):
        secret = os.urandom(32)
        shares = split(secret, n_shares=5, threshold=3)
        with pytest.raises(ProtocolError, match="cannot rebuild"):
            reconstruct({1: shares[1], 2: shares[2]}, threshold=3)
        try:  # interpolating two shares as if the polynomial had degree 1: not the secret
            assert reconstruct({1: shares[1], 2: shares[2]}, threshold=2) != secret
        except ProtocolError:
            pass  # the interpolated value is not even a 32-byte secret


def test_a_planted_low_degree_polynomial_is_caught() -> None:
    def broken_split(secret: bytes, n_shares: int, threshold: int) -> dict[int, bytes]:
        return split(secret, n_shares=n_shares, threshold=threshold - 1)  # one degree short

    secret = os.urandom(32)
    shares = broken_split(secret, 5, 3)
    # the property the test above checks fails for the broken copy: two shares suffice
    assert reconstruct({1: shares[1], 2: shares[2]}, threshold=2) == secret


def test_shares_of_another_secret_or_malformed_shares_are_refused() -> None:
    a = split(os.urandom(32), n_shares=4, threshold=3)
    b = split(os.urandom(32), n_shares=4, threshold=3)
    mixed = {1: a[1], 2: a[2], 3: b[3]}
    try:
        out = reconstruct(mixed, threshold=3)
    except ProtocolError:
        out = None
    assert out is None or out not in (reconstruct(a, threshold=3), reconstruct(b, threshold=3))
    with pytest.raises(ProtocolError, match="not an element"):
        reconstruct({1: a[1], 2: a[2], 3: (PRIME).to_bytes(SHARE_BYTES, "big")}, threshold=3)
    with pytest.raises(ProtocolError, match="not an element"):
        reconstruct({1: a[1], 2: a[2], 3: b"short"}, threshold=3)


@pytest.mark.parametrize(("secret", "n", "t"), [(b"x" * 31, 3, 2), (b"x" * 32, 3, 4),
                                                (b"x" * 32, 3, 0)])
def test_bad_arguments_are_named(secret: bytes, n: int, t: int) -> None:
    with pytest.raises(ValidationError):
        split(secret, n_shares=n, threshold=t)
