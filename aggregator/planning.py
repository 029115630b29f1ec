"""Decode and validate analysts' job specs in worker processes, bounded in memory and time.

An analyst's request is the one input the coordinator cannot size in advance: a 16 MiB
``JobSpec`` decodes to hundreds of megabytes of Python objects, and validating it (query sets,
workloads) can be CPU-heavy. So the coordinator never does either itself: :class:`Planner`
hands the serialized message to one of ``workers`` long-lived worker processes (forked from a
``forkserver`` that has the job types imported), each with an address-space limit
(``RLIMIT_AS``: what it started with plus ``memory_bytes``) and a wall-clock ``timeout_s``. A
request that exceeds either, or kills its worker (even a crash inside a native library), is
refused with a ValidationError naming the limit; the worker is replaced. The coordinator's
event loop only waits, so other callers are answered meanwhile, and its own memory does not
grow with what analysts send. Request shapes are also bounded before anything is built
(:mod:`dpfed.common.queries`), so the limits here are a second line, not the first.
:func:`validate_job_spec` is every check of a request, as a worker runs it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import resource
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from dpfed.aggregator.config import MAX_DEADLINE_S, MAX_SITES
from dpfed.aggregator.federation import Federation
from dpfed.common.errors import DpfedError, ValidationError
from dpfed.common.jobs.registry import JOB_KINDS, job_kind
from dpfed.common.jobs.results import check_finite_values
from dpfed.common.transport.identity import check_principal_id
from dpfed.common.transport.protocol import JobSpec
from dpfed.common.validation import (
    MIN_DELTA,
    check_delta,
    check_epsilon,
    check_int,
    check_nonnegative,
)

log = logging.getLogger(__name__)

#: Worker processes (requests planned at once; more wait their turn).
PLANNING_WORKERS = 2
#: Longest a request may take to decode and validate.
PLAN_TIMEOUT_S = 60.0
#: Memory a worker may allocate beyond what it holds when it starts.
PLAN_MEMORY_BYTES = 2 << 30
#: Bytes of serialized requests that may wait for (or be in) a worker; more are refused.
MAX_WAITING_BYTES = 256 << 20

_CONTEXT = multiprocessing.get_context("forkserver")
# The fork server imports this module and the in-tree kinds' modules once; every worker is
# forked from it (no re-import, and never a fork of the coordinator's own threads). Never
# ``__main__``.
_CONTEXT.set_forkserver_preload(["dpfed.aggregator.planning",
                                 *(entry.module for entry in JOB_KINDS.values())])


def validate_job_spec(spec: JobSpec, federation: Federation) -> JobSpec:
    """Return the spec with canonical parameters (raises ValidationError).

    Every value an analyst sends is checked here, so a bad one is INVALID_ARGUMENT with
    its name, never an internal error later (docs/hardening.md). The coordinator runs this
    in a planning worker process (:class:`Planner`), never on its event loop.
    """
    kind = job_kind(spec.kind)
    check_epsilon(spec.epsilon)
    if not (spec.delta == 0.0 and kind.pure_epsilon):
        check_delta(spec.delta)
        if spec.delta < MIN_DELTA:
            raise ValidationError(f"delta must be >= {MIN_DELTA:g} (smaller values cannot be "
                                  f"calibrated in double precision), got {spec.delta!r}")
    check_int(spec.min_sites, "min_sites", minimum=0, maximum=MAX_SITES)
    check_nonnegative(spec.deadline_seconds, "deadline_seconds")
    if spec.deadline_seconds > MAX_DEADLINE_S:
        raise ValidationError(f"deadline_seconds must be <= {MAX_DEADLINE_S:g} (30 days), "
                              f"got {spec.deadline_seconds!r}")
    if len(spec.sites) > MAX_SITES or any(not s or len(s) > 200 for s in spec.sites):
        raise ValidationError(f"sites must list at most {MAX_SITES} site ids of 1 to 200 "
                              "characters")
    if spec.study:
        check_principal_id(spec.study, "study")
    for key, value in spec.params.items():
        try:
            check_finite_values(value, f"params.{key}")
        except ValueError as exc:
            raise ValidationError(f"{spec.kind} parameter {exc}; parameters must be "
                                  "finite JSON numbers, strings, booleans or lists") from None
    try:
        params = kind.canonical(spec.params, spec.epsilon, spec.delta, federation.schema)
    except DpfedError:
        raise
    except (ArithmeticError, ValueError) as exc:
        raise ValidationError(f"{spec.kind} job with epsilon={spec.epsilon!r}, "
                              f"delta={spec.delta!r}: the noise cannot be calibrated "
                              f"({type(exc).__name__}: {exc})") from None
    return JobSpec(spec.kind, spec.epsilon, spec.delta, params, spec.min_sites,
                   spec.deadline_seconds, spec.sites, spec.study)


def _address_space() -> int:
    """Return this process's virtual memory size in bytes (from /proc; 0 if unknown)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _serve(conn: Connection, federation: Federation, memory_bytes: int) -> None:
    """Worker loop: decode and validate one serialized JobSpec per message."""
    from dpfed.common.pb.v1 import analyst_pb2
    from dpfed.common.transport.wire import job_spec_from_proto

    current = _address_space()
    if current:  # without /proc the limit cannot be placed above what the worker holds
        resource.setrlimit(resource.RLIMIT_AS, (current + memory_bytes,) * 2)
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        reply: tuple[str, Any]
        too_big = ValidationError(f"the request needs more than {memory_bytes / 2**30:g} GiB "
                                  "to validate; it is refused (make it smaller)")
        try:
            msg = analyst_pb2.JobSpec.FromString(data)
            reply = ("ok", validate_job_spec(job_spec_from_proto(msg), federation))
        except MemoryError:
            reply = ("error", too_big)
        except DpfedError as exc:
            reply = ("error", exc)
        except Exception as exc:  # noqa: BLE001 -- a malformed message, reported as such
            # protobuf reports an allocation refused by the limit as a decode error
            reply = ("error", too_big if "alloc failed" in str(exc) else ValidationError(
                f"the job spec cannot be decoded: {type(exc).__name__}: {str(exc)[:300]}"))
        try:
            conn.send(reply)
        except Exception:  # noqa: BLE001 -- e.g. an error that does not pickle
            conn.send(("error", ValidationError(str(reply[1])[:2000])))


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection

    def close(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)


