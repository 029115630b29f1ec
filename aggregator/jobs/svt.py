"""Coordinator side of the ``svt`` job: one batch of an SVT session at every site, combined.

A job either opens a session (``threshold``, ``cutoff``, optional ``numeric_epsilon``, the first
``queries``; its id becomes the session id and its epsilon is the session's whole cost),
continues one (``session`` and the next ``queries``; no new charge), or closes it
(``session``, ``close = true``). Per query the coordinator reports how many sites answered
"above" and which, and with eps_3 the sum of the released values with its standard error --
post-processing only.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.aggregator.federation import Federation
from dpfed.aggregator.jobs.base import JobContext, JobOutput, JobType
from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.queries.query_language import compile_query_set
from dpfed.common.queries.svt_stream import SVTSessionParams
from dpfed.common.transport.protocol import JobSpec, TaskResult
from dpfed.common.validation import check_epsilon

_OPEN_KEYS = {"queries", "threshold", "cutoff", "numeric_epsilon", "monotonic"}


def svt_task_params(spec: JobSpec, federation: Federation) -> dict[str, Any]:
    """Validate an analyst's svt parameters; return the canonical job parameters."""
    params = dict(spec.params)
    session = params.get("session") or ""
    close = params.get("close", False)
    if not isinstance(close, bool):
        raise ValidationError(f"close must be true or false, got {close!r}")
    if not isinstance(session, str) or len(session) > 200:
        raise ValidationError(f"session must be a job id, got {session!r}")
    if spec.delta != 0.0:
        raise ValidationError(f"svt is pure epsilon-DP (Laplace noise): delta must be 0, got "
                              f"{spec.delta!r}")
    eps = check_epsilon(spec.epsilon)
    if close:
        if not session:
            raise ValidationError("close needs the session to close (its opening job id)")
        extra = sorted(set(params) - {"session", "close"})
        if extra:
            raise ValidationError(f"closing a session takes no other parameters, got {extra}")
        return {"action": "close", "session": session}
    queries = compile_query_set(federation.schema, params.get("queries"))
    if session:
        extra = sorted(set(params) - {"session", "queries", "close"})
        if extra:
            raise ValidationError(
                f"parameter(s) {extra} are fixed when a session opens; a continuation takes "
                "only session and queries")
        return {"action": "batch", "session": session, "queries": list(queries.canonical)}
    extra = sorted(set(params) - _OPEN_KEYS - {"session", "close"})
    if extra:
        raise ValidationError(f"unknown svt parameter(s) {extra}; known: {sorted(_OPEN_KEYS)}")
    sp = SVTSessionParams.from_mapping(params, eps)
    if sp.monotonic and not queries.one_directional(federation.schema):
        raise ValidationError("monotonic=true needs queries that provably move in one direction "
                              "under replace-one (a chain of nested predicates, e.g. age >= 80, "
                              "age >= 70, ...); these do not, so use the default noise")
    return {"action": "open", **sp.to_mapping(), "queries": list(queries.canonical)}


class SVTJob(JobType):
    """Open, continue or close an SVT session at every site and combine the transcripts."""

    kind = "svt"
    pure_epsilon = True

    def validate(self, spec: JobSpec, federation: Federation) -> dict[str, Any]:
        """Validate queries, T, c, eps_3 against the schema; nothing is sent yet."""
        return svt_task_params(spec, federation)

    async def run(self, ctx: JobContext) -> JobOutput:
        """Dispatch the batch, validate each transcript, combine per query."""
        params = dict(ctx.params)
        action = params["action"]
        task_params: dict[str, Any] = dict(params)
        if action == "open":
            task_params["session"] = ctx.job_id
        session = str(task_params["session"])
        names: list[str] = []
        if action != "close":  # up to 50,000 predicate nodes: off the event loop
            names = list((await asyncio.to_thread(compile_query_set, ctx.federation.schema,
                                                  params["queries"], canonical=True)).names)
        k = len(names)

        def check(result: TaskResult) -> None:
            above = result.arrays.get("above")
            if above is None or above.ndim != 1 or above.shape[0] > k or not np.all(
                    (above == 0) | (above == 1)):
                raise ProtocolError(f"expected 'above' flags for at most {k} queries")
            values = result.arrays.get("values")
            n_pos = int((above == 1).sum())
            if values is not None and (values.shape != (n_pos,) or values.dtype != np.float64
                                       or not np.all(np.isfinite(values))):
                raise ProtocolError("'values' must hold one finite float64 per 'above' flag")
            if action == "open" and result.spend.epsilon <= 0:
                raise ProtocolError("the opening task reports no charge")
            if action != "open" and (result.spend.epsilon > 0 or result.spend.delta > 0):
                raise ProtocolError("a continuation must not charge again")
            if result.metadata.get("session") != session:
                raise ProtocolError("answer for another session")

        round_eps = ctx.spec.epsilon
        results = await ctx.dispatch("svt", task_params, round_name="svt", check_result=check,
                                     progress=(0.05, 0.9), epsilon=round_eps, delta=0.0)
        return combine_svt(ctx, results, names, session, action)


