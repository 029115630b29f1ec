"""Dropout recovery for secure sums (Bonawitz et al., CCS 2017, rounds 1-4; Bell et al. 2020).

Every participant holds two fresh X25519 keys per sum (one for masks, one for the channel that
carries shares), signed together. Before masking, a site Shamir-shares (threshold ``T``) its
mask key and a fresh self-mask seed among its neighbours (:mod:`dpfed.common.secagg.graph`;
every participant on a complete graph), each share encrypted to its recipient (AES-GCM under
a key from the channel exchange) and committed to (SHA-256) in public. It then masks with
every neighbour that dealt shares and with its own self-mask. After the masked
vectors are in, every survivor signs the participant and survivor sets it was shown and
reveals, once at least ``T`` survivors signed the same sets, the self-mask share of every
survivor and the mask-key share of every dropped site -- never both for one site
(:class:`RevealRecord`). The coordinator checks every share against its commitment before
using it. docs/secure-aggregation.md, "Dropouts", states the protocol and why it is private.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.secagg.graph import NeighbourGraph, threshold
from dpfed.common.secagg.keys import certificate
from dpfed.common.secagg.masking import MaskContext, derive_pair_seed, mask_stream
from dpfed.common.secagg.shamir import SHARE_BYTES, reconstruct, split

__all__ = [
    "Dealt",
    "RevealRecord",
    "RoundKeys",
    "commitment",
    "deal",
    "mask_public",
    "open_share",
    "recovery_correction",
    "self_mask",
    "sign_view",
    "threshold",
    "verify_view",
    "view_message",
]

_CHANNEL = b"dpfed-secagg-channel-v1"
_COMMIT = b"dpfed-secagg-commit-v1"
_VIEW = b"dpfed-secagg-view-v1"
KINDS = ("self", "key")
#: A sealed pair of shares: 12-byte nonce, two shares, 16-byte tag.
SEALED_BYTES = 12 + 2 * SHARE_BYTES + 16


def _raw(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw,
                                         serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class RoundKeys:
    """A site's two ephemeral keys of one sum; ``public`` is what it signs (mask || channel)."""

    mask: X25519PrivateKey
    channel: X25519PrivateKey

    @classmethod
    def generate(cls) -> RoundKeys:
        """Return two fresh X25519 keys."""
        return cls(X25519PrivateKey.generate(), X25519PrivateKey.generate())

    @property
    def public(self) -> bytes:
        """The 64 bytes every peer verifies: the mask key's then the channel key's public half."""
        return _raw(self.mask) + _raw(self.channel)

    def mask_secret(self) -> bytes:
        """Return the mask key's 32 raw private bytes (shared; rebuilt if the site drops)."""
        return self.mask.private_bytes(serialization.Encoding.Raw,
                                       serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption())


def mask_public(public: bytes) -> bytes:
    """Return the mask half of a 64-byte round public key."""
    if len(public) != 64:
        raise ProtocolError(f"a round key has 64 bytes (mask and channel), got {len(public)}")
    return public[:32]


def self_mask(seed: bytes, n_values: int) -> np.ndarray:
    """Return the self-mask stream of a 32-byte seed (fresh per sum: one stream per key)."""
    return mask_stream(seed, n_values)


def _ids(*ids: str) -> bytes:
    out = b""
    for s in ids:
        raw = s.encode("utf-8")
        out += len(raw).to_bytes(4, "big") + raw
    return out


def commitment(context: MaskContext, dealer: str, recipient: str, kind: str,
               share: bytes) -> bytes:
    """SHA-256 commitment to one share (public: a share is a uniform 521-bit value)."""
    return hashlib.sha256(_COMMIT + context.encode() + _ids(dealer, recipient, kind)
                          + share).digest()


def _channel_key(own: X25519PrivateKey, peer_public: bytes, own_id: str, peer_id: str,
                 context: MaskContext) -> bytes:
    if len(peer_public) != 64:
        raise ProtocolError(f"the round key of {peer_id!r} has {len(peer_public)} bytes, "
                            "expected 64")
    try:
        shared = own.exchange(X25519PublicKey.from_public_bytes(peer_public[32:]))
    except ValueError:
        shared = bytes(32)
    if shared == bytes(32):
        raise ProtocolError(f"the channel key of {peer_id!r} gives an all-zero shared secret")
    low, high = sorted((own_id, peer_id))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=_CHANNEL + context.encode() + _ids(low, high)).derive(shared)


