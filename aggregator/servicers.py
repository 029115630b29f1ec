"""gRPC servicers of the coordinator: thin -- authenticate, decode, call, encode.

Identity comes only from the verified client certificate (``context.auth_context()``); a
site certificate cannot call analyst methods and vice versa. What an analyst may do with a
job -- watch, fetch, list, cancel, continue its SVT session -- is decided by
:class:`dpfed.aggregator.access_control.JobAccess`: its own jobs, unless the coordinator's
``[access]`` grants more; another analyst's job answers NOT_FOUND like an unknown id. Errors
are mapped to status codes in one place (``dpfed.common.transport.grpc_errors``) and status
messages never carry data values.

A job runs on the coordinator whether or not its submitter is still listening: a client
whose ``SubmitJob`` stream ends (killed, network lost) leaves the job running, to be followed
again with ``WatchJob`` and fetched with ``FetchResult``; ``CancelJob`` is how to stop it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from dpfed import __version__
from dpfed.aggregator.access_control import AccessControl, JobAccess
from dpfed.aggregator.federation import Federation
from dpfed.aggregator.orchestrator import JobManager
from dpfed.aggregator.registry import SiteRegistry, SiteSession
from dpfed.aggregator.store import JobStore
from dpfed.common.errors import (
    AuthenticationError,
    DpfedError,
    PermissionDeniedError,
    ProtocolError,
)
from dpfed.common.pb.v1 import analyst_pb2, analyst_pb2_grpc, site_link_pb2, site_link_pb2_grpc
from dpfed.common.transport.grpc_errors import details_for, status_for
from dpfed.common.transport.grpc_options import CHUNK_BYTES
from dpfed.common.transport.identity import Principal
from dpfed.common.transport.protocol import (
    PROTOCOL_VERSION,
    JobInfo,
    Refusal,
    SiteHello,
    SiteInfo,
)
from dpfed.common.transport.tls import (
    peer_fingerprint,
    principal_from_auth_context,
    require_role,
)
from dpfed.common.transport.wire import (
    budget_from_proto,
    budget_to_proto,
    hello_from_proto,
    iter_chunks,
    job_event_to_proto,
    job_info_to_proto,
    refusal_from_proto,
    result_from_bytes,
    site_info_to_proto,
)

log = logging.getLogger(__name__)

#: How long a newly connected site has to send its Hello.
HELLO_TIMEOUT_S = 30.0
#: Longest refusal reason kept from a site (the rest is cut; the code is an enum).
MAX_REFUSAL_REASON = 2000
#: Metadata key naming the caller in --insecure mode only (development; never with TLS).
INSECURE_PRINCIPAL_KEY = "x-dpfed-insecure-principal"
#: Longest cancellation reason kept from an analyst.
MAX_CANCEL_REASON = 500


class Authenticator:
    """Turns a call's context into a :class:`Principal` (certificate only, unless insecure).

    With an :class:`AccessControl`, :meth:`require` also refuses revoked certificates and
    ids that are not on the allow-list of their role (PERMISSION_DENIED).
    """

    def __init__(self, *, insecure: bool = False, access: AccessControl | None = None) -> None:
        self.insecure = insecure
        self.access = access

    def principal(self, context: grpc.aio.ServicerContext) -> Principal:
        """Return the authenticated caller (raises AuthenticationError)."""
        if self.insecure:
            for key, value in context.invocation_metadata() or ():
                if key == INSECURE_PRINCIPAL_KEY:
                    role, _, name = str(value).partition("/")
                    return Principal(role, name)  # type: ignore[arg-type]
            raise AuthenticationError(f"insecure mode: send metadata {INSECURE_PRINCIPAL_KEY}")
        return principal_from_auth_context(context.auth_context())

    def fingerprint(self, context: grpc.aio.ServicerContext) -> str | None:
        """SHA-256 fingerprint of the caller's certificate (None in insecure mode)."""
        return None if self.insecure else peer_fingerprint(context.auth_context())

    async def require(self, context: grpc.aio.ServicerContext, role: str) -> Principal:
        """Authenticate and check the role and admission, aborting the call if refused."""
        try:
            principal = require_role(self.principal(context), role)  # type: ignore[arg-type]
            if self.access is not None:
                refusal = self.access.check(principal, self.fingerprint(context))
                if refusal is not None:
                    raise PermissionDeniedError(refusal)
            return principal
        except (AuthenticationError, PermissionDeniedError) as exc:
            log.warning("[Auth] %s: %s (peer %s)", type(exc).__name__, exc, context.peer())
            await context.abort(status_for(exc), details_for(exc))
            raise AssertionError("unreachable") from None


