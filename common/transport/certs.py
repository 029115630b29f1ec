"""The federation's PKI: one private CA and certificates that carry dpfed identities.

A federation has one certificate authority. It signs a server certificate for the
coordinator and one client certificate per site (hospital) and per analyst. Both gRPC sides
use them for mutual TLS, and the coordinator takes each caller's identity from the verified
client certificate (docs/privacy.md, invariant 6), never from a request field.

Layout written by :func:`init_federation` (and extended by :func:`issue_certificate`)::

    out_dir/                          0700
        ca.pem                        federation CA certificate (public)
        ca.key                        CA private key, 0600: keep it offline if you can
        coordinator/                  0700, the coordinator's kit
            coordinator.pem           server certificate (serverAuth)
            coordinator.key           0600
            ca.pem                    copy of the CA certificate
        sites/<id>/                   0700, the "startup kit" handed to hospital <id>
            site.pem                  client certificate (clientAuth)
            site.key                  0600
            ca.pem                    copy of the CA certificate
        analysts/<id>/                0700, the kit of analyst <id>
            analyst.pem               client certificate (clientAuth)
            analyst.key               0600
            ca.pem                    copy of the CA certificate
        coordinator/access.toml       allow-lists (site and analyst ids) and revocations
        revoked.toml                  revocations and site ids, also copied to sites/<id>/

The two access files are described in :mod:`dpfed.common.transport.access`: ``init`` writes
them with the ids it issues, ``issue`` adds its id (and under ``force`` revokes the
certificate it replaces), :func:`revoke_certificate` revokes one.

Each kit directory is self-contained, so it can be copied to the machine that uses it. A site
or analyst added later with :func:`issue_certificate` gets a new kit signed by the same CA;
no other kit changes (only the coordinator's allow-list gains its id), so nothing has to be
re-provisioned (a known pain point of NVFlare,
where adding a participant meant re-running provisioning: ``docs/references.md``).

Identity encoding
-----------------
A principal is a ``(role, name)`` pair. Its certificate carries it twice:

* as a URI subject alternative name, ``urn:dpfed:site:<id>``, ``urn:dpfed:analyst:<id>`` or
  ``urn:dpfed:coordinator``. This is the authoritative copy: gRPC exposes URI SANs of the
  verified peer certificate in ``context.auth_context()`` (see :mod:`dpfed.common.transport.tls`);
* as the subject, ``CN=<id>, OU=<role>``, for people reading ``dpfed certs show`` or
  ``openssl x509 -text``. Code never reads identity from the subject.

Ids match ``^[a-z0-9][a-z0-9._-]{0,62}$`` (:data:`ID_RULE`).

Cryptography: ECDSA on P-256 with SHA-256 signatures. The CA has ``BasicConstraints(ca=True,
path_length=0)`` (it signs end-entity certificates only) and ``KeyUsage keyCertSign``; client
certificates have ``ExtendedKeyUsage clientAuth``, the coordinator's ``serverAuth``. Private
keys are unencrypted PKCS#8 PEM because gRPC cannot read encrypted keys; unlike NVFlare's
password-protected kits, protecting a kit in transit is left to the operator (file mode 0600
and a separate, trusted channel).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dpfed.common.errors import AuthenticationError, CertificateError, ConfigError, ValidationError
from dpfed.common.transport import access
from dpfed.common.transport.cert_defaults import DEFAULT_CA_VALIDITY_DAYS, DEFAULT_VALIDITY_DAYS

# Identities live in identity.py; re-exported here, where callers have always found them.
from dpfed.common.transport.identity import (
    CLIENT_ROLES as CLIENT_ROLES,
)
from dpfed.common.transport.identity import (
    COORDINATOR_NAME as COORDINATOR_NAME,
)
from dpfed.common.transport.identity import (
    ID_RULE as ID_RULE,
)
from dpfed.common.transport.identity import (
    ROLES as ROLES,
)
from dpfed.common.transport.identity import (
    URN_PREFIX as URN_PREFIX,
)
from dpfed.common.transport.identity import (
    Principal as Principal,
)
from dpfed.common.transport.identity import (
    Role as Role,
)
from dpfed.common.transport.identity import (
    check_principal_id as check_principal_id,
)
from dpfed.common.transport.identity import (
    check_role as check_role,
)
from dpfed.common.transport.identity import (
    make_principal as make_principal,
)
from dpfed.common.transport.identity import (
    parse_principal_uri as parse_principal_uri,
)
from dpfed.common.transport.identity import (
    principal_from_uris as principal_from_uris,
)
from dpfed.common.validation import check_int

logger = logging.getLogger(__name__)

# One DNS label; '_' is tolerated because docker compose service names use it (not RFC 1123).
_LABEL_RE = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")

#: Certificates are back-dated by this much so a peer whose clock is a little behind
#: does not reject a certificate issued a moment ago.
CLOCK_SKEW = dt.timedelta(minutes=5)

#: Hosts every coordinator certificate names, so local runs and ``dpfed simulate`` work.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

_KIT_FILES: dict[Role, tuple[str, str]] = {
    "site": ("site.pem", "site.key"),
    "analyst": ("analyst.pem", "analyst.key"),
    "coordinator": ("coordinator.pem", "coordinator.key"),
}
_KIT_PARENT: dict[Role, str] = {"site": "sites", "analyst": "analysts"}
_EKU_NAMES = {
    ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth",
    ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth",
}


def certificate_uris(cert: x509.Certificate) -> list[str]:
    """Return the URI subject alternative names of ``cert`` (empty if it has none)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(u) for u in san.get_values_for_type(x509.UniformResourceIdentifier)]


