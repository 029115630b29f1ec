"""The ``pca`` job under secure aggregation: one secure Gram sum instead of per-site factors.

The sites' Gram matrices of their unit-ball rows are summed under secure aggregation with
distributed Skellam noise (:mod:`dpfed.aggregator.jobs.secure_rounds`); the coordinator decodes
the noisy pooled ``G``, divides by the public pooled row count and takes the top-K eigenvectors
— post-processing of one DP release whose noise is calibrated to one row of the *pooled* data,
not of each site's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from scipy import linalg

from dpfed import __version__
from dpfed.aggregator.jobs.base import JobContext, JobOutput
from dpfed.aggregator.jobs.secure_rounds import secure_sum, symmetric_from_upper
from dpfed.aggregator.pca_result import PCAResult
from dpfed.common.job_params import PCAParams
from dpfed.common.pca.dppca import PCAEstimate


def _decompose(a: np.ndarray, k: int) -> PCAEstimate:
    values, vectors = linalg.eigh(a, check_finite=False)
    order = np.argsort(values)[::-1]
    values, vectors = values[order], vectors[:, order]
    comps = np.ascontiguousarray(vectors[:, :k].T)
    signs = np.sign(comps[np.arange(k), np.argmax(np.abs(comps), axis=1)])
    comps *= np.where(signs == 0, 1.0, signs)[:, None]
    spectrum = np.clip(values, 0.0, None)
    return PCAEstimate(comps, spectrum[:k], float(np.sum(spectrum)), spectrum)


async def run_secure_pca(ctx: JobContext, params: PCAParams, kind: str) -> JobOutput:
    """Run the secure rounds, decode the pooled second moment, return the PCA result."""
    names = ctx.federation.feature_names
    p = len(names)
    site_params: dict[str, Any] = {}
    if params.clip_norm is not None:
        site_params["clip_norm"] = params.clip_norm
    out = await secure_sum(ctx, name="pca", statistic="gram", dim=p, site_params=site_params,
                           epsilon=ctx.spec.epsilon, delta=ctx.spec.delta)
    n_total = out.n_rows_total
    ctx.emit("combine", f"decoded the secure sum of {len(out.plan.participants)} sites "
             f"({n_total} rows); top {params.n_components} of the pooled second moment", 0.92)
    a = symmetric_from_upper(out.value, p) / n_total
    estimate = await asyncio.to_thread(_decompose, a, params.n_components)
    cal = out.plan.calibration
    sites: list[dict[str, Any]] = [
        {"site_id": s, "n_rows": out.n_rows[s], "epsilon": ctx.spec.epsilon,
         "delta": ctx.spec.delta, "noise_sigma": float(np.sqrt(out.plan.share))
         / out.plan.scale ** 2 / n_total} for s in out.plan.participants]
    metadata: dict[str, Any] = {
        "job_id": ctx.job_id, "kind": kind, "epsilon": ctx.spec.epsilon,
        "delta": ctx.spec.delta, **params.to_mapping(),
        "total_variance": estimate.total_variance, "sites": sites, "n_rows_total": n_total,
        "schema_toml": ctx.federation.schema.to_toml(), "software_version": __version__,
        "secure": {"participants": list(out.plan.participants),
                   "tolerated_colluders": out.plan.tolerated, "attempts": out.attempts,
                   "mechanism": "skellam", "noise_variance_integer": out.plan.mu_total,
                   "scale": out.plan.scale, "l2_sensitivity_integer": cal.l2_sensitivity,
                   "pooled_noise_sigma": float(np.sqrt(out.plan.mu_total))
                   / out.plan.scale ** 2 / n_total},
    }
    ratio = estimate.explained_variance_ratio
    summary = {"n_components": params.n_components, "aggregation": "secure",
               "sites": len(out.plan.participants), "n_rows_total": n_total,
               "tolerated_colluders": out.plan.tolerated,
               "top_eigenvalues": [float(v) for v in estimate.eigenvalues[:5]],
               "explained_variance_ratio_sum": float(np.sum(ratio))}
    result = PCAResult(estimate.components, estimate.eigenvalues, ratio, tuple(names),
                       metadata, estimate.spectrum)
    return JobOutput(result.arrays(), metadata, summary)
