"""The ``svt`` job kind: one batch of an SVT session at every site (Lyu, Su & Li 2017, Alg. 1).

A job opens a session (its id becomes the session id; its epsilon is the whole stream's cost,
charged once), continues one (the next queries, covered by the opening charge) or closes it.
The session's secret threshold noise and its count of positives live in a store beside the
site's ledger (:mod:`dpfed.common.queries.svt_sessions`), so a restart neither redraws the
noise nor resets the cut-off, and a retried batch replays its transcript. Per query the
coordinator reports how many sites answered "above" and which; with eps_3 the sum of the paid
values and its standard error. Privacy: docs/queries.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.common.errors import DataError, ProtocolError, ValidationError
from dpfed.common.job_params import SVTParams
from dpfed.common.jobs.contract import Ask, CoveredBy, JobKind, NewCharge, Release, Request, Site
from dpfed.common.jobs.contract import Round as BaseRound
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.queries.query_language import CompiledQuerySet, compile_query_set
from dpfed.common.queries.svt_sessions import SVTSessionStore, sessions_path
from dpfed.common.queries.svt_stream import (
    SessionState,
    SVTSessionParams,
    answer_batch,
    open_session,
)
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.common.transport.wire import result_from_bytes, result_to_bytes

log = logging.getLogger(__name__)

#: A continuation reports no new spend: the session paid for the whole stream when it opened.
NO_NEW_SPEND = PrivacyCost(0.0, 0.0, 0.0, "svt-session")
_OPEN_KEYS = {"session", "action", "queries", "threshold", "cutoff", "numeric_epsilon",
              "monotonic"}


def _session_id(params: Mapping[str, Any]) -> str:
    sid = params.get("session")
    if not isinstance(sid, str) or not 1 <= len(sid) <= 200:
        raise ValidationError(f"svt needs a session id (1-200 characters), got {sid!r}")
    return sid


def session_store(site: Site) -> SVTSessionStore:
    """Return the site's SVT session store, beside its ledger (opened once per site)."""
    path = site.ledger_path
    if path is None:
        raise ValidationError("the svt round is not bound to a site (no session store)")
    return site.keep("svt-sessions", lambda: SVTSessionStore(sessions_path(path)))


def _counts(queries: CompiledQuerySet, site: Site) -> tuple[np.ndarray, int]:
    answers, n_rows = queries.counts(t for t, _ in site.data.iter_chunks())
    if n_rows == 0:
        raise DataError("the site has no valid rows to answer queries on")
    return answers, n_rows


@dataclass(frozen=True)
class SessionBatch:
    """What a batch is asked with: the session id and the names of its queries."""

    session: str
    names: list[str]


def batch_of(params: SVTParams, job_id: str, schema: Any) -> SessionBatch:
    """Return the session a job opens (its own id) or continues, and its queries' names."""
    session = job_id if params.action == "open" else params.session
    names = ([] if params.action == "close" else
             list(compile_query_set(schema, params.queries, canonical=True).names))
    return SessionBatch(session, names)


@dataclass(frozen=True)
class Transcripts:
    """The sites' transcripts of one batch, per query (rows: sites in order)."""

    site_ids: list[str]
    above: np.ndarray
    values: np.ndarray
    numeric_scale: float
    sites: list[dict[str, Any]]