class Planner:
    """Decode and validate serialized job specs in bounded worker processes.

    Parameters
    ----------
    federation : Federation
        What the job types validate against (sent to each worker once).
    workers, timeout_s, memory_bytes, max_waiting_bytes
        See the module constants.
    """

    def __init__(self, federation: Federation, *, workers: int = PLANNING_WORKERS,
                 timeout_s: float = PLAN_TIMEOUT_S, memory_bytes: int = PLAN_MEMORY_BYTES,
                 max_waiting_bytes: int = MAX_WAITING_BYTES) -> None:
        self.federation = federation
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.max_waiting_bytes = max_waiting_bytes
        self.workers = workers
        self._slots = asyncio.Semaphore(workers)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._waiting = 0
        self._closed = False

    def warm_up(self) -> None:
        """Start the workers now (blocking: call it on a thread), so no request waits for them."""
        started = []
        with self._lock:
            missing = self.workers - len(self._idle)
        for _ in range(missing):
            started.append(self._start_worker())
        with self._lock:
            if self._closed:
                for worker in started:
                    worker.close()
            else:
                self._idle.extend(started)

    def _start_worker(self) -> _Worker:
        parent, child = _CONTEXT.Pipe()
        process = _CONTEXT.Process(target=_serve, args=(child, self.federation,
                                                        self.memory_bytes),
                                   name="dpfed-planner", daemon=True)
        process.start()
        child.close()
        return _Worker(process, parent)

    async def plan(self, spec_bytes: bytes) -> JobSpec:
        """Return the canonical, validated spec of a serialized ``JobSpec`` message.

        Raises
        ------
        ValidationError
            The spec is invalid, or deciding it exceeded the time or memory limit, or the
            coordinator is already planning too many requests.
        """
        size = len(spec_bytes)
        if self._waiting and self._waiting + size > self.max_waiting_bytes:
            raise ValidationError(f"the coordinator is already checking "
                                  f"{self._waiting / 2**20:.0f} MiB of submitted jobs; retry in "
                                  "a moment")
        self._waiting += size
        try:
            async with self._slots:
                return await asyncio.to_thread(self._plan_blocking, spec_bytes)
        finally:
            self._waiting -= size

    def _plan_blocking(self, spec_bytes: bytes) -> JobSpec:
        if self._closed:
            raise ValidationError("the coordinator is shutting down")
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = self._start_worker()
        ok = False
        try:
            worker.conn.send_bytes(spec_bytes)
            deadline = time.monotonic() + self.timeout_s
            while not worker.conn.poll(0.05):  # a dead worker's pipe polls ready (EOF)
                if time.monotonic() > deadline:
                    log.warning("[Planner] a %d-byte request took more than %gs; its worker "
                                "is stopped", len(spec_bytes), self.timeout_s)
                    raise ValidationError(f"checking this request took longer than "
                                          f"{self.timeout_s:g}s; it is refused (make it "
                                          "smaller)")
            status, value = worker.conn.recv()
            ok = True
        except (EOFError, OSError):
            worker.process.join(5)
            log.error("[Planner] a planning worker died (exit code %s) on a %d-byte request",
                      worker.process.exitcode, len(spec_bytes))
            raise ValidationError("checking this request crashed its worker process (exit "
                                  f"code {worker.process.exitcode}); it is refused") from None
        finally:
            if ok and not self._closed:
                with self._lock:
                    self._idle.append(worker)
            else:
                worker.close()
        if status == "ok" and isinstance(value, JobSpec):
            return value
        error = value if isinstance(value, DpfedError) else ValidationError(str(value)[:2000])
        try:
            raise error
        finally:  # no cycle error -> traceback -> this frame -> error (it holds the request)
            del error, value, spec_bytes

    def close(self) -> None:
        """Stop the idle workers (a busy one stops when its request ends)."""
        self._closed = True
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()
