"""Ephemeral key agreement keys, signed with each site's certificate key.

For every secure round each site makes fresh X25519 keys (a mask key and a channel key:
:class:`dpfed.common.secagg.dropouts.RoundKeys`) and signs their public halves with the ECDSA
key of its federation certificate. The coordinator only relays the signed keys; each site
checks every peer's certificate against the federation CA, that the certificate names the site
id the key claims, and the signature over (domain tag, job, round, task, site id, public
key). A coordinator that substitutes a key — to sit in the middle of a pair and unmask one
site's contribution — cannot produce a valid signature, so the site refuses the round before it
releases anything. The coordinator may hold the kits of revoked sites (or a certificate the CA
issued outside the federation's list): :func:`verify_participants` also refuses a peer whose
certificate is on the site's own revocation list or whose id is not one of the federation's
sites, so masks are only ever agreed with sites the site itself recognises.

A certificate is parsed and checked against the CA once per process (:func:`certificate`,
:func:`_issued_by`, bounded caches keyed by the exact PEM bytes and the CA): a federation's
certificates do not change between rounds, and re-verifying every peer's chain in every sum
was about 40 % of the key checks. Validity dates, the revocation list, the site list and the
per-round signature are checked every time.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from dpfed.common.errors import AuthenticationError, ProtocolError
from dpfed.common.secagg.masking import MaskContext
from dpfed.common.transport.access import AccessList
from dpfed.common.transport.certs import fingerprint, is_signed_by, principal_from_certificate

__all__ = ["SignedKey", "certificate", "generate_ephemeral", "sign_ephemeral",
           "verify_participants", "verify_signed_key"]

_TAG = b"dpfed-secagg-key-v1"


@dataclass(frozen=True)
class SignedKey:
    """A site's ephemeral public key for one secure round, with proof of who made it."""

    site_id: str
    public_key: bytes
    signature: bytes
    certificate_pem: bytes


def _message(site_id: str, public_key: bytes, context: MaskContext) -> bytes:
    sid = site_id.encode("utf-8")
    return (_TAG + context.encode() + len(sid).to_bytes(4, "big") + sid
            + len(public_key).to_bytes(4, "big") + public_key)


def generate_ephemeral() -> tuple[X25519PrivateKey, bytes]:
    """Return a fresh X25519 key pair (private key, 32-byte raw public key)."""
    key = X25519PrivateKey.generate()
    public = key.public_key().public_bytes(serialization.Encoding.Raw,
                                           serialization.PublicFormat.Raw)
    return key, public


def sign_ephemeral(*, site_id: str, public_key: bytes, context: MaskContext,
                   signing_key: ec.EllipticCurvePrivateKey,
                   certificate_pem: bytes) -> SignedKey:
    """Sign ``public_key`` for ``context`` with the site's certificate key."""
    signature = signing_key.sign(_message(site_id, public_key, context),
                                 ec.ECDSA(hashes.SHA256()))
    return SignedKey(site_id, public_key, signature, certificate_pem)


def verify_signed_key(signed: SignedKey, *, context: MaskContext, ca: x509.Certificate,
                      now: dt.datetime | None = None) -> bytes:
    """Return the verified raw public key, or raise if anything does not check out.

    Raises
    ------
    AuthenticationError
        The certificate does not chain to the federation CA, is not valid now, or names
        another principal than ``signed.site_id``.
    ProtocolError
        The public key is malformed or the signature does not verify (e.g. a substituted key,
        or a key signed for another round).
    """
    _verified_certificate(signed, context=context, ca=ca, now=now)
    return signed.public_key


def verify_participants(signed: Mapping[str, SignedKey], *, context: MaskContext,
                        ca: x509.Certificate, federation: AccessList,
                        now: dt.datetime | None = None) -> dict[str, bytes]:
    """Verify every participant's key against the CA, the revocation list and the site list.

    Parameters
    ----------
    signed : mapping of str to SignedKey
        Participant id -> the signed key relayed for it.
    federation : AccessList
        The site's copy of the federation's lists (``revoked.toml``): revoked certificate
        fingerprints and the federation's site ids.

    Returns
    -------
    dict of str to bytes
        Participant id -> verified raw public key.

    Raises
    ------
    AuthenticationError
        Naming every participant that is revoked, not on the federation's site list, whose
        certificate does not chain to the CA or name it, or whose key's signature does not
        verify.
    """
    problems: list[str] = []
    verified: dict[str, bytes] = {}
    for site_id in sorted(signed):
        key = signed[site_id]
        if key.site_id != site_id:
            problems.append(f"the key relayed for {site_id!r} claims to be {key.site_id!r}")
            continue
        try:
            cert = _verified_certificate(key, context=context, ca=ca, now=now)
        except (AuthenticationError, ProtocolError) as exc:
            problems.append(str(exc))
            continue
        fp = fingerprint(cert)
        if federation.is_revoked(fp):
            problems.append(f"{site_id!r} presents a revoked certificate (sha256 {fp[:23]}...)")
        elif site_id not in federation.sites:
            problems.append(f"{site_id!r} is not one of the federation's sites on this site's "
                            "list")
        else:
            verified[site_id] = key.public_key
    if problems:
        raise AuthenticationError("; ".join(problems))
    return verified


@functools.lru_cache(maxsize=4096)
def certificate(pem: bytes) -> x509.Certificate:
    """Parse a PEM certificate (cached by its bytes; ``ValueError`` if it is none)."""
    return x509.load_pem_x509_certificate(pem)


@functools.lru_cache(maxsize=4096)
def _issued_by(pem: bytes, ca: x509.Certificate) -> bool:
    """Whether ``ca`` issued the certificate ``pem`` (cached per PEM and CA: it cannot change)."""
    return is_signed_by(certificate(pem), ca)


def _verified_certificate(signed: SignedKey, *, context: MaskContext, ca: x509.Certificate,
                          now: dt.datetime | None) -> x509.Certificate:
    """Return the certificate of ``signed`` once it and the key's signature are verified."""
    try:
        cert = certificate(signed.certificate_pem)
    except ValueError:
        raise AuthenticationError(f"the certificate sent for {signed.site_id!r} is not a PEM "
                                  "certificate") from None
    if not _issued_by(signed.certificate_pem, ca):
        raise AuthenticationError(f"the certificate for {signed.site_id!r} is not issued by the "
                                  "federation CA")
    at = now or dt.datetime.now(dt.UTC)
    if not cert.not_valid_before_utc <= at <= cert.not_valid_after_utc:
        raise AuthenticationError(f"the certificate for {signed.site_id!r} is not valid now")
    principal = principal_from_certificate(cert, source=f"certificate of {signed.site_id!r}")
    if principal.role != "site" or principal.name != signed.site_id:
        raise AuthenticationError(f"a key claimed for site {signed.site_id!r} comes with the "
                                  f"certificate of {principal}")
    if len(signed.public_key) not in (32, 64):
        raise ProtocolError(f"the ephemeral key of {signed.site_id!r} has "
                            f"{len(signed.public_key)} bytes, expected 32 (a mask key) or 64 "
                            "(a mask and a channel key)")
    public = cert.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise AuthenticationError(f"the certificate of {signed.site_id!r} has no EC key")
    try:
        public.verify(signed.signature, _message(signed.site_id, signed.public_key, context),
                      ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise ProtocolError(f"the ephemeral key of {signed.site_id!r} is not signed by that "
                            "site for this round (substituted or replayed)") from None
    return cert
