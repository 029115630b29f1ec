"""A site honours the revocation list for the coordinator's certificate, without a restart,
and the coordinator serves a re-issued certificate without one.

Real coordinator (aio gRPC, mTLS) and a real site agent; certificates and the revocation list
come from the project's certs tool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import ssl
from pathlib import Path

import pytest

from dpfed import __version__
from dpfed.aggregator.certs_cli import main as certs_main
from dpfed.aggregator.config import load_aggregator_config
from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.aggregator.server import RunningCoordinator, start_coordinator
from dpfed.common import exit_codes
from dpfed.common.data.data_sources import open_data_source, scan, spec_from_path
from dpfed.common.data.schema import Schema
from dpfed.common.transport.access import WatchedAccessList
from dpfed.common.transport.protocol import PROTOCOL_VERSION, SiteHello
from dpfed.common.transport.tls import load_channel_credentials
from dpfed.site_agent.agent import SiteAgent
from dpfed.site_agent.config import load_site_config
from dpfed.site_agent.coordinator_check import CoordinatorCheck
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner


def _served_certificate(address: str, certs: Path) -> bytes:
    """The PEM of the certificate a TLS handshake with ``address`` is served now."""
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    ctx.check_hostname = False
    site = certs / "sites" / "hospital-1"
    ctx.load_cert_chain(site / "site.pem", site / "site.key")
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            ctx.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return ssl.DER_cert_to_PEM_cert(der).encode().strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _until(predicate: object, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_site_drops_and_refuses_a_revoked_coordinator_then_accepts_its_successor(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fed = LocalFederation.create(tmp_path / "fed", n_sites=1, rows=100, features=3, seed=4,
                                 settings=SiteSettings(connect_timeout_s=30))
    port = _free_port()
    config = dataclasses.replace(load_aggregator_config(fed.aggregator_config),
                                 listen=f"127.0.0.1:{port}")
    fed.port = port

    async def start() -> RunningCoordinator:
        return await start_coordinator(config)

    coordinator = await start()
    site_cfg = load_site_config(fed.site_config("hospital-1"), {"coordinator": fed.address})
    assert site_cfg.tls is not None and site_cfg.revocation_list is not None
    schema = Schema.load(site_cfg.data.schema)
    source = open_data_source(spec_from_path(site_cfg.data.path), schema)
    rows = scan(source).rows_kept
    ledger = Ledger(site_cfg.ledger_path, site_cfg.budget)
    check = CoordinatorCheck(WatchedAccessList(site_cfg.revocation_list), site_cfg.tls.ca,
                             site_cfg.tls.cert, site_cfg.tls.key, interval_s=0.1)
    agent = SiteAgent(
        address=fed.address,
        credentials=load_channel_credentials(site_cfg.tls.ca, site_cfg.tls.cert,
                                             site_cfg.tls.key, role="site"),
        runner=TaskRunner(source, ledger, site_cfg.allowed_jobs), connect_timeout_s=30,
        hello=lambda: SiteHello(__version__, PROTOCOL_VERSION, schema.digest(), rows,
                                site_cfg.allowed_jobs, None, ledger.status()),
        coordinator_check=check)
    task = asyncio.create_task(agent.run())
    try:
        await _until(lambda: coordinator.registry.get("hospital-1") is not None)
        # The coordinator's certificate is replaced: the old one is revoked in every site kit.
        code = certs_main(["certs", "issue", "--ca-dir", str(fed.certs), "--coordinator",
                           "localhost", "--force"])
        assert code == exit_codes.OK
        with caplog.at_level(logging.ERROR, logger="dpfed.site_agent"):
            # The live stream, on the revoked certificate, is dropped by the site ...
            await _until(lambda: "is on this site's revocation list" in caplog.text)
        # ... and the site rejoins by itself: the running coordinator serves its new
        # certificate from the next handshake on, without a restart.
        await _until(lambda: coordinator.registry.get("hospital-1") is not None, timeout=40)
        assert not task.done()
        new_leaf = (fed.certs / "coordinator" / "coordinator.pem").read_bytes()
        assert _served_certificate(fed.address, fed.certs) in new_leaf
        # A broken replacement is refused; the coordinator keeps serving the valid one.
        (fed.certs / "coordinator" / "coordinator.pem").write_bytes(b"not a certificate")
        assert _served_certificate(fed.address, fed.certs) in new_leaf
        # A restart with the new certificate works as before.
        (fed.certs / "coordinator" / "coordinator.pem").write_bytes(new_leaf)
        await coordinator.stop(grace=0.2)
        coordinator = await start()
        await _until(lambda: coordinator.registry.get("hospital-1") is not None, timeout=40)
    finally:
        agent.stop()
        await coordinator.stop(grace=0.2)
        await asyncio.wait_for(task, 15)