@dataclass(frozen=True)
class Dealt:
    """What a dealer sends one recipient: the sealed shares and the public commitments."""

    sealed: bytes
    commit_self: bytes
    commit_key: bytes


def deal(keys: RoundKeys, self_seed: bytes, *, own_id: str, publics: Mapping[str, bytes],
         context: MaskContext, threshold_: int, neighbours: Iterable[str] | None = None
         ) -> tuple[dict[str, Dealt], bytes, bytes]:
    """Share the self-mask seed and the mask key among ``neighbours`` (default: every dealer).

    ``publics``: every dealer's round key. Share ``x`` belongs to the dealer at position
    ``x - 1`` in sorted order. Returns the sealed shares for every neighbour, the dealer's own
    self-mask share (which it reveals itself if it survives; its own mask-key share is never
    needed) and that share's commitment.
    """
    order = sorted(publics)
    if own_id not in order:
        raise ValidationError(f"{own_id!r} is not among the participants it deals to")
    peers = set(order if neighbours is None else neighbours) - {own_id}
    if not peers <= set(order):
        raise ValidationError(f"{own_id!r} deals to neighbours that are not dealers")
    xs = [x for x, s in enumerate(order, start=1) if s in peers or s == own_id]
    self_shares = split(self_seed, n_shares=len(order), threshold=threshold_, only=xs)
    key_shares = split(keys.mask_secret(), n_shares=len(order), threshold=threshold_, only=xs)
    out: dict[str, Dealt] = {}
    for x, peer in enumerate(order, start=1):
        if peer not in peers:
            continue
        aead = AESGCM(_channel_key(keys.channel, publics[peer], own_id, peer, context))
        nonce = os.urandom(12)
        sealed = nonce + aead.encrypt(nonce, self_shares[x] + key_shares[x],
                                      context.encode() + _ids(own_id, peer))
        out[peer] = Dealt(sealed, commitment(context, own_id, peer, "self", self_shares[x]),
                          commitment(context, own_id, peer, "key", key_shares[x]))
    own = self_shares[order.index(own_id) + 1]
    return out, own, commitment(context, own_id, own_id, "self", own)


def open_share(keys: RoundKeys, dealt: Dealt, *, own_id: str, dealer: str,
               dealer_public: bytes, context: MaskContext) -> tuple[bytes, bytes]:
    """Decrypt the shares ``dealer`` sent this site and check them against its commitments.

    Raises
    ------
    ProtocolError
        The shares do not decrypt (tampered, or sealed for another site or round) or do not
        match the dealer's public commitments.
    """
    if len(dealt.sealed) != SEALED_BYTES:
        raise ProtocolError(f"the shares from {dealer!r} have {len(dealt.sealed)} bytes, "
                            f"expected {SEALED_BYTES}")
    aead = AESGCM(_channel_key(keys.channel, dealer_public, own_id, dealer, context))
    try:
        plain = aead.decrypt(dealt.sealed[:12], dealt.sealed[12:],
                             context.encode() + _ids(dealer, own_id))
    except InvalidTag:
        raise ProtocolError(f"the shares from {dealer!r} do not decrypt (tampered, or sealed "
                            "for another site or round)") from None
    own_self, own_key = plain[:SHARE_BYTES], plain[SHARE_BYTES:]
    if (commitment(context, dealer, own_id, "self", own_self) != dealt.commit_self
            or commitment(context, dealer, own_id, "key", own_key) != dealt.commit_key):
        raise ProtocolError(f"the shares from {dealer!r} do not match its commitments")
    return own_self, own_key


def view_message(context: MaskContext, participants: Sequence[str],
                 survivors: Sequence[str]) -> bytes:
    """Return the bytes a survivor signs: the round, the participant set and the survivor set."""
    return (_VIEW + context.encode() + len(participants).to_bytes(4, "big")
            + _ids(*sorted(participants)) + len(survivors).to_bytes(4, "big")
            + _ids(*sorted(survivors)))


def sign_view(signing_key: ec.EllipticCurvePrivateKey, context: MaskContext,
              participants: Sequence[str], survivors: Sequence[str]) -> bytes:
    """Sign the view with the site's certificate key."""
    return signing_key.sign(view_message(context, participants, survivors),
                            ec.ECDSA(hashes.SHA256()))


