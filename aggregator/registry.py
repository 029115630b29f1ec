"""Connected sites: one :class:`SiteSession` per live ``SiteLink.Connect`` stream.

A session owns the stream's outbox (messages to the site) and the futures of the tasks sent
down it. When the stream ends, every pending task of that session fails with
:class:`SiteDisconnected`; the job layer may resend the *same* task id once the site is back
(the site's ledger then replays the stored release instead of charging again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

from dpfed.common.pb.v1 import site_link_pb2
from dpfed.common.privacy.accounting import BudgetStatus
from dpfed.common.transport.grpc_options import CHUNK_BYTES
from dpfed.common.transport.protocol import Refusal, SiteHello, TaskResult
from dpfed.common.transport.wire import iter_chunks

log = logging.getLogger(__name__)


class SiteDisconnected(Exception):
    """The site's stream ended while a task was outstanding."""


@dataclass
class SiteSession:
    """One connected site."""

    site_id: str
    hello: SiteHello
    connected_at: float = field(default_factory=time.time)
    outbox: asyncio.Queue[site_link_pb2.CoordinatorMessage] = field(default_factory=asyncio.Queue)
    pending: dict[str, asyncio.Future[TaskResult | Refusal]] = field(default_factory=dict)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    close_reason: str = ""

    async def submit(self, task_id: str, payload: bytes,
                     deadline_unix: float) -> TaskResult | Refusal:
        """Send a serialized task and wait for its result or refusal (no timeout here).

        Raises
        ------
        SiteDisconnected
            If the stream closes before the answer arrives.
        """
        if self.closed.is_set():
            raise SiteDisconnected(self.close_reason or "stream closed")
        fut = self.pending.get(task_id)
        if fut is None or fut.done():
            fut = asyncio.get_running_loop().create_future()
            self.pending[task_id] = fut
            for chunk in iter_chunks(task_id, payload, CHUNK_BYTES):
                msg = site_link_pb2.CoordinatorMessage(
                    task=site_link_pb2.TaskChunk(deadline_unix_ms=int(deadline_unix * 1000),
                                                 chunk=chunk))
                self.outbox.put_nowait(msg)
        try:
            return await asyncio.shield(fut)
        finally:
            if fut.done():
                self.pending.pop(task_id, None)

    def resolve(self, task_id: str, outcome: TaskResult | Refusal) -> bool:
        """Deliver a site's answer; False if nobody is waiting for it (late or unknown)."""
        fut = self.pending.get(task_id)
        if fut is None or fut.done():
            return False
        fut.set_result(outcome)
        return True

    def update_budget(self, budget: BudgetStatus) -> None:
        """Record a budget update the site sent after a task."""
        self.hello = replace(self.hello, budget=budget)

    def update_row_count(self, row_count: int) -> None:
        """Record the row count a site sends once it has counted (after connecting)."""
        log.info("[SiteSession] site=%s rows=%d", self.site_id, row_count)
        self.hello = replace(self.hello, row_count=row_count)

    def close(self, reason: str) -> None:
        """Mark the session closed and fail its pending tasks."""
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(SiteDisconnected(reason))
                fut.exception()  # mark retrieved: a waiter may already have given up
        self.pending.clear()


class SiteRegistry:
    """The live sessions, by site id (identity from the certificate)."""

    def __init__(self) -> None:
        self._sessions: dict[str, SiteSession] = {}
        self._changed = asyncio.Condition()

    async def attach(self, site_id: str, hello: SiteHello) -> SiteSession:
        """Register a new stream for ``site_id``, replacing (and closing) an older one."""
        session = SiteSession(site_id, hello)
        async with self._changed:
            old = self._sessions.get(site_id)
            if old is not None:
                old.close("replaced by a newer connection from the same site")
            self._sessions[site_id] = session
            self._changed.notify_all()
        log.info("[SiteRegistry.attach] site=%s rows=%d", site_id, hello.row_count)
        return session

    async def detach(self, session: SiteSession, reason: str) -> None:
        """Remove a session (if it is still the current one for its site)."""
        session.close(reason)
        async with self._changed:
            if self._sessions.get(session.site_id) is session:
                del self._sessions[session.site_id]
            self._changed.notify_all()
        log.info("[SiteRegistry.detach] site=%s reason=%s", session.site_id, reason)

    def get(self, site_id: str) -> SiteSession | None:
        """Return the live session of a site, if connected."""
        s = self._sessions.get(site_id)
        return s if s is not None and not s.closed.is_set() else None

    def connected(self) -> list[SiteSession]:
        """All live sessions, sorted by site id."""
        return [s for _, s in sorted(self._sessions.items()) if not s.closed.is_set()]

    async def wait_for_site(self, site_id: str, timeout: float) -> SiteSession | None:
        """Wait up to ``timeout`` seconds for ``site_id`` to be connected."""
        deadline = time.monotonic() + timeout
        async with self._changed:
            while True:
                s = self.get(site_id)
                if s is not None:
                    return s
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    return self.get(site_id)

    async def wait_for_count(self, n: int, timeout: float) -> int:
        """Wait until at least ``n`` sites are connected; return how many are."""
        deadline = time.monotonic() + timeout
        async with self._changed:
            while len(self.connected()) < n:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    break
            return len(self.connected())

    def close_all(self, reason: str) -> None:
        """Close every session (coordinator shutdown)."""
        for s in list(self._sessions.values()):
            s.close(reason)
