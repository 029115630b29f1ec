"""A site that starts many result transfers and finishes none (issue 19, Robustness).

The coordinator accepts result chunks only for tasks pending at the site's session, each
within its task's cap -- but a site with many pending tasks (here 48 SVT jobs at once, each
task capped at 64 MiB) could keep a partial transfer open for every one of them: 48 x 15 MiB
were held, and the coordinator's RSS grew by hundreds of MiB. An honest site writes each
answer whole, so the session now holds one partial result at a time; a transfer started while
another is unfinished fails its task. Real coordinator and site processes over mTLS; the
hostile site speaks SiteLink with a genuine site certificate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.common.data.schema import Schema
from dpfed.common.pb.v1 import analyst_pb2, analyst_pb2_grpc, site_link_pb2, site_link_pb2_grpc
from dpfed.common.pb.v1.types_pb2 import Chunk
from dpfed.common.transport.grpc_options import channel_options
from dpfed.common.transport.protocol import PROTOCOL_VERSION, JobSpec, SiteHello
from dpfed.common.transport.tls import load_channel_credentials
from dpfed.common.transport.wire import Reassembler, hello_to_proto, job_spec_to_proto
from tests.e2e.federations import roomy_settings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

JOBS = 48
MIB_EACH = 15


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def fed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalFederation]:
    # RSS should show what the coordinator keeps, not glibc's load-dependent arena cache (see
    # test_e2e_hardening's transfer test): a fixed mmap threshold returns freed chunks.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    federation = LocalFederation.create(tmp_path / "fed", n_sites=3, rows=200, features=4,
                                        seed=6, min_sites=2, task_deadline_s=120,
                                        settings=roomy_settings())
    federation.start_coordinator()
    for site_id in ("hospital-1", "hospital-2"):
        federation.start_site(site_id)
    try:
        federation.wait_for_sites(2)
        yield federation
    finally:
        federation.stop_all()


def creds(fed: LocalFederation, role: str, name: str) -> grpc.ChannelCredentials:
    kit = fed.certs / f"{role}s" / name
    return load_channel_credentials(kit / "ca.pem", kit / f"{role}.pem", kit / f"{role}.key")


async def hostile_transfers(fed: LocalFederation, pid: int) -> tuple[float, float, int]:
    """Hold 48 SVT tasks at hospital-3 and start a 15 MiB transfer for each; finish none.

    Returns the coordinator's RSS before and while the transfers are open, and how many of
    the 48 jobs already ended (the refused transfers fail the site's part at once).
    """
    digest = Schema.load(fed.schema_path).digest()
    async with grpc.aio.secure_channel(fed.address, creds(fed, "site", "hospital-3"),
                                       options=channel_options()) as site, \
            grpc.aio.secure_channel(fed.address, creds(fed, "analyst", "analyst"),
                                    options=channel_options()) as analyst:
        call = site_link_pb2_grpc.SiteLinkStub(site).Connect()
        await call.write(site_link_pb2.SiteMessage(hello=hello_to_proto(SiteHello(
            "x", PROTOCOL_VERSION, digest, 200, ("svt",), None, None))))
        assert (await call.read()).WhichOneof("body") == "welcome"
        await asyncio.sleep(1.0)
        before = rss_mib(pid)
        stub = analyst_pb2_grpc.AnalystStub(analyst)
        spec = job_spec_to_proto(JobSpec("svt", 1.0, 0.0, {
            "queries": [{"name": "all"}], "threshold": 10.0, "cutoff": 1}, min_sites=2,
            deadline_seconds=120.0))
        streams = [stub.SubmitJob(analyst_pb2.SubmitJobRequest(spec=spec), timeout=200)
                   for _ in range(JOBS)]
        ended = 0

        async def follow(stream: grpc.aio.UnaryStreamCall) -> None:  # type: ignore[type-arg]
            nonlocal ended
            async for _event in stream:
                pass
            ended += 1

        followers = [asyncio.ensure_future(follow(s)) for s in streams]
        tasks: list[str] = []
        chunks = Reassembler(1 << 30)
        while len(tasks) < JOBS:
            msg = await asyncio.wait_for(call.read(), 60)
            payload = chunks.add(msg.task.chunk)
            if payload is not None:
                tasks.append(msg.task.chunk.transfer_id)
        block = b"\x01" * (1 << 20)
        for i in range(MIB_EACH):
            for task_id in tasks:
                await call.write(site_link_pb2.SiteMessage(result_chunk=Chunk(
                    transfer_id=task_id, index=i, last=False, data=block,
                    total_size=(MIB_EACH + 1) << 20)))
        # let the coordinator read everything that was sent and end the jobs whose transfer it
        # refused (on a loaded machine the other sites' answers to 48 jobs take a while)
        waited = time.monotonic() + 90
        await asyncio.sleep(2.0)
        while ended < JOBS - 1 and time.monotonic() < waited:
            await asyncio.sleep(0.5)
        during = rss_mib(pid)
        done = ended
        call.cancel()
        for f in followers:
            f.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
    return before, during, done


def test_a_site_holds_at_most_one_unfinished_result(fed: LocalFederation) -> None:
    pid = fed.procs["coordinator"][0].pid
    t0 = time.monotonic()
    before, during, ended = asyncio.run(hostile_transfers(fed, pid))
    fed.check_alive("coordinator")
    print(f"\ncoordinator RSS {before:.0f} -> {during:.0f} MiB with {JOBS} pending tasks and "
          f"{JOBS} x {MIB_EACH} MiB of unfinished result transfers sent ({ended} of the "
          f"{JOBS} jobs already ended; {time.monotonic() - t0:.0f} s)")
    assert during - before < 96, (before, during)
    assert ended >= JOBS - 1  # every job but the one whose transfer is open has finished
