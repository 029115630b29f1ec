"""Run jobs: validate, persist, execute the job type, stream progress, store results.

Progress events are written to the store and pushed to live subscribers in one synchronous
step on the event loop, so a subscriber that replays the stored events and then follows live
ones never misses or duplicates an event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from dpfed.aggregator.federation import Federation
from dpfed.aggregator.jobs.job import Job, JobOutput
from dpfed.aggregator.planning import Planner, validate_job_spec
from dpfed.aggregator.registry import SiteRegistry
from dpfed.aggregator.result_file import encode_result
from dpfed.aggregator.store import JobStore, utc_now
from dpfed.common.errors import DpfedError, ProtocolError, QuorumError, ValidationError
from dpfed.common.jobs.contract import resolve
from dpfed.common.jobs.eligibility import connected_facts
from dpfed.common.jobs.registry import job_kind
from dpfed.common.jobs.results import check_finite_values
from dpfed.common.transport.protocol import JobEvent, JobInfo, JobSpec, JobState

# The stage of a job's last event, by its final state.
_FINAL_STAGE = {JobState.SUCCEEDED: "done", JobState.FAILED: "failed",
                JobState.CANCELLED: "cancelled"}

log = logging.getLogger(__name__)


def analyst_id_of(submitted_by: str) -> str:
    """Return the analyst id in a job's ``submitted_by`` (``analyst/<id>``), else "".

    ``submitted_by`` is the principal of the analyst's verified certificate, so the id that
    travels with every task of the job is the coordinator's attribution, not the analyst's
    claim.
    """
    role, sep, name = submitted_by.partition("/")
    return name if sep and role == "analyst" else ""

#: How long CancelJob waits for the job's coroutine to unwind before recording it anyway.
CANCEL_WAIT_S = 10.0
#: Longest request id (the other bounds of a request: ``planning.validate_job_spec``).
MAX_REQUEST_ID = 200


def _sorted(outcomes: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(outcomes[s] for s in sorted(outcomes))


def _non_finite(output: JobOutput) -> str:
    """Describe the first non-finite value in a job's output ("" when all are finite)."""
    for name, array in output.arrays.items():
        a = np.asarray(array)
        if a.dtype.kind in "fc" and not np.all(np.isfinite(a)):
            return f"array {name!r} holds NaN or infinite values"
    for what, value in (("summary", output.summary), ("metadata", output.metadata)):
        try:
            check_finite_values(dict(value), what)
        except ValueError as exc:
            return str(exc)
    return ""