def _welcome(site_id: str) -> site_link_pb2.Welcome:
    return site_link_pb2.Welcome(coordinator_version=__version__,
                                 protocol_version=PROTOCOL_VERSION, site_id=site_id)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if not isinstance(exc, DpfedError):
        log.exception("[Servicer] unexpected error", exc_info=exc)
    await context.abort(status_for(exc), details_for(exc))


class SiteLinkServicer(site_link_pb2_grpc.SiteLinkServicer):
    """The long-lived stream each site dials (``SiteLink.Connect``)."""

    def __init__(self, registry: SiteRegistry, store: JobStore, federation: Federation,
                 auth: Authenticator) -> None:
        self.registry = registry
        self.store = store
        self.federation = federation
        self.auth = auth
        # Live streams (by id(session)) and the certificate each was opened with, so that
        # enforce_access can drop a peer that is revoked or removed from the allow-list.
        self._live: dict[int, tuple[SiteSession, Principal, str | None]] = {}
        self._refused: dict[int, str] = {}

    # grpc.aio allows a stream-stream handler to use context.read()/write() and return None;
    # the generated stub types only the iterator style, hence the override ignore.
    async def Connect(self, request_iterator: Any,  # type: ignore[override]  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        """Authenticate the site, check its Hello, then pump tasks down and results up."""
        principal = await self.auth.require(context, "site")  # allow-list and revocation
        site_id = principal.name
        fingerprint = self.auth.fingerprint(context)
        try:
            first = await asyncio.wait_for(context.read(), HELLO_TIMEOUT_S)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no Hello within {HELLO_TIMEOUT_S:g}s")
        if first is grpc.aio.EOF or first.WhichOneof("body") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be Hello")
        hello = await self._accepted_hello(context, site_id, first.hello)
        session = await self.registry.attach(site_id, hello)
        reader: asyncio.Task[None] | None = None
        reason = "stream ended"
        # Everything after attach() is inside try/finally: a site that drops while we record
        # it or write Welcome (the write raises, or the call is cancelled) is detached too.
        self._live[id(session)] = (session, principal, fingerprint)
        try:
            self.store.record_site(site_id, hello)
            await context.write(site_link_pb2.CoordinatorMessage(welcome=_welcome(site_id)))
            reader = asyncio.create_task(self._read_loop(context, session))
            while not session.closed.is_set():
                get = asyncio.ensure_future(session.outbox.get())
                closed = asyncio.ensure_future(session.closed.wait())
                done, _ = await asyncio.wait({get, closed, reader},
                                             return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    closed.cancel()
                    await context.write(get.result())
                    continue
                get.cancel()
                closed.cancel()
                if reader in done:
                    err = reader.exception()
                    reason = f"read error: {err}" if err else "the site closed the stream"
                break
            refusal = self._refused.pop(id(session), None)
            if refusal is not None:  # dropped by enforce_access: tell the site why
                reason = refusal
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        except asyncio.CancelledError:
            reason = "the call was cancelled (the site went away)"
            raise
        finally:
            self._live.pop(id(session), None)
            self._refused.pop(id(session), None)
            if reader is not None:
                reader.cancel()
            await self.registry.detach(session, reason)

    async def _accepted_hello(self, context: grpc.aio.ServicerContext, site_id: str,
                              msg: site_link_pb2.Hello) -> SiteHello:
        """Decode a Hello and check what Connect requires of it, aborting the call if not."""
        try:
            hello = hello_from_proto(msg)
        except ProtocolError as exc:
            await _abort(context, exc)
        if hello.protocol_version != PROTOCOL_VERSION:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"protocol version {hello.protocol_version} is not supported; "
                                f"the coordinator speaks {PROTOCOL_VERSION}")
        if hello.schema_digest != self.federation.schema_digest:
            log.warning("[SiteLink] site=%s schema mismatch", site_id)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"schema mismatch: the site's schema digest is "
                                f"{hello.schema_digest[:12]}..., the federation's is "
                                f"{self.federation.schema_digest[:12]}...; "
                                "every site must use the federation's schema.toml")
        return hello

    async def Preflight(self, request: site_link_pb2.Hello,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> site_link_pb2.Welcome:
        """Answer as Connect would to this Hello, registering nothing (``dpfed-site check``)."""
        principal = await self.auth.require(context, "site")  # allow-list and revocation
        await self._accepted_hello(context, principal.name, request)
        return _welcome(principal.name)

    def enforce_access(self) -> int:
        """Close the live sessions the access rules now refuse; return how many were closed.

        Called when the access file changed (a revocation, an id removed from the
        allow-list): the site's stream ends with PERMISSION_DENIED and its pending tasks fail
        at once, as if it had disconnected.
        """
        access = self.auth.access
        if access is None:
            return 0
        closed = 0
        for session, principal, fingerprint in list(self._live.values()):
            refusal = access.check(principal, fingerprint)
            if refusal is not None and not session.closed.is_set():
                log.warning("[SiteLink.enforce_access] dropping site=%s: %s", session.site_id,
                            refusal)
                self._refused[id(session)] = refusal
                session.close(refusal)
                closed += 1
        return closed

    async def _read_loop(self, context: grpc.aio.ServicerContext, session: SiteSession) -> None:
        """Read the site's messages; hold nothing the session did not ask for."""
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return
            which = msg.WhichOneof("body")
            if which == "result_chunk":
                task_id = msg.result_chunk.transfer_id
                payload = session.add_result_chunk(msg.result_chunk)
                if payload is None:
                    continue
                try:
                    result = result_from_bytes(payload)
                    if result.task_id != task_id:
                        raise ProtocolError(f"a result for task {result.task_id[:80]!r} "
                                            f"arrived in the transfer of {task_id!r}")
                except ProtocolError as exc:
                    log.warning("[SiteLink] site=%s sent an undecodable result for %s: %s",
                                session.site_id, task_id, exc)
                    session.fail(task_id, exc)
                    continue
                session.resolve(task_id, result)
            elif which == "refusal":
                refusal = refusal_from_proto(msg.refusal)
                session.resolve(refusal.task_id, Refusal(
                    refusal.task_id, refusal.code, refusal.reason[:MAX_REFUSAL_REASON]))
            elif which == "budget":
                # The latest report is always what `dpfed budgets` shows (held in memory);
                # the rate limit bounds only the durable store writes a site can cause.
                budget = budget_from_proto(msg.budget)
                if budget is None:
                    continue
                session.update_budget(budget)
                if session.allow_budget_report():
                    self.store.record_site(session.site_id, session.hello)
                else:
                    log.debug("[SiteLink] site=%s budget report not stored (rate limit)",
                              session.site_id)
            elif which == "hello":
                # A site connects before counting its rows (row_count 0) and sends Hello
                # again once counted; only the row count may change on the same stream.
                again = hello_from_proto(msg.hello)
                if again.schema_digest != session.hello.schema_digest or (
                        again.protocol_version != session.hello.protocol_version):
                    raise ProtocolError("a repeated Hello may only update the row count")
                session.update_row_count(again.row_count)
                self.store.record_site(session.site_id, session.hello)
            else:
                raise ProtocolError(f"unexpected message {which!r} after Hello")


class AnalystServicer(analyst_pb2_grpc.AnalystServicer):
    """Sites, budgets, jobs and results for authenticated analysts."""

    def __init__(self, registry: SiteRegistry, store: JobStore, jobs: JobManager,
                 federation: Federation, auth: Authenticator,
                 job_access: JobAccess | None = None) -> None:
        self.registry = registry
        self.store = store
        self.jobs = jobs
        self.federation = federation
        self.auth = auth
        self.job_access = job_access or JobAccess()

    def _readable_job(self, principal: Principal, job_id: str) -> JobInfo:
        """Return the job if ``principal`` may read it (else NotFoundError, as for no job)."""
        return self.job_access.readable(principal, self.store.get_job(job_id))

    def _site_infos(self, include_disconnected: bool) -> list[SiteInfo]:
        live = {s.site_id: s for s in self.registry.connected()}
        infos = []
        for site_id, first, last, hello in self.store.known_sites():
            session = live.get(site_id)
            if session is None and not include_disconnected:
                continue
            h = session.hello if session is not None else hello
            infos.append(SiteInfo(site_id, session is not None, h.row_count, h.schema_digest,
                                  h.software_version, h.allowed_kinds, h.max_epsilon_per_task,
                                  h.budget, first, last, h.secure_policy))
        return infos

    async def ListSites(self, request: analyst_pb2.ListSitesRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> analyst_pb2.ListSitesResponse:
        """List connected sites (and, on request, the ones seen before)."""
        await self.auth.require(context, "analyst")
        infos = self._site_infos(request.include_disconnected)
        return analyst_pb2.ListSitesResponse(sites=[site_info_to_proto(i) for i in infos],
                                             schema_digest=self.federation.schema_digest,
                                             schema_toml=self.federation.schema.to_toml())

    async def GetBudgets(self, request: analyst_pb2.GetBudgetsRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> analyst_pb2.GetBudgetsResponse:
        """Every known site's last reported budget."""
        await self.auth.require(context, "analyst")
        out = []
        for info in self._site_infos(include_disconnected=True):
            b = analyst_pb2.SiteBudget(site_id=info.site_id, connected=info.connected)
            if info.budget is not None:
                b.budget.CopyFrom(budget_to_proto(info.budget))
            out.append(b)
        return analyst_pb2.GetBudgetsResponse(budgets=out)

    async def _stream_job(self, job_id: str, context: grpc.aio.ServicerContext | None = None,
                          principal: Principal | None = None,
                          ) -> AsyncIterator[analyst_pb2.JobEvent]:
        fingerprint = None if context is None else self.auth.fingerprint(context)
        async for event in self.jobs.follow(job_id):
            # A long stream is re-checked at each event: a revoked analyst stops receiving.
            if context is not None and principal is not None and self.auth.access is not None:
                refusal = self.auth.access.check(principal, fingerprint)
                if refusal is not None:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
            if event.job is None:
                yield job_event_to_proto(event)
            else:  # the final event carries the job's parameters: encoded off the loop
                yield await asyncio.to_thread(job_event_to_proto, event)

    async def SubmitJob(self, request: analyst_pb2.SubmitJobRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> AsyncIterator[analyst_pb2.JobEvent]:
        """Validate and start a job; stream its progress until it finishes."""
        principal = await self.auth.require(context, "analyst")
        try:
            job = await self._submit(request, principal)
        except Exception as exc:  # noqa: BLE001 -- mapped to a status code
            # An aborted call's state and the frames of its abort form a reference cycle
            # that only a garbage collection breaks: keep the request (up to 16 MiB) and the
            # planner's frames out of it, or every refused large request stays in memory.
            del request
            await _abort(context, exc if not isinstance(exc, DpfedError)
                         else exc.with_traceback(None))
            return
        async for event in self._stream_job(job.job_id, context, principal):
            yield event

    async def _submit(self, request: analyst_pb2.SubmitJobRequest,
                      principal: Principal) -> JobInfo:
        fields = request.spec.params.fields
        session = fields["session"].string_value if "session" in fields else ""
        self.job_access.check_continuation(principal, request.spec.kind, session, self.store)
        return await self.jobs.submit(request.spec.SerializeToString(),
                                      submitted_by=str(principal),
                                      request_id=request.request_id)

    async def WatchJob(self, request: analyst_pb2.WatchJobRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[analyst_pb2.JobEvent]:
        """Replay and follow a job's progress."""
        principal = await self.auth.require(context, "analyst")
        try:
            self._readable_job(principal, request.job_id)
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)
            return
        async for event in self._stream_job(request.job_id, context, principal):
            yield event

    async def GetJob(self, request: analyst_pb2.GetJobRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> analyst_pb2.JobInfo:
        """One job's state."""
        principal = await self.auth.require(context, "analyst")
        try:
            return await asyncio.to_thread(
                lambda: job_info_to_proto(self._readable_job(principal, request.job_id)))
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)
            raise

    async def ListJobs(self, request: analyst_pb2.ListJobsRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> analyst_pb2.ListJobsResponse:
        """Most recent jobs first (those the caller may read)."""
        principal = await self.auth.require(context, "analyst")

        def listing() -> analyst_pb2.ListJobsResponse:  # decoding and encoding parameters
            jobs = self.store.list_jobs(request.limit or 50,
                                        submitted_by=self.job_access.readable_owners(principal))
            return analyst_pb2.ListJobsResponse(jobs=[job_info_to_proto(j) for j in jobs])

        return await asyncio.to_thread(listing)

    async def FetchResult(self, request: analyst_pb2.FetchResultRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Stream a finished job's result file in chunks."""
        principal = await self.auth.require(context, "analyst")
        try:
            self._readable_job(principal, request.job_id)
            path = self.store.result_path(request.job_id)
            data = await asyncio.to_thread(path.read_bytes)
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)
            return
        for chunk in iter_chunks(request.job_id, data, CHUNK_BYTES):
            yield chunk

    async def CancelJob(self, request: analyst_pb2.CancelJobRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> analyst_pb2.JobInfo:
        """Cancel an unfinished job (its submitter or an admin); return its final state."""
        principal = await self.auth.require(context, "analyst")
        try:
            job = self._readable_job(principal, request.job_id)
            if not self.job_access.may_cancel(principal, job):
                raise PermissionDeniedError(f"job {job.job_id} was submitted by "
                                            f"{job.submitted_by}; only its submitter or an "
                                            "admin may cancel it")
            why = request.reason.strip()[:MAX_CANCEL_REASON]
            reason = f"cancelled by {principal}" + (f": {why}" if why else "")
            return job_info_to_proto(await self.jobs.cancel(job.job_id, reason))
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)
            raise