class Batch(BaseRound[SVTParams, SessionBatch, Transcripts]):
    """``svt``: open, continue or close the session named by the task at this site.

    Privacy: replace-one; counting queries (sensitivity 1); query noise ``Lap(2 c / eps_2)``
    (``Lap(c / eps_2)`` for a declared chain of nested predicates), threshold noise
    ``Lap(1 / eps_1)`` drawn once per session and stored, paid values with fresh
    ``Lap(c / eps_3)``; the whole session is (eps_1 + eps_2 + eps_3)-DP and charged when it
    opens. Only the above/below flags (and the paid values) leave the site.
    """

    name = "svt"
    task_kind = "svt"

    # ------------------------------------------------------------------ site
    def prepare(self, task: Task, site: Site) -> Release:
        """Open the session (a new charge) or continue it (covered by the opening charge)."""
        return self.prepare_with(task, site, session_store(site))

    def prepare_with(self, task: Task, site: Site, store: SVTSessionStore) -> Release:
        """:meth:`prepare` with the session store given (a test restarts a store at will)."""
        params = dict(task.params)
        action = params.get("action")
        if action not in ("open", "batch", "close"):
            raise ValidationError(f"svt action must be one of ['open', 'batch', 'close'], "
                                  f"got {action!r}")
        sid = _session_id(params)
        if action == "open":
            return self._open(task, params, sid, site, store)
        session = store.get(sid)
        if session is None:
            raise ValidationError(f"this site has no SVT session {sid!r} (it did not take part "
                                  "in the session's opening job)")
        covered = CoveredBy(session.open_task_id)
        stored = store.stored_batch(task.task_id)
        if stored is not None and stored[0] == task.digest():
            blob = stored[1]
            return Release(covered, lambda _rng: blob)
        sp = SVTSessionParams(**session.params)
        if action == "close":
            unknown = sorted(set(params) - {"session", "action"})
            if unknown:
                raise ValidationError(f"unknown svt close parameter(s) {unknown}")
            return Release(covered, lambda rng: _step(store, task, sid, sp, np.zeros(0), [],
                                                      rng, NO_NEW_SPEND, close=True, n_rows=0))
        unknown = sorted(set(params) - {"session", "action", "queries"})
        if unknown:
            raise ValidationError(f"unknown svt batch parameter(s) {unknown}; the session's "
                                  "threshold, cut-off and budget were fixed when it opened")
        if session.closed:
            raise ValidationError(f"SVT session {sid!r} was closed by the analyst")
        queries = compile_query_set(site.data.schema, params.get("queries"), canonical=True)
        if sp.monotonic:
            _check_chain(site, store, sid, queries)
        answers, n_rows = _counts(queries, site)
        return Release(covered, lambda rng: _step(
            store, task, sid, sp, answers, list(queries.canonical), rng, NO_NEW_SPEND,
            close=False, n_rows=n_rows))

    @staticmethod
    def _open(task: Task, params: dict[str, Any], sid: str, site: Site,
              store: SVTSessionStore) -> Release:
        if sid != task.job_id:
            raise ValidationError("an SVT session's id is the id of the job that opens it")
        unknown = sorted(set(params) - _OPEN_KEYS)
        if unknown:
            raise ValidationError(f"unknown svt parameter(s) {unknown}")
        sp = SVTSessionParams.from_mapping(params, task.epsilon)
        queries = compile_query_set(site.data.schema, params.get("queries"), canonical=True)
        if sp.monotonic and not queries.one_directional(site.data.schema):
            raise ValidationError("monotonic noise needs queries that provably move in one "
                                  "direction under replace-one (a chain of nested predicates); "
                                  "these do not")
        answers, n_rows = _counts(queries, site)
        cost = sp.calibration.cost()
        stored_params = {**sp.to_mapping(), "epsilon": sp.epsilon}
        log.info("task=%s opens session %s: %d queries, c=%d, epsilon=%g", task.task_id, sid,
                 queries.n_queries, sp.cutoff, sp.epsilon)

        def produce(rng: np.random.Generator) -> TaskResult:
            store.open_session(sid, task.task_id, stored_params, lambda: open_session(sp, rng))
            return result_from_bytes(_step(store, task, sid, sp, answers,
                                           list(queries.canonical), rng, cost, close=False,
                                           n_rows=n_rows))

        return Release(NewCharge(cost), produce)

    # ------------------------------------------------------------------ coordinator
    def request(self, ask: Ask[SVTParams, SessionBatch]) -> Request:
        """Return the canonical parameters, naming the session (the opening job's id)."""
        return Request({**ask.params.to_mapping(), "session": ask.inputs.session})

    def check(self, result: TaskResult, ask: Ask[SVTParams, SessionBatch]) -> None:
        """Require flags for at most the batch's queries; values only for "above"; charged once."""
        k = len(ask.inputs.names)
        above = result.arrays.get("above")
        if above is None or above.ndim != 1 or above.shape[0] > k or not np.all(
                (above == 0) | (above == 1)):
            raise ProtocolError(f"expected 'above' flags for at most {k} queries")
        values = result.arrays.get("values")
        n_pos = int((above == 1).sum())
        if values is not None and (values.shape != (n_pos,) or values.dtype != np.float64
                                   or not np.all(np.isfinite(values))):
            raise ProtocolError("'values' must hold one finite float64 per 'above' flag")
        opening = ask.params.action == "open"
        if opening and result.spend.epsilon <= 0:
            raise ProtocolError("the opening task reports no charge")
        if not opening and (result.spend.epsilon > 0 or result.spend.delta > 0):
            raise ProtocolError("a continuation must not charge again")
        if result.metadata.get("session") != ask.inputs.session:
            raise ProtocolError("answer for another session")

    def pool(self, results: Mapping[str, TaskResult],
             ask: Ask[SVTParams, SessionBatch]) -> Transcripts:
        """Per query: which sites examined it, which were above, the paid values."""
        site_ids = sorted(results)
        k = len(ask.inputs.names)
        above = np.full((len(site_ids), k), -1, dtype=np.int8)  # -1: not examined (cut-off)
        values = np.full((len(site_ids), k), np.nan)
        numeric_scale = 0.0
        sites: list[dict[str, Any]] = []
        for i, s in enumerate(site_ids):
            r = results[s]
            flags = r.arrays["above"]
            above[i, :flags.shape[0]] = flags
            if "values" in r.arrays:
                values[i, np.flatnonzero(flags == 1)] = r.arrays["values"]
            m = r.metadata
            sites.append({"site_id": s, "n_rows": m.get("n_rows"), "epsilon": r.spend.epsilon,
                          "n_examined_total": m.get("n_examined_total"),
                          "n_positives_total": m.get("n_positives_total"),
                          "halted": bool(m.get("halted")), "closed": bool(m.get("closed"))})
            scale = m.get("numeric_scale")
            if isinstance(scale, int | float) and math.isfinite(scale) and scale > 0:
                if numeric_scale and abs(numeric_scale - scale) > 1e-9 * scale:
                    raise ProtocolError(f"site {s} reports a numeric noise scale different "
                                        "from the other sites'")
                numeric_scale = float(scale)
        return Transcripts(site_ids, above, values, numeric_scale, sites)


