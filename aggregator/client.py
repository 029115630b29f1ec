"""The analyst's Python API to the coordinator.

    from dpfed.aggregator.client import Coordinator

    with Coordinator("coord.example.org:50051", ca="ca.pem", cert="analyst.pem",
                     key="analyst.key") as coord:
        for site in coord.sites():
            print(site.site_id, site.row_count, site.budget.epsilon_remaining)
        result = coord.pca(5, epsilon=1.0, delta=1e-5, on_event=print)
        scores = result.transform(new_rows_dataframe)

Every call has a timeout; only UNAVAILABLE and DEADLINE_EXCEEDED are retried, with
exponential backoff and jitter. Job submission carries a client-chosen request id, so a
retried submission returns the same job instead of starting (and paying for) a second one.
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np

from dpfed.common.data.schema import Schema
from dpfed.common.errors import (
    AuthenticationError,
    BudgetExceededError,
    CoordinatorUnavailableError,
    DpfedError,
    JobBudgetExceededError,
    JobFailedError,
    NotFoundError,
    PermissionDeniedError,
    QuorumError,
    SitesNotConnectedError,
    ValidationError,
)
from dpfed.common.pb.v1 import analyst_pb2, analyst_pb2_grpc
from dpfed.common.privacy.accounting import BudgetStatus
from dpfed.common.transport.grpc_errors import tls_hint
from dpfed.common.transport.grpc_options import (
    DEFAULT_RPC_TIMEOUT_S,
    MAX_TRANSFER_BYTES,
    channel_options,
)
from dpfed.common.transport.protocol import (
    JobEvent,
    JobInfo,
    JobSpec,
    RefusalCode,
    SiteInfo,
    SiteStatus,
)

if TYPE_CHECKING:
    import pandas as pd

    from dpfed.aggregator.pca_result import PCAResult
    from dpfed.aggregator.query_results import QueryJobResult, SVTJobResult
    from dpfed.aggregator.synth_model import SynthModel
from dpfed.common.transport.tls import load_channel_credentials
from dpfed.common.transport.wire import (
    Reassembler,
    budget_from_proto,
    job_event_from_proto,
    job_info_from_proto,
    job_spec_to_proto,
    site_info_from_proto,
)

T = TypeVar("T")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
#: How long a submitted job's progress stream may last before the client gives up waiting
#: (the job keeps running on the coordinator; ``watch`` re-attaches).
DEFAULT_WAIT_S = 6 * 3600.0


def error_from_rpc(exc: grpc.RpcError, address: str) -> DpfedError:
    """Translate a gRPC failure into the project's error classes."""
    code = exc.code()
    details = exc.details() or code.name
    if code == grpc.StatusCode.UNAVAILABLE:
        return CoordinatorUnavailableError(
            f"coordinator at {address} unavailable: {details}{tls_hint(details)}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return CoordinatorUnavailableError(f"coordinator at {address} did not answer in time")
    cls: type[DpfedError] = {
        grpc.StatusCode.INVALID_ARGUMENT: ValidationError,
        grpc.StatusCode.NOT_FOUND: NotFoundError,
        grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
        grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
        grpc.StatusCode.FAILED_PRECONDITION: QuorumError,
    }.get(code, DpfedError)
    if code == grpc.StatusCode.FAILED_PRECONDITION and "budget" in details.lower():
        cls = BudgetExceededError
    return cls(details)


def job_failure(info: JobInfo) -> JobFailedError:
    """Return the error that reports a job that did not succeed.

    A :class:`JobBudgetExceededError` (exit code ``BUDGET_EXCEEDED``) when at least one site
    refused for lack of budget and every other site that did not answer refused for the
    same reason; a :class:`JobFailedError` otherwise.
    """
    failed = [s for s in info.sites if s.status != SiteStatus.OK]
    budget = [s for s in failed if s.code is RefusalCode.BUDGET_EXCEEDED]
    message = f"job {info.job_id} {info.state}: {info.error}"
    if budget and len(budget) == len(failed):
        return JobBudgetExceededError(
            f"{message} -- {len(budget)} site(s) have no privacy budget left for this request "
            f"({', '.join(s.site_id for s in budget)}); `dpfed budgets` shows what is left")
    return JobFailedError(message)


def pca_params(n_components: int, *, rank: int | None = None, calibration: str = "analytic",
               clip_norm: float | str | None = None, centering: str | None = None,
               site_weighting: str | None = None, clip_quantile: float | None = None,
               aggregation: str | None = None) -> dict[str, Any]:
    """Return the ``params`` of a pca job spec (what :meth:`Coordinator.pca` submits).

    Options left at None take the job's defaults (docs/pca.md).
    """
    params: dict[str, Any] = {"n_components": n_components, "calibration": calibration}
    if rank is not None:
        params["rank"] = rank
    optional = {"clip_norm": clip_norm, "centering": centering,
                "site_weighting": site_weighting, "clip_quantile": clip_quantile,
                "aggregation": aggregation}
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


class Coordinator:
    """A connection to the coordinator, authenticated with an analyst certificate.

    Parameters
    ----------
    address : str
        ``host:port`` of the coordinator.
    ca, cert, key : path
        Federation CA, analyst certificate and key (``dpfed certs init --analysts``).
    server_name : str, optional
        TLS name to check when ``address`` is not named in the coordinator's certificate.
    timeout : float
        Timeout of each unary call, seconds.
    retries : int
        Attempts for calls that fail with UNAVAILABLE / DEADLINE_EXCEEDED.
    insecure_principal : str, optional
        Development only: connect without TLS as ``analyst/<name>``.
    """

    def __init__(self, address: str, *, ca: str | Path | None = None,
                 cert: str | Path | None = None, key: str | Path | None = None,
                 server_name: str | None = None, timeout: float = DEFAULT_RPC_TIMEOUT_S,
                 retries: int = 3, insecure_principal: str | None = None,
                 study: str = "") -> None:
        if not address:
            raise ValidationError("coordinator address is required (host:port)")
        self.address = address
        self.timeout = timeout
        self.retries = max(1, retries)
        #: The study every job submitted through this client spends from ("" = none).
        self.study = study
        options = channel_options(server_name)
        self._metadata: tuple[tuple[str, str], ...] | None = None
        if insecure_principal is not None:
            self._channel = grpc.insecure_channel(address, options=options)
            self._metadata = (("x-dpfed-insecure-principal", insecure_principal),)
        else:
            if ca is None or cert is None or key is None:
                raise ValidationError("ca, cert and key are required (an analyst certificate "
                                      "from `dpfed certs init --analysts NAME`)")
            creds = load_channel_credentials(ca, cert, key, role="analyst")
            self._channel = grpc.secure_channel(address, creds, options=options)
        self._stub = analyst_pb2_grpc.AnalystStub(self._channel)
        self._random = random.Random()

    # ------------------------------------------------------------------ plumbing
    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[..., T], request: Any) -> T:
        delay = 0.25
        for attempt in range(self.retries):
            try:
                return fn(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE or attempt == self.retries - 1:
                    raise error_from_rpc(exc, self.address) from None
                time.sleep(self._random.uniform(0, delay))
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ sites
    def sites(self, include_disconnected: bool = False) -> list[SiteInfo]:
        """Return the connected sites (and previously seen ones on request)."""
        resp = self._call(self._stub.ListSites,
                          analyst_pb2.ListSitesRequest(include_disconnected=include_disconnected))
        return [site_info_from_proto(s) for s in resp.sites]

    def federation(self) -> tuple[list[SiteInfo], Schema | None]:
        """Return the connected sites and the federation's schema (None: an older coordinator)."""
        resp = self._call(self._stub.ListSites, analyst_pb2.ListSitesRequest())
        schema = Schema.from_toml(resp.schema_toml) if resp.schema_toml else None
        return [site_info_from_proto(s) for s in resp.sites], schema

    def budgets(self) -> list[tuple[str, bool, BudgetStatus | None]]:
        """(site id, connected, last reported budget) for every known site."""
        resp = self._call(self._stub.GetBudgets, analyst_pb2.GetBudgetsRequest())
        return [(b.site_id, b.connected, budget_from_proto(b.budget)) for b in resp.budgets]

    def wait_for_sites(self, n: int, timeout: float = 60.0) -> list[SiteInfo]:
        """Poll until at least ``n`` sites are connected.

        While the coordinator is not answering yet (it may still be starting), keep polling
        until ``timeout`` too.

        Raises
        ------
        SitesNotConnectedError
            The coordinator answered, but fewer than ``n`` sites connected in time.
        CoordinatorUnavailableError
            The coordinator never answered within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        sites: list[SiteInfo] | None = None
        while True:
            try:
                sites = self.sites()
            except CoordinatorUnavailableError as exc:
                if time.monotonic() > deadline:
                    if sites is None:
                        raise CoordinatorUnavailableError(
                            f"{exc} (kept trying for {timeout:g}s)") from None
                    raise
            else:
                if len(sites) >= n:
                    return sites
                if time.monotonic() > deadline:
                    names = ", ".join(s.site_id for s in sites) or "none"
                    raise SitesNotConnectedError(
                        f"only {len(sites)} of {n} site(s) connected to {self.address} after "
                        f"{timeout:g}s (connected: {names}); start the missing site agents "
                        "(`dpfed-site check --config site.toml` tells a site what is wrong), "
                        "wait longer with --wait-timeout, or ask for fewer with --wait-sites")
            time.sleep(0.5 if sites is None else 0.2)

    # ------------------------------------------------------------------ jobs
    def _follow(self, stream: Iterator[analyst_pb2.JobEvent],
                on_event: Callable[[JobEvent], None] | None) -> JobInfo:
        final: JobInfo | None = None
        try:
            for msg in stream:
                event = job_event_from_proto(msg)
                if on_event is not None:
                    on_event(event)
                if event.job is not None:
                    final = event.job
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.address) from None
        if final is None:
            raise CoordinatorUnavailableError("the job's progress stream ended without a result")
        return final

    def submit(self, spec: JobSpec, *, on_event: Callable[[JobEvent], None] | None = None,
               request_id: str | None = None, wait_timeout: float = DEFAULT_WAIT_S) -> JobInfo:
        """Submit a job and follow it to the end; return its final state (may be failed).

        A spec without a study is submitted under the client's ``study``.
        """
        if self.study and not spec.study:
            spec = dataclasses.replace(spec, study=self.study)
        request = analyst_pb2.SubmitJobRequest(spec=job_spec_to_proto(spec),
                                               request_id=request_id or uuid.uuid4().hex)
        delay = 0.25
        for attempt in range(self.retries):
            stream = self._stub.SubmitJob(request, timeout=wait_timeout, metadata=self._metadata)
            try:
                return self._follow(stream, on_event)
            except CoordinatorUnavailableError:
                # Safe to resubmit: the request id makes the coordinator return the same job.
                if attempt == self.retries - 1:
                    raise
                time.sleep(self._random.uniform(0, delay))
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    def watch(self, job_id: str, *, on_event: Callable[[JobEvent], None] | None = None,
              wait_timeout: float = DEFAULT_WAIT_S) -> JobInfo:
        """Replay and follow a job's progress until it finishes."""
        stream = self._stub.WatchJob(analyst_pb2.WatchJobRequest(job_id=job_id),
                                     timeout=wait_timeout, metadata=self._metadata)
        return self._follow(stream, on_event)

    def job(self, job_id: str) -> JobInfo:
        """One job's state."""
        return job_info_from_proto(self._call(self._stub.GetJob,
                                              analyst_pb2.GetJobRequest(job_id=job_id)))

    def jobs(self, limit: int = 50) -> list[JobInfo]:
        """Recent jobs, newest first."""
        resp = self._call(self._stub.ListJobs, analyst_pb2.ListJobsRequest(limit=limit))
        return [job_info_from_proto(j) for j in resp.jobs]

    def cancel(self, job_id: str, reason: str = "") -> JobInfo:
        """Cancel an unfinished job (one you submitted, or any as an admin).

        Nothing more is sent to the sites; tasks they already charged stay charged. Returns
        the job's final state: ``cancelled``, or the state it had already reached.
        """
        return job_info_from_proto(self._call(
            self._stub.CancelJob, analyst_pb2.CancelJobRequest(job_id=job_id, reason=reason)))

    def fetch_result(self, job_id: str) -> bytes:
        """Download a finished job's result file (``.npz`` bytes)."""
        reassembler = Reassembler(MAX_TRANSFER_BYTES)
        try:
            for chunk in self._stub.FetchResult(analyst_pb2.FetchResultRequest(job_id=job_id),
                                                timeout=max(self.timeout, 300.0),
                                                metadata=self._metadata):
                data = reassembler.add(chunk)
                if data is not None:
                    return data
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.address) from None
        raise CoordinatorUnavailableError(f"the result of job {job_id} arrived incomplete")

    def pca(self, n_components: int, *, epsilon: float, delta: float, rank: int | None = None,
            calibration: str = "analytic", clip_norm: float | str | None = None,
            min_sites: int = 0, deadline_seconds: float = 0.0, sites: tuple[str, ...] = (),
            on_event: Callable[[JobEvent], None] | None = None,
            centering: str | None = None, site_weighting: str | None = None,
            clip_quantile: float | None = None, aggregation: str | None = None) -> PCAResult:
        """Run a DP-PCA job and return its result.

        ``clip_norm``: ``"auto"`` (a DP quantile of the row norms, the job default when None),
        ``"schema"`` (the worst case) or a number; ``centering``: ``"mean"`` (default) or
        ``"none"``; ``site_weighting``: ``"size"`` (default) or ``"equal"``; ``aggregation``:
        ``"site"`` (default) or ``"secure"`` (a secure sum with distributed noise: pooled-data
        utility, the coordinator sees only the noisy sum). See docs/pca.md.

        Raises
        ------
        JobFailedError
            If the job failed (e.g. quorum not reached); the message says why.
        """
        params = pca_params(n_components, rank=rank, calibration=calibration,
                            clip_norm=clip_norm, centering=centering,
                            site_weighting=site_weighting, clip_quantile=clip_quantile,
                            aggregation=aggregation)
        job = self.submit(JobSpec("pca", epsilon, delta, params, min_sites, deadline_seconds,
                                  tuple(sites)), on_event=on_event)
        return self.pca_result(job)

    def pca_result(self, job: JobInfo | str) -> PCAResult:
        """Fetch a finished pca job's result (raises JobFailedError if it failed)."""
        info = self.job(job) if isinstance(job, str) else job
        if info.state != "succeeded":
            raise job_failure(info)
        from dpfed.aggregator.pca_result import PCAResult

        return PCAResult.from_bytes(self.fetch_result(info.job_id))

    # ------------------------------------------------------------------ svt / query
    def svt(self, queries: Any = None, *, epsilon: float | None = None,
            threshold: float | None = None, cutoff: int = 1,
            numeric_epsilon: float | None = None, monotonic: bool = False,
            session: str | None = None, close: bool = False, min_sites: int = 0,
            deadline_seconds: float = 0.0, sites: tuple[str, ...] = (),
            on_event: Callable[[JobEvent], None] | None = None) -> SVTJobResult:
        """Open, continue or close an SVT session; return this batch's combined transcript.

        Parameters
        ----------
        queries : path, list or dict
            A query set (TOML/JSON file or the same structure in Python); see docs/queries.md.
        epsilon : float
            Opening: the session's whole cost at each site, eps_1 + eps_2 (+ eps_3), charged
            now. Continuing or closing: leave None (the session's, nothing new is charged).
        threshold, cutoff, numeric_epsilon, monotonic
            Opening only: T, c, eps_3 (part of ``epsilon``) and monotonic noise.
        session : str, optional
            Continue (or, with ``close=True``, close) the session opened by this job id.

        Raises
        ------
        JobFailedError
            The job failed (quorum, every site refused, ...); the message says why.
        """
        from dpfed.common.queries.query_language import load_query_file

        params: dict[str, Any] = {}
        if queries is not None:
            params["queries"] = (load_query_file(queries) if isinstance(queries, str | Path)
                                 else queries)
        if session:
            params["session"] = session
            if close:
                params["close"] = True
            if epsilon is None:
                epsilon = self.job(session).spec.epsilon
        else:
            if threshold is not None:
                params["threshold"] = threshold
            params["cutoff"] = cutoff
            if numeric_epsilon is not None:
                params["numeric_epsilon"] = numeric_epsilon
            if monotonic:
                params["monotonic"] = True
        if epsilon is None:
            raise ValidationError("epsilon is required to open an SVT session (its whole cost "
                                  "at each site)")
        job = self.submit(JobSpec("svt", epsilon, 0.0, params, min_sites, deadline_seconds,
                                  tuple(sites)), on_event=on_event)
        info = job
        if info.state != "succeeded":
            raise JobFailedError(f"job {info.job_id} {info.state}: {info.error}")
        from dpfed.aggregator.query_results import SVTJobResult

        return SVTJobResult.from_bytes(self.fetch_result(info.job_id))

    def query(self, columns: str | list[str], *, epsilon: float, delta: float = 0.0,
              bins: dict[str, Any] | None = None, workload: str = "identity",
              k: int | None = None, workload_matrix: Any = None, strategy: str = "auto",
              noise: str = "auto", reconstruction: str = "least_squares",
              min_sites: int = 0, deadline_seconds: float = 0.0,
              sites: tuple[str, ...] = (),
              on_event: Callable[[JobEvent], None] | None = None,
              aggregation: str = "site", secure_noise: str = "auto") -> QueryJobResult:
        """Answer a linear workload over a histogram domain with the matrix mechanism.

        Parameters
        ----------
        columns : str or list of str
            1-3 columns; continuous ones need ``bins`` (count or edges).
        workload : {"identity", "all_range", "prefix", "marginals", "custom"}
            ``k`` for marginals; ``workload_matrix`` (array, or a .npy/.csv path) for custom.
        strategy : {"auto", "identity", "h2", "wavelet", "prefix", "optimized"}
        noise : {"auto", "laplace", "gaussian"}
            Gaussian needs ``delta`` in (0, 1); Laplace needs ``delta = 0``.
        reconstruction : {"least_squares", "nnls", "l1"}
        aggregation : {"site", "secure"}
            ``secure``: one secure sum with distributed noise (one pooled noise draw; noise
            ``auto`` or ``gaussian``); docs/queries.md.
        secure_noise : {"auto", "skellam", "dlaplace"}
            A secure sum's noise: Skellam (needs ``delta`` in (0, 1)), the distributed discrete
            Laplace (pure epsilon, ``delta = 0``), or whichever ranks best (``auto``).
        """
        domain: dict[str, Any] = {"columns": [columns] if isinstance(columns, str)
                                  else list(columns)}
        if bins:
            domain["bins"] = dict(bins)
        w: dict[str, Any] = {"kind": workload}
        if k is not None:
            w["k"] = k
        if workload_matrix is not None:
            from dpfed.common.queries.workload_spec import load_workload_matrix

            w["matrix"] = (load_workload_matrix(workload_matrix)
                           if isinstance(workload_matrix, str | Path)
                           else np.asarray(workload_matrix, dtype=np.float64).tolist())
        params = {"domain": domain, "workload": w, "strategy": strategy, "noise": noise,
                  "reconstruction": reconstruction}
        if aggregation != "site":
            params["aggregation"] = aggregation
        if secure_noise != "auto":
            params["secure_noise"] = secure_noise
        job = self.submit(JobSpec("query", epsilon, delta, params, min_sites, deadline_seconds,
                                  tuple(sites)), on_event=on_event)
        if job.state != "succeeded":
            raise JobFailedError(f"job {job.job_id} {job.state}: {job.error}")
        from dpfed.aggregator.query_results import QueryJobResult

        return QueryJobResult.from_bytes(self.fetch_result(job.job_id))

    def synthesize(self, *, epsilon: float, delta: float, rows: int | None = None,
                   mode: str = "generative", continuous_link: str = "quantile",
                   n_bins: int = 32, rank: int | None = None, clip_norm: float | None = None,
                   info_threshold: float = 0.8, min_sites: int = 0,
                   deadline_seconds: float = 0.0, sites: tuple[str, ...] = (),
                   on_event: Callable[[JobEvent], None] | None = None,
                   evaluate_rows: int = 0,
                   aggregation: str = "site",
                   evaluate_summary: tuple[float, float] | None = None,
                   pairs: int | None = None, pair_groups: int | None = None,
                   composition: str = "basic",
                   ) -> tuple[pd.DataFrame, SynthModel]:
        """Run a federated DP synthesis job; return a synthetic table and the fitted model.

        ``mode="generative"`` (default) samples ``rows`` new rows from the DP model (any
        number, no extra budget; ``model.sample(n)`` / ``model.write(path, n)`` draw more);
        ``mode="row_aligned"`` returns one noisy row per real row (``rows`` must be None).
        ``evaluate_rows > 0`` sends that many synthetic rows to every site, which writes a
        site-local evaluation report in its own directory (nothing comes back or is charged);
        every site then holds out some of its rows from every round to compare against.
        ``evaluate_summary=(epsilon, delta)`` also asks the sites whose policy allows it for a
        DP summary of their evaluation, charged at that budget (``model.metadata
        ["evaluation"]["summaries"]``).

        ``pairs`` (generative mode) is the most DP 2-way marginals of column pairs the job
        measures (rounds ``pair_scores`` and ``pairs``; default: the number of columns minus
        1; 0 skips them) and ``pair_groups`` the most groups per ordinal/continuous column in
        a pair table (default 6); see docs/synthesis.md.

        ``composition="zcdp"`` gives every round its share of the job's zCDP rho instead of
        its share of (epsilon, delta): much less noise per round, for sites whose ledger uses
        the ``zcdp`` accountant (others are left out, charged nothing). With secure
        aggregation every round's Skellam noise is calibrated to at most its rho share too.

        ``aggregation="secure"`` (generative mode only) sums the sites' histograms and latent
        Gram matrices under secure aggregation (noise of one row of the pooled data; the
        coordinator sees only the noisy totals); ``"site"`` (default) noises every site alone.
        The DataFrame is typed: floats within the schema bounds (int64 for ``integer``
        columns), categoricals with the schema's labels (ordered for ordinal columns).

        Raises
        ------
        ValidationError
            ``rows`` out of range (or given in row-aligned mode); bad parameters.
        JobFailedError
            If the job failed (quorum, refusals, budget); the message says why.
        """
        model = self.synth_model(epsilon=epsilon, delta=delta, rows=rows, mode=mode,
                                 continuous_link=continuous_link, n_bins=n_bins, rank=rank,
                                 clip_norm=clip_norm, info_threshold=info_threshold,
                                 min_sites=min_sites, deadline_seconds=deadline_seconds,
                                 sites=sites, on_event=on_event, evaluate_rows=evaluate_rows,
                                 aggregation=aggregation,
                                 evaluate_summary=evaluate_summary, pairs=pairs,
                                 pair_groups=pair_groups, composition=composition)
        return model.sample(rows), model

    def synth_model(self, *, epsilon: float, delta: float, rows: int | None = None,
                    mode: str = "generative", continuous_link: str = "quantile",
                    n_bins: int = 32, rank: int | None = None, clip_norm: float | None = None,
                    info_threshold: float = 0.8, min_sites: int = 0,
                    deadline_seconds: float = 0.0, sites: tuple[str, ...] = (),
                    on_event: Callable[[JobEvent], None] | None = None,
                    evaluate_rows: int = 0, aggregation: str = "site",
                    evaluate_summary: tuple[float, float] | None = None,
                    pairs: int | None = None, pair_groups: int | None = None,
                    composition: str = "basic") -> SynthModel:
        """Run a synthesis job and return only the fitted model (see :meth:`synthesize`)."""
        mode = mode.replace("-", "_")
        if mode == "row_aligned":
            if rows is not None:
                raise ValidationError("--rows: row-aligned mode releases exactly one noisy row "
                                      "per real row; omit --rows")
        else:
            from dpfed.aggregator.synth_model import check_rows

            check_rows(rows if rows is not None else 0)
        job = self.submit(self.synth_spec(epsilon=epsilon, delta=delta, mode=mode,
                                          continuous_link=continuous_link, n_bins=n_bins,
                                          rank=rank, clip_norm=clip_norm,
                                          info_threshold=info_threshold, min_sites=min_sites,
                                          deadline_seconds=deadline_seconds, sites=sites,
                                          evaluate_rows=evaluate_rows,
                                          aggregation=aggregation,
                                          evaluate_summary=evaluate_summary, pairs=pairs,
                                          pair_groups=pair_groups, composition=composition),
                          on_event=on_event)
        return self.synth_result(job)

    @staticmethod
    def synth_spec(*, epsilon: float, delta: float, mode: str = "generative",
                   continuous_link: str = "quantile", n_bins: int = 32,
                   rank: int | None = None, clip_norm: float | None = None,
                   info_threshold: float = 0.8, min_sites: int = 0,
                   deadline_seconds: float = 0.0, sites: tuple[str, ...] = (),
                   evaluate_rows: int = 0, aggregation: str = "site",
                   evaluate_summary: tuple[float, float] | None = None,
                   pairs: int | None = None, pair_groups: int | None = None,
                   composition: str = "basic") -> JobSpec:
        """Return the job spec of a synthesis job (what :meth:`synthesize` submits)."""
        params: dict[str, Any] = {"mode": mode.replace("-", "_"),
                                  "continuous_link": continuous_link, "n_bins": n_bins,
                                  "info_threshold": info_threshold}
        if rank is not None:
            params["rank"] = rank
        if clip_norm is not None:
            params["clip_norm"] = clip_norm
        if evaluate_rows:
            params["evaluate_rows"] = evaluate_rows
        if aggregation != "site":
            params["aggregation"] = aggregation
        if evaluate_summary is not None:
            params["summary_epsilon"], params["summary_delta"] = evaluate_summary
        if pairs is not None:
            params["pairs"] = pairs
        if pair_groups is not None:
            params["pair_groups"] = pair_groups
        if composition != "basic":
            params["composition"] = composition
        return JobSpec("synth", epsilon, delta, params, min_sites, deadline_seconds,
                       tuple(sites))

    def synth_result(self, job: JobInfo | str) -> SynthModel:
        """Fetch a finished synth job's model (raises JobFailedError if it failed)."""
        info = self.job(job) if isinstance(job, str) else job
        if info.state != "succeeded":
            raise JobFailedError(f"job {info.job_id} {info.state}: {info.error}")
        from dpfed.aggregator.synth_model import SynthModel

        return SynthModel.from_bytes(self.fetch_result(info.job_id))
