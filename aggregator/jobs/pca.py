"""Coordinator side of the ``pca`` job: DP clip radius, DP mean, the second moment, top-K.

Every round is a deterministic function of the job's parameters and of the earlier rounds'
releases, so a resumed job re-sends identical tasks (same ids, same centre and clip radius)
and the sites replay their ledgers instead of charging again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.aggregator.jobs.job import Job, JobOutput
from dpfed.aggregator.jobs.records import mode_record, round_log, secure_record, site_spend
from dpfed.aggregator.pca_result import PCAResult
from dpfed.common.job_params import PCAParams
from dpfed.common.jobs.contract import Pooled
from dpfed.common.jobs.eligibility import gaussian_rounds_epsilon
from dpfed.common.jobs.pca import MEAN, MOMENT, NORMS, MomentInputs
from dpfed.common.pca.centring import centred_radius
from dpfed.common.pca.features import feature_names


async def run(job: Job[PCAParams]) -> JobOutput:
    """Ask for the rounds the parameters call for, then decompose (post-processing only)."""
    params = job.params
    schema = job.federation.schema
    released: list[Pooled[Any]] = []
    center = None
    clip = params.clip_norm if isinstance(params.clip_norm, float) else None

    async def norms() -> float:
        pooled = await job.release(NORMS, center)
        released.append(pooled)
        job.emit("combine", f"clip radius {pooled.value:.4g} = DP {params.clip_quantile:g}-"
                 "quantile of the row norms")
        return float(pooled.value)

    if params.clip_first and params.clip_norm == "auto":  # the radius bounds the mean's rows
        clip = await norms()
    if params.centering == "mean":
        mean = await job.release(MEAN, clip if params.clip_first else None)
        released.append(mean)
        center = mean.value
        job.emit("combine", f"DP mean formed from {len(mean.rows)} site sum(s) over "
                 f"{mean.n_rows_total} rows")
    if not params.clip_first and params.clip_norm == "auto":
        clip = await norms()
    elif params.clip_norm == "auto" and center is not None and clip is not None:
        clip = centred_radius(clip, center)  # post-processing: the centred rows are shorter
        job.emit("combine", f"clip radius {clip:.4g} for the rows centred at the DP mean")
    moment = await job.release(MOMENT, MomentInputs(center, clip))
    released.append(moment)
    job.emit("combine", f"combining {len(moment.rows)} site release(s) into "
             f"K={params.n_components} components", 0.92)
    estimate = await asyncio.to_thread(moment.value.top, params.n_components)
    names = feature_names(schema)
    base = params.to_mapping()
    sites = [{"site_id": s, "n_rows": moment.rows[s], **site_spend(released, s),
              "noise_sigma": moment.value.noise_sigma[s], "weight": moment.value.weights[s]}
             for s in moment.participants]
    if params.composition == "gdp":  # what a pld ledger is charged: the rounds composed
        for site in sites:
            site["epsilon"] = gaussian_rounds_epsilon(
                [(p.budget.epsilon, p.budget.delta) for p in released if site["site_id"] in p.rows])
    metadata: dict[str, Any] = {
        "job_id": job.job_id, "kind": job.kind.name, "epsilon": job.spec.epsilon,
        "delta": job.spec.delta, **base, "clip_norm_requested": base["clip_norm"],
        "clip_norm": moment.value.clip_norm,
        "rounds": round_log(released), "total_variance": estimate.total_variance,
        "sites": sites, "n_rows_total": moment.n_rows_total, "schema_toml": schema.to_toml(),
        "software_version": __version__, **secure_record(moment)}
    modes = mode_record(job, moment)
    if modes:
        metadata["aggregation_comparison"] = modes
    ratio = estimate.explained_variance_ratio
    summary = {"n_components": params.n_components, "rank": params.rank,
               "aggregation": params.aggregation, "sites": len(sites),
               "n_rows_total": moment.n_rows_total, "centering": params.centering,
               "clip_norm": metadata["clip_norm"],
               "top_eigenvalues": [float(v) for v in estimate.eigenvalues[:5]],
               "explained_variance_ratio_sum": float(np.sum(ratio))}
    result = PCAResult(estimate.components, estimate.eigenvalues, ratio, tuple(names),
                       metadata, estimate.spectrum, center)
    return JobOutput(result.arrays(), metadata, summary)

