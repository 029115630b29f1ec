"""A hostile coordinator for end-to-end tests: the real SiteLink protocol, hand-driven tasks.

It serves ``SiteLink.Connect`` on loopback with the federation's genuine coordinator
certificate (real mTLS from ``dpfed certs``), so real ``dpfed-site`` processes connect to it
as to the real coordinator. The test then sends each site whatever tasks it likes and reads
the answers -- e.g. secure rounds whose participants are revoked sites whose kits the
coordinator holds (``sign_as`` signs ephemeral keys with such a kit).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from dpfed import __version__
from dpfed.common.pb.v1 import site_link_pb2, site_link_pb2_grpc
from dpfed.common.secagg.dropouts import RoundKeys
from dpfed.common.secagg.keys import sign_ephemeral
from dpfed.common.secagg.masking import MaskContext
from dpfed.common.secagg.messages import signed_key_arrays
from dpfed.common.transport.certs import parse_private_key, read_pem_file
from dpfed.common.transport.grpc_options import CHUNK_BYTES, MAX_TRANSFER_BYTES, server_options
from dpfed.common.transport.protocol import PROTOCOL_VERSION, Refusal, Task, TaskResult
from dpfed.common.transport.tls import load_server_credentials, principal_from_auth_context
from dpfed.common.transport.wire import (
    Reassembler,
    iter_chunks,
    refusal_from_proto,
    result_from_bytes,
    task_to_bytes,
)


@dataclass
class _Session:
    outbox: asyncio.Queue[site_link_pb2.CoordinatorMessage] = field(
        default_factory=asyncio.Queue)
    answers: dict[str, asyncio.Future[TaskResult | Refusal]] = field(default_factory=dict)
    transfers: Reassembler = field(default_factory=lambda: Reassembler(MAX_TRANSFER_BYTES))
    rows: int = 0


class RogueCoordinator(site_link_pb2_grpc.SiteLinkServicer):
    """Accept sites like the coordinator does, then let the test drive them."""

    def __init__(self, certs: Path) -> None:
        self.certs = certs
        self.sessions: dict[str, _Session] = {}
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> int:
        """Serve on a free loopback port with the federation's coordinator certificate."""
        kit = self.certs / "coordinator"
        self.server = grpc.aio.server(options=server_options())
        site_link_pb2_grpc.add_SiteLinkServicer_to_server(self, self.server)
        creds = load_server_credentials(self.certs / "ca.pem", kit / "coordinator.pem",
                                        kit / "coordinator.key")
        self.port = self.server.add_secure_port("127.0.0.1:0", creds)
        await self.server.start()
        return self.port

    async def stop(self) -> None:
        """Stop serving (the sites' streams end)."""
        if self.server is not None:
            await self.server.stop(0.5)

    async def Connect(self, request_iterator: Any,  # type: ignore[override]  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        site_id = principal_from_auth_context(context.auth_context()).name
        first = await context.read()
        session = _Session(rows=first.hello.row_count)
        self.sessions[site_id] = session
        await context.write(site_link_pb2.CoordinatorMessage(welcome=site_link_pb2.Welcome(
            coordinator_version=__version__, protocol_version=PROTOCOL_VERSION,
            site_id=site_id)))
        reader = asyncio.create_task(self._read(context, session))
        try:
            while not reader.done():
                get = asyncio.ensure_future(session.outbox.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    await context.write(get.result())
                else:
                    get.cancel()
        finally:
            reader.cancel()
            self.sessions.pop(site_id, None)

    @staticmethod
    async def _read(context: grpc.aio.ServicerContext, session: _Session) -> None:
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return
            which = msg.WhichOneof("body")
            if which == "hello":
                session.rows = msg.hello.row_count
            elif which == "refusal":
                refusal = refusal_from_proto(msg.refusal)
                fut = session.answers.get(refusal.task_id)
                if fut is not None and not fut.done():
                    fut.set_result(refusal)
            elif which == "result_chunk":
                payload = session.transfers.add(msg.result_chunk)
                if payload is not None:
                    result = result_from_bytes(payload)
                    fut = session.answers.get(result.task_id)
                    if fut is not None and not fut.done():
                        fut.set_result(result)

    async def wait_for(self, *site_ids: str, timeout: float = 60.0) -> None:
        """Wait until every named site is connected and has counted its rows."""
        end = time.monotonic() + timeout
        while not all(s in self.sessions and self.sessions[s].rows > 0 for s in site_ids):
            if time.monotonic() > end:
                raise AssertionError(f"sites {site_ids} did not connect within {timeout}s "
                                     f"(connected: {sorted(self.sessions)})")
            await asyncio.sleep(0.05)

    def rows(self, site_id: str) -> int:
        """The row count the site reported."""
        return self.sessions[site_id].rows

    async def ask(self, site_id: str, task: Task, timeout: float = 60.0
                  ) -> TaskResult | Refusal:
        """Send ``task`` to a connected site and return its answer."""
        session = self.sessions[site_id]
        fut: asyncio.Future[TaskResult | Refusal] = asyncio.get_running_loop().create_future()
        session.answers[task.task_id] = fut
        deadline_ms = int((time.time() + timeout) * 1000)
        for chunk in iter_chunks(task.task_id, task_to_bytes(task), CHUNK_BYTES):
            session.outbox.put_nowait(site_link_pb2.CoordinatorMessage(
                task=site_link_pb2.TaskChunk(deadline_unix_ms=deadline_ms, chunk=chunk)))
        return await asyncio.wait_for(fut, timeout)

    def cancel(self, site_id: str, task_id: str, reason: str = "job cancelled") -> None:
        """Tell a site that a task it was sent is cancelled."""
        self.sessions[site_id].outbox.put_nowait(site_link_pb2.CoordinatorMessage(
            cancel=site_link_pb2.CancelTask(task_id=task_id, reason=reason)))


def sign_as(certs: Path, site_id: str, context: MaskContext) -> dict[str, np.ndarray]:
    """The relayed-key arrays of a key signed with ``site_id``'s kit (held by the coordinator)."""
    kit = certs / "sites" / site_id
    signed = sign_ephemeral(site_id=site_id, public_key=RoundKeys.generate().public,
                            context=context,
                            signing_key=parse_private_key(read_pem_file(kit / "site.key", "key"),
                                                          kit / "site.key", "key"),
                            certificate_pem=read_pem_file(kit / "site.pem", "certificate"))
    return signed_key_arrays(signed)