def principal_from_certificate(cert: x509.Certificate, *, source: str = "certificate") -> Principal:
    """Return the dpfed principal encoded in ``cert``'s URI SAN (see the module docstring).

    Raises
    ------
    AuthenticationError
        If the certificate carries no dpfed identity or several.
    """
    return principal_from_uris(certificate_uris(cert), source=source)


# --------------------------------------------------------------------------------------------
# Host names of the coordinator


def check_host(host: object) -> str:
    """Return a normalised coordinator host name or IP literal.

    Host names are lower-cased and a trailing dot dropped; IPv6 literals may be written in
    brackets (``[::1]``). Wildcards are refused: each coordinator address is named.

    Raises
    ------
    ValidationError
        If ``host`` is neither an IP address nor a valid DNS name.
    """
    if not isinstance(host, str) or not host.strip():
        raise ValidationError(f"coordinator host must be a DNS name or IP address, got {host!r}")
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    name = text.lower().removesuffix(".")
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL_RE.fullmatch(label) for label in labels):
        raise ValidationError(
            "coordinator host must be an IP address or a DNS name (labels of letters, digits, "
            f"'-' or '_', at most 63 characters each; no wildcards or ports), got {host!r}"
        )
    return name


def _coordinator_sans(hosts: Iterable[str], *, include_loopback: bool) -> list[x509.GeneralName]:
    # The loopback names are added by default so that the coordinator can be reached as
    # localhost/127.0.0.1/[::1] on its own machine, e.g. by `dpfed simulate`.
    names: list[str] = []
    for host in [*hosts, *(LOOPBACK_HOSTS if include_loopback else ())]:
        normalised = check_host(host)
        if normalised not in names:
            names.append(normalised)
    sans: list[x509.GeneralName] = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    return sans


