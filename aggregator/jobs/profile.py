"""Coordinator side of the ``profile`` job: per-site policy counts, pooled means to impute with.

Everything here is post-processing of the two releases: per column, a missing rate over the
rows read (the sites' noisy ``missing`` counts over their public ``N_s`` plus their noisy
dropped rows) and, for the job's columns, the DP mean of the observed values
(:func:`dpfed.common.data.imputation.dp_means`) with its approximate noise sd.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.aggregator.jobs.job import Job, JobOutput
from dpfed.common.data.imputation import dp_means
from dpfed.common.data.policy_counts import DROP_BUCKETS
from dpfed.common.data.schema import DateColumn, Schema
from dpfed.common.jobs.profile import MEANS, POLICY, PooledSums, ProfileParams, SiteCounts


def missing_rates(schema: Schema, counts: SiteCounts) -> np.ndarray:
    """Per column of the schema, its pooled missing rate over the rows read, clipped to [0, 1].

    Rows read at a site: its public ``N_s`` plus its noisy dropped rows (at least 0).
    """
    n_drop = len(DROP_BUCKETS)
    n_cols = len(schema.columns)
    missing = np.zeros(n_cols)
    read = 0.0
    for site, v in counts.counts.items():
        read += counts.rows[site] + max(float(v[:n_drop].sum()), 0.0)
        missing += v[n_drop:n_drop + n_cols]
    return np.clip(missing / max(read, 1.0), 0.0, 1.0)


def suggested_impute(schema: Schema, column: str, value: float) -> str:
    """Return the ``impute`` value for the schema: ISO 8601 for dates, a number otherwise."""
    col = schema.column(column)
    return col.iso(value) if isinstance(col, DateColumn) else f"{value:.6g}"


def means_with_sd(schema: Schema, sums: PooledSums) -> tuple[np.ndarray, np.ndarray]:
    """Return the DP means in schema units and their approximate noise sd.

    The sd is the delta-method one of the numerator's noise: ``half_range sqrt(S) sigma /
    n_c`` with ``n_c`` the pooled noisy count of observed values (at least 1).
    """
    means = dp_means(schema, sums.columns, sums.releases)
    total = np.sum(sums.releases, axis=0)
    c = len(sums.columns)
    sds = []
    for i, name in enumerate(sums.columns):
        half_range = float(schema.column(name).half_range)  # type: ignore[union-attr]
        sds.append(half_range * math.sqrt(len(sums.releases)) * sums.sigma
                   / max(float(total[c + i]), 1.0))
    return np.array([means[n] for n in sums.columns]), np.array(sds)


async def run(job: Job[ProfileParams]) -> JobOutput:
    """Release the policy counts, then (with columns) the observed sums; pool both."""
    schema = job.federation.schema
    policy = await job.release(POLICY, None)
    counts = policy.value
    sites = sorted(counts.counts)
    arrays: dict[str, np.ndarray] = {
        "policy_counts": np.array([counts.counts[s] for s in sites]),
        "missing_rate": missing_rates(schema, counts)}
    metadata: dict[str, Any] = {
        "job_id": job.job_id, "kind": "profile", "epsilon": job.spec.epsilon,
        "delta": job.spec.delta, "params": job.params.to_mapping(),
        "count_names": list(counts.names), "columns": [c.name for c in schema.columns],
        "policy_sigma": counts.sigma, "policy_epsilon": policy.budget.epsilon,
        "policy_delta": policy.budget.delta,
        "sites": [{"site_id": s, "n_rows": counts.rows[s]} for s in sites],
        "software_version": __version__}
    summary: dict[str, Any] = {"sites": len(sites)}
    if job.params.columns:
        sums = await job.release(MEANS, None)
        means, sds = means_with_sd(schema, sums.value)
        arrays["means"] = means
        arrays["mean_sd"] = sds
        metadata.update({
            "mean_columns": sums.value.columns, "means_sigma": sums.value.sigma,
            "means_epsilon": sums.budget.epsilon, "means_delta": sums.budget.delta,
            "means_sites": sums.participants,
            "impute": {c: suggested_impute(schema, c, float(m))
                       for c, m in zip(sums.value.columns, means, strict=True)}})
        summary["columns"] = len(sums.value.columns)
    return JobOutput(arrays, metadata, summary)