def verify_view(certificate_pem: bytes, signature: bytes, context: MaskContext,
                participants: Sequence[str], survivors: Sequence[str]) -> bool:
    """Return whether ``signature`` signs this view with the key of ``certificate_pem``.

    The certificate was verified against the CA with the site's round keys beforehand.
    """
    public = certificate(certificate_pem).public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        return False
    try:
        public.verify(signature, view_message(context, participants, survivors),
                      ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


@dataclass
class RevealRecord:
    """What a site has revealed in one sum: per peer, ``self`` or ``key`` -- never both.

    The site reveals a survivor's self-mask share or a dropped site's mask-key share; a second
    request that would reveal the other kind for a peer (a coordinator replaying the round
    with other sets) is refused, so no peer is ever fully unmasked.
    """

    kinds: dict[str, str] = field(default_factory=dict)

    def allow(self, survivors: Collection[str], dropped: Collection[str]) -> None:
        """Record the reveal of self shares of ``survivors`` and key shares of ``dropped``.

        Raises
        ------
        ValidationError
            A peer is in both sets, or was revealed as the other kind before.
        """
        both = set(survivors) & set(dropped)
        if both:
            raise ValidationError(f"secure round refused: {sorted(both)} named both survivor "
                                  "and dropped")
        wanted = {**dict.fromkeys(survivors, "self"), **dict.fromkeys(dropped, "key")}
        clash = sorted(p for p, k in wanted.items() if self.kinds.get(p, k) != k)
        if clash:
            raise ValidationError(f"secure round refused: revealing {clash} now would reveal "
                                  "both masks of a site (its other share was revealed before)")
        self.kinds.update(wanted)


def recovery_correction(*, n_values: int, order: Sequence[str], survivors: Sequence[str],
                        mask_publics: Mapping[str, bytes],
                        revealed: Mapping[str, Mapping[str, Mapping[str, bytes]]],
                        commitments: Mapping[tuple[str, str, str], bytes],
                        threshold_: int, context: MaskContext,
                        graph: NeighbourGraph | None = None) -> np.ndarray:
    """Return what to subtract from the survivors' summed vectors to remove every mask left.

    Parameters
    ----------
    order : sequence of str
        The participants, every site that masked, in sorted order.
    survivors : sequence of str
        The sites whose masked vectors are summed; the others in ``order`` dropped.
    graph : NeighbourGraph, optional
        The sum's graph over every dealer: share ``x`` belongs to the ``x``-th dealer in sorted
        order, a dropped site masked with its neighbours. Default: complete over ``order``.
    mask_publics : mapping of str to bytes
        Every dealer's verified 32-byte mask public key.
    revealed : mapping
        revealer -> kind (``"self"``/``"key"``) -> owner -> share.
    commitments : mapping
        (dealer, recipient, kind) -> the dealer's public commitment to that share.

    Raises
    ------
    ProtocolError
        Fewer than ``threshold_`` verified shares of a secret, or a rebuilt mask key that does
        not match its public key. A share failing its commitment is never used.
    """
    survivors_set = set(survivors)
    dropped = [u for u in order if u not in survivors_set]
    graph = graph if graph is not None else NeighbourGraph(tuple(order), len(order) - 1)
    position = {s: x for x, s in enumerate(sorted(graph.ring), start=1)}
    verified: dict[tuple[str, str], dict[int, bytes]] = {}
    for revealer in sorted(revealed):
        for kind in KINDS:
            for owner, share in revealed[revealer].get(kind, {}).items():
                expected = commitments.get((owner, revealer, kind))
                if expected is None or commitment(context, owner, revealer, kind,
                                                  share) != expected:
                    continue  # an unverified share is never used
                verified.setdefault((owner, kind), {})[position[revealer]] = share
    correction = np.zeros(n_values, dtype=np.uint64)
    for v in survivors:
        seed = reconstruct(verified.get((v, "self"), {}), threshold=threshold_)
        correction += self_mask(seed, n_values)
    for u in dropped:
        secret = reconstruct(verified.get((u, "key"), {}), threshold=threshold_)
        key = X25519PrivateKey.from_private_bytes(secret)
        if _raw(key) != mask_publics[u]:
            raise ProtocolError(f"the mask key rebuilt for {u!r} does not match its public key")
        for v in sorted(survivors_set.intersection(graph.neighbours(u))):
            seed = derive_pair_seed(key, mask_publics[v], own_id=u, peer_id=v, context=context)
            stream = mask_stream(seed, n_values)
            if v < u:  # v added the pair's stream, so subtract it; v > u subtracted it
                correction += stream
            else:
                correction -= stream
    return correction
