"""A real coordinator on loopback with real site agents, and a site that speaks the protocol
by hand (for the hardening tests).

Everything is real: the grpc.aio server, mTLS with certificates from the project's tool
(``LocalFederation.create`` runs ``dpfed.common.transport.certs``), SQLite ledgers and job
store. The hand-written site uses a genuine site certificate and the genuine wire messages;
only its behaviour is hostile.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from dpfed import __version__
from dpfed.aggregator.config import load_aggregator_config
from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.aggregator.server import RunningCoordinator, start_coordinator
from dpfed.common.data.data_sources import open_data_source, scan, spec_from_path
from dpfed.common.data.schema import Schema
from dpfed.common.pb.v1 import analyst_pb2, analyst_pb2_grpc, site_link_pb2, site_link_pb2_grpc
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.transport.grpc_options import CHUNK_BYTES, channel_options
from dpfed.common.transport.protocol import (
    PROTOCOL_VERSION,
    JobInfo,
    JobSpec,
    SiteHello,
    Task,
    TaskResult,
)
from dpfed.common.transport.tls import load_channel_credentials
from dpfed.common.transport.wire import (
    Reassembler,
    hello_to_proto,
    iter_chunks,
    job_event_from_proto,
    job_spec_to_proto,
    result_to_bytes,
    task_from_bytes,
)
from dpfed.site_agent.agent import SiteAgent
from dpfed.site_agent.config import load_site_config
from dpfed.site_agent.handlers import TaskHandler, default_handlers
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner

TIMEOUT = 30.0


def creds(kit: Path, name: str) -> grpc.ChannelCredentials:
    return load_channel_credentials(kit / "ca.pem", kit / f"{name}.pem", kit / f"{name}.key")


@dataclass
class Harness:
    """A running coordinator, its honest in-process sites, and the federation on disk."""

    fed: LocalFederation
    coordinator: RunningCoordinator
    ledgers: dict[str, Ledger]
    agents: dict[str, SiteAgent]
    agent_tasks: dict[str, asyncio.Task[int]] = field(default_factory=dict)

    @property
    def schema_digest(self) -> str:
        return Schema.load(self.fed.schema_path).digest()

    @property
    def n_features(self) -> int:
        return len(Schema.load(self.fed.schema_path).names)

    def analyst_channel(self) -> grpc.aio.Channel:
        kit = self.fed.certs / "analysts" / "analyst"
        return grpc.aio.secure_channel(self.fed.address, creds(kit, "analyst"),
                                       options=channel_options())

    async def submit(self, spec: JobSpec, request_id: str = "") -> JobInfo:
        """Submit a job as the analyst and follow it to its end; return the final JobInfo."""
        async with self.analyst_channel() as ch:
            call = analyst_pb2_grpc.AnalystStub(ch).SubmitJob(
                analyst_pb2.SubmitJobRequest(spec=job_spec_to_proto(spec), request_id=request_id),
                timeout=120)
            final = None
            async for msg in call:
                event = job_event_from_proto(msg)
                if event.job is not None:
                    final = event.job
        assert final is not None
        return final

    async def wait_connected(self, site_id: str, connected: bool = True,
                             timeout: float = 20.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while (self.coordinator.registry.get(site_id) is not None) != connected:
            if loop.time() > end:
                raise AssertionError(f"{site_id} connected != {connected} after {timeout}s")
            await asyncio.sleep(0.02)


async def start_agent(fed: LocalFederation, site_id: str, *,
                      handlers: Mapping[str, TaskHandler] | None = None,
                      extra_kinds: tuple[str, ...] = ()) -> tuple[SiteAgent, Ledger,
                                                                  asyncio.Task[int]]:
    """Start a real site agent in this event loop (real data, real ledger, mTLS)."""
    cfg = load_site_config(fed.site_config(site_id), {"coordinator": fed.address})
    schema = Schema.load(cfg.data.schema)
    source = open_data_source(spec_from_path(cfg.data.path), schema)
    rows = scan(source).rows_kept
    ledger = Ledger(cfg.ledger_path, cfg.budget)
    kinds = (*cfg.allowed_jobs, *extra_kinds)
    runner = TaskRunner(source, ledger, kinds, handlers={**default_handlers(), **(handlers or {})})
    assert cfg.tls is not None
    agent = SiteAgent(
        address=fed.address,
        credentials=load_channel_credentials(cfg.tls.ca, cfg.tls.cert, cfg.tls.key, role="site"),
        runner=runner, connect_timeout_s=10,
        hello=lambda: SiteHello(__version__, PROTOCOL_VERSION, schema.digest(), rows, kinds,
                                None, ledger.status()))
    return agent, ledger, asyncio.create_task(agent.run())


@asynccontextmanager
async def harness(tmp_path: Path, *, honest: tuple[str, ...] = ("hospital-1", "hospital-2"),
                  n_sites: int = 3, deadline_s: float = 20.0, min_sites: int = 2,
                  agent_handlers: Mapping[str, TaskHandler] | None = None,
                  extra_kinds: tuple[str, ...] = ()) -> AsyncIterator[Harness]:
    fed = LocalFederation.create(tmp_path / "fed", n_sites=n_sites, rows=300, features=4, seed=5,
                                 min_sites=min_sites, task_deadline_s=deadline_s,
                                 settings=SiteSettings(budget_epsilon=1e4, budget_delta=0.1,
                                                       connect_timeout_s=10))
    config = dataclasses.replace(load_aggregator_config(fed.aggregator_config),
                                 listen="127.0.0.1:0")
    coordinator = await start_coordinator(config)
    if coordinator.planner_warm_up is not None:  # timings below measure jobs, not start-up
        await coordinator.planner_warm_up
    fed.port = coordinator.port
    h = Harness(fed, coordinator, {}, {})
    try:
        for site_id in honest:
            agent, ledger, task = await start_agent(fed, site_id, handlers=agent_handlers,
                                                    extra_kinds=extra_kinds)
            h.agents[site_id], h.ledgers[site_id], h.agent_tasks[site_id] = agent, ledger, task
        for site_id in honest:
            await h.wait_connected(site_id)
        yield h
    finally:
        for agent in h.agents.values():
            agent.stop()
        await coordinator.stop(grace=0.5)
        for task in h.agent_tasks.values():
            await asyncio.wait_for(task, 15)
        for ledger in h.ledgers.values():
            ledger.close()


class HandSite:
    """A site that speaks SiteLink by hand with a real site certificate."""

    def __init__(self, h: Harness, site_id: str = "hospital-3", rows: int = 300) -> None:
        self.h = h
        self.site_id = site_id
        self.rows = rows
        kit = h.fed.certs / "sites" / site_id
        self.channel = grpc.aio.secure_channel(h.fed.address, creds(kit, "site"),
                                               options=channel_options())
        self.call: Any = None
        self.tasks = Reassembler(1 << 30)

    def hello(self) -> site_link_pb2.SiteMessage:
        return site_link_pb2.SiteMessage(hello=hello_to_proto(SiteHello(
            __version__, PROTOCOL_VERSION, self.h.schema_digest, self.rows, ("pca",), None,
            None)))

    async def connect(self) -> None:
        self.call = site_link_pb2_grpc.SiteLinkStub(self.channel).Connect()
        await self.call.write(self.hello())
        first = await asyncio.wait_for(self.call.read(), TIMEOUT)
        assert first.WhichOneof("body") == "welcome", first

    async def next_task(self) -> Task:
        while True:
            msg = await asyncio.wait_for(self.call.read(), TIMEOUT)
            assert msg.WhichOneof("body") == "task"
            payload = self.tasks.add(msg.task.chunk)
            if payload is not None:
                return task_from_bytes(payload)

    async def send_result(self, task: Task, arrays: dict[str, np.ndarray],
                          metadata: dict[str, Any] | None = None) -> None:
        spend = PrivacyCost(task.epsilon, task.delta, 0.0, "symmetric-gaussian", 1.0, 1.0)
        data = result_to_bytes(TaskResult(task.task_id, spend, arrays,
                                          metadata or {"n_rows": self.rows}))
        for chunk in iter_chunks(task.task_id, data, CHUNK_BYTES):
            await self.call.write(site_link_pb2.SiteMessage(result_chunk=chunk))

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        await self.channel.close()
