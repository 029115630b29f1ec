"""Pairwise masks that cancel in the sum (Bonawitz et al., CCS 2017, the masking layer).

Every pair of sites (u, v) in a round derives the same 32-byte seed from an X25519 exchange of
ephemeral keys, bound by HKDF-SHA256 to the job, the round, the task and the two site ids. Each
seed is expanded by ChaCha20 into a pseudo-random vector in Z_(2^64); site u *adds* the pair's
vector if u sorts before v and *subtracts* it otherwise, so in the sum over all sites every
pairwise vector appears once with each sign and cancels. A single masked contribution is
indistinguishable from uniform to anyone who lacks at least one of that site's pair seeds.

Why a fixed ChaCha20 nonce is safe here: the key (the pair seed) is used for exactly one
stream. The ephemeral X25519 keys are fresh for every round, and the HKDF ``info`` binds the
job id, round and task id as well, so even a site that (wrongly) reused an ephemeral key
would derive a different seed for a different task.

Dropouts: the pairwise vectors of a site that vanishes are removed with its mask key, rebuilt
from Shamir shares (:mod:`dpfed.common.secagg.dropouts`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dpfed.common.errors import ProtocolError, ValidationError

__all__ = [
    "MaskContext",
    "apply_masks",
    "derive_pair_seed",
    "mask_stream",
    "sum_masked",
]

_DOMAIN = b"dpfed-secagg-v1"
_NONCE = bytes(16)  # one stream per key: see the module docstring


@dataclass(frozen=True)
class MaskContext:
    """What every pairwise seed of one secure sum is bound to."""

    job_id: str
    round_name: str
    task_id: str

    def encode(self) -> bytes:
        """Unambiguous bytes of the context (length-prefixed UTF-8 fields)."""
        out = b""
        for field in (self.job_id, self.round_name, self.task_id):
            raw = field.encode("utf-8")
            out += len(raw).to_bytes(4, "big") + raw
        return out


def derive_pair_seed(own_key: X25519PrivateKey, peer_public: bytes, *, own_id: str,
                     peer_id: str, context: MaskContext) -> bytes:
    """Return the 32-byte seed this site shares with ``peer_id`` for ``context``."""
    if own_id == peer_id:
        raise ValidationError(f"a site cannot mask with itself ({own_id!r})")
    try:
        peer = X25519PublicKey.from_public_bytes(peer_public)
    except ValueError as exc:
        raise ProtocolError(f"invalid X25519 public key from {peer_id!r}: {exc}") from None
    try:
        shared = own_key.exchange(peer)
    except ValueError:  # OpenSSL refuses low-order points (all-zero shared secret)
        shared = bytes(32)
    if shared == bytes(32):
        raise ProtocolError(f"the key of {peer_id!r} gives an all-zero shared secret")
    low, high = sorted((own_id, peer_id))
    info = (_DOMAIN + context.encode() + len(low).to_bytes(4, "big") + low.encode()
            + len(high).to_bytes(4, "big") + high.encode())
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def mask_stream(seed: bytes, n_values: int) -> np.ndarray:
    """Expand a 32-byte seed into ``n_values`` pseudo-random uint64 ring elements (ChaCha20)."""
    if len(seed) != 32:
        raise ValidationError(f"a mask seed has 32 bytes, got {len(seed)}")
    if n_values < 0:
        raise ValidationError(f"n_values must be >= 0, got {n_values}")
    encryptor = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor()
    raw = encryptor.update(bytes(8 * n_values)) + encryptor.finalize()
    return np.frombuffer(raw, dtype="<u8").astype(np.uint64)


def apply_masks(values: np.ndarray, *, own_id: str, seeds: Mapping[str, bytes]) -> np.ndarray:
    """Return ``values`` (uint64 ring elements) plus this site's signed pairwise masks."""
    v = np.asarray(values)
    if v.dtype != np.uint64 or v.ndim != 1:
        raise ValidationError(f"values must be a 1-D uint64 array, got {v.dtype} {v.shape}")
    out = v.copy()
    for peer_id in sorted(seeds):
        stream = mask_stream(seeds[peer_id], v.size)
        if own_id < peer_id:
            out += stream
        elif own_id > peer_id:
            out -= stream
        else:
            raise ValidationError(f"a site cannot mask with itself ({own_id!r})")
    return out


def sum_masked(contributions: Sequence[np.ndarray]) -> np.ndarray:
    """Sum masked contributions in the ring; the masks cancel when every pair took part."""
    if not contributions:
        raise ValidationError("nothing to sum")
    shape = np.asarray(contributions[0]).shape
    total = np.zeros(shape, dtype=np.uint64)
    for c in contributions:
        arr = np.asarray(c)
        if arr.dtype != np.uint64 or arr.shape != shape:
            raise ProtocolError(f"a masked contribution must be uint64 of shape {shape}, "
                                f"got {arr.dtype} {arr.shape}")
        total += arr
    return total


def contribution_digest(values: np.ndarray) -> str:
    """SHA-256 of a contribution, for logs and the ledger (never the values themselves)."""
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()
