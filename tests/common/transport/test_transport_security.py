"""Transport and identity at the coordinator, on a real grpc.aio server on loopback (port 0).

A real site agent (in-process, real ledger on disk) stays connected through every negative
case, and its ledger must show that nothing was charged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dpfed import __version__
from dpfed.aggregator.config import load_aggregator_config
from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.aggregator.server import RunningCoordinator, start_coordinator
from dpfed.common.data.data_sources import open_data_source, scan, spec_from_path
from dpfed.common.data.schema import Schema
from dpfed.common.pb.v1 import analyst_pb2, analyst_pb2_grpc, site_link_pb2, site_link_pb2_grpc
from dpfed.common.transport.certs import init_federation
from dpfed.common.transport.grpc_options import channel_options
from dpfed.common.transport.protocol import PROTOCOL_VERSION, JobSpec, SiteHello
from dpfed.common.transport.tls import load_channel_credentials
from dpfed.common.transport.wire import hello_to_proto, job_spec_to_proto
from dpfed.site_agent.agent import SiteAgent
from dpfed.site_agent.config import load_site_config
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner

TIMEOUT = 10.0


def creds(kit: Path, name: str) -> grpc.ChannelCredentials:
    return load_channel_credentials(kit / "ca.pem", kit / f"{name}.pem", kit / f"{name}.key")


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[tuple[LocalFederation, RunningCoordinator,
                                                         Ledger]]:
    fed = LocalFederation.create(tmp_path / "fed", n_sites=1, rows=200, features=4, seed=3,
                                 settings=SiteSettings(connect_timeout_s=10))
    config = dataclasses.replace(load_aggregator_config(fed.aggregator_config),
                                 listen="127.0.0.1:0")
    coordinator = await start_coordinator(config)
    fed.port = coordinator.port
    site_cfg = load_site_config(fed.site_config("hospital-1"), {"coordinator": fed.address})
    schema = Schema.load(site_cfg.data.schema)
    source = open_data_source(spec_from_path(site_cfg.data.path), schema)
    rows = scan(source).rows_kept
    ledger = Ledger(site_cfg.ledger_path, site_cfg.budget)
    runner = TaskRunner(source, ledger, site_cfg.allowed_jobs)
    assert site_cfg.tls is not None
    agent = SiteAgent(
        address=fed.address,
        credentials=load_channel_credentials(site_cfg.tls.ca, site_cfg.tls.cert,
                                             site_cfg.tls.key, role="site"),
        runner=runner, connect_timeout_s=10,
        hello=lambda: SiteHello(__version__, PROTOCOL_VERSION, schema.digest(), rows,
                                site_cfg.allowed_jobs, None, ledger.status()))
    task = asyncio.create_task(agent.run())
    for _ in range(200):
        if coordinator.registry.get("hospital-1") is not None:
            break
        await asyncio.sleep(0.05)
    assert coordinator.registry.get("hospital-1") is not None
    try:
        yield fed, coordinator, ledger
    finally:
        agent.stop()
        await coordinator.stop(grace=0.5)
        await asyncio.wait_for(task, 15)
        ledger.close()


async def submit_error(stub: analyst_pb2_grpc.AnalystStub,
                       spec: JobSpec) -> grpc.aio.AioRpcError:
    """Submit a job whose progress stream must end in an error; return that error."""
    call = stub.SubmitJob(analyst_pb2.SubmitJobRequest(spec=job_spec_to_proto(spec)),
                          timeout=TIMEOUT)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    return info.value


def nothing_charged(ledger: Ledger) -> bool:
    return ledger.events() == [] and ledger.refusals() == []


async def test_site_certificate_cannot_call_analyst_methods(running) -> None:  # type: ignore[no-untyped-def]
    fed, _, ledger = running
    kit = fed.certs / "sites" / "hospital-1"
    async with grpc.aio.secure_channel(fed.address, creds(kit, "site"),
                                       options=channel_options()) as ch:
        stub = analyst_pb2_grpc.AnalystStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListSites(analyst_pb2.ListSitesRequest(), timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "site/hospital-1 may not call this method" in (info.value.details() or "")
        error = await submit_error(stub, JobSpec("pca", 1.0, 1e-5, {"n_components": 2}))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert nothing_charged(ledger)


async def test_analyst_certificate_cannot_join_as_a_site(running) -> None:  # type: ignore[no-untyped-def]
    fed, coordinator, ledger = running
    kit = fed.certs / "analysts" / "analyst"
    async with grpc.aio.secure_channel(fed.address, creds(kit, "analyst"),
                                       options=channel_options()) as ch:
        call = site_link_pb2_grpc.SiteLinkStub(ch).Connect(timeout=TIMEOUT)
        hello = SiteHello("x", PROTOCOL_VERSION, "d", 1, ("pca",), None, None)
        # The server may abort before or after our Hello arrives: either way the call ends
        # with PERMISSION_DENIED (a write to an aborted call raises, which is fine here).
        try:
            await call.write(site_link_pb2.SiteMessage(hello=hello_to_proto(hello)))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        assert await call.code() == grpc.StatusCode.PERMISSION_DENIED
    assert [s.site_id for s in coordinator.registry.connected()] == ["hospital-1"]
    assert nothing_charged(ledger)


async def test_other_ca_and_missing_client_certificate_fail_the_handshake(
        running, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fed, _, ledger = running
    other = init_federation(tmp_path / "other", coordinator_hosts=["localhost"],
                            sites=["hospital-1"], analysts=["analyst"])
    del other
    foreign = creds(tmp_path / "other" / "analysts" / "analyst", "analyst")
    root_only = grpc.ssl_channel_credentials((fed.certs / "ca.pem").read_bytes())
    for channel_creds in (foreign, root_only):
        async with grpc.aio.secure_channel(fed.address, channel_creds,
                                           options=channel_options()) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await analyst_pb2_grpc.AnalystStub(ch).ListSites(
                    analyst_pb2.ListSitesRequest(), timeout=TIMEOUT)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert nothing_charged(ledger)


async def test_oversized_message_is_refused_not_hung(running) -> None:  # type: ignore[no-untyped-def]
    fed, _, ledger = running
    kit = fed.certs / "analysts" / "analyst"
    big = {"n_components": 2, "padding": "x" * (20 << 20)}
    async with grpc.aio.secure_channel(fed.address, creds(kit, "analyst"),
                                       options=channel_options()) as ch:
        error = await submit_error(analyst_pb2_grpc.AnalystStub(ch),
                                   JobSpec("pca", 1.0, 1e-5, big))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert nothing_charged(ledger)


async def test_invalid_job_is_rejected_with_invalid_argument(running) -> None:  # type: ignore[no-untyped-def]
    fed, _, ledger = running
    kit = fed.certs / "analysts" / "analyst"
    async with grpc.aio.secure_channel(fed.address, creds(kit, "analyst"),
                                       options=channel_options()) as ch:
        stub = analyst_pb2_grpc.AnalystStub(ch)
        for spec, match in [(JobSpec("pca", -1.0, 1e-5, {"n_components": 2}), "epsilon"),
                            (JobSpec("pca", 1.0, 1e-5, {"n_components": 99}), "n_components"),
                            (JobSpec("pca", 10.0, 1e-5, {"n_components": 2,
                                                         "calibration": "classic",
                                                         "centering": "none",
                                                         "clip_norm": "schema"}),
                             "not differentially private"),
                            (JobSpec("kmeans", 1.0, 1e-5, {}), "unknown job kind")]:
            error = await submit_error(stub, spec)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert match in (error.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetJob(analyst_pb2.GetJobRequest(job_id="nope"), timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert nothing_charged(ledger)


async def test_health_and_reflection(running) -> None:  # type: ignore[no-untyped-def]
    fed, _, _ = running
    kit = fed.certs / "analysts" / "analyst"
    async with grpc.aio.secure_channel(fed.address, creds(kit, "analyst"),
                                       options=channel_options()) as ch:
        health = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT)
        names = set()
        async for r in responses:
            names |= {s.name for s in r.list_services_response.service}
        assert {"dpfed.v1.SiteLink", "dpfed.v1.Analyst", "grpc.health.v1.Health"} <= names


async def test_sites_not_in_the_allow_list_are_refused(tmp_path: Path) -> None:
    fed = LocalFederation.create(tmp_path / "fed", n_sites=1, rows=50, features=3, seed=1)
    text = re.sub(r"access_list = .*\n", "", fed.aggregator_config.read_text()).replace(
        "[federation]\n", "[federation]\nallowed_sites = [\"somebody-else\"]\n")
    fed.aggregator_config.write_text(text)
    config = dataclasses.replace(load_aggregator_config(fed.aggregator_config),
                                 listen="127.0.0.1:0")
    coordinator = await start_coordinator(config)
    try:
        kit = fed.certs / "sites" / "hospital-1"
        address = f"127.0.0.1:{coordinator.port}"
        async with grpc.aio.secure_channel(address, creds(kit, "site"),
                                           options=channel_options()) as ch:
            call = site_link_pb2_grpc.SiteLinkStub(ch).Connect(timeout=TIMEOUT)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "not admitted" in (info.value.details() or "")
    finally:
        await coordinator.stop(grace=0.5)


async def test_insecure_mode_only_when_asked_and_still_needs_a_principal(tmp_path: Path) -> None:
    fed = LocalFederation.create(tmp_path / "fed", n_sites=1, rows=50, features=3, seed=1)
    config = dataclasses.replace(load_aggregator_config(fed.aggregator_config, {"insecure": True}),
                                 listen="127.0.0.1:0")
    assert config.tls is None
    coordinator = await start_coordinator(config)
    address = f"127.0.0.1:{coordinator.port}"
    try:
        async with grpc.aio.insecure_channel(address, options=channel_options()) as ch:
            stub = analyst_pb2_grpc.AnalystStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListSites(analyst_pb2.ListSitesRequest(), timeout=TIMEOUT)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = await stub.ListSites(analyst_pb2.ListSitesRequest(), timeout=TIMEOUT,
                                      metadata=(("x-dpfed-insecure-principal", "analyst/analyst"),))
            assert list(ok.sites) == []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListSites(analyst_pb2.ListSitesRequest(), timeout=TIMEOUT,
                                     metadata=(("x-dpfed-insecure-principal", "site/dev"),))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await coordinator.stop(grace=0.5)


async def test_secure_server_ignores_the_insecure_principal_header(running) -> None:  # type: ignore[no-untyped-def]
    fed, _, _ = running
    kit = fed.certs / "sites" / "hospital-1"
    async with grpc.aio.secure_channel(fed.address, creds(kit, "site"),
                                       options=channel_options()) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await analyst_pb2_grpc.AnalystStub(ch).ListSites(
                analyst_pb2.ListSitesRequest(), timeout=TIMEOUT,
                metadata=(("x-dpfed-insecure-principal", "analyst/evil"),))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # still the site cert
