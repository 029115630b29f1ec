"""Mutual TLS credentials for both gRPC sides, and the caller's identity from its certificate.

Loading credentials
-------------------
:func:`load_server_credentials` (the coordinator) and :func:`load_channel_credentials` (sites
and analysts) check the three PEM files *before* handing them to gRPC. A bad file otherwise
shows up only as an opaque handshake failure on the other side (``UNAVAILABLE``, "failed to
connect to all addresses"), so each check here raises
:class:`dpfed.common.errors.CertificateError` (a ``ConfigError``) naming the file and the problem:

* a file is missing, unreadable, empty, or not PEM;
* the private key does not belong to the certificate;
* the certificate is not signed by the given CA (or the CA file is not a CA);
* a certificate is expired or not yet valid;
* the certificate is for the wrong role (e.g. a site certificate given to the coordinator as
  its server certificate) or lacks the needed extended key usage.

A private key readable by group or others is logged as a warning, not refused.

Identity of the caller
----------------------
The coordinator takes a caller's identity only from ``context.auth_context()``, the data gRPC
exposes about the *verified* peer certificate (docs/privacy.md, invariant 6; gRPC's
``doc/server_side_auth.md``: "AuthContext is the only reliable source of truth"). With mTLS,
grpcio 1.85 exposes these keys (each a list of ``bytes``), found by experiment in
``tests/common/transport/test_tls.py``::

    transport_security_type        [b"ssl"]  ([b"insecure"] without TLS)
    security_level                 [b"TSI_PRIVACY_AND_INTEGRITY"]
    x509_pem_cert                  [the peer's leaf certificate, PEM]
    x509_common_name               [b"<CN>"]
    x509_subject                   [b"OU=site,CN=a"]
    x509_subject_alternative_name  [every SAN as text, all types mixed]
    peer_uri / peer_dns / peer_ip / peer_email   [SANs of that one type]
    ssl_tls_version, ssl_session_reused, ssl_negotiated_key_exchange_group

:func:`principal_from_auth_context` reads the typed ``peer_uri`` list and falls back to
parsing ``x509_pem_cert`` when an older grpcio does not expose ``peer_uri``. It never reads
``x509_subject_alternative_name`` (a DNS name and a URI are indistinguishable there), the
common name, metadata or the request.

Server name when dialling
-------------------------
The coordinator certificate names the hosts given to ``dpfed certs init`` plus localhost,
127.0.0.1 and ::1, as DNS and IP SANs; gRPC checks the dialled host against both, so dialling
any of them needs nothing extra. Only when the coordinator is reached at an address its
certificate does not name (a port-forward, a NAT address, a docker network alias) does the
client pass :func:`target_name_options` with a name that *is* in the certificate. That is
no weaker: the certificate must still chain to the federation CA and name that host.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import grpc
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from dpfed.common.errors import AuthenticationError, CertificateError, PermissionDeniedError
from dpfed.common.transport.certs import (
    certificate_uris,
    check_host,
    fingerprint,
    is_ca_certificate,
    is_signed_by,
    key_matches_certificate,
    parse_certificates,
    parse_private_key,
    principal_from_certificate,
    read_pem_file,
)
from dpfed.common.transport.identity import (
    CLIENT_ROLES,
    Principal,
    Role,
    check_role,
    principal_from_uris,
)

__all__ = [
    "Principal",
    "TlsMaterial",
    "check_tls_files",
    "load_channel_credentials",
    "load_server_credentials",
    "peer_fingerprint",
    "principal_from_auth_context",
    "require_role",
    "target_name_options",
]

logger = logging.getLogger(__name__)

Use = Literal["server", "client"]
_USAGE = {"server": ExtendedKeyUsageOID.SERVER_AUTH, "client": ExtendedKeyUsageOID.CLIENT_AUTH}
_USAGE_NAME = {"server": "serverAuth", "client": "clientAuth"}


@dataclass(frozen=True)
class TlsMaterial:
    """Checked PEM bytes for gRPC, and the identity the certificate carries.

    Attributes
    ----------
    ca_pem : bytes
        The federation CA certificate(s): the trust root for the peer.
    cert_chain_pem : bytes
        Our certificate (and any intermediates).
    key_pem : bytes
        Our private key.
    principal : Principal
        The identity in our certificate (for logs: ``[Site.Start] identity site/a``).
    not_after : datetime
        When our certificate expires (UTC).
    """

    ca_pem: bytes
    cert_chain_pem: bytes
    key_pem: bytes
    principal: Principal
    not_after: dt.datetime

    def __repr__(self) -> str:  # never print key material, even in a traceback
        return f"TlsMaterial(principal={self.principal}, not_after={self.not_after:%Y-%m-%d})"


def _check_validity(cert: x509.Certificate, path: Path, what: str, now: dt.datetime) -> None:
    if now < cert.not_valid_before_utc:
        raise CertificateError(
            f"{what} {path} is not yet valid (valid from "
            f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S} UTC); check this machine's clock"
        )
    if now > cert.not_valid_after_utc:
        raise CertificateError(
            f"{what} {path} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC; "
            "issue a new one with 'dpfed certs issue --force'"
        )


def _warn_if_key_readable_by_others(key_path: Path) -> None:
    try:
        mode = key_path.stat().st_mode & 0o777
    except OSError:  # pragma: no cover - it was just read successfully
        return
    if mode & 0o077:
        logger.warning(
            "[TLS.Load] private key %s has mode %03o: it is readable by group/others; "
            "run 'chmod 600 %s'",
            key_path,
            mode,
            key_path,
        )


def _has_usage(cert: x509.Certificate, use: Use) -> bool:
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True  # RFC 5280 4.2.1.12: no EKU extension means any purpose
    return _USAGE[use] in usages


def check_tls_files(
    ca_path: str | os.PathLike[str],
    cert_path: str | os.PathLike[str],
    key_path: str | os.PathLike[str],
    *,
    use: Use,
    roles: Collection[Role],
) -> TlsMaterial:
    """Read and check a CA, a certificate and its key for one side of a mutual-TLS link.

    Parameters
    ----------
    ca_path : path
        Federation CA certificate (PEM; several CA certificates may be concatenated).
    cert_path : path
        Our certificate (PEM; our leaf first, then any intermediates).
    key_path : path
        Our unencrypted private key (PEM).
    use : {"server", "client"}
        Which end of the TLS connection the certificate is for.
    roles : collection of {"site", "analyst", "coordinator"}
        Roles the certificate may carry for this use.

    Returns
    -------
    TlsMaterial

    Raises
    ------
    CertificateError
        Naming the file and the problem (see the module docstring).
    """
    allowed = {check_role(r) for r in roles}
    what = "server certificate" if use == "server" else "client certificate"
    ca_file, cert_file, key_file = Path(ca_path), Path(cert_path), Path(key_path)
    ca_pem = read_pem_file(ca_file, "CA certificate")
    cert_pem = read_pem_file(cert_file, what)
    key_pem = read_pem_file(key_file, "private key")

    now = dt.datetime.now(dt.UTC)
    cas = parse_certificates(ca_pem, ca_file, "CA certificate")
    for ca in cas:
        if not is_ca_certificate(ca):
            raise CertificateError(
                f"CA certificate {ca_file} holds a certificate that is not a CA "
                f"({ca.subject.rfc4514_string()}); pass the federation's ca.pem"
            )
        _check_validity(ca, ca_file, "CA certificate", now)
    chain = parse_certificates(cert_pem, cert_file, what)
    leaf = chain[0]
    key = parse_private_key(key_pem, key_file, "private key")
    _warn_if_key_readable_by_others(key_file)
    if not key_matches_certificate(key, leaf):
        raise CertificateError(
            f"private key {key_file} does not match the {what} {cert_file} "
            "(they come from different kits?)"
        )
    for cert in chain:
        _check_validity(cert, cert_file, what, now)

    # Each certificate of the chain is signed by the next; the last by one of the CAs.
    for child, parent in zip(chain, chain[1:], strict=False):
        if not is_signed_by(child, parent):
            raise CertificateError(
                f"{what} {cert_file}: {child.subject.rfc4514_string()} is not signed by the "
                f"next certificate in the file ({parent.subject.rfc4514_string()})"
            )
    if not any(is_signed_by(chain[-1], ca) for ca in cas):
        raise CertificateError(
            f"{what} {cert_file} is not signed by the CA in {ca_file} "
            f"(issuer {chain[-1].issuer.rfc4514_string()}, CA "
            f"{', '.join(ca.subject.rfc4514_string() for ca in cas)}); "
            "it belongs to another federation or the CA file is wrong"
        )

    try:
        principal = principal_from_certificate(leaf, source=f"{what} {cert_file}")
    except AuthenticationError as exc:
        raise CertificateError(str(exc)) from None
    if principal.role not in allowed:
        wanted = " or ".join(sorted(allowed))
        raise CertificateError(
            f"{what} {cert_file} identifies {principal}, but a TLS {use} here needs a "
            f"certificate of role {wanted} (the coordinator serves with "
            "coordinator/coordinator.pem, a site dials with sites/<id>/site.pem)"
        )
    if not _has_usage(leaf, use):
        raise CertificateError(
            f"{what} {cert_file} lacks the {_USAGE_NAME[use]} extended key usage needed by a "
            f"TLS {use}"
        )
    return TlsMaterial(ca_pem, cert_pem, key_pem, principal, leaf.not_valid_after_utc)


def load_server_credentials(
    ca_path: str | os.PathLike[str],
    cert_path: str | os.PathLike[str],
    key_path: str | os.PathLike[str],
) -> grpc.ServerCredentials:
    """Return checked ``grpc.ServerCredentials`` for the coordinator, requiring client certs.

    The files are re-read when they change: a coordinator certificate re-issued with
    ``dpfed certs issue --coordinator NAME --force`` (or a renewed CA bundle) is served from the
    next TLS handshake on, without a restart; live streams keep the session they have. A
    replacement that fails the checks is refused with an error in the log and the previous
    certificate stays in service.

    Parameters
    ----------
    ca_path : path
        Federation CA: clients must present a certificate it signed.
    cert_path, key_path : path
        The coordinator's certificate (role coordinator, ``serverAuth``) and key.

    Returns
    -------
    grpc.ServerCredentials
        ``grpc.dynamic_ssl_server_credentials`` requiring client authentication: a client
        without a certificate signed by the CA (or with an expired one) fails the handshake.

    Raises
    ------
    CertificateError
        If any file fails the checks of :func:`check_tls_files` at start-up.
    """
    watcher = ServerCertificateWatcher(ca_path, cert_path, key_path)
    return grpc.dynamic_ssl_server_credentials(
        watcher.configuration(), watcher.fetch, require_client_authentication=True)


class ServerCertificateWatcher:
    """The coordinator's TLS files, re-checked and re-served when they change on disk.

    gRPC calls :meth:`fetch` before every new handshake; a ``stat`` of three files decides
    whether anything changed, so the cost per connection is negligible.
    """

    _ROLES: tuple[Role, ...] = ("coordinator",)

    def __init__(self, ca_path: str | os.PathLike[str], cert_path: str | os.PathLike[str],
                 key_path: str | os.PathLike[str]) -> None:
        self._paths = (Path(ca_path), Path(cert_path), Path(key_path))
        self._stamp = self._stat()
        self.material = self._load()
        self._failed_stamp: tuple[tuple[int, int], ...] | None = None

    def _stat(self) -> tuple[tuple[int, int], ...]:
        stamps = []
        for path in self._paths:
            try:
                st = path.stat()
                stamps.append((st.st_mtime_ns, st.st_size))
            except OSError:
                stamps.append((-1, -1))
        return tuple(stamps)

    def _load(self) -> TlsMaterial:
        ca, cert, key = self._paths
        material = check_tls_files(ca, cert, key, use="server", roles=self._ROLES)
        logger.info("[TLS.LoadServer] serving as %s, certificate valid until %s",
                    material.principal, material.not_after)
        return material

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        """Return the gRPC configuration of the material in service."""
        return grpc.ssl_server_certificate_configuration(
            [(self.material.key_pem, self.material.cert_chain_pem)],
            root_certificates=self.material.ca_pem)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Return a new configuration if the files changed and pass the checks, else None."""
        stamp = self._stat()
        if stamp == self._stamp or stamp == self._failed_stamp:
            return None
        try:
            material = self._load()
        except Exception as exc:  # noqa: BLE001 -- a half-written file must not stop serving
            self._failed_stamp = stamp
            logger.error("[TLS.Reload] the changed coordinator TLS files were not loaded "
                         "(still serving %s): %s", self.material.principal, exc)
            return None
        self.material, self._stamp, self._failed_stamp = material, stamp, None
        logger.info("[TLS.Reload] the coordinator's TLS files changed; new handshakes use them")
        return self.configuration()


