"""Who may connect: allow-lists refuse by default, revocation works without a restart.

Real coordinator (aio gRPC on loopback port 0, mTLS), real certificates from the project's
certs tool (``dpfed certs`` CLI), real site streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from dpfed import __version__
from dpfed.aggregator.certs_cli import main as certs_main
from dpfed.aggregator.config import load_aggregator_config
from dpfed.aggregator.local_federation import LocalFederation
from dpfed.aggregator.server import RunningCoordinator, start_coordinator
from dpfed.common import exit_codes
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ConfigError
from dpfed.common.pb.v1 import analyst_pb2, analyst_pb2_grpc, site_link_pb2, site_link_pb2_grpc
from dpfed.common.transport import certs
from dpfed.common.transport.grpc_options import channel_options
from dpfed.common.transport.protocol import PROTOCOL_VERSION, SiteHello
from dpfed.common.transport.tls import load_channel_credentials
from dpfed.common.transport.wire import hello_to_proto

TIMEOUT = 10.0


def creds(kit: Path, name: str) -> grpc.ChannelCredentials:
    return load_channel_credentials(kit / "ca.pem", kit / f"{name}.pem", kit / f"{name}.key")


def site_kit(fed: LocalFederation, site: str) -> Path:
    return fed.certs / "sites" / site


async def start(fed: LocalFederation, edit: str | None = None,
                reload_s: float = 0.1) -> RunningCoordinator:
    """Start the coordinator of ``fed`` in-process (``edit`` rewrites its [federation])."""
    if edit is not None:
        text = re.sub(r"access_list = .*\n", "", fed.aggregator_config.read_text())
        fed.aggregator_config.write_text(text.replace("[federation]\n", f"[federation]\n{edit}"))
    config = dataclasses.replace(load_aggregator_config(fed.aggregator_config),
                                 listen="127.0.0.1:0", access_reload_s=reload_s)
    coordinator = await start_coordinator(config)
    fed.port = coordinator.port
    return coordinator


class SiteStream:
    """A raw SiteLink stream: Hello, then the Welcome or the refusal."""

    def __init__(self, fed: LocalFederation, kit: Path) -> None:
        self.fed = fed
        self.channel = grpc.aio.secure_channel(fed.address, creds(kit, "site"),
                                               options=channel_options())
        self.call = site_link_pb2_grpc.SiteLinkStub(self.channel).Connect()

    async def hello(self) -> site_link_pb2.CoordinatorMessage:
        digest = Schema.load(self.fed.schema_path).digest()
        hello = SiteHello(__version__, PROTOCOL_VERSION, digest, 100, ("pca",), None, None)
        await self.call.write(site_link_pb2.SiteMessage(hello=hello_to_proto(hello)))
        return await asyncio.wait_for(self.call.read(), TIMEOUT)

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


async def refused(fed: LocalFederation, kit: Path) -> str:
    """Connect with ``kit``; assert PERMISSION_DENIED and return its details."""
    stream = SiteStream(fed, kit)
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            await stream.hello()
        # The call's own status, not the exception of whichever operation noticed first: a
        # write racing the server's refusal fails with a generic INTERNAL error.
        code = await asyncio.wait_for(stream.call.code(), TIMEOUT)
        assert code == grpc.StatusCode.PERMISSION_DENIED, code
        return await stream.call.details() or ""
    finally:
        await stream.close()


@pytest.fixture
async def fed(tmp_path: Path) -> AsyncIterator[LocalFederation]:
    yield LocalFederation.create(tmp_path / "fed", n_sites=2, rows=50, features=3, seed=1)


async def test_a_ca_signed_site_off_the_allow_list_is_refused_by_default(
        fed: LocalFederation) -> None:
    # A certificate the federation CA signed but that 'certs issue' never put on the list
    # (made directly with the CA key, as anyone holding it could).
    ca_cert, ca_key = certs.load_ca(fed.certs)
    cert, key = certs.make_certificate(ca_cert, ca_key, role="site", name="intruder")
    kit = fed.root / "intruder"
    kit.mkdir()
    (kit / "site.pem").write_bytes(certs.certificate_pem(cert))
    (kit / "site.key").write_bytes(certs.private_key_pem(key))
    (kit / "ca.pem").write_bytes(certs.certificate_pem(ca_cert))
    coordinator = await start(fed)
    try:
        assert "not admitted" in await refused(fed, kit)
        welcome = SiteStream(fed, site_kit(fed, "hospital-1"))
        try:
            assert (await welcome.hello()).welcome.site_id == "hospital-1"
        finally:
            await welcome.close()
    finally:
        await coordinator.stop(grace=0.5)


async def test_no_allow_list_at_all_admits_nobody_unless_allow_any_site(
        fed: LocalFederation) -> None:
    coordinator = await start(fed, edit="")
    try:
        assert "not admitted" in await refused(fed, site_kit(fed, "hospital-1"))
    finally:
        await coordinator.stop(grace=0.5)
    coordinator = await start(fed, edit="allow_any_site = true\n")
    try:
        stream = SiteStream(fed, site_kit(fed, "hospital-1"))
        try:
            assert (await stream.hello()).WhichOneof("body") == "welcome"
        finally:
            await stream.close()
    finally:
        await coordinator.stop(grace=0.5)


async def test_revoke_drops_the_live_session_and_refuses_new_ones_without_restart(
        fed: LocalFederation, capsys: pytest.CaptureFixture[str]) -> None:
    # A reload period long enough that the new connection below reads the change first.
    coordinator = await start(fed, reload_s=1.0)
    stream = SiteStream(fed, site_kit(fed, "hospital-1"))
    try:
        assert (await stream.hello()).WhichOneof("body") == "welcome"
        assert coordinator.registry.get("hospital-1") is not None
        code = certs_main(["certs", "revoke", "--ca-dir", str(fed.certs), "hospital-1"])
        assert code == exit_codes.OK, capsys.readouterr().err
        assert "site/hospital-1" in capsys.readouterr().out
        # A new connection is refused at once (it reads the changed file first) ...
        assert "revoked" in await refused(fed, site_kit(fed, "hospital-1"))
        # ... and the live stream still ends with PERMISSION_DENIED within a reload period.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(stream.call.read(), TIMEOUT)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "revoked" in (info.value.details() or "")
        assert coordinator.registry.get("hospital-1") is None
        # The other site is untouched.
        other = SiteStream(fed, site_kit(fed, "hospital-2"))
        try:
            assert (await other.hello()).WhichOneof("body") == "welcome"
        finally:
            await other.close()
    finally:
        await stream.close()
        await coordinator.stop(grace=0.5)


async def test_issue_force_revokes_the_replaced_certificate(fed: LocalFederation) -> None:
    old_kit = fed.root / "old-kit"
    shutil.copytree(site_kit(fed, "hospital-1"), old_kit)
    coordinator = await start(fed)
    try:
        code = certs_main(["certs", "issue", "--ca-dir", str(fed.certs), "--site",
                           "hospital-1", "--force"])
        assert code == exit_codes.OK
        await asyncio.sleep(0.3)  # a few reload periods
        assert "revoked" in await refused(fed, old_kit)
        fresh = SiteStream(fed, site_kit(fed, "hospital-1"))
        try:
            assert (await fresh.hello()).welcome.site_id == "hospital-1"
        finally:
            await fresh.close()
    finally:
        await coordinator.stop(grace=0.5)


async def test_analysts_need_the_allow_list_and_lose_access_when_revoked(
        fed: LocalFederation) -> None:
    certs.issue_certificate(fed.certs, role="analyst", name="bob")
    access = fed.certs / "coordinator" / "access.toml"
    access.write_text(access.read_text().replace('"analyst", "bob"', '"analyst"'))
    coordinator = await start(fed)
    try:
        for name, ok in (("analyst", True), ("bob", False)):
            kit = fed.certs / "analysts" / name
            async with grpc.aio.secure_channel(fed.address, creds(kit, "analyst"),
                                               options=channel_options()) as ch:
                stub = analyst_pb2_grpc.AnalystStub(ch)
                if ok:
                    await stub.ListSites(analyst_pb2.ListSitesRequest(), timeout=TIMEOUT)
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ListSites(analyst_pb2.ListSitesRequest(), timeout=TIMEOUT)
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "analyst 'bob' is not admitted" in (info.value.details() or "")
        certs.revoke_certificate(fed.certs, role="analyst", name="analyst")
        await asyncio.sleep(0.3)
        kit = fed.certs / "analysts" / "analyst"
        async with grpc.aio.secure_channel(fed.address, creds(kit, "analyst"),
                                           options=channel_options()) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await analyst_pb2_grpc.AnalystStub(ch).ListSites(
                    analyst_pb2.ListSitesRequest(), timeout=TIMEOUT)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await coordinator.stop(grace=0.5)


async def test_a_malformed_access_file_keeps_the_previous_lists(fed: LocalFederation) -> None:
    coordinator = await start(fed)
    access = fed.certs / "coordinator" / "access.toml"
    try:
        access.write_text("sites = [\n")  # an operator's typo must not open the federation
        await asyncio.sleep(0.3)
        stream = SiteStream(fed, site_kit(fed, "hospital-1"))
        try:
            assert (await stream.hello()).WhichOneof("body") == "welcome"
        finally:
            await stream.close()
    finally:
        await coordinator.stop(grace=0.5)


async def test_a_coordinator_with_a_missing_access_file_does_not_start(
        fed: LocalFederation) -> None:
    (fed.certs / "coordinator" / "access.toml").unlink()
    config = dataclasses.replace(load_aggregator_config(fed.aggregator_config),
                                 listen="127.0.0.1:0")
    with pytest.raises(ConfigError, match="access list .*access.toml does not exist"):
        await start_coordinator(config)


def test_revoke_names_what_it_cannot_find(fed: LocalFederation,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert certs_main(["certs", "revoke", "--ca-dir", str(fed.certs), "nobody"]) \
        == exit_codes.CONFIG_ERROR
    assert "no site or analyst kit named 'nobody'" in capsys.readouterr().err
    assert certs_main(["certs", "revoke", "--ca-dir", str(fed.certs), "admin/x"]) \
        == exit_codes.CONFIG_ERROR
    assert "site/ID, analyst/ID or coordinator" in capsys.readouterr().err
