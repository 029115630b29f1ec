"""The site agent's connection to the coordinator: dial out, serve tasks, reconnect.

The hospital opens no inbound port: the agent dials the coordinator and keeps one
``SiteLink.Connect`` stream open. It sends ``Hello`` (version, schema digest, row count,
policy, budget), then receives task chunks, runs each task on a worker thread (so the stream
keeps flowing while a large Gram matrix is computed), and streams back its updated budget
followed by the released bytes or a refusal.

Connection failures:

* never connected within ``connect_timeout_s`` -> exit ``COORDINATOR_UNREACHABLE`` with the
  last error (a wrong address or CA is not retried silently forever);
* after a first successful connection, any drop (coordinator restart, network) is retried
  for ever with exponential backoff (0.5 s doubling to 30 s) and full jitter;
* the coordinator refusing the site (unknown identity, schema mismatch, protocol version) ->
  exit ``REJECTED_BY_COORDINATOR`` with its message.

The long-lived stream has no deadline by design; liveness is checked by HTTP/2 keepalive
pings (``dpfed.common.transport.grpc_options``), and every task carries its own deadline.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from dpfed.common import exit_codes
from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.pb.v1 import site_link_pb2, site_link_pb2_grpc
from dpfed.common.transport.grpc_errors import tls_hint
from dpfed.common.transport.grpc_options import (
    CHUNK_BYTES,
    DEFAULT_KEEPALIVE_S,
    MAX_TRANSFER_BYTES,
    channel_options,
)
from dpfed.common.transport.protocol import Refusal, RefusalCode, SiteHello, Task
from dpfed.common.transport.wire import (
    Reassembler,
    budget_to_proto,
    hello_to_proto,
    iter_chunks,
    refusal_to_proto,
    task_from_bytes,
)
from dpfed.site_agent.coordinator_check import CoordinatorCheck, CoordinatorRevokedError
from dpfed.site_agent.metrics import SiteMetrics
from dpfed.site_agent.runner import TaskRunner

log = logging.getLogger(__name__)

WELCOME_TIMEOUT_S = 30.0
#: Cancelled task ids remembered (the oldest are forgotten first).
MAX_CANCELLED_IDS = 4096
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
_FATAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.UNIMPLEMENTED)


class _Rejected(Exception):
    """The coordinator refused this site."""


def describe_rpc_error(exc: grpc.aio.AioRpcError) -> str:
    """Explain a connection failure in one line, with a hint for TLS problems."""
    details = exc.details() or ""
    return f"{exc.code().name}: {details}{tls_hint(details)}"


class SiteAgent:
    """Dial the coordinator and serve tasks until stopped.

    Parameters
    ----------
    address : str
        Coordinator ``host:port``.
    credentials : grpc.ChannelCredentials or None
        mTLS credentials (None only in --insecure development mode).
    runner : TaskRunner
        Executes tasks against the site's data and ledger.
    hello : callable
        Returns the current Hello (called at each connection: budget may have changed).
    connect_timeout_s : float
        Give up if the first connection does not succeed within this many seconds.
    server_name : str, optional
        TLS name to verify when the address is not in the coordinator's certificate.
    insecure_principal : str, optional
        ``site/<id>`` sent as metadata in --insecure mode only.
    coordinator_check : CoordinatorCheck, optional
        Refuse a coordinator whose certificate is on the site's revocation list, before each
        connection and while connected (``dpfed.site_agent.coordinator_check``).
    after_connect : callable, optional
        Run on the task thread after each connection, before any task; when it returns
        True the agent sends a fresh Hello on the same stream (the site counts its rows
        this way instead of before connecting: ``dpfed.site_agent.row_count``).
    metrics : SiteMetrics, optional
        Counts connections and answered tasks (``dpfed.site_agent.metrics``).
    """

    def __init__(self, *, address: str, credentials: grpc.ChannelCredentials | None,
                 runner: TaskRunner, hello: Callable[[], SiteHello], connect_timeout_s: float,
                 server_name: str | None = None, insecure_principal: str | None = None,
                 coordinator_check: CoordinatorCheck | None = None,
                 keepalive_s: float = DEFAULT_KEEPALIVE_S,
                 after_connect: Callable[[], bool] | None = None,
                 metrics: SiteMetrics | None = None) -> None:
        self.address = address
        self.credentials = credentials
        self.runner = runner
        self.hello = hello
        self.connect_timeout_s = connect_timeout_s
        self.server_name = server_name
        self.insecure_principal = insecure_principal
        self.coordinator_check = coordinator_check
        self.keepalive_s = keepalive_s
        self.after_connect = after_connect
        self.metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpfed-task")
        self._stop = asyncio.Event()
        self._random = random.Random()
        #: Task ids the coordinator cancelled (its job was cancelled): refused if not started.
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self.connected_once = False
        #: Whether a session is open now (the agent's status file reports it).
        self.connected = False
        self.site_id: str | None = None

    def stop(self) -> None:
        """Ask :meth:`run` to return (after the current stream closes)."""
        self._stop.set()

    def _channel(self) -> grpc.aio.Channel:
        options = channel_options(self.server_name, self.keepalive_s)
        if self.credentials is None:
            return grpc.aio.insecure_channel(self.address, options=options)
        return grpc.aio.secure_channel(self.address, self.credentials, options=options)

    async def run(self) -> int:
        """Serve until stopped; return an exit code from :mod:`dpfed.common.exit_codes`."""
        started = time.monotonic()
        attempt = 0
        last_error = "no attempt yet"
        try:
            while not self._stop.is_set():
                try:
                    await self._session()
                    last_error = "the coordinator closed the stream"
                    attempt = 0
                except _Rejected as exc:
                    log.error("[SiteAgent.run] the coordinator refused this site: %s", exc)
                    return exit_codes.REJECTED_BY_COORDINATOR
                except grpc.aio.AioRpcError as exc:
                    last_error = describe_rpc_error(exc)
                    if exc.code() in _FATAL_CODES:
                        log.error("[SiteAgent.run] the coordinator refused this site: %s",
                                  last_error)
                        return exit_codes.REJECTED_BY_COORDINATOR
                    log.warning("[SiteAgent.run] connection to %s failed: %s", self.address,
                                last_error)
                except CoordinatorRevokedError as exc:
                    # Not fatal: the coordinator may come back with a new certificate.
                    last_error = str(exc)
                    log.error("[SiteAgent.run] %s", exc)
                except (OSError, ssl.SSLError) as exc:  # the revocation check's handshake
                    last_error = f"{type(exc).__name__}: {exc}"
                    log.warning("[SiteAgent.run] connection to %s failed: %s", self.address,
                                last_error)
                except (ProtocolError, TimeoutError) as exc:
                    last_error = f"{type(exc).__name__}: {exc}"
                    log.warning("[SiteAgent.run] session with %s ended: %s", self.address,
                                last_error)
                if self._stop.is_set():
                    break
                if not self.connected_once and (
                        time.monotonic() - started > self.connect_timeout_s):
                    log.error("[SiteAgent.run] could not connect to the coordinator at %s "
                              "within %gs; last error: %s", self.address,
                              self.connect_timeout_s, last_error)
                    return exit_codes.COORDINATOR_UNREACHABLE
                delay = self._random.uniform(0, min(BACKOFF_MAX_S,
                                                    BACKOFF_INITIAL_S * 2 ** attempt))
                attempt += 1
                log.info("[SiteAgent.run] reconnecting in %.1fs (attempt %d)", delay, attempt)
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                except TimeoutError:
                    pass
            return exit_codes.OK
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _session(self) -> None:
        metadata = None
        if self.credentials is None and self.insecure_principal:
            metadata = (("x-dpfed-insecure-principal", self.insecure_principal),)
        coordinator_fp = None
        if self.coordinator_check is not None:
            coordinator_fp = await self.coordinator_check.check(self.address)
        async with self._channel() as channel:
            stub = site_link_pb2_grpc.SiteLinkStub(channel)
            call = stub.Connect(metadata=metadata)
            write_lock = asyncio.Lock()
            await call.write(site_link_pb2.SiteMessage(hello=hello_to_proto(self.hello())))
            first = await asyncio.wait_for(call.read(), WELCOME_TIMEOUT_S)
            if first is grpc.aio.EOF:
                # The server closed without a message: surface its status if it gave one.
                await call.wait_for_connection()
                code = await call.code()
                if code in _FATAL_CODES:
                    raise _Rejected(f"{code.name}: {await call.details()}")
                raise ProtocolError(f"the coordinator closed the stream ({code.name})")
            if first.WhichOneof("body") != "welcome":
                raise ProtocolError("the coordinator's first message was not Welcome")
            self.site_id = first.welcome.site_id
            self.connected_once = self.connected = True
            if self.metrics is not None:
                self.metrics.connected(True)
            log.info("[SiteAgent.session] connected to %s as site %s (coordinator %s)",
                     self.address, self.site_id, first.welcome.coordinator_version)
            reassembler = Reassembler(MAX_TRANSFER_BYTES)
            running: set[asyncio.Future[Any]] = set()
            if self.after_connect is not None:
                # Submitted to the task thread before any task can be: the count runs first,
                # and the fresh Hello is written before any task's answer (the lock is FIFO).
                counting = asyncio.ensure_future(self._after_connect(call, write_lock))
                running.add(counting)
                counting.add_done_callback(running.discard)
            stop_wait = asyncio.ensure_future(self._stop.wait())
            revoked: asyncio.Future[None] = (
                asyncio.ensure_future(self.coordinator_check.wait_until_revoked(coordinator_fp))
                if self.coordinator_check is not None and coordinator_fp is not None
                else asyncio.get_running_loop().create_future())
            try:
                while True:
                    read = asyncio.ensure_future(call.read())
                    done, _ = await asyncio.wait({read, stop_wait, revoked},
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if stop_wait in done:
                        read.cancel()
                        call.cancel()
                        return
                    if revoked in done:
                        read.cancel()
                        call.cancel()
                        assert self.coordinator_check is not None and coordinator_fp
                        self.coordinator_check.refuse_if_revoked(coordinator_fp)
                    msg = read.result()
                    if msg is grpc.aio.EOF:
                        code = await call.code()
                        if code in _FATAL_CODES:
                            raise _Rejected(f"{code.name}: {await call.details()}")
                        log.warning("[SiteAgent.session] stream closed by the coordinator (%s)",
                                    code.name)
                        return
                    which = msg.WhichOneof("body")
                    if which == "task":
                        transfer_id = msg.task.chunk.transfer_id
                        try:
                            payload = reassembler.add(msg.task.chunk)
                        except ProtocolError as exc:
                            # Every task gets an answer: refuse the broken transfer by its id.
                            log.warning("[SiteAgent.session] broken task transfer: %s", exc)
                            payload = None
                            if transfer_id:
                                refuse = asyncio.ensure_future(self._send(call, write_lock, [
                                    _refusal(transfer_id, f"the task's chunks are invalid: "
                                                          f"{exc}")]))
                                running.add(refuse)
                                refuse.add_done_callback(running.discard)
                        if payload is None:
                            continue
                        deadline = msg.task.deadline_unix_ms / 1000.0 or None
                        t = asyncio.ensure_future(
                            self._serve_task(call, write_lock, transfer_id, payload, deadline))
                        running.add(t)
                        t.add_done_callback(running.discard)
                    elif which == "cancel":
                        log.info("[SiteAgent.session] coordinator cancelled task %.80r: %.200s",
                                 msg.cancel.task_id, msg.cancel.reason)
                        self._cancelled[msg.cancel.task_id] = None
                        while len(self._cancelled) > MAX_CANCELLED_IDS:
                            self._cancelled.popitem(last=False)
            finally:
                self.connected = False
                if self.metrics is not None:
                    self.metrics.connected(False)
                stop_wait.cancel()
                revoked.cancel()
                for unfinished in running:
                    unfinished.cancel()

    async def _after_connect(self, call: grpc.aio.StreamStreamCall,
                             write_lock: asyncio.Lock) -> None:
        """Run ``after_connect`` on the task thread; send a fresh Hello if it asks for one."""
        assert self.after_connect is not None
        loop = asyncio.get_running_loop()
        try:
            changed = await loop.run_in_executor(self._executor, self.after_connect)
        except Exception as exc:  # a data error here is the first task's to report
            log.error("[SiteAgent.session] could not count the site's rows: %s", exc)
            return
        if not changed:
            return
        hello = self.hello()
        try:
            async with write_lock:
                await call.write(site_link_pb2.SiteMessage(hello=hello_to_proto(hello)))
            log.info("[SiteAgent.session] told the coordinator the row count (%d)",
                     hello.row_count)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.warning("[SiteAgent.session] could not send the row count (sent again at the "
                        "next connection): %s", exc)

    async def _serve_task(self, call: grpc.aio.StreamStreamCall, write_lock: asyncio.Lock,
                          transfer_id: str, payload: bytes, deadline: float | None) -> None:
        """Run one task and send its answer -- a result or a refusal, whatever the task held.

        The answer is written as soon as the ledger committed it, right after the site's
        budget report (read on its own thread, so a result never waits behind queued tasks).
        """
        try:
            task = task_from_bytes(payload)
        except ValidationError as exc:  # e.g. a delta no mechanism can be calibrated to
            log.warning("[SiteAgent.task] invalid task %.80r: %s", transfer_id, exc)
            await self._send(call, write_lock, [_refusal(transfer_id, str(exc)[:500])])
            return
        except Exception as exc:  # noqa: BLE001 -- any decoding failure is refused, not dropped
            log.warning("[SiteAgent.task] undecodable task %.80r: %s", transfer_id, exc)
            await self._send(call, write_lock, [_refusal(
                transfer_id, f"the task cannot be decoded: {str(exc)[:500]}")])
            return
        loop = asyncio.get_running_loop()
        outcome = await loop.run_in_executor(self._executor, self._run_unless_cancelled, task,
                                             deadline)
        if self.metrics is not None:
            self.metrics.task(task.kind, len(payload), outcome)
        # The budget report goes first, in the same locked write as the answer: the
        # coordinator reads the stream in order, so when a job's last answer arrives every
        # site's reported budget already counts it (`dpfed budgets` right after a job is exact).
        budget = await asyncio.to_thread(self.runner.ledger.status)
        messages = [site_link_pb2.SiteMessage(budget=budget_to_proto(budget))]
        if isinstance(outcome, Refusal):
            messages.append(site_link_pb2.SiteMessage(refusal=refusal_to_proto(outcome)))
        else:
            messages.extend(site_link_pb2.SiteMessage(result_chunk=c)
                            for c in iter_chunks(task.task_id, outcome, CHUNK_BYTES))
        if not await self._send(call, write_lock, messages):
            # The stream dropped after the ledger committed: the charge and bytes are stored,
            # so the coordinator's resend of the same task id is answered by replay.
            log.warning("[SiteAgent.task] could not send the answer to %.80r (stored in the "
                        "ledger, will be replayed on resend)", task.task_id)

    def _run_unless_cancelled(self, task: Task, deadline: float | None) -> bytes | Refusal:
        """Run ``task`` on the task thread, unless its job was cancelled while it queued."""
        if task.task_id in self._cancelled:
            log.info("[SiteAgent.task] %.80r was cancelled before it started: not run, nothing "
                     "charged", task.task_id)
            return Refusal(task.task_id, RefusalCode.CANCELLED, "the coordinator cancelled this "
                           "task's job before the task started; nothing was charged")
        return self.runner.run(task, deadline)

    @staticmethod
    async def _send(call: grpc.aio.StreamStreamCall, write_lock: asyncio.Lock,
                    messages: list[site_link_pb2.SiteMessage]) -> bool:
        """Write messages in order under the stream's write lock; False if the stream is gone."""
        try:
            async with write_lock:
                for m in messages:
                    await call.write(m)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.warning("[SiteAgent.send] the stream is gone: %s", exc)
            return False
        return True


def _refusal(task_id: str, reason: str) -> site_link_pb2.SiteMessage:
    return site_link_pb2.SiteMessage(
        refusal=refusal_to_proto(Refusal(task_id, RefusalCode.INVALID, reason)))
