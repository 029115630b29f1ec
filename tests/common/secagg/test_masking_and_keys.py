"""Secure aggregation core: masks cancel, a single masked message looks uniform, seeds are bound
to their round, and a substituted or replayed key is caught. Certificates come from the
project's own CA tool."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from scipy import stats

from dpfed.common.errors import AuthenticationError, ProtocolError, ValidationError
from dpfed.common.secagg import masking
from dpfed.common.secagg.keys import (
    SignedKey,
    generate_ephemeral,
    sign_ephemeral,
    verify_signed_key,
)
from dpfed.common.secagg.masking import MaskContext, apply_masks, derive_pair_seed, sum_masked
from dpfed.common.transport.certs import init_federation

SITES = ("hospital-a", "hospital-b", "hospital-c", "hospital-d")
CTX = MaskContext("job-1", "pca", "job-1/pca")


def _seeds(ctx: MaskContext, derive=derive_pair_seed) -> dict[str, dict[str, bytes]]:  # type: ignore[no-untyped-def]
    keys = {s: generate_ephemeral() for s in SITES}
    return {s: {p: derive(keys[s][0], keys[p][1], own_id=s, peer_id=p, context=ctx)
                for p in SITES if p != s} for s in SITES}


def test_masks_cancel_exactly_in_the_sum() -> None:
    rng = np.random.default_rng(1)
    plain = {s: rng.integers(-2**40, 2**40, size=1000).astype(np.int64) for s in SITES}
    seeds = _seeds(CTX)
    masked = [apply_masks(plain[s].astype(np.uint64), own_id=s, seeds=seeds[s]) for s in SITES]
    total = sum_masked(masked).astype(np.int64)
    assert np.array_equal(total, sum(plain.values()))


def test_a_wrong_sign_convention_is_caught() -> None:
    rng = np.random.default_rng(2)
    plain = {s: rng.integers(0, 100, size=50).astype(np.int64) for s in SITES}
    seeds = _seeds(CTX)
    masked = []
    for s in SITES:
        out = plain[s].astype(np.uint64)
        for p in sorted(seeds[s]):  # planted: every site adds every mask
            out = out + masking.mask_stream(seeds[s][p], out.size)
        masked.append(out)
    assert not np.array_equal(sum_masked(masked).astype(np.int64), sum(plain.values()))


def _uniform_p_value(values: np.ndarray) -> float:
    """Chi-square p-value that the 16-bit limbs of uint64 values are uniform."""
    limbs = values.view(np.uint16)
    counts = np.bincount((limbs >> 8).astype(np.int64), minlength=256)  # top byte of each limb
    return float(stats.chisquare(counts).pvalue)


def test_one_masked_message_looks_uniform_and_a_weak_mask_is_caught() -> None:
    seeds = _seeds(CTX)
    plain = np.arange(20_000, dtype=np.uint64) % 7  # highly structured data
    masked = apply_masks(plain, own_id="hospital-b", seeds=seeds["hospital-b"])
    assert _uniform_p_value(masked) > 1e-4
    # planted: a mask stream with only 32 random bits per element leaves the high limbs plain
    weak = plain.copy()
    for p in sorted(seeds["hospital-b"]):
        weak += masking.mask_stream(seeds["hospital-b"][p], plain.size) & np.uint64(0xFFFFFFFF)
    assert _uniform_p_value(weak) < 1e-6


def test_seeds_are_bound_to_the_round_and_a_reused_stream_is_caught() -> None:
    a, a_pub = generate_ephemeral()
    b, b_pub = generate_ephemeral()
    r1 = derive_pair_seed(a, b_pub, own_id="x", peer_id="y", context=CTX)
    assert r1 == derive_pair_seed(b, a_pub, own_id="y", peer_id="x", context=CTX)
    other = MaskContext("job-1", "pca", "job-1/pca-retry")
    r2 = derive_pair_seed(a, b_pub, own_id="x", peer_id="y", context=other)
    assert r1 != r2
    # A reused stream leaks the difference of two rounds' values: the test that would catch it.
    v1, v2 = np.uint64([5, 6, 7]), np.uint64([1, 2, 3])

    def leaks(seed_1: bytes, seed_2: bytes) -> bool:
        m1 = apply_masks(v1, own_id="x", seeds={"y": seed_1})
        m2 = apply_masks(v2, own_id="x", seeds={"y": seed_2})
        return bool(np.array_equal(m1 - m2, v1 - v2))

    assert not leaks(r1, r2)
    assert leaks(r1, r1)  # planted: a derivation that ignores the task id


def test_invalid_peer_keys_are_refused() -> None:
    a, _ = generate_ephemeral()
    with pytest.raises(ProtocolError):
        derive_pair_seed(a, b"\x01" * 31, own_id="x", peer_id="y", context=CTX)
    with pytest.raises(ProtocolError):  # a low-order point gives an all-zero secret
        derive_pair_seed(a, bytes(32), own_id="x", peer_id="y", context=CTX)
    with pytest.raises(ValidationError):
        derive_pair_seed(a, generate_ephemeral()[1], own_id="x", peer_id="x", context=CTX)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pki")
    init_federation(root / "fed", coordinator_hosts=["localhost"], sites=list(SITES[:2]),
                    analysts=[])
    init_federation(root / "foreign", coordinator_hosts=["localhost"], sites=["hospital-a"],
                    analysts=[])
    return {"fed": root / "fed", "foreign": root / "foreign"}


def _kit(root: Path, site: str) -> tuple[bytes, object]:
    cert = (root / "sites" / site / "site.pem").read_bytes()
    key = serialization.load_pem_private_key((root / "sites" / site / "site.key").read_bytes(),
                                             password=None)
    return cert, key


def _ca(root: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate((root / "ca.pem").read_bytes())


def _signed(root: Path, site: str, public: bytes, ctx: MaskContext = CTX) -> SignedKey:
    cert, key = _kit(root, site)
    return sign_ephemeral(site_id=site, public_key=public, context=ctx, signing_key=key,  # type: ignore[arg-type]
                          certificate_pem=cert)


def test_signed_key_round_trip(pki: dict[str, Path]) -> None:
    _, pub = generate_ephemeral()
    signed = _signed(pki["fed"], "hospital-a", pub)
    assert verify_signed_key(signed, context=CTX, ca=_ca(pki["fed"])) == pub


def test_a_key_substituted_by_the_coordinator_is_caught(pki: dict[str, Path]) -> None:
    _, pub = generate_ephemeral()
    signed = _signed(pki["fed"], "hospital-a", pub)
    _, evil = generate_ephemeral()
    forged = SignedKey(signed.site_id, evil, signed.signature, signed.certificate_pem)
    with pytest.raises(ProtocolError, match="substituted or replayed"):
        verify_signed_key(forged, context=CTX, ca=_ca(pki["fed"]))


def test_a_key_replayed_from_another_round_is_caught(pki: dict[str, Path]) -> None:
    _, pub = generate_ephemeral()
    old = _signed(pki["fed"], "hospital-a", pub, MaskContext("job-0", "pca", "job-0/pca"))
    with pytest.raises(ProtocolError):
        verify_signed_key(old, context=CTX, ca=_ca(pki["fed"]))


def test_certificates_must_chain_and_name_the_site(pki: dict[str, Path]) -> None:
    _, pub = generate_ephemeral()
    foreign = _signed(pki["foreign"], "hospital-a", pub)
    with pytest.raises(AuthenticationError, match="not issued by the federation CA"):
        verify_signed_key(foreign, context=CTX, ca=_ca(pki["fed"]))
    cert_b, key_b = _kit(pki["fed"], "hospital-b")
    claim_a = sign_ephemeral(site_id="hospital-a", public_key=pub, context=CTX,
                             signing_key=key_b, certificate_pem=cert_b)  # type: ignore[arg-type]
    with pytest.raises(AuthenticationError, match="comes with the certificate of site/hospital-b"):
        verify_signed_key(claim_a, context=CTX, ca=_ca(pki["fed"]))


def test_a_cached_chain_check_holds_only_for_its_own_ca(pki: dict[str, Path]) -> None:
    # Certificates are checked against the CA once per process (keys._issued_by): a check
    # passed under one CA must not let the same certificate through under another, and a
    # foreign certificate for the same site is refused after the genuine one was cached.
    _, pub = generate_ephemeral()
    genuine = _signed(pki["fed"], "hospital-a", pub)
    foreign = _signed(pki["foreign"], "hospital-a", pub)
    for _ in range(2):  # the second pass meets every check in the cache
        assert verify_signed_key(genuine, context=CTX, ca=_ca(pki["fed"])) == pub
        assert verify_signed_key(foreign, context=CTX, ca=_ca(pki["foreign"])) == pub
        with pytest.raises(AuthenticationError, match="not issued by the federation CA"):
            verify_signed_key(genuine, context=CTX, ca=_ca(pki["foreign"]))
        with pytest.raises(AuthenticationError, match="not issued by the federation CA"):
            verify_signed_key(foreign, context=CTX, ca=_ca(pki["fed"]))


def test_x25519_exchange_is_symmetric_sanity() -> None:
    a, b = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    assert a.exchange(b.public_key()) == b.exchange(a.public_key())