# --------------------------------------------------------------------------------------------
# Building certificates (in memory)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _name(common_name: str, unit: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _key_usage(*, digital_signature: bool, key_cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=key_cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def generate_ca(
    *,
    validity_days: int = DEFAULT_CA_VALIDITY_DAYS,
    common_name: str | None = None,
    not_before: dt.datetime | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Create a self-signed federation CA (ECDSA P-256, SHA-256) in memory.

    Parameters
    ----------
    validity_days : int
        Lifetime of the CA certificate in days (>= 1).
    common_name : str, optional
        Subject CN. The default, ``dpfed federation CA <8 hex digits>``, differs between
        federations so that two CAs are easy to tell apart in ``dpfed certs show``.
    not_before : datetime, optional
        Start of validity (default: now minus :data:`CLOCK_SKEW`).

    Returns
    -------
    (certificate, private_key)
    """
    days = check_int(validity_days, "ca_validity_days", minimum=1)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before if not_before is not None else _now() - CLOCK_SKEW
    subject = _name(common_name or f"dpfed federation CA {secrets.token_hex(4)}", "ca")
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        # path_length=0: this CA signs end-entity certificates only, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(digital_signature=False, key_cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def make_certificate(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    *,
    role: str,
    name: str | None = None,
    hosts: Sequence[str] = (),
    validity_days: int = DEFAULT_VALIDITY_DAYS,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
    include_loopback: bool = True,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Create and sign one end-entity certificate in memory (nothing is written).

    Parameters
    ----------
    ca_cert, ca_key : certificate and private key of the federation CA.
    role : {"site", "analyst", "coordinator"}
        Sites and analysts get a client certificate (``clientAuth``), the coordinator a server
        certificate (``serverAuth``).
    name : str, optional
        The site or analyst id; must be omitted (or ``"coordinator"``) for the coordinator.
    hosts : sequence of str
        Coordinator only: DNS names and IP literals the coordinator is reached at.
    validity_days : int
        Lifetime in days, used when ``not_after`` is not given.
    not_before, not_after : datetime, optional
        Explicit validity window (tests use it to make expired certificates). Default:
        from now minus :data:`CLOCK_SKEW`, for ``validity_days``.
    include_loopback : bool
        Coordinator only: also name localhost, 127.0.0.1 and ::1 (the default). Tests turn it
        off to make a certificate for the wrong host.

    Returns
    -------
    (certificate, private_key)

    Raises
    ------
    ValidationError
        Invalid role, id, host or validity.
    """
    principal = make_principal(role, name)
    if hosts and principal.role != "coordinator":
        raise ValidationError(f"hosts are for the coordinator certificate only, not a {role}")
    start = not_before if not_before is not None else _now() - CLOCK_SKEW
    if not_after is None:
        days = check_int(validity_days, "validity_days", minimum=1)
        not_after = start + dt.timedelta(days=days)
    if not_after <= start:
        raise ValidationError(f"not_after ({not_after}) must be later than not_before ({start})")

    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(principal.uri)]
    if principal.role == "coordinator":
        sans += _coordinator_sans(hosts, include_loopback=include_loopback)
        usage = ExtendedKeyUsageOID.SERVER_AUTH
    else:
        usage = ExtendedKeyUsageOID.CLIENT_AUTH
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(principal.name, principal.role))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True, key_cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def certificate_pem(cert: x509.Certificate) -> bytes:
    """Return ``cert`` as PEM bytes."""
    return cert.public_bytes(serialization.Encoding.PEM)