class JobManager:
    """Owns running jobs and their subscribers."""

    def __init__(self, store: JobStore, registry: SiteRegistry, federation: Federation,
                 planner: Planner | None = None) -> None:
        self.store = store
        self.registry = registry
        self.federation = federation
        #: Decodes and validates submitted specs in worker processes (never on the loop).
        self.planner = planner or Planner(federation)
        self._running: dict[str, asyncio.Task[None]] = {}
        self._subscribers: dict[str, set[asyncio.Queue[JobEvent]]] = {}
        #: Jobs being cancelled by an analyst -> the reason (vs. cancelled by shutdown).
        self._cancelling: dict[str, str] = {}

    # ------------------------------------------------------------------ submission
    def validate(self, spec: JobSpec) -> JobSpec:
        """Return the spec with canonical parameters (raises ValidationError)."""
        return validate_job_spec(spec, self.federation)

    async def submit(self, spec_bytes: bytes, *, submitted_by: str,
                     request_id: str = "") -> JobInfo:
        """Validate, persist and start a job (an already-seen request id returns its job).

        ``spec_bytes`` is the analyst's serialized ``JobSpec`` message: the planner decodes
        and validates it in a worker process, bounded in time and memory, so other callers
        are answered while a large request is checked.

        Raises
        ------
        ValidationError
            For an invalid spec or request id.
        IdempotencyConflictError
            When ``request_id`` was already used for a different job spec.
        """
        if len(request_id) > MAX_REQUEST_ID:
            raise ValidationError(f"request_id must be at most {MAX_REQUEST_ID} characters, "
                                  f"got {len(request_id)}")
        canonical = self._settled(await self.planner.plan(spec_bytes))
        job, created = await asyncio.to_thread(  # encodes the spec and commits: off the loop
            lambda: self.store.create_job(canonical, submitted_by=submitted_by,
                                          request_id=request_id))
        if created:
            log.info("job=%s kind=%s by=%s epsilon=%g delta=%g", job.job_id,
                     canonical.kind, submitted_by, canonical.epsilon, canonical.delta)
            self._emit(job.job_id, "submitted",
                       f"{canonical.kind} job submitted by {submitted_by}", 0.0,
                       JobState.PENDING)
            self._start(job, resumed=False)
        return job

    def _settled(self, spec: JobSpec) -> JobSpec:
        """Return ``spec`` with what its kind decides from the connected sites' public facts.

        E.g. a pca job's budget split from their row counts (:meth:`JobKind.settle`); the
        settled parameters are stored, so a resumed job runs with exactly them.
        """
        kind = job_kind(spec.kind)
        if not kind.params.settles:
            return spec
        facts = connected_facts([(s.site_id, s.hello, s.hello.row_count)
                                 for s in self.registry.connected()], spec.kind, spec.sites)
        params = kind.settle(spec.params, spec.epsilon, spec.delta, self.federation.schema,
                             facts)
        return dataclasses.replace(spec, params=params)

    def _start(self, job: JobInfo, *, resumed: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._run(job, resumed))
        self._running[job.job_id] = task
        task.add_done_callback(lambda _t: self._running.pop(job.job_id, None))

    async def resume_unfinished(self) -> int:
        """Restart jobs a previous coordinator process left unfinished; return how many."""
        jobs = self.store.unfinished_jobs()
        for job in jobs:
            log.info("resuming job=%s (same task ids: sites replay)",
                     job.job_id)
            self._emit(job.job_id, "resumed", "coordinator restarted; resuming the job", 0.0,
                       JobState.PENDING)
            self._start(job, resumed=True)
        return len(jobs)

    async def cancel(self, job_id: str, reason: str) -> JobInfo:
        """Cancel an unfinished job; return its final state (a finished job is returned as is).

        The job's coroutine is cancelled: it dispatches nothing more, its outstanding tasks
        are abandoned (the sites are told, and a site that has not started one refuses it;
        whatever a site already charged stays charged), and it ends in state ``cancelled``
        with ``reason`` as its error. It is not resumed after a restart.
        """
        job = self.store.get_job(job_id)
        if JobState(job.state).finished:
            return job
        told = self.registry.cancel_tasks(f"{job_id}/", reason)
        log.info("job=%s: %s (%d outstanding task(s) abandoned)", job_id,
                 reason, told)
        task = self._running.get(job_id)
        if task is not None and not task.done():
            self._cancelling[job_id] = reason
            task.cancel()
            await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
            self._cancelling.pop(job_id, None)
        job = self.store.get_job(job_id)
        if not JobState(job.state).finished:  # not running here, or it did not unwind in time
            self._record_cancelled(job_id, reason, None)
        return self.store.get_job(job_id)

    def _record_cancelled(self, job_id: str, reason: str,
                          sites: tuple[Any, ...] | None) -> None:
        log.warning("job=%s outcome=cancelled: %s", job_id, reason)
        self.store.update_job(job_id, state=JobState.CANCELLED, error=reason, sites=sites)
        self._emit(job_id, "cancelled", reason, 1.0, JobState.CANCELLED)

    async def shutdown(self) -> None:
        """Cancel running jobs; they stay 'running' in the store and resume at next start."""
        tasks = list(self._running.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.planner.close()

    # ------------------------------------------------------------------ execution
    async def _run(self, job: JobInfo, resumed: bool) -> None:
        job_id = job.job_id
        self.store.update_job(job_id, state=JobState.RUNNING)
        self._emit(job_id, "running", "job started", 0.01, JobState.RUNNING)
        outcomes: dict[str, Any] = {}
        try:
            kind = job_kind(job.spec.kind)
            params = await asyncio.to_thread(kind.parse, job.spec.params, self.federation.schema)
            ctx = Job(job_id=job_id, spec=job.spec, kind=kind, params=params,
                      federation=self.federation, registry=self.registry,
                      emit=lambda stage, msg, p: self._emit(job_id, stage, msg, p,
                                                            JobState.RUNNING),
                      wait_for_quorum_s=self.federation.resume_wait_s if resumed else 0.0,
                      resumed=resumed, analyst_id=analyst_id_of(job.submitted_by),
                      earlier_outcomes=job.sites if resumed else (),
                      save_outcomes=lambda sites: self.store.update_job(job_id, sites=sites))
            outcomes = ctx.outcomes
            output = await resolve(kind.run)(ctx)
            problem = _non_finite(output)
            if problem:
                self._fail(job_id, outcomes, f"the job's output is not finite ({problem}); "
                           "nothing was stored")
                return
            data = await asyncio.to_thread(encode_result, output.arrays, output.metadata)
            await asyncio.to_thread(self.store.save_result, job_id, data)
            self.store.update_job(job_id, state=JobState.SUCCEEDED,
                                  sites=_sorted(outcomes), summary=dict(output.summary))
            log.info("job=%s outcome=succeeded result=%d bytes", job_id, len(data))
            self._emit(job_id, "done", f"job succeeded; result {len(data)} bytes", 1.0,
                       JobState.SUCCEEDED)
        except asyncio.CancelledError:
            reason = self._cancelling.pop(job_id, None)
            if reason is None:  # shutdown: the job stays unfinished and resumes at next start
                self.store.update_job(job_id, sites=_sorted(outcomes))
                raise
            self._record_cancelled(job_id, reason, _sorted(outcomes))
        except (QuorumError, ValidationError, ProtocolError, DpfedError) as exc:
            self._fail(job_id, outcomes, str(exc))
        except Exception:
            log.exception("job=%s crashed", job_id)
            self._fail(job_id, outcomes, "internal error in the coordinator (see its log)")

    def _fail(self, job_id: str, outcomes: dict[str, Any], reason: str) -> None:
        log.warning("job=%s outcome=failed: %s", job_id, reason)
        self.store.update_job(job_id, state=JobState.FAILED, error=reason,
                              sites=_sorted(outcomes))
        self._emit(job_id, "failed", reason, 1.0, JobState.FAILED)

    # ------------------------------------------------------------------ events
    def _emit(self, job_id: str, stage: str, message: str, progress: float,
              state: JobState) -> None:
        event = JobEvent(job_id, utc_now(), stage, message, max(0.0, min(1.0, progress)), state)
        self.store.add_event(event)
        if state.finished:
            event = JobEvent(event.job_id, event.time, event.stage, event.message,
                             event.progress, event.state, self.store.get_job(job_id))
        for q in self._subscribers.get(job_id, ()):
            q.put_nowait(event)

    async def follow(self, job_id: str) -> AsyncIterator[JobEvent]:
        """Replay a job's events so far, then follow live ones until it finishes.

        The last event always carries the final :class:`JobInfo`.
        """
        job = self.store.get_job(job_id)  # NotFoundError for unknown ids
        queue: asyncio.Queue[JobEvent] = asyncio.Queue()
        # Register and replay without awaiting in between: no event can slip through.
        self._subscribers.setdefault(job_id, set()).add(queue)
        past = self.store.events(job_id)
        try:
            for event in past:
                if JobState(event.state).finished:
                    yield JobEvent(event.job_id, event.time, event.stage, event.message,
                                   event.progress, event.state, self.store.get_job(job_id))
                    return
                yield event
            if JobState(job.state).finished:
                # Killed between storing the final state and its event: the stored job is
                # the truth, so the stream still ends with it.
                state = JobState(job.state)
                yield JobEvent(job_id, job.updated, _FINAL_STAGE[state], job.error, 1.0,
                               state, job)
                return
            while True:
                event = await queue.get()
                yield event
                if JobState(event.state).finished:
                    return
        finally:
            subs = self._subscribers.get(job_id)
            if subs is not None:
                subs.discard(queue)
                if not subs:
                    self._subscribers.pop(job_id, None)
