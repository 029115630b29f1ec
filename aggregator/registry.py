"""Connected sites: one :class:`SiteSession` per live ``SiteLink.Connect`` stream.

A session owns the stream's outbox (messages to the site) and the futures of the tasks sent
down it. When the stream ends, every pending task of that session fails with
:class:`SiteDisconnected`; the job layer may resend the *same* task id once the site is back
(the site's ledger then replays the stored release instead of charging again).

A session also bounds what the site can make the coordinator hold (docs/hardening.md):
result chunks are accepted only for a task pending at this session, one transfer per task,
each capped at the size the job expects for that task, and one transfer at a time (a result
started while another is unfinished fails its task); a partial transfer is dropped when its
task ends; budget reports are rate-limited (a token bucket).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dpfed.aggregator.metrics import CoordinatorMetrics
from dpfed.common.errors import ProtocolError
from dpfed.common.pb.v1 import site_link_pb2
from dpfed.common.pb.v1.types_pb2 import Chunk as ProtoChunk
from dpfed.common.privacy.accounting import BudgetStatus
from dpfed.common.transport.grpc_options import CHUNK_BYTES, MAX_TRANSFER_BYTES
from dpfed.common.transport.protocol import Refusal, SiteHello, TaskResult
from dpfed.common.transport.wire import Reassembler, iter_chunks

log = logging.getLogger(__name__)


#: Budget reports a site may send in a burst, and how many per second after that.
BUDGET_BURST = 10
BUDGET_PER_S = 2.0


class SiteDisconnected(Exception):
    """The site's stream ended while a task was outstanding."""


@dataclass
class TokenBucket:
    """A token bucket: ``allow()`` is True at most ``burst`` times at once, then ``rate``/s."""

    burst: float
    rate: float
    tokens: float = -1.0
    stamp: float = field(default_factory=time.monotonic)

    def allow(self) -> bool:
        """Take one token if there is one."""
        now = time.monotonic()
        if self.tokens < 0:
            self.tokens = self.burst
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


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
    #: Largest result (bytes) accepted for each pending task.
    result_limits: dict[str, int] = field(default_factory=dict)
    transfers: Reassembler = field(default_factory=lambda: Reassembler(MAX_TRANSFER_BYTES))
    budget_bucket: TokenBucket = field(
        default_factory=lambda: TokenBucket(BUDGET_BURST, BUDGET_PER_S))
    #: Budget reports accepted / dropped by the rate limit (logged when the session ends).
    budget_accepted: int = 0
    budget_dropped: int = 0
    metrics: CoordinatorMetrics | None = None

    async def submit(self, task_id: str, payload: bytes, deadline_unix: float, *,
                     max_result_bytes: int = MAX_TRANSFER_BYTES) -> TaskResult | Refusal:
        """Send a serialized task and wait for its result or refusal (no timeout here).

        ``max_result_bytes`` caps the site's answer: a longer transfer fails the task with
        :class:`ProtocolError` as soon as it is declared or exceeded.

        Raises
        ------
        SiteDisconnected
            If the stream closes before the answer arrives.
        ProtocolError
            If the site's answer cannot be accepted (too large, malformed).
        """
        if self.closed.is_set():
            raise SiteDisconnected(self.close_reason or "stream closed")
        fut = self.pending.get(task_id)
        if fut is None or fut.done():
            fut = asyncio.get_running_loop().create_future()
            self.pending[task_id] = fut
            self.result_limits[task_id] = max_result_bytes
            if self.metrics is not None:
                self.metrics.sent(self.site_id, len(payload))
            for chunk in iter_chunks(task_id, payload, CHUNK_BYTES):
                msg = site_link_pb2.CoordinatorMessage(
                    task=site_link_pb2.TaskChunk(deadline_unix_ms=int(deadline_unix * 1000),
                                                 chunk=chunk))
                self.outbox.put_nowait(msg)
        try:
            return await asyncio.shield(fut)
        finally:
            if fut.done() or self.pending.get(task_id) is fut:
                # Answered, or the waiter gave up (deadline): nothing more is accepted for it.
                self._forget(task_id)

    def _forget(self, task_id: str) -> None:
        self.pending.pop(task_id, None)
        self.result_limits.pop(task_id, None)
        self.transfers.discard(task_id)

    def add_result_chunk(self, chunk: ProtoChunk) -> bytes | None:
        """Accept one result chunk; return the whole payload when it is complete.

        Chunks of a transfer that does not answer a task pending at this session (late,
        unknown, or forged ids) are dropped without being stored. A transfer that breaks the
        chunking rules or exceeds the task's limit fails that task (the site is reported as
        misbehaving) and is dropped.
        """
        task_id = chunk.transfer_id
        fut = self.pending.get(task_id)
        if fut is None or fut.done():
            return None
        unfinished = [t for t in self.transfers.in_progress() if t != task_id]
        if unfinished:
            # A site writes each answer whole under its stream's write lock: an honest one never
            # interleaves two. So the session holds at most one partial result (within its cap).
            self.fail(task_id, ProtocolError(
                f"a result for {task_id[:80]!r} started while the result for "
                f"{unfinished[0][:80]!r} is unfinished; a site sends one result at a time"))
            return None
        if self.metrics is not None:
            self.metrics.received(self.site_id, len(chunk.data))
        try:
            return self.transfers.add(chunk, self.result_limits.get(task_id, 0))
        except ProtocolError as exc:
            self.transfers.discard(task_id)
            self.fail(task_id, exc)
            return None

    def allow_budget_report(self) -> bool:
        """Rate limit of budget reports (a site sends one per task)."""
        if self.budget_bucket.allow():
            self.budget_accepted += 1
            return True
        self.budget_dropped += 1
        return False

    def resolve(self, task_id: str, outcome: TaskResult | Refusal) -> bool:
        """Deliver a site's answer; False if nobody is waiting for it (late or unknown)."""
        fut = self.pending.get(task_id)
        if fut is None or fut.done():
            return False
        if isinstance(outcome, Refusal) and self.metrics is not None:
            self.metrics.refused(self.site_id, outcome.code)
        fut.set_result(outcome)
        return True

    def fail(self, task_id: str, error: ProtocolError) -> bool:
        """Fail a pending task because the site's answer broke the protocol."""
        fut = self.pending.get(task_id)
        if fut is None or fut.done():
            return False
        fut.set_exception(error)
        fut.exception()  # the waiter re-raises it; never "exception was never retrieved"
        return True

    def update_budget(self, budget: BudgetStatus) -> None:
        """Record a budget update the site sent after a task."""
        self.hello = replace(self.hello, budget=budget)

    def update_row_count(self, row_count: int) -> None:
        """Record the row count a site sends once it has counted (after connecting)."""
        log.info("site=%s rows=%d", self.site_id, row_count)
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
        self.result_limits.clear()
        self.transfers = Reassembler(MAX_TRANSFER_BYTES)