def _check_chain(site: Site, store: SVTSessionStore, sid: str,
                 queries: CompiledQuerySet) -> None:
    earlier = [q for batch in store.session_queries(sid) for q in batch]
    combined = compile_query_set(site.data.schema, earlier + list(queries.canonical),
                                 canonical=True)
    if not combined.one_directional(site.data.schema):
        raise ValidationError("this monotonic SVT session only accepts queries that form a "
                              "chain with all earlier ones (provably one-directional under "
                              "replace-one); this batch breaks the chain")


def _step(store: SVTSessionStore, task: Task, sid: str, sp: SVTSessionParams,
          answers: np.ndarray, canonical: list[Any], rng: np.random.Generator,
          spend: PrivacyCost, *, close: bool, n_rows: int) -> bytes:
    """Answer one batch (or close) durably: the new state and the bytes commit together."""
    def step(state: SessionState, closed: bool) -> tuple[SessionState, bytes, bool]:
        outcome = answer_batch(sp, state, np.zeros(0) if close or closed else answers, rng)
        arrays: dict[str, np.ndarray] = {"above": outcome.above.astype(np.int8)}
        rows: dict[str, Any] = {"n_rows": n_rows} if n_rows > 0 else {}
        if outcome.values is not None:  # one value per "above" flag, in order
            arrays["values"] = outcome.values[outcome.above].astype(np.float64)
        scale = sp.calibration.numeric_scale
        if scale is not None:
            rows["numeric_scale"] = scale
        result = TaskResult(task.task_id, spend, arrays, {
            **rows, "session": sid, "n_queries": int(answers.size),
            "n_examined_batch": int(outcome.above.size),
            "n_examined_total": outcome.state.n_examined,
            "n_positives_total": outcome.state.n_positives,
            "halted": outcome.halted, "closed": bool(close or closed),
            "cutoff": sp.cutoff, "software_version": __version__})
        return outcome.state, result_to_bytes(result), close

    return store.run_batch(sid, task.task_id, task.digest(), canonical, step)


BATCH = Batch()

KIND: JobKind[SVTParams] = JobKind(
    name="svt", params=SVTParams, rounds=(BATCH,), run="dpfed.aggregator.jobs.svt:run",
    report="dpfed.aggregator.result_reports:svt", pure_epsilon=True,
    summary="sparse vector technique over a query stream")