def combine_svt(ctx: JobContext, results: dict[str, TaskResult], names: list[str],
                session: str, action: str) -> JobOutput:
    """Per query: sites above, which ones, and the sum of paid values with its std error."""
    site_ids = sorted(results)
    k = len(names)
    above = np.full((len(site_ids), k), -1, dtype=np.int8)  # -1: not examined (cut-off)
    values = np.full((len(site_ids), k), np.nan)
    numeric_scale = 0.0
    sites_meta: list[dict[str, Any]] = []
    for i, s in enumerate(site_ids):
        r = results[s]
        flags = r.arrays["above"]
        above[i, :flags.shape[0]] = flags
        if "values" in r.arrays:
            values[i, np.flatnonzero(flags == 1)] = r.arrays["values"]
        m = r.metadata
        sites_meta.append({"site_id": s, "n_rows": m.get("n_rows"),
                           "epsilon": r.spend.epsilon,
                           "n_examined_total": m.get("n_examined_total"),
                           "n_positives_total": m.get("n_positives_total"),
                           "halted": bool(m.get("halted")), "closed": bool(m.get("closed"))})
        scale = m.get("numeric_scale")
        if isinstance(scale, int | float) and math.isfinite(scale) and scale > 0:
            if numeric_scale and abs(numeric_scale - scale) > 1e-9 * scale:
                raise ProtocolError(f"site {s} reports a numeric noise scale different from the "
                                    "other sites'")
            numeric_scale = float(scale)
    n_above = (above == 1).sum(axis=0)
    n_examined = (above >= 0).sum(axis=0)
    has_values = bool(np.any(~np.isnan(values)))
    n_valued = (~np.isnan(values)).sum(axis=0)
    value_sum = np.where(n_valued > 0, np.nansum(values, axis=0), np.nan)
    value_se = np.where(n_valued > 0, np.sqrt(n_valued * 2.0) * numeric_scale, np.nan)
    metadata: dict[str, Any] = {
        "job_id": ctx.job_id, "kind": "svt", "action": action, "session": session,
        "epsilon": ctx.spec.epsilon, "queries": names, "site_ids": site_ids,
        "sites": sites_meta, "numeric_scale": numeric_scale if has_values else None,
        "params": {k2: v for k2, v in ctx.params.items() if k2 != "queries"},
        "charged_now": action == "open", "software_version": __version__}
    summary = {"session": session, "action": action, "queries": k, "sites": len(site_ids),
               "queries_above_somewhere": int((n_above > 0).sum()),
               "halted_sites": sum(1 for m in sites_meta if m["halted"])}
    # Result files hold finite numbers only (the coordinator refuses to store NaN): "no value"
    # travels as 0 with a mask (``value_released``, ``n_valued``); SVTJobResult restores NaN.
    released = ~np.isnan(values)
    arrays = {"above": above, "values": np.where(released, values, 0.0),
              "value_released": released, "n_above": n_above.astype(np.int64),
              "n_examined": n_examined.astype(np.int64), "n_valued": n_valued.astype(np.int64),
              "value_sum": np.where(n_valued > 0, value_sum, 0.0),
              "value_std_error": np.where(n_valued > 0, value_se, 0.0)}
    return JobOutput(arrays, metadata, summary)
