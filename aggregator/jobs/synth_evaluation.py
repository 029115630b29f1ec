"""Coordinator side of a ``synth`` job's evaluation rounds (after the model is fitted).

``evaluate`` (task kind ``synth_eval``)
    a synthetic sample goes to every site whose data is in the model; each writes its local
    report (training rows vs its holdout) and answers only that it did: nothing is charged.
``evaluate_summary`` (task kind ``synth_eval_dp``, only when the job names a summary budget)
    the same sample goes to the model's sites whose policy allows DP summaries (they
    advertise the kind); each releases a DP summary of its evaluation
    (:mod:`dpfed.common.evaluation.dp_summary`), charged to its ledger at the job's summary
    (epsilon, delta).

Neither round can fail the job (the model is already made): a site that fails one keeps its
"ok" outcome with the failure in its reason; each summary is a site's own statistic, so the
summary round needs one answering site, not the quorum.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from dpfed.aggregator.jobs.base import JobContext
from dpfed.aggregator.synth_model import SynthModel
from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ProtocolError, QuorumError
from dpfed.common.job_params import SynthParams
from dpfed.common.transport.protocol import SiteOutcome, TaskResult

log = logging.getLogger(__name__)

#: Task kind of the local-only evaluation round.
EVAL_KIND = "synth_eval"
#: Task kind of the DP evaluation summary (sites enable it with evaluation_summary = "dp").
SUMMARY_KIND = "synth_eval_dp"
#: Largest |value| a noisy summary statistic may have (a share or TVD plus noise).
MAX_SUMMARY_VALUE = 1e6
_SUMMARY_META = ("n_train", "n_compared", "n_holdout", "threshold", "sigma_tvd",
                 "sigma_near_train", "sigma_near_holdout")


def summary_sites(ctx: JobContext, model_sites: list[str]) -> list[str]:
    """Return the model's sites that advertise DP evaluation summaries (policy allows)."""
    allowing = {s.site_id for s in ctx.registry.connected()
                if SUMMARY_KIND in s.hello.allowed_kinds}
    return [s for s in model_sites if s in allowing]


def check_summary(n_columns: int) -> Any:
    """Return the result check of the summary round (shapes, finite, bounded)."""

    def check(result: TaskResult) -> None:
        tvd, near = result.arrays.get("tvd"), result.arrays.get("near")
        for name, a, size in (("tvd", tvd, n_columns), ("near", near, 2)):
            if a is None or a.shape != (size,) or a.dtype != np.float64 or not np.all(
                    np.isfinite(a)) or float(np.abs(a).max(initial=0.0)) > MAX_SUMMARY_VALUE:
                raise ProtocolError(f"expected a finite float64 {name} of shape ({size},)")
        for key in _SUMMARY_META:
            v = result.metadata.get(key)
            if not isinstance(v, int | float) or not np.isfinite(v) or v < 0:
                raise ProtocolError(f"summary metadata {key!r} must be a finite number >= 0")

    return check


def _keep_ok(ctx: JobContext, before: dict[str, SiteOutcome], round_name: str) -> None:
    """Restore "ok" for sites that failed an evaluation round (their model part stands)."""
    for site_id, earlier in before.items():
        now = ctx.outcomes.get(site_id)
        if earlier.status == "ok" and now is not None and now.status != "ok":
            ctx.outcomes[site_id] = SiteOutcome(
                site_id, "ok", f"{round_name}: {now.status} ({now.reason})", now.spend,
                earlier.row_count)


async def run_evaluation(ctx: JobContext, model: SynthModel, params: SynthParams,
                         schema: Schema, model_sites: list[str]) -> dict[str, Any]:
    """Run the evaluation round(s) at ``model_sites``; return what the model records of them."""
    sample = EncodedTable.concatenate(list(model.iter_encoded(
        None if model.factors is not None else params.evaluate_rows)))
    take = min(sample.n_rows, params.evaluate_rows)
    arrays = {f"col:{c.name}": np.ascontiguousarray(sample.columns[c.name][:take])
              for c in schema.columns}
    out: dict[str, Any] = {"sample_rows": take, "local_report_sites": []}
    ctx.emit("evaluate", f"sending a {take}-row synthetic sample to {len(model_sites)} site(s) "
             "for their local evaluation (nothing comes back, nothing is charged)", 0.95)
    before = dict(ctx.outcomes)
    try:
        local = await ctx.dispatch(EVAL_KIND, {"schema_digest": schema.digest()},
                                   round_name="evaluate", arrays=arrays, epsilon=0.0,
                                   delta=0.0, progress=(0.95, 0.97), only=model_sites)
        out["local_report_sites"] = sorted(local)
    except QuorumError as exc:
        ctx.emit("evaluate", f"site-local evaluation incomplete: {exc}", 0.97)
    _keep_ok(ctx, before, "evaluate")
    if params.summary_epsilon <= 0:
        return out
    allowing = summary_sites(ctx, model_sites)
    out["summary_epsilon"] = params.summary_epsilon
    out["summary_delta"] = params.summary_delta
    out["summary_sites_asked"] = allowing
    out["summaries"] = {}
    if not allowing:
        ctx.emit("evaluate", "no site of the model allows DP evaluation summaries "
                 "(policy evaluation_summary = \"dp\"); nothing was asked or charged", 0.99)
        return out
    ctx.emit("evaluate", f"asking {len(allowing)} site(s) whose policy allows it for a DP "
             f"summary of their evaluation (epsilon {params.summary_epsilon:g}, delta "
             f"{params.summary_delta:g} each)", 0.97)
    before = dict(ctx.outcomes)
    try:
        results = await ctx.dispatch(
            SUMMARY_KIND, {"schema_digest": schema.digest(), "n_bins": params.n_bins},
            round_name="evaluate_summary", arrays=arrays, epsilon=params.summary_epsilon,
            delta=params.summary_delta, check_result=check_summary(len(schema.columns)),
            progress=(0.97, 0.99), only=allowing, quorum=1)
    except QuorumError as exc:
        ctx.emit("evaluate", f"no DP evaluation summary came back: {exc}", 0.99)
        results = {}
    _keep_ok(ctx, before, "evaluate_summary")
    for site_id in sorted(results):
        r = results[site_id]
        out["summaries"][site_id] = {
            "tvd": dict(zip(schema.names, (float(x) for x in r.arrays["tvd"]), strict=True)),
            "near_train": float(r.arrays["near"][0]),
            "near_holdout": float(r.arrays["near"][1]),
            **{k: float(r.metadata[k]) for k in _SUMMARY_META},
            "epsilon": r.spend.epsilon, "delta": r.spend.delta}
    return out
