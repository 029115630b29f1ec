"""Site step of the ``svt`` job: Lyu-Su-Li Alg. 1 over this site's rows, one session at a time.

A session opens with a charged task (its whole cost, eps_1 + eps_2 (+ eps_3), paid once) that
also answers the first batch; later batches and the closing task continue it at no extra cost.
The session's secret threshold noise and its count of positives live in
:class:`~dpfed.site_agent.svt_sessions.SVTSessionStore`, so a restart neither redraws the
noise nor resets the cut-off, and a retried batch replays its stored transcript.

Task parameters: ``session`` (the opening job's id), ``action`` (``open``, ``batch`` or
``close``), ``queries`` (canonical query set, see
:mod:`dpfed.common.queries.query_language`), and on ``open`` the session's ``threshold``,
``cutoff``, ``numeric_epsilon`` and ``monotonic``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.common.errors import DataError, ValidationError
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.queries.query_language import CompiledQuerySet, compile_query_set
from dpfed.common.queries.svt_stream import (
    SessionState,
    SVTSessionParams,
    answer_batch,
    open_session,
)
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.common.transport.wire import result_from_bytes, result_to_bytes
from dpfed.site_agent.handlers.base import (
    DataAccess,
    PreparedContinuation,
    PreparedRelease,
    TaskHandler,
)
from dpfed.site_agent.svt_sessions import SVTSessionStore, sessions_path

log = logging.getLogger(__name__)

ACTIONS: tuple[str, ...] = ("open", "batch", "close")
#: A continuation reports no new spend: the session paid for the whole stream when it opened.
NO_NEW_SPEND = PrivacyCost(0.0, 0.0, 0.0, "svt-session")


def _session_id(params: dict[str, Any]) -> str:
    sid = params.get("session")
    if not isinstance(sid, str) or not 1 <= len(sid) <= 200:
        raise ValidationError(f"svt needs a session id (1-200 characters), got {sid!r}")
    return sid


class SVTHandler(TaskHandler):
    """Answer SVT batches for the analyst's query stream, durably per session.

    Privacy
    -------
    Replace-one neighbours; counting queries over the public schema (sensitivity 1);
    non-monotonic query noise ``Lap(2 c / eps_2)`` unless the session is declared monotonic and
    every query it receives forms a chain with all earlier ones (then ``Lap(c / eps_2)``),
    threshold noise ``Lap(1 / eps_1)`` drawn once per session and stored, values of positive
    queries with fresh ``Lap(c / eps_3)``. The whole session is (eps_1 + eps_2 + eps_3)-DP
    (Lyu, Su & Li 2017, Alg. 1; adaptive queries allowed) and is charged at opening. Only
    the above/below flags (and the paid values) leave the site.
    """

    kind = "svt"

    def __init__(self, store: SVTSessionStore | None = None) -> None:
        self._store = store

    def for_site(self, ledger_path: Path) -> TaskHandler:
        """Bind to the session store beside this site's ledger."""
        return SVTHandler(SVTSessionStore(sessions_path(ledger_path)))

    @property
    def store(self) -> SVTSessionStore:
        """The bound session store."""
        if self._store is None:
            raise ValidationError("the svt handler is not bound to a site (no session store)")
        return self._store

    def prepare(self, task: Task, data: DataAccess) -> PreparedRelease | PreparedContinuation:
        """Validate the task and compute the true counts; open or continue the session."""
        params = dict(task.params)
        action = params.get("action")
        if action not in ACTIONS:
            raise ValidationError(f"svt action must be one of {list(ACTIONS)}, got {action!r}")
        sid = _session_id(params)
        if action == "open":
            return self._open(task, params, sid, data)
        session = self.store.get(sid)
        if session is None:
            raise ValidationError(f"this site has no SVT session {sid!r} (it did not take part "
                                  "in the session's opening job)")
        stored = self.store.stored_batch(task.task_id)
        if stored is not None:
            digest, blob = stored
            if digest == task.digest():
                return PreparedContinuation(session.open_task_id, lambda _rng: blob)
        sp = SVTSessionParams(**session.params)
        if action == "close":
            unknown = sorted(set(params) - {"session", "action"})
            if unknown:
                raise ValidationError(f"unknown svt close parameter(s) {unknown}")
            return PreparedContinuation(session.open_task_id, lambda rng: self._step(
                task, sid, sp, np.zeros(0), [], rng, NO_NEW_SPEND, close=True, n_rows=0))
        unknown = sorted(set(params) - {"session", "action", "queries"})
        if unknown:
            raise ValidationError(f"unknown svt batch parameter(s) {unknown}; the session's "
                                  "threshold, cut-off and budget were fixed when it opened")
        if session.closed:
            raise ValidationError(f"SVT session {sid!r} was closed by the analyst")
        queries = compile_query_set(data.schema, params.get("queries"), canonical=True)
        if sp.monotonic:
            self._check_chain(data, sid, queries)
        answers, n_rows = self._counts(queries, data)
        return PreparedContinuation(session.open_task_id, lambda rng: self._step(
            task, sid, sp, answers, list(queries.canonical), rng, NO_NEW_SPEND, close=False,
            n_rows=n_rows))

    def _open(self, task: Task, params: dict[str, Any], sid: str,
              data: DataAccess) -> PreparedRelease:
        if sid != task.job_id:
            raise ValidationError("an SVT session's id is the id of the job that opens it")
        unknown = sorted(set(params) - {"session", "action", "queries", "threshold", "cutoff",
                                        "numeric_epsilon", "monotonic"})
        if unknown:
            raise ValidationError(f"unknown svt parameter(s) {unknown}")
        sp = SVTSessionParams.from_mapping(params, task.epsilon)
        queries = compile_query_set(data.schema, params.get("queries"), canonical=True)
        if sp.monotonic and not queries.one_directional(data.schema):
            raise ValidationError("monotonic noise needs queries that provably move in one "
                                  "direction under replace-one (a chain of nested predicates); "
                                  "these do not")
        answers, n_rows = self._counts(queries, data)
        cost = sp.calibration.cost()
        stored_params = {**sp.to_mapping(), "epsilon": sp.epsilon}
        log.info("[SVTHandler.prepare] task=%s opens session %s: %d queries, c=%d, epsilon=%g",
                 task.task_id, sid, queries.n_queries, sp.cutoff, sp.epsilon)

        def release(rng: np.random.Generator) -> TaskResult:
            self.store.open_session(sid, task.task_id, stored_params,
                                    lambda: open_session(sp, rng))
            blob = self._step(task, sid, sp, answers, list(queries.canonical), rng, cost,
                              close=False, n_rows=n_rows)
            return result_from_bytes(blob)

        return PreparedRelease(cost, release)

    def _check_chain(self, data: DataAccess, sid: str, queries: CompiledQuerySet) -> None:
        earlier = [q for batch in self.store.session_queries(sid) for q in batch]
        combined = compile_query_set(data.schema, earlier + list(queries.canonical),
                                     canonical=True)
        if not combined.one_directional(data.schema):
            raise ValidationError("this monotonic SVT session only accepts queries that form a "
                                  "chain with all earlier ones (provably one-directional under "
                                  "replace-one); this batch breaks the chain")

    @staticmethod
    def _counts(queries: CompiledQuerySet, data: DataAccess) -> tuple[np.ndarray, int]:
        answers, n_rows = queries.counts(t for t, _ in data.iter_chunks())
        if n_rows == 0:
            raise DataError("the site has no valid rows to answer queries on")
        return answers, n_rows

    def _step(self, task: Task, sid: str, sp: SVTSessionParams, answers: np.ndarray,
              canonical: list[Any], rng: np.random.Generator, spend: PrivacyCost, *,
              close: bool, n_rows: int) -> bytes:
        def step(state: SessionState, closed: bool) -> tuple[SessionState, bytes, bool]:
            if close or closed:
                outcome = answer_batch(sp, state, np.zeros(0), rng)
            else:
                outcome = answer_batch(sp, state, answers, rng)
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

        return self.store.run_batch(sid, task.task_id, task.digest(), canonical, step)
