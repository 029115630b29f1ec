"""Mutual TLS loaders and certificate identities (dpfed.common.transport.tls), over real loopback
gRPC."""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dpfed.common.errors import (
    AuthenticationError,
    CertificateError,
    ConfigError,
    PermissionDeniedError,
    ValidationError,
)
from dpfed.common.transport import certs
from dpfed.common.transport.identity import Principal, Role
from dpfed.common.transport.tls import (
    check_tls_files,
    load_channel_credentials,
    load_server_credentials,
    principal_from_auth_context,
    require_role,
    target_name_options,
)

TIMEOUT = 5.0
SERVICE = "dpfed.test.Probe"


# ------------------------------------------------------------------------------ helpers


@dataclass(frozen=True)
class Kit:
    ca: Path
    cert: Path
    key: Path


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _p(path: Path) -> str:
    """A path inside a ``match=`` pattern."""
    return re.escape(str(path))


def _write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    return path


def _write_kit(
    directory: Path, ca: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> Kit:
    return Kit(
        ca,
        _write(directory / "cert.pem", certs.certificate_pem(cert)),
        _write(directory / "key.pem", certs.private_key_pem(key), 0o600),
    )


def _load_ca(root: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    return certs.load_ca(root)


@dataclass(frozen=True)
class Federation:
    root: Path

    def kit(self, role: str, name: str | None = None) -> Kit:
        principal = certs.make_principal(role, name)
        cert, key, _ = certs.kit_paths(self.root, principal)
        return Kit(self.root / "ca.pem", cert, key)

    def custom(self, directory: str, **kwargs: Any) -> Kit:
        """A certificate signed by this federation's CA with non-default parameters."""
        ca, ca_key = _load_ca(self.root)
        cert, key = certs.make_certificate(ca, ca_key, **kwargs)
        return _write_kit(self.root.parent / directory, self.root / "ca.pem", cert, key)


@pytest.fixture
def fed(tmp_path: Path) -> Federation:
    certs.init_federation(
        tmp_path / "fed", coordinator_hosts=["coord.example"], sites=["a", "b"], analysts=["x"]
    )
    return Federation(tmp_path / "fed")


@pytest.fixture
def foreign(tmp_path: Path) -> Federation:
    """Another federation with the same ids: same names, different CA."""
    certs.init_federation(
        tmp_path / "foreign", coordinator_hosts=["coord.example"], sites=["a"], analysts=["x"]
    )
    return Federation(tmp_path / "foreign")


@pytest.fixture
def expired_site(fed: Federation) -> Kit:
    return fed.custom(
        "expired",
        role="site",
        name="a",
        not_before=_now() - dt.timedelta(days=10),
        not_after=_now() - dt.timedelta(days=1),
    )


def _raw_certificate(
    fed: Federation, *, uris: list[str], usage: x509.ObjectIdentifier
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A CA-signed certificate built by hand (for identities make_certificate never makes)."""
    ca, ca_key = _load_ca(fed.root)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "raw")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - dt.timedelta(minutes=5))
        .not_valid_after(_now() + dt.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _raw_channel_credentials(kit: Kit | None, ca: Path) -> Any:
    """Client credentials straight to gRPC, bypassing our checks (what an attacker can do)."""
    if kit is None:
        return grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=kit.key.read_bytes(),
        certificate_chain=kit.cert.read_bytes(),
    )


# ------------------------------------------------------------------------------ loopback server


@dataclass
class Probe:
    """A tiny mTLS server: health service plus methods that report the caller's identity."""

    port: int
    calls: list[dict[str, list[bytes]]] = field(default_factory=list)

    async def call(self, credentials: Any, method: str = "WhoAmI", options: Any = ()) -> str:
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{self.port}", credentials, options=list(options)
        ) as channel:
            reply: bytes = await channel.unary_unary(f"/{SERVICE}/{method}")(b"", timeout=TIMEOUT)
        return reply.decode()

    async def refused(self, credentials: Any, **kwargs: Any) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await self.call(credentials, **kwargs)
        return info.value


def _handlers(probe_calls: list[dict[str, list[bytes]]]) -> grpc.GenericRpcHandler:
    async def who_am_i(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        auth = {k: list(v) for k, v in context.auth_context().items()}
        probe_calls.append(auth)
        try:
            principal = principal_from_auth_context(auth)
        except AuthenticationError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return str(principal).encode()

    async def analyst_only(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            principal = require_role(principal_from_auth_context(context.auth_context()), "analyst")
        except PermissionDeniedError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        return str(principal).encode()

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "WhoAmI": grpc.unary_unary_rpc_method_handler(who_am_i),
            "AnalystOnly": grpc.unary_unary_rpc_method_handler(analyst_only),
        },
    )


StartProbe = Callable[[Kit], Awaitable[Probe]]


@pytest.fixture
async def start_probe() -> AsyncIterator[StartProbe]:
    servers: list[grpc.aio.Server] = []

    async def start(kit: Kit) -> Probe:
        server = grpc.aio.server()
        calls: list[dict[str, list[bytes]]] = []
        server.add_generic_rpc_handlers([_handlers(calls)])
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_secure_port(
            "127.0.0.1:0", load_server_credentials(kit.ca, kit.cert, kit.key)
        )
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        servers.append(server)
        return Probe(port, calls)

    yield start
    for server in servers:
        await server.stop(None)


@pytest.fixture
async def probe(fed: Federation, start_probe: StartProbe) -> Probe:
    return await start_probe(fed.kit("coordinator"))


def _client(kit: Kit, role: Role | None = None) -> Any:
    return load_channel_credentials(kit.ca, kit.cert, kit.key, role=role)


# ------------------------------------------------------------------------------ mTLS: accepted


async def test_site_identity_comes_from_its_certificate(fed: Federation, probe: Probe) -> None:
    assert await probe.call(_client(fed.kit("site", "a"), role="site")) == "site/a"
    assert await probe.call(_client(fed.kit("site", "b"))) == "site/b"


async def test_analyst_identity(fed: Federation, probe: Probe) -> None:
    assert await probe.call(_client(fed.kit("analyst", "x"))) == "analyst/x"
    assert await probe.call(_client(fed.kit("analyst", "x")), method="AnalystOnly") == "analyst/x"


async def test_a_site_added_later_is_accepted_by_the_running_coordinator(
    fed: Federation, probe: Probe
) -> None:
    # The coordinator keeps its files and keeps running; the new kit just works.
    certs.issue_certificate(fed.root, role="site", name="c")
    assert await probe.call(_client(fed.kit("site", "c"))) == "site/c"


async def test_health_service_over_mtls(fed: Federation, probe: Probe) -> None:
    credentials = _client(fed.kit("site", "a"))
    async with grpc.aio.secure_channel(f"127.0.0.1:{probe.port}", credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_auth_context_keys_exposed_by_grpcio(fed: Federation, probe: Probe) -> None:
    """Documents what grpcio gives servicers; principal_from_auth_context relies on it."""
    await probe.call(_client(fed.kit("site", "a")))
    (auth,) = probe.calls
    assert auth["transport_security_type"] == [b"ssl"]
    assert auth["peer_uri"] == [b"urn:dpfed:site:a"]
    assert auth["x509_common_name"] == [b"a"]
    assert auth["x509_subject_alternative_name"] == [b"urn:dpfed:site:a"]
    pem = (fed.root / "sites" / "a" / "site.pem").read_bytes()
    assert auth["x509_pem_cert"][0].strip() == pem.strip()
    # Without the typed peer_uri key (older grpcio) the PEM fallback gives the same answer.
    without_uri = {k: v for k, v in auth.items() if k != "peer_uri"}
    assert principal_from_auth_context(without_uri) == Principal("site", "a")


async def test_dialling_an_unlisted_address_with_a_target_name_override(
    fed: Federation, start_probe: StartProbe
) -> None:
    # Coordinator certificate naming only coord.example (no loopback names): dialling
    # 127.0.0.1 needs the override, and works with it.
    coordinator = fed.custom(
        "coord-only", role="coordinator", hosts=["coord.example"], include_loopback=False
    )
    probe = await start_probe(coordinator)
    client = _client(fed.kit("site", "a"))
    assert await probe.call(client, options=target_name_options("coord.example")) == "site/a"
    error = await probe.refused(client)
    assert error.code() == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------------------ mTLS: refused


async def test_no_client_certificate_fails_the_handshake(fed: Federation, probe: Probe) -> None:
    error = await probe.refused(_raw_channel_credentials(None, fed.root / "ca.pem"))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert probe.calls == []  # the servicer never ran


async def test_certificate_from_another_ca_fails_the_handshake(
    fed: Federation, foreign: Federation, probe: Probe
) -> None:
    # Same id "a", signed by another federation's CA; trusts our CA so only the server refuses.
    impostor = foreign.kit("site", "a")
    error = await probe.refused(_raw_channel_credentials(impostor, fed.root / "ca.pem"))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert probe.calls == []


async def test_expired_client_certificate_fails_the_handshake(
    fed: Federation, expired_site: Kit, probe: Probe
) -> None:
    error = await probe.refused(_raw_channel_credentials(expired_site, fed.root / "ca.pem"))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert probe.calls == []


async def test_server_certificate_for_the_wrong_host_fails_the_handshake(
    fed: Federation, probe: Probe, start_probe: StartProbe
) -> None:
    client = _client(fed.kit("site", "a"))
    # The standard coordinator certificate does not name wrong.example.
    error = await probe.refused(client, options=target_name_options("wrong.example"))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    # A coordinator certificate issued for another host only, dialled at 127.0.0.1.
    elsewhere = fed.custom(
        "elsewhere", role="coordinator", hosts=["elsewhere.example"], include_loopback=False
    )
    other = await start_probe(elsewhere)
    error = await other.refused(client)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert probe.calls == [] and other.calls == []


async def test_client_refuses_a_coordinator_from_another_federation(
    fed: Federation, foreign: Federation, start_probe: StartProbe
) -> None:
    other = await start_probe(foreign.kit("coordinator"))
    error = await other.refused(_client(fed.kit("site", "a")))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert other.calls == []


async def test_coordinator_certificate_cannot_be_used_as_a_client(
    fed: Federation, probe: Probe
) -> None:
    # serverAuth only: the server's path validation refuses it as a client certificate.
    error = await probe.refused(
        _raw_channel_credentials(fed.kit("coordinator"), fed.root / "ca.pem")
    )
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert probe.calls == []


async def test_certificate_without_dpfed_identity_is_unauthenticated(
    fed: Federation, probe: Probe
) -> None:
    # Right CA, passes the handshake, but names no dpfed principal.
    cert, key = _raw_certificate(
        fed, uris=["https://hospital.example/a"], usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    kit = _write_kit(fed.root.parent / "anonymous", fed.root / "ca.pem", cert, key)
    error = await probe.refused(_raw_channel_credentials(kit, fed.root / "ca.pem"))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "no dpfed identity" in (error.details() or "")


async def test_site_calling_an_analyst_method_is_permission_denied(
    fed: Federation, probe: Probe
) -> None:
    error = await probe.refused(_client(fed.kit("site", "a")), method="AnalystOnly")
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "site/a may not call this method" in (error.details() or "")


# ------------------------------------------------------------------------------ loader checks


def test_loaders_accept_a_good_kit(fed: Federation) -> None:
    coordinator = fed.kit("coordinator")
    assert isinstance(
        load_server_credentials(coordinator.ca, coordinator.cert, coordinator.key),
        grpc.ServerCredentials,
    )
    site = fed.kit("site", "a")
    assert isinstance(_client(site, role="site"), grpc.ChannelCredentials)
    roles: tuple[Role, ...] = ("site",)
    material = check_tls_files(site.ca, site.cert, site.key, use="client", roles=roles)
    assert material.principal == Principal("site", "a")
    assert material.key_pem == site.key.read_bytes()
    assert "PRIVATE" not in repr(material) and "site/a" in repr(material)


@pytest.mark.parametrize("which", ["ca", "cert", "key"])
def test_missing_file(fed: Federation, which: str) -> None:
    kit = fed.kit("site", "a")
    missing = fed.root / "nope.pem"
    paths = {"ca": kit.ca, "cert": kit.cert, "key": kit.key} | {which: missing}
    label = {"ca": "CA certificate", "cert": "client certificate", "key": "private key"}[which]
    with pytest.raises(CertificateError, match=f"{label} {_p(missing)} does not exist"):
        load_channel_credentials(paths["ca"], paths["cert"], paths["key"])


def test_directory_and_empty_file(fed: Federation) -> None:
    kit = fed.kit("site", "a")
    with pytest.raises(CertificateError, match="is a directory"):
        load_channel_credentials(fed.root, kit.cert, kit.key)
    empty = _write(fed.root / "empty.pem", b"")
    with pytest.raises(CertificateError, match=f"client certificate {_p(empty)} is empty"):
        load_channel_credentials(kit.ca, empty, kit.key)


@pytest.mark.parametrize("which", ["ca", "cert", "key"])
def test_garbage_pem(fed: Federation, which: str) -> None:
    kit = fed.kit("site", "a")
    garbage = _write(fed.root / "garbage.pem", b"this is not PEM at all\n")
    paths = {"ca": kit.ca, "cert": kit.cert, "key": kit.key} | {which: garbage}
    expected = {
        "ca": f"CA certificate {garbage} is not a PEM certificate",
        "cert": f"client certificate {garbage} is not a PEM certificate",
        "key": f"private key {garbage} is not a PEM private key",
    }[which]
    with pytest.raises(CertificateError, match=expected):
        load_channel_credentials(paths["ca"], paths["cert"], paths["key"])


def test_corrupt_pem_bodies(fed: Federation) -> None:
    kit = fed.kit("site", "a")
    bad_cert = _write(
        fed.root / "bad-cert.pem", b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    )
    with pytest.raises(CertificateError, match="is not a valid PEM certificate"):
        load_channel_credentials(kit.ca, bad_cert, kit.key)
    bad_key = _write(
        fed.root / "bad-key.pem", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"
    )
    with pytest.raises(CertificateError, match="is not a valid PEM private key"):
        load_channel_credentials(kit.ca, kit.cert, bad_key)


def test_swapped_certificate_and_key_files(fed: Federation) -> None:
    kit = fed.kit("site", "a")
    with pytest.raises(CertificateError, match="looks like a private key"):
        load_channel_credentials(kit.ca, kit.key, kit.cert)


def test_mismatched_key(fed: Federation) -> None:
    a, b = fed.kit("site", "a"), fed.kit("site", "b")
    with pytest.raises(
        CertificateError,
        match=f"private key {_p(b.key)} does not match the client certificate {_p(a.cert)}",
    ):
        load_channel_credentials(a.ca, a.cert, b.key)


def test_certificate_from_another_ca(fed: Federation, foreign: Federation) -> None:
    impostor = foreign.kit("site", "a")
    with pytest.raises(
        CertificateError,
        match=f"client certificate {_p(impostor.cert)} is not signed by the CA in "
        f"{_p(fed.root / 'ca.pem')}",
    ):
        load_channel_credentials(fed.root / "ca.pem", impostor.cert, impostor.key)
    coordinator = foreign.kit("coordinator")
    with pytest.raises(CertificateError, match="server certificate .* is not signed by the CA"):
        load_server_credentials(fed.root / "ca.pem", coordinator.cert, coordinator.key)


def test_expired_certificate(expired_site: Kit) -> None:
    with pytest.raises(
        CertificateError, match=f"client certificate {_p(expired_site.cert)} expired on"
    ):
        load_channel_credentials(expired_site.ca, expired_site.cert, expired_site.key)


def test_not_yet_valid_certificate(fed: Federation) -> None:
    future = fed.custom(
        "future",
        role="site",
        name="a",
        not_before=_now() + dt.timedelta(days=1),
        not_after=_now() + dt.timedelta(days=2),
    )
    with pytest.raises(CertificateError, match="is not yet valid .*check this machine's clock"):
        load_channel_credentials(future.ca, future.cert, future.key)


def test_expired_ca(tmp_path: Path) -> None:
    ca, ca_key = certs.generate_ca(validity_days=1, not_before=_now() - dt.timedelta(days=3))
    ca_path = _write(tmp_path / "ca.pem", certs.certificate_pem(ca))
    cert, key = certs.make_certificate(
        ca, ca_key, role="site", name="a", not_before=_now() - dt.timedelta(days=3),
        not_after=_now() + dt.timedelta(days=1),
    )  # fmt: skip
    kit = _write_kit(tmp_path / "kit", ca_path, cert, key)
    with pytest.raises(CertificateError, match=f"CA certificate {_p(ca_path)} expired on"):
        load_channel_credentials(kit.ca, kit.cert, kit.key)


def test_ca_file_that_is_not_a_ca(fed: Federation) -> None:
    kit = fed.kit("site", "a")
    with pytest.raises(CertificateError, match=f"CA certificate {_p(kit.cert)} .* is not a CA"):
        load_channel_credentials(kit.cert, kit.cert, kit.key)


def test_site_certificate_as_the_coordinator_server_certificate(fed: Federation) -> None:
    site = fed.kit("site", "a")
    with pytest.raises(
        CertificateError,
        match=f"server certificate {_p(site.cert)} identifies site/a, but a TLS server here "
        "needs a certificate of role coordinator",
    ):
        load_server_credentials(site.ca, site.cert, site.key)


def test_wrong_client_roles(fed: Federation) -> None:
    coordinator = fed.kit("coordinator")
    with pytest.raises(
        CertificateError, match="identifies coordinator/coordinator.*analyst or site"
    ):
        load_channel_credentials(coordinator.ca, coordinator.cert, coordinator.key)
    analyst = fed.kit("analyst", "x")
    with pytest.raises(CertificateError, match="identifies analyst/x.*role site"):
        load_channel_credentials(analyst.ca, analyst.cert, analyst.key, role="site")


def test_missing_extended_key_usage(fed: Federation) -> None:
    cert, key = _raw_certificate(
        fed, uris=["urn:dpfed:site:a"], usage=ExtendedKeyUsageOID.SERVER_AUTH
    )
    kit = _write_kit(fed.root.parent / "server-usage", fed.root / "ca.pem", cert, key)
    with pytest.raises(CertificateError, match="lacks the clientAuth extended key usage"):
        load_channel_credentials(kit.ca, kit.cert, kit.key)


def test_certificate_without_identity(fed: Federation) -> None:
    cert, key = _raw_certificate(fed, uris=[], usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    kit = _write_kit(fed.root.parent / "anonymous", fed.root / "ca.pem", cert, key)
    with pytest.raises(
        CertificateError, match=f"client certificate {_p(kit.cert)} carries no dpfed"
    ):
        load_channel_credentials(kit.ca, kit.cert, kit.key)


def test_encrypted_key(fed: Federation) -> None:
    kit = fed.kit("site", "a")
    key = serialization.load_pem_private_key(kit.key.read_bytes(), password=None)
    encrypted = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    path = _write(fed.root / "encrypted.key", encrypted, 0o600)
    with pytest.raises(CertificateError, match=f"private key {_p(path)} is encrypted"):
        load_channel_credentials(kit.ca, kit.cert, path)


def test_group_readable_key_is_a_warning_not_an_error(
    fed: Federation, caplog: pytest.LogCaptureFixture
) -> None:
    kit = fed.kit("site", "a")
    with caplog.at_level(logging.WARNING, logger="dpfed.common.transport.tls"):
        load_channel_credentials(kit.ca, kit.cert, kit.key)
    assert "readable by group/others" not in caplog.text
    kit.key.chmod(0o640)
    with caplog.at_level(logging.WARNING, logger="dpfed.common.transport.tls"):
        load_channel_credentials(kit.ca, kit.cert, kit.key)
    assert f"private key {kit.key} has mode 640" in caplog.text
    assert "chmod 600" in caplog.text


def test_certificate_errors_are_config_errors(fed: Federation) -> None:
    # Binaries that only know ConfigError still stop with a clear message.
    kit = fed.kit("site", "a")
    with pytest.raises(ConfigError):
        load_channel_credentials(kit.ca, kit.cert, fed.root / "missing.key")


# ------------------------------------------------------------------------------ identity helpers


def test_principal_requires_tls() -> None:
    insecure = {"transport_security_type": [b"insecure"], "security_level": [b"TSI_SECURITY_NONE"]}
    with pytest.raises(AuthenticationError, match="not TLS .*insecure"):
        principal_from_auth_context(insecure)
    with pytest.raises(AuthenticationError, match="not TLS .*none"):
        principal_from_auth_context({})


def test_principal_requires_a_peer_certificate() -> None:
    with pytest.raises(AuthenticationError, match="presented no client certificate"):
        principal_from_auth_context({"transport_security_type": [b"ssl"]})


def test_principal_never_reads_untyped_sans_or_the_common_name() -> None:
    # A DNS SAN or CN spelled like a dpfed URI must not count: only typed URI SANs do.
    auth = {
        "transport_security_type": [b"ssl"],
        "x509_pem_cert": [b"-----BEGIN CERTIFICATE-----..."],
        "peer_uri": [],
        "x509_subject_alternative_name": [b"urn:dpfed:site:a"],
        "x509_common_name": [b"urn:dpfed:site:a"],
    }
    with pytest.raises(AuthenticationError, match="no dpfed identity"):
        principal_from_auth_context(auth)


def test_principal_with_an_unparsable_fallback_certificate() -> None:
    auth = {"transport_security_type": [b"ssl"], "x509_pem_cert": [b"garbage"]}
    with pytest.raises(AuthenticationError, match="cannot be parsed"):
        principal_from_auth_context(auth)


def test_principal_with_two_identities_is_refused() -> None:
    auth = {
        "transport_security_type": [b"ssl"],
        "x509_pem_cert": [b"pem"],
        "peer_uri": [b"urn:dpfed:site:a", b"urn:dpfed:analyst:x"],
    }
    with pytest.raises(AuthenticationError, match="several dpfed identities"):
        principal_from_auth_context(auth)


def test_require_role() -> None:
    site = Principal("site", "a")
    assert require_role(site, "site") is site
    assert require_role(site, "analyst", "site") is site
    with pytest.raises(PermissionDeniedError, match="site/a may not call .* role analyst only"):
        require_role(site, "analyst")
    with pytest.raises(ValueError, match="at least one role"):
        require_role(site)


def test_target_name_options() -> None:
    assert target_name_options(None) == []
    assert target_name_options("Coord.Example") == [
        ("grpc.ssl_target_name_override", "coord.example")
    ]
    with pytest.raises(ValidationError, match="coordinator host"):
        target_name_options("*.example")