class SiteRegistry:
    """The live sessions, by site id (identity from the certificate)."""

    def __init__(self, metrics: CoordinatorMetrics | None = None) -> None:
        #: This coordinator's metrics; sessions count their transfers and refusals into it.
        self.metrics = metrics if metrics is not None else CoordinatorMetrics()
        self._sessions: dict[str, SiteSession] = {}
        self._changed = asyncio.Condition()

    async def attach(self, site_id: str, hello: SiteHello) -> SiteSession:
        """Register a new stream for ``site_id``, replacing (and closing) an older one."""
        session = SiteSession(site_id, hello, metrics=self.metrics)
        async with self._changed:
            old = self._sessions.get(site_id)
            if old is not None:
                old.close("replaced by a newer connection from the same site")
            self._sessions[site_id] = session
            self._changed.notify_all()
        log.info("site=%s rows=%d", site_id, hello.row_count)
        return session

    async def detach(self, session: SiteSession, reason: str) -> None:
        """Remove a session (if it is still the current one for its site)."""
        session.close(reason)
        async with self._changed:
            if self._sessions.get(session.site_id) is session:
                del self._sessions[session.site_id]
            self._changed.notify_all()
        log.info("site=%s reason=%s", session.site_id, reason)
        if session.budget_dropped:
            log.warning("site=%s sent budget reports too fast: %d "
                        "dropped, %d accepted", session.site_id, session.budget_dropped,
                        session.budget_accepted)

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

    async def wait_for_count(self, n: int, timeout: float,
                             eligible: Callable[[SiteSession], bool] | None = None) -> int:
        """Wait until at least ``n`` sites (``eligible`` ones, if given) are connected.

        Returns how many (eligible) sites are connected when it stops.
        """
        deadline = time.monotonic() + timeout

        def count() -> int:
            return sum(1 for s in self.connected() if eligible is None or eligible(s))

        async with self._changed:
            while count() < n:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    break
            return count()

    def cancel_tasks(self, prefix: str, reason: str) -> int:
        """Tell every site to drop its pending tasks whose id starts with ``prefix``.

        The waiters are left alone (the job that owns them is being cancelled); a site that
        has not started such a task refuses it instead of charging it. Returns how many
        task ids were named.
        """
        told = 0
        for session in self.connected():
            for task_id in [t for t in session.pending if t.startswith(prefix)]:
                session.outbox.put_nowait(site_link_pb2.CoordinatorMessage(
                    cancel=site_link_pb2.CancelTask(task_id=task_id, reason=reason[:500])))
                told += 1
        return told

    def close_all(self, reason: str) -> None:
        """Close every session (coordinator shutdown)."""
        for s in list(self._sessions.values()):
            s.close(reason)