def load_channel_credentials(
    ca_path: str | os.PathLike[str],
    cert_path: str | os.PathLike[str],
    key_path: str | os.PathLike[str],
    *,
    role: Role | None = None,
) -> grpc.ChannelCredentials:
    """Return checked ``grpc.ChannelCredentials`` for a site or an analyst dialling out.

    Parameters
    ----------
    ca_path : path
        Federation CA: the coordinator's certificate must be signed by it.
    cert_path, key_path : path
        Our client certificate (``clientAuth``) and key.
    role : {"site", "analyst"}, optional
        Require this role (the site agent passes ``"site"``); default: site or analyst.

    Returns
    -------
    grpc.ChannelCredentials

    Raises
    ------
    CertificateError
        If any file fails the checks of :func:`check_tls_files`.
    """
    roles: tuple[Role, ...] = CLIENT_ROLES if role is None else (role,)
    material = check_tls_files(ca_path, cert_path, key_path, use="client", roles=roles)
    logger.info(
        "[TLS.LoadChannel] dialling as %s, certificate valid until %s",
        material.principal,
        material.not_after,
    )
    return grpc.ssl_channel_credentials(
        root_certificates=material.ca_pem,
        private_key=material.key_pem,
        certificate_chain=material.cert_chain_pem,
    )


