"""The ``query`` job under secure aggregation: one secure sum of ``Ã x_s`` instead of S releases.

1. Choose the strategy as the site-level job does, for Gaussian-shaped noise and ONE noise draw
   (the pooled sum carries one noise vector, not S), and send it verifiably (name or matrix +
   digest).
2. One secure sum (:func:`dpfed.aggregator.jobs.secure_rounds.secure_sum`, ``source =
   "query"``): the coordinator picks the largest power-of-two scale ``s`` that cannot wrap
   (:func:`dpfed.common.secagg.linear_sum.choose_linear_scale`, from the public row counts);
   every site rebuilds ``Ã = rint(s A)``, its sensitivities and the Skellam variance, and sends
   ``Ã x_s`` plus its noise share, masked.
3. The coordinator decodes ``Σ / s = (Ã / s) x + noise / s`` and reconstructs with the strategy
   ``Ã / s`` actually used (no bias from rounding ``A``); each answer's standard error comes
   from the pooled noise variance ``n · μ / (n - t) / s²`` (one draw, every share counted).

Privacy: the sites' Skellam shares sum to at least ``μ`` among any ``n - t`` honest sites,
calibrated for the replace-one sensitivity of ``Ã`` (see :mod:`dpfed.common.secagg.linear_sum`);
each site is charged ``(epsilon, delta)`` once; reconstruction is post-processing. The
coordinator learns only the noisy pooled answers and the public row counts.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.aggregator.jobs.base import JobContext, JobOutput
from dpfed.aggregator.jobs.secure_rounds import secure_sum
from dpfed.common.errors import ProtocolError
from dpfed.common.queries.federated_matrix import (
    per_query_std_error,
    strategy_digest,
    strategy_transport,
)
from dpfed.common.queries.matrix_mechanism import reconstruct
from dpfed.common.queries.query_language import Domain
from dpfed.common.queries.workload_spec import choose_strategy
from dpfed.common.queries.workloads import Workload, identity_workload
from dpfed.common.secagg.linear_sum import (
    LinearSumPlan,
    choose_linear_scale,
    plan_linear,
    sum_fits_ring,
)
from dpfed.common.secagg.secure_sum import SecureSumPlan


async def run_secure_query(ctx: JobContext, domain: Domain, workload: Workload,
                           params: dict[str, Any]) -> JobOutput:
    """Choose the strategy, run the secure sum, reconstruct, answer with standard errors."""
    eps, delta = ctx.spec.epsilon, ctx.spec.delta
    ctx.emit("strategy", f"choosing a strategy for {workload.name} over {domain.n_cells} "
             f"cells (candidates: {params['strategy']}; secure: one pooled noise draw)", 0.02)
    pick = await asyncio.to_thread(choose_strategy, workload, strategy_name=params["strategy"],
                                   noises=("gaussian",), epsilon=eps, delta=delta, n_sites=1)
    a = pick.matrix
    digest = strategy_digest(a)
    strategy_spec, arrays = strategy_transport(pick.name, a, domain.n_cells)
    planned: dict[tuple[tuple[str, ...], int, int], LinearSumPlan] = {}

    def make_plan(participants: list[str], tolerated: int, total_rows: int) -> SecureSumPlan:
        scale = choose_linear_scale(a, total_rows=total_rows, epsilon=eps, delta=delta,
                                    n_participants=len(participants))
        linear = plan_linear(a, scale=scale, epsilon=eps, delta=delta,
                             participants=participants, tolerated=tolerated)
        planned[(linear.plan.participants, tolerated, total_rows)] = linear
        return linear.plan

    async def plan_for(participants: list[str], tolerated: int,
                       total_rows: int) -> SecureSumPlan:
        # O(k n^2) sensitivities: off the event loop that serves the sites' streams
        return await asyncio.to_thread(make_plan, participants, tolerated, total_rows)

    site_params = {"source": "query", "domain": domain.to_json(), "strategy": strategy_spec}
    out = await secure_sum(ctx, name="query", statistic="linear", dim=int(a.shape[0]),
                           site_params=site_params, epsilon=eps, delta=delta, arrays=arrays,
                           plan_for=plan_for, require_kind="query", progress=(0.05, 0.9))
    linear = next(lp for lp in planned.values() if lp.plan is out.plan)
    plan = out.plan
    if not sum_fits_ring(linear, out.n_rows_total):
        raise ProtocolError(f"the sites report {out.n_rows_total} rows, more than the scale "
                            f"{plan.scale:g} was chosen for: the secure sum may have wrapped; "
                            "rerun the job (the sites' row counts are now known)")
    used = linear.strategy
    recon = params["reconstruction"]
    ctx.emit("combine", f"decoded the secure sum of {len(plan.participants)} sites "
             f"({out.n_rows_total} rows); reconstructing ({recon})", 0.92)
    x_hat = await asyncio.to_thread(reconstruct, out.value, used,
                                    nonnegative=None if recon == "least_squares" else recon)
    answers = workload.answer(x_hat)
    var = linear.answer_variance
    answer_se = per_query_std_error(workload, used, noise_variance=var, n_sites=1)
    cell_se = per_query_std_error(identity_workload(domain.n_cells), used, noise_variance=var,
                                  n_sites=1)
    rmse = float(np.sqrt(np.mean(answer_se ** 2)))
    # The strategy ranking priced Gaussian noise; the secure sum's noise differs from it by one
    # factor for every strategy (Skellam vs Gaussian, n / (n - t) shares), applied to the rest.
    factor = rmse / pick.rmse if pick.rmse > 0 else 1.0
    cal = plan.calibration
    share_sigma = math.sqrt(plan.share) / plan.scale
    sites = [{"site_id": s, "n_rows": out.n_rows[s], "epsilon": eps, "delta": delta,
              "sensitivity": cal.l2_sensitivity / plan.scale, "noise_scale": share_sigma}
             for s in plan.participants]
    w = params["workload"]
    guarantee = (f"({eps:g}, {delta:g})-DP for every row at every participating site under "
                 f"replace-one, as long as at most {plan.tolerated} parties (the coordinator "
                 f"counted) collude; the coordinator sees only the noisy pooled sum")
    secure = {"participants": list(plan.participants), "tolerated_colluders": plan.tolerated,
              "attempts": out.attempts, "mechanism": "skellam", "scale": plan.scale,
              "noise_variance_integer": plan.pooled_variance,
              "guaranteed_variance_integer": plan.mu_total,
              "l2_sensitivity_integer": cal.l2_sensitivity,
              "l1_sensitivity_integer": cal.l1_sensitivity,
              "sensitivity_exact": linear.sensitivity_exact,
              "achieved_epsilon": cal.achieved_epsilon,
              "pooled_noise_sigma": math.sqrt(var), "guarantee": guarantee}
    metadata: dict[str, Any] = {
        "job_id": ctx.job_id, "kind": "query", "epsilon": eps, "delta": delta,
        "domain": domain.to_json(), "workload": {"kind": w["kind"], "k": w.get("k", 0)},
        "workload_name": workload.name, "strategy": pick.name, "noise": "skellam",
        "aggregation": "secure", "strategy_digest": digest, "reconstruction": recon,
        "expected_rmse": rmse, "identity_expected_rmse": pick.identity_rmse * factor,
        "ranking": [[nm, "skellam", r * factor] for nm, _nz, r in pick.ranking],
        "sites": sites, "n_sites": len(plan.participants), "n_rows_total": out.n_rows_total,
        "secure": secure, "schema_toml": ctx.federation.schema.to_toml(),
        "software_version": __version__}
    summary = {"strategy": pick.name, "noise": "skellam", "aggregation": "secure",
               "cells": domain.n_cells, "queries": workload.n_queries,
               "sites": len(plan.participants), "tolerated_colluders": plan.tolerated,
               "expected_rmse": round(rmse, 4),
               "identity_expected_rmse": round(pick.identity_rmse * factor, 4)}
    result = {"x_hat": x_hat, "x_std_error": cell_se, "answers": answers,
              "answer_std_error": answer_se}
    if w["kind"] == "custom":
        result["workload_matrix"] = np.asarray(w["matrix"], dtype=np.float64)
    return JobOutput(result, metadata, summary)
