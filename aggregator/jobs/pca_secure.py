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
from dpfed.common.pca.features import max_feature_norm
from dpfed.common.privacy.composition import rounds_rho


def decompose_second_moment(a: np.ndarray, k: int) -> PCAEstimate:
    """Top-``k`` eigenpairs of a decoded (noisy) symmetric matrix as a PCAEstimate.

    Post-processing: components in sklearn orientation with the largest-magnitude entry of each
    made positive; the spectrum's negative (noise) eigenvalues are clipped to 0.
    """
    values, vectors = linalg.eigh(a, check_finite=False)
    order = np.argsort(values)[::-1]
    values, vectors = values[order], vectors[:, order]
    comps = np.ascontiguousarray(vectors[:, :k].T)
    signs = np.sign(comps[np.arange(k), np.argmax(np.abs(comps), axis=1)])
    comps *= np.where(signs == 0, 1.0, signs)[:, None]
    spectrum = np.clip(values, 0.0, None)
    return PCAEstimate(comps, spectrum[:k], float(np.sum(spectrum)), spectrum)


async def run_secure_pca(ctx: JobContext, params: PCAParams, kind: str) -> JobOutput:
    """Run the secure rounds, decode the pooled (centred) second moment, return the result.

    Rows are the unit-ball rows ``x = clip_c(u) / c`` of every site (``c`` the public clip
    norm). Uncentred: ``A = G / N`` from one secure Gram sum. Centred (default): a secure row
    sum first (the ``mean`` share of the budget) gives the DP mean ``mu = S / N``, and the
    coordinator centres the decoded second moment itself, ``A = G / N - mu mu^T`` — exact
    post-processing, which the site-level mode cannot do because its sites send low-rank
    factors. Sites that drop out of one sum are left out of the next.
    """
    names = ctx.federation.feature_names
    schema = ctx.federation.schema
    p = len(names)
    clip = params.clip_norm if isinstance(params.clip_norm, float) else None
    c = clip if clip is not None else max_feature_norm(schema)
    site_params: dict[str, Any] = {} if clip is None else {"clip_norm": clip}
    shares = params.rounds(ctx.spec.epsilon, ctx.spec.delta)
    budget = {name: (eps, dl) for name, eps, dl in shares}
    if len(budget) > 1:  # every round a Skellam sum: at most its Gaussian-equivalent rho
        ctx.refuse_over_budget(rho=rounds_rho(shares))
    centred = params.centering == "mean"
    mu = np.zeros(p)
    rounds: list[dict[str, Any]] = []
    start = 0.05
    if centred:
        eps, dl = budget["mean"]
        mean_out = await secure_sum(ctx, name="mean", statistic="row_sum", dim=p,
                                    site_params=site_params, epsilon=eps, delta=dl,
                                    progress=(start, 0.4), require_kind=kind)
        mu = mean_out.value / mean_out.n_rows_total
        norm = float(np.linalg.norm(mu))
        if norm > 1.0:  # the true mean of unit-ball rows lies in the ball: post-processing
            mu /= norm
        mu = np.clip(mu * c, -1.0, 1.0) / c  # ... and in the schema's box
        rounds.append({"round": "mean", "epsilon": eps, "delta": dl,
                       "sites": list(mean_out.plan.participants)})
        start = 0.45
    eps, dl = budget["pca"]
    out = await secure_sum(ctx, name="pca", statistic="gram", dim=p, site_params=site_params,
                           epsilon=eps, delta=dl, progress=(start, 0.9), require_kind=kind)
    rounds.append({"round": "pca", "epsilon": eps, "delta": dl,
                   "sites": list(out.plan.participants)})
    n_total = out.n_rows_total
    ctx.emit("combine", f"decoded the secure sum of {len(out.plan.participants)} sites "
             f"({n_total} rows); top {params.n_components} of the pooled "
             f"{'covariance' if centred else 'second moment'}", 0.92)
    a = symmetric_from_upper(out.value, p) / n_total - np.outer(mu, mu)
    estimate = await asyncio.to_thread(decompose_second_moment, a, params.n_components)
    cal = out.plan.calibration
    sites: list[dict[str, Any]] = [
        {"site_id": s, "n_rows": out.n_rows[s],
         "epsilon": sum(r["epsilon"] for r in rounds if s in r["sites"]),
         "delta": sum(r["delta"] for r in rounds if s in r["sites"]),
         "noise_sigma": float(np.sqrt(out.plan.share)) / out.plan.scale ** 2 / n_total,
         "weight": out.n_rows[s] / n_total} for s in out.plan.participants]
    base = params.to_mapping()
    metadata: dict[str, Any] = {
        "job_id": ctx.job_id, "kind": kind, "epsilon": ctx.spec.epsilon,
        "delta": ctx.spec.delta, **base, "clip_norm_requested": base["clip_norm"],
        "clip_norm": c, "rounds": rounds,
        "total_variance": estimate.total_variance, "sites": sites, "n_rows_total": n_total,
        "schema_toml": schema.to_toml(), "software_version": __version__,
        "secure": {"participants": list(out.plan.participants),
                   "tolerated_colluders": out.plan.tolerated, "attempts": out.attempts,
                   "mechanism": "skellam", "noise_variance_integer": out.plan.pooled_variance,
                   "guaranteed_variance_integer": out.plan.mu_total,
                   "scale": out.plan.scale, "l2_sensitivity_integer": cal.l2_sensitivity,
                   "pooled_noise_sigma": float(np.sqrt(out.plan.pooled_variance))
                   / out.plan.scale ** 2 / n_total},
    }
    ratio = estimate.explained_variance_ratio
    summary = {"n_components": params.n_components, "aggregation": "secure",
               "centering": params.centering, "clip_norm": c,
               "sites": len(out.plan.participants), "n_rows_total": n_total,
               "tolerated_colluders": out.plan.tolerated,
               "top_eigenvalues": [float(v) for v in estimate.eigenvalues[:5]],
               "explained_variance_ratio_sum": float(np.sum(ratio))}
    result = PCAResult(estimate.components, estimate.eigenvalues, ratio, tuple(names),
                       metadata, estimate.spectrum, mu * c if centred else None)
    return JobOutput(result.arrays(), metadata, summary)