def target_name_options(server_name: str | None) -> list[tuple[str, str]]:
    """Channel options to verify the coordinator certificate against ``server_name``.

    Use only when the address dialled is not named in the coordinator's certificate (see
    the module docstring); ``None`` gives no options.

    Parameters
    ----------
    server_name : str or None
        A DNS name or IP literal the coordinator certificate names (``dpfed certs show
        coordinator/coordinator.pem`` lists them).

    Returns
    -------
    list of (str, str)
        ``[("grpc.ssl_target_name_override", server_name)]`` or ``[]``.
    """
    if server_name is None:
        return []
    return [("grpc.ssl_target_name_override", check_host(server_name))]


def _values(auth_context: Mapping[str, Iterable[bytes]], key: str) -> list[bytes]:
    return list(auth_context.get(key, ()))


def principal_from_auth_context(auth_context: Mapping[str, Iterable[bytes]]) -> Principal:
    """Return the caller's principal from gRPC's ``context.auth_context()``.

    Only the verified peer certificate is read (URI SANs, see the module docstring). The
    server must have been built with :func:`load_server_credentials`
    (``require_client_auth=True``), so that any certificate gRPC reports was verified against
    the federation CA during the handshake.

    Parameters
    ----------
    auth_context : mapping of str to iterable of bytes
        ``context.auth_context()`` of a servicer call.

    Returns
    -------
    Principal

    Raises
    ------
    AuthenticationError
        If the connection is not TLS, there is no peer certificate, or the certificate
        carries no dpfed identity (or several).
    """
    security = _values(auth_context, "transport_security_type")
    if b"ssl" not in security:
        kind = b",".join(security).decode("ascii", "replace") or "none"
        raise AuthenticationError(
            f"the connection is not TLS (transport_security_type={kind}); dpfed identities "
            "come from mutual-TLS client certificates"
        )
    pems = _values(auth_context, "x509_pem_cert")
    if not pems:
        raise AuthenticationError(
            "the caller presented no client certificate; the server must require client "
            "certificates (dpfed.common.transport.tls.load_server_credentials)"
        )
    if "peer_uri" in auth_context:
        try:
            uris = [u.decode("utf-8") for u in _values(auth_context, "peer_uri")]
        except UnicodeDecodeError:
            raise AuthenticationError(
                "the peer certificate has a URI SAN that is not UTF-8"
            ) from None
        return principal_from_uris(uris, source="the peer certificate")
    # Older grpcio without typed SAN keys: parse the verified certificate itself.
    try:
        cert = x509.load_pem_x509_certificate(pems[0])
    except ValueError:
        raise AuthenticationError(
            "the peer certificate reported by gRPC cannot be parsed"
        ) from None
    return principal_from_uris(certificate_uris(cert), source="the peer certificate")


