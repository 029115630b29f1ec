"""Dead, hung and flooding sites against a real coordinator process (issue 7, §2).

Coordinator and sites are real processes over mTLS on loopback (``LocalFederation``); the
flooding site is a client speaking SiteLink with a genuine site certificate.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import grpc
import pytest

from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.common.data.schema import Schema
from dpfed.common.pb.v1 import site_link_pb2, site_link_pb2_grpc
from dpfed.common.pb.v1.types_pb2 import Chunk
from dpfed.common.transport.grpc_options import channel_options
from dpfed.common.transport.protocol import PROTOCOL_VERSION, JobInfo, JobSpec, SiteHello
from dpfed.common.transport.tls import load_channel_credentials
from dpfed.common.transport.wire import hello_to_proto
from dpfed.common.warm_imports import IMPORTED_MESSAGE
from tests.e2e.federations import roomy_settings, running, wait_until, with_keepalive

#: One-round pca tasks (the default job adds a DP mean and a norm round first).
ONE_ROUND = {"centering": "none", "clip_norm": "schema"}

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

KEEPALIVE_S = 2.0


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=600, features=5, seed=21, min_sites=2,
        task_deadline_s=30, resume_wait_s=10,
        settings=roomy_settings())
    with_keepalive(federation, KEEPALIVE_S)
    yield from running(federation)


def connected(fed: LocalFederation) -> set[str]:
    with fed.analyst() as coord:
        return {s.site_id for s in coord.sites()}


def job_seconds(job: JobInfo) -> float:
    """Coordinator-side duration of a job (created -> last update)."""
    return (datetime.fromisoformat(job.updated) - datetime.fromisoformat(job.created)
            ).total_seconds()


def test_a_hung_site_is_noticed_within_one_keepalive_and_holds_no_job(
        fed: LocalFederation) -> None:
    fed.signal("hospital-3", signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        while "hospital-3" in connected(fed):
            assert time.monotonic() - t0 < 30, "the hung site was never dropped"
            time.sleep(0.1)
        noticed = time.monotonic() - t0
    finally:
        fed.signal("hospital-3", signal.SIGCONT)
    fed.wait_for_sites(timeout=30)  # it rejoins by itself once resumed
    fed.signal("hospital-3", signal.SIGSTOP)
    try:
        with fed.analyst() as coord:
            t1 = time.monotonic()
            job = coord.submit(JobSpec("pca", 1.0, 1e-5, {"n_components": 2, **ONE_ROUND},
                                       min_sites=2))
            elapsed = time.monotonic() - t1
    finally:
        fed.signal("hospital-3", signal.SIGCONT)
    print(f"\nhung site noticed after {noticed:.2f}s (keepalive {KEEPALIVE_S:g}s); "
          f"job with a hung target completed in {elapsed:.2f}s (deadline 30s)")
    assert noticed < KEEPALIVE_S + 1.5
    assert job.state == "succeeded"
    assert {s.site_id: s.status for s in job.sites} == {
        "hospital-1": "ok", "hospital-2": "ok", "hospital-3": "disconnected"}
    assert elapsed < KEEPALIVE_S + 3.0


def test_with_a_site_missing_a_job_fails_by_quorum_within_deadline_plus_1s(
        fed: LocalFederation) -> None:
    fed.signal("hospital-3", signal.SIGSTOP)
    try:
        with fed.analyst() as coord:
            job = coord.submit(JobSpec("pca", 1.0, 1e-5, {"n_components": 2, **ONE_ROUND},
                                       min_sites=3,
                                       deadline_seconds=4.0))
    finally:
        fed.signal("hospital-3", signal.SIGCONT)
    print(f"\nquorum failure with a hung site after {job_seconds(job):.2f}s (deadline 4s)")
    assert job.state == "failed" and "min_sites=3" in job.error
    assert job_seconds(job) < 4.0 + 1.0


def test_a_dead_site_does_not_slow_a_job(fed: LocalFederation) -> None:
    fed.signal("hospital-3", signal.SIGKILL)
    fed.wait("hospital-3")
    with fed.analyst() as coord:
        t0 = time.monotonic()
        job = coord.submit(JobSpec("pca", 1.0, 1e-5, {"n_components": 2, **ONE_ROUND},
                                       min_sites=2))
        elapsed = time.monotonic() - t0
    print(f"\njob with a killed site completed in {elapsed:.2f}s")
    assert job.state == "succeeded" and elapsed < 5.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def flood(fed: LocalFederation, transfers: int, mib_each: int, pid: int,
                phases: int = 2) -> list[float]:
    """Open ``transfers`` result transfers of 15 MiB declared; send ``mib_each`` MiB of each,
    ``phases`` times over, on one stream.

    Returns the coordinator's RSS (MiB) after each phase, measured while the stream is open.
    """
    kit = fed.certs / "sites" / "hospital-3"
    creds = load_channel_credentials(kit / "ca.pem", kit / "site.pem", kit / "site.key")
    rss = []
    async with grpc.aio.secure_channel(fed.address, creds, options=channel_options()) as ch:
        call = site_link_pb2_grpc.SiteLinkStub(ch).Connect()
        digest = Schema.load(fed.schema_path).digest()
        await call.write(site_link_pb2.SiteMessage(hello=hello_to_proto(SiteHello(
            "x", PROTOCOL_VERSION, digest, 600, ("pca",), None, None))))
        assert (await call.read()).WhichOneof("body") == "welcome"
        block = b"\x01" * (1 << 20)
        for i in range(mib_each * phases):
            for t in range(transfers):
                await call.write(site_link_pb2.SiteMessage(result_chunk=Chunk(
                    transfer_id=f"flood-{t}", index=i, last=False, data=block,
                    total_size=15 << 20)))
            if (i + 1) % mib_each == 0:
                await asyncio.sleep(1.0)  # let the coordinator read everything that was sent
                rss.append(rss_mib(pid))
        call.cancel()
    return rss


def test_unfinished_transfers_do_not_grow_the_coordinator(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # RSS should show what the coordinator keeps, not what glibc caches: with its default
    # dynamic threshold, a freed 1 MiB chunk raises the mmap threshold and later chunks come
    # from the heap arenas, whose high-water mark grew with the load-dependent backlog (+204
    # MiB in the second phase of a loaded CI run, for the same code that grows 4 MiB when
    # quiet). A fixed threshold keeps every chunk of 128 KiB or more in its own mapping,
    # returned when freed.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    federation = LocalFederation.create(tmp_path / "fed", n_sites=3, rows=200, features=4,
                                        seed=2, settings=SiteSettings(connect_timeout_s=30))
    federation.start_coordinator()
    try:
        pid = federation.procs["coordinator"][0].pid
        # The coordinator imports the jobs' libraries in the background once it listens
        # (~100 MiB): measure from after that, so only the transfers can grow it.
        wait_until(lambda: IMPORTED_MESSAGE in (federation.logs / "coordinator.log").read_text(),
                   60, "the coordinator's background imports")
        before = rss_mib(pid)
        first, second = asyncio.run(flood(federation, transfers=48, mib_each=4, pid=pid))
        federation.check_alive("coordinator")
    finally:
        federation.stop_all()
    print(f"\ncoordinator RSS {before:.0f} MiB -> {first:.0f} -> {second:.0f} MiB with 48 "
          "unfinished transfers, after 4 and 8 MiB sent on each")
    # The landed code kept every unfinished transfer (48 x 15 MiB: 169 -> 926 MiB). What is
    # read and dropped still leaves the allocator's high-water mark in RSS -- 16 to 116 MiB
    # after the first 192 MiB, more on a loaded machine, where more chunks wait to be read at
    # once -- which the second 192 MiB reuse; kept data would add all of them again.
    assert first - before < 360, (before, first)  # half of the declared 48 x 15 MiB
    assert second - first < 96, (before, first, second)