def private_key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """Return ``key`` as unencrypted PKCS#8 PEM bytes (the form gRPC reads)."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def fingerprint(cert: x509.Certificate) -> str:
    """Return the SHA-256 fingerprint of ``cert`` as colon-separated upper-case hex."""
    return cert.fingerprint(hashes.SHA256()).hex(":").upper()


# --------------------------------------------------------------------------------------------
# Writing files


def _make_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) with mode 0700; warn if it exists and is open."""
    if path.is_dir():
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            logger.warning(
                "[Certs.Write] directory %s holding private keys has mode %o; 0700 is advised",
                path,
                mode,
            )
        return
    if path.exists():
        raise ConfigError(f"{path} exists and is not a directory")
    if not path.parent.exists():
        _make_private_dir(path.parent)
    # mkdir's mode is masked by the umask, which can only remove bits: never wider than 0700.
    os.mkdir(path, 0o700)


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` atomically, the file being created with ``mode``.

    The temporary file is created by ``os.open(..., O_CREAT | O_EXCL, mode)`` so a private
    key is never readable by others, not even for an instant (no write-then-chmod).
    """
    tmp_name = str(path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp")
    # O_EXCL: never follow or reuse a file someone else placed there. The umask can only
    # narrow ``mode``.
    fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise


def _write_private_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    _write_file(path, private_key_pem(key), 0o600)


def _write_certificate(path: Path, pem: bytes) -> None:
    _write_file(path, pem, 0o644)


# --------------------------------------------------------------------------------------------
# Federation layout


@dataclass(frozen=True)
class IssuedCertificate:
    """What was written for one principal.

    Attributes
    ----------
    principal : Principal
    cert_path, key_path, ca_path : Path
        The certificate, its private key, and the copy of the CA certificate in the kit.
    not_after : datetime
        End of validity (UTC).
    fingerprint : str
        SHA-256 fingerprint of the certificate.
    """

    principal: Principal
    cert_path: Path
    key_path: Path
    ca_path: Path
    not_after: dt.datetime
    fingerprint: str

    @property
    def kit_dir(self) -> Path:
        """The directory to hand over to this principal."""
        return self.cert_path.parent


@dataclass(frozen=True)
class Federation:
    """What :func:`init_federation` wrote: the CA files and every issued certificate."""

    ca_cert_path: Path
    ca_key_path: Path
    issued: tuple[IssuedCertificate, ...]


def kit_paths(out_dir: str | os.PathLike[str], principal: Principal) -> tuple[Path, Path, Path]:
    """Return ``(cert_path, key_path, ca_copy_path)`` of ``principal``'s kit under ``out_dir``."""
    root = Path(out_dir)
    if principal.role == "coordinator":
        kit = root / "coordinator"
    else:
        kit = root / _KIT_PARENT[principal.role] / principal.name
    cert_name, key_name = _KIT_FILES[principal.role]
    return kit / cert_name, kit / key_name, kit / "ca.pem"


def _write_kit(
    out_dir: Path,
    principal: Principal,
    cert: x509.Certificate,
    key: ec.EllipticCurvePrivateKey,
    ca_pem: bytes,
) -> IssuedCertificate:
    cert_path, key_path, ca_path = kit_paths(out_dir, principal)
    _make_private_dir(cert_path.parent)
    _write_private_key(key_path, key)
    _write_certificate(cert_path, certificate_pem(cert))
    _write_certificate(ca_path, ca_pem)
    return IssuedCertificate(
        principal, cert_path, key_path, ca_path, cert.not_valid_after_utc, fingerprint(cert)
    )


def _refuse_existing(paths: Iterable[Path], flag: str) -> None:
    existing = [str(p) for p in paths if p.exists() or p.is_symlink()]
    if existing:
        shown = ", ".join(existing[:5]) + (
            f" and {len(existing) - 5} more" if len(existing) > 5 else ""
        )
        raise ConfigError(
            f"refusing to overwrite existing certificate/key files: {shown}; "
            f"pass {flag} to replace them"
        )


def _unique_ids(ids: Sequence[str], role: str) -> list[str]:
    if isinstance(ids, str):
        raise ValidationError(f"{role}s must be a list of ids, got the string {ids!r}")
    checked = [check_principal_id(i, role) for i in ids]
    duplicates = sorted({i for i in checked if checked.count(i) > 1})
    if duplicates:
        raise ValidationError(f"{role} ids must be unique, got duplicates {duplicates}")
    return checked


def init_federation(
    out_dir: str | os.PathLike[str],
    *,
    coordinator_hosts: Sequence[str],
    sites: Sequence[str],
    analysts: Sequence[str],
    validity_days: int = DEFAULT_VALIDITY_DAYS,
    ca_validity_days: int = DEFAULT_CA_VALIDITY_DAYS,
    force: bool = False,
) -> Federation:
    """Create a federation CA and every certificate of a new federation under ``out_dir``.

    Parameters
    ----------
    out_dir : path
        Where to write the layout described in the module docstring (created 0700).
    coordinator_hosts : sequence of str
        DNS names and IP literals the coordinator is reached at. ``localhost``, 127.0.0.1
        and ::1 are always added.
    sites, analysts : sequence of str
        Ids of the sites and analysts to issue client certificates for (may be empty; more
        can be added later with :func:`issue_certificate`).
    validity_days : int
        Lifetime of the coordinator, site and analyst certificates.
    ca_validity_days : int
        Lifetime of the CA (must be >= ``validity_days``).
    force : bool
        Replace existing files. This creates a *new* CA: every certificate issued by the
        old one stops working.

    Returns
    -------
    Federation
        Paths written and the issued certificates (coordinator first, then sites, analysts).

    Raises
    ------
    ValidationError
        Invalid or duplicate ids, invalid hosts or validity.
    ConfigError
        Some target file already exists and ``force`` is False (nothing is written then).
    """
    root = Path(out_dir)
    days = check_int(validity_days, "validity_days", minimum=1)
    ca_days = check_int(ca_validity_days, "ca_validity_days", minimum=1)
    if ca_days < days:
        raise ValidationError(
            f"ca_validity_days must be >= validity_days ({days}), got {ca_days}: "
            "a certificate cannot outlive the CA that signed it"
        )
    hosts = [check_host(h) for h in coordinator_hosts]
    principals = [make_principal("coordinator")]
    principals += [Principal("site", s) for s in _unique_ids(sites, "site")]
    principals += [Principal("analyst", a) for a in _unique_ids(analysts, "analyst")]

    # Check every target before writing anything, so a refusal leaves the directory untouched.
    targets = [root / "ca.pem", root / "ca.key"]
    for principal in principals:
        targets += kit_paths(root, principal)
    if not force:
        _refuse_existing(targets, "force=True (--force)")

    now = _now() - CLOCK_SKEW
    ca_cert, ca_key = generate_ca(validity_days=ca_days, not_before=now)
    ca_pem = certificate_pem(ca_cert)
    _make_private_dir(root)
    _write_private_key(root / "ca.key", ca_key)
    _write_certificate(root / "ca.pem", ca_pem)
    issued = []
    for principal in principals:
        cert, key = make_certificate(
            ca_cert,
            ca_key,
            role=principal.role,
            name=principal.name,
            hosts=hosts if principal.role == "coordinator" else (),
            validity_days=days,
            not_before=now,
        )
        issued.append(_write_kit(root, principal, cert, key, ca_pem))
    # The allow-lists name exactly the issued ids; a new CA starts with no revocations.
    access.publish_federation_access(root, access.AccessList().with_ids(
        "site", [p.name for p in principals if p.role == "site"]).with_ids(
        "analyst", [p.name for p in principals if p.role == "analyst"]))
    logger.info("[Certs.Init] federation CA and %d certificates written to %s", len(issued), root)
    return Federation(root / "ca.pem", root / "ca.key", tuple(issued))


# --------------------------------------------------------------------------------------------
# Reading certificates and keys


def read_pem_file(path: str | os.PathLike[str], what: str) -> bytes:
    """Return the bytes of ``path``; raise ``CertificateError`` naming ``what`` and the path."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise CertificateError(f"{what} {p} does not exist") from None
    except IsADirectoryError:
        raise CertificateError(f"{what} {p} is a directory, expected a PEM file") from None
    except PermissionError:
        raise CertificateError(
            f"{what} {p} is not readable by this user (permission denied)"
        ) from None
    except OSError as exc:
        raise CertificateError(f"{what} {p} cannot be read: {exc.strerror or exc}") from None
    if not data.strip():
        raise CertificateError(f"{what} {p} is empty")
    return data


def parse_certificates(
    data: bytes, path: str | os.PathLike[str], what: str
) -> list[x509.Certificate]:
    """Parse one or more PEM certificates; raise ``CertificateError`` if there are none."""
    if b"-----BEGIN CERTIFICATE-----" not in data:
        hint = " (it looks like a private key)" if b"PRIVATE KEY-----" in data else ""
        raise CertificateError(f"{what} {path} is not a PEM certificate{hint}")
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise CertificateError(f"{what} {path} is not a valid PEM certificate: {exc}") from None


def parse_private_key(
    data: bytes, path: str | os.PathLike[str], what: str
) -> ec.EllipticCurvePrivateKey:
    """Parse an unencrypted PEM private key; raise ``CertificateError`` on any problem.

    Only EC keys are accepted: dpfed issues ECDSA P-256 keys only.
    """
    if b"PRIVATE KEY-----" not in data:
        hint = " (it looks like a certificate)" if b"BEGIN CERTIFICATE" in data else ""
        raise CertificateError(f"{what} {path} is not a PEM private key{hint}")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise CertificateError(
            f"{what} {path} is encrypted; gRPC needs an unencrypted key file (mode 0600)"
        ) from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise CertificateError(f"{what} {path} is not a valid PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError(
            f"{what} {path} holds a {type(key).__name__}; dpfed uses ECDSA (EC) keys only"
        )
    return key


def key_matches_certificate(key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> bool:
    """Return True if ``key`` is the private half of ``cert``'s public key."""
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    return bool(
        key.public_key().public_bytes(der, spki) == cert.public_key().public_bytes(der, spki)
    )


def is_ca_certificate(cert: x509.Certificate) -> bool:
    """Return True if ``cert`` has ``BasicConstraints(ca=True)``."""
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def is_signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """Return True if ``issuer`` is named as ``cert``'s issuer and its key signed ``cert``."""
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def load_ca(ca_dir: str | os.PathLike[str]) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Load and check the federation CA (``ca.pem`` and ``ca.key``) from ``ca_dir``.

    Raises
    ------
    CertificateError
        Missing or malformed files, a key that does not belong to the certificate, a
        certificate that is not a CA or has expired.
    """
    root = Path(ca_dir)
    cert_path, key_path = root / "ca.pem", root / "ca.key"
    certs = parse_certificates(
        read_pem_file(cert_path, "CA certificate"), cert_path, "CA certificate"
    )
    cert = certs[0]
    key = parse_private_key(read_pem_file(key_path, "CA private key"), key_path, "CA private key")
    if not is_ca_certificate(cert):
        raise CertificateError(
            f"CA certificate {cert_path} is not a CA certificate (BasicConstraints ca=False)"
        )
    if not key_matches_certificate(key, cert):
        raise CertificateError(
            f"CA private key {key_path} does not match the CA certificate {cert_path}"
        )
    if cert.not_valid_after_utc <= _now():
        raise CertificateError(
            f"CA certificate {cert_path} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; "
            "a new federation (dpfed certs init --force) is needed"
        )
    return cert, key


def issue_certificate(
    ca_dir: str | os.PathLike[str],
    *,
    role: str,
    name: str | None = None,
    hosts: Sequence[str] | None = None,
    validity_days: int = DEFAULT_VALIDITY_DAYS,
    force: bool = False,
) -> IssuedCertificate:
    """Issue one more certificate with an existing federation CA, touching no other file.

    This is how a hospital joins after the federation was set up: its kit
    (``sites/<id>/``) is written next to the others and signed by the same CA, and its id is
    added to the coordinator's allow-list (``coordinator/access.toml``, which the coordinator
    reads again without a restart); no other site needs new files.

    Parameters
    ----------
    ca_dir : path
        The federation directory holding ``ca.pem`` and ``ca.key`` (the ``out_dir`` of
        :func:`init_federation`); the new kit is written under it.
    role : {"site", "analyst", "coordinator"}
    name : str, optional
        The site or analyst id (omit for the coordinator).
    hosts : sequence of str, optional
        Coordinator only: its DNS names and IP literals (loopback names are added).
    validity_days : int
        Lifetime in days. It is shortened, with a warning, to end when the CA does.
    force : bool
        Replace this principal's existing kit (e.g. to re-issue the coordinator certificate
        for new host names, or to renew a site's certificate).

    Returns
    -------
    IssuedCertificate

    Raises
    ------
    ValidationError
        Invalid role, id, host or validity.
    CertificateError
        The CA files are missing, malformed or expired.
    ConfigError
        The principal's kit already exists and ``force`` is False.
    """
    principal = make_principal(role, name)
    days = check_int(validity_days, "validity_days", minimum=1)
    host_list = [check_host(h) for h in (hosts or ())]
    if host_list and principal.role != "coordinator":
        raise ValidationError(f"hosts are for the coordinator certificate only, not a {role}")
    root = Path(ca_dir)
    ca_cert, ca_key = load_ca(root)
    if not force:
        _refuse_existing(kit_paths(root, principal), "force=True (--force)")
    replaced = _current_fingerprint(kit_paths(root, principal)[0])
    start = _now() - CLOCK_SKEW
    end = start + dt.timedelta(days=days)
    if end > ca_cert.not_valid_after_utc:
        end = ca_cert.not_valid_after_utc
        logger.warning(
            "[Certs.Issue] %s: validity shortened to end with the CA on %s", principal, end
        )
    cert, key = make_certificate(
        ca_cert,
        ca_key,
        role=principal.role,
        name=principal.name,
        hosts=host_list,
        not_before=start,
        not_after=end,
    )
    issued = _write_kit(root, principal, cert, key, certificate_pem(ca_cert))
    # Admit the new id; a replaced certificate is revoked so that it stops working.
    access.record_issued(root, principal, replaced)
    logger.info("[Certs.Issue] issued %s, valid until %s", principal, issued.not_after)
    return issued


def _current_fingerprint(cert_path: Path) -> str | None:
    """Fingerprint of the certificate at ``cert_path``, or None if there is no readable one."""
    if not cert_path.is_file():
        return None
    try:
        return fingerprint(parse_certificates(cert_path.read_bytes(), cert_path,
                                              "certificate")[0])
    except (OSError, CertificateError):
        logger.warning("[Certs.Issue] %s cannot be read; it is replaced without being revoked",
                       cert_path)
        return None


def revoke_certificate(ca_dir: str | os.PathLike[str], *, role: str, name: str | None = None,
                       reason: str = "revoked with 'dpfed certs revoke'") -> str:
    """Revoke the current certificate of a principal of the federation in ``ca_dir``.

    Its SHA-256 fingerprint is added to the revocation list (``coordinator/access.toml``,
    ``revoked.toml`` and every site kit's ``revoked.toml``) and its id is removed from the
    coordinator's allow-list; the coordinator and the sites honour the change without a
    restart once they see the updated files (see :mod:`dpfed.common.transport.access`).

    Returns
    -------
    str
        The revoked certificate's fingerprint.

    Raises
    ------
    ValidationError
        Invalid role or id.
    CertificateError
        The CA is unusable, or the principal has no readable certificate under ``ca_dir``.
    """
    principal = make_principal(role, name)
    root = Path(ca_dir)
    load_ca(root)  # the same directory check as 'issue': this is a federation directory
    cert_path = kit_paths(root, principal)[0]
    cert = parse_certificates(read_pem_file(cert_path, "certificate"), cert_path,
                              "certificate")[0]
    fp = fingerprint(cert)
    access.record_revoked(root, principal, fp, reason)
    logger.info("[Certs.Revoke] %s revoked (sha256 %s)", principal, fp)
    return fp


# --------------------------------------------------------------------------------------------
# Describing certificates


@dataclass(frozen=True)
class CertificateInfo:
    """A readable summary of one certificate (what ``dpfed certs show`` prints)."""

    path: Path
    subject: str
    issuer: str
    principal: Principal | None
    is_ca: bool
    dns_names: tuple[str, ...]
    ip_addresses: tuple[str, ...]
    uris: tuple[str, ...]
    extended_key_usage: tuple[str, ...]
    not_before: dt.datetime
    not_after: dt.datetime
    serial_number: str
    fingerprint_sha256: str

    def lines(self) -> list[str]:
        """Return the summary as ``label: value`` lines."""
        if self.is_ca:
            identity = "federation CA"
        elif self.principal is not None:
            identity = str(self.principal)
        else:
            identity = "none (no urn:dpfed: URI SAN)"
        return [
            f"path:        {self.path}",
            f"identity:    {identity}",
            f"subject:     {self.subject}",
            f"issuer:      {self.issuer}",
            f"dns names:   {', '.join(self.dns_names) or '-'}",
            f"ip addrs:    {', '.join(self.ip_addresses) or '-'}",
            f"uris:        {', '.join(self.uris) or '-'}",
            f"key usage:   {', '.join(self.extended_key_usage) or '-'}",
            f"valid from:  {self.not_before:%Y-%m-%d %H:%M:%S} UTC",
            f"valid until: {self.not_after:%Y-%m-%d %H:%M:%S} UTC",
            f"serial:      {self.serial_number}",
            f"sha256:      {self.fingerprint_sha256}",
        ]


def describe_certificate(path: str | os.PathLike[str]) -> CertificateInfo:
    """Summarise the (first) certificate in the PEM file ``path``.

    Raises
    ------
    CertificateError
        If the file is missing, unreadable or not a PEM certificate.
    """
    p = Path(path)
    cert = parse_certificates(read_pem_file(p, "certificate"), p, "certificate")[0]
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = tuple(san.get_values_for_type(x509.DNSName))
        ips = tuple(str(a) for a in san.get_values_for_type(x509.IPAddress))
        uris = tuple(san.get_values_for_type(x509.UniformResourceIdentifier))
    except x509.ExtensionNotFound:
        dns, ips, uris = (), (), ()
    try:
        eku_ext = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        eku = tuple(_EKU_NAMES.get(oid, oid.dotted_string) for oid in eku_ext)
    except x509.ExtensionNotFound:
        eku = ()
    try:
        principal: Principal | None = principal_from_uris(uris, source=str(p))
    except AuthenticationError:
        principal = None
    return CertificateInfo(
        path=p,
        subject=cert.subject.rfc4514_string(),
        issuer=cert.issuer.rfc4514_string(),
        principal=principal,
        is_ca=is_ca_certificate(cert),
        dns_names=dns,
        ip_addresses=ips,
        uris=uris,
        extended_key_usage=eku,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        serial_number=f"{cert.serial_number:x}",
        fingerprint_sha256=fingerprint(cert),
    )