def require_role(principal: Principal, *roles: Role) -> Principal:
    """Return ``principal`` if its role is one of ``roles``.

    Parameters
    ----------
    principal : Principal
        From :func:`principal_from_auth_context`.
    *roles : {"site", "analyst", "coordinator"}
        Roles allowed to call the method.

    Raises
    ------
    PermissionDeniedError
        If the principal's role is not allowed (the message names both).
    """
    if not roles:
        raise ValueError("require_role needs at least one role")
    if principal.role not in roles:
        wanted = " or ".join(roles)
        raise PermissionDeniedError(
            f"{principal} may not call this method; it is for role {wanted} only"
        )
    return principal


def peer_fingerprint(auth_context: Mapping[str, Iterable[bytes]]) -> str | None:
    """Return the SHA-256 fingerprint of the verified peer certificate, or None without one.

    The fingerprint has the form ``dpfed certs show`` prints (``AB:CD:...``), the form the
    revocation list stores (:mod:`dpfed.common.transport.access`).

    Raises
    ------
    AuthenticationError
        If gRPC reports a peer certificate that cannot be parsed.
    """
    pems = _values(auth_context, "x509_pem_cert")
    if not pems:
        return None
    try:
        cert = x509.load_pem_x509_certificate(pems[0])
    except ValueError:
        raise AuthenticationError(
            "the peer certificate reported by gRPC cannot be parsed") from None
    return fingerprint(cert)
