"""Coordinator side of the ``pca`` job: DPdisPCA's aggregation of the sites' P_s."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.aggregator.federation import Federation
from dpfed.aggregator.jobs.base import JobContext, JobOutput, JobType
from dpfed.aggregator.jobs.validators import (
    RESULT_ENVELOPE_BYTES,
    check_gram_factor,
    require_array,
    require_positive_int,
    symmetric_gaussian_norm_bound,
)
from dpfed.aggregator.pca_result import PCAResult
from dpfed.common.job_params import PCAParams
from dpfed.common.pca.dppca import combine, pca_mechanism
from dpfed.common.transport.protocol import JobSpec, TaskResult
from dpfed.common.validation import check_delta, check_epsilon


class PCAJob(JobType):
    """One round: every site sends P_s (p x R); the coordinator returns the top-K subspace."""

    kind = "pca"

    def validate(self, spec: JobSpec, federation: Federation) -> dict[str, Any]:
        """Validate K, R, calibration and clip_norm against the federation schema."""
        epsilon = check_epsilon(spec.epsilon)
        delta = check_delta(spec.delta)
        params = PCAParams.from_mapping(spec.params, n_features=len(federation.feature_names))
        params.check_privacy(epsilon, delta)
        return params.to_mapping()

    async def run(self, ctx: JobContext) -> JobOutput:
        """Dispatch, validate each P_s, combine."""
        names = ctx.federation.feature_names
        params = PCAParams.from_mapping(ctx.params, n_features=len(names))
        p = len(names)

        def check(result: TaskResult) -> None:
            factor = require_array(result, "factor", (p, params.rank))
            n = require_positive_int(result.metadata, "n_rows")
            # What an honest P_s can be: ||G_s/N_s||_2 <= 1 (unit-ball rows) plus the noise,
            # whose sigma is public (epsilon, delta, calibration and the site's N_s).
            sigma = pca_mechanism(n, ctx.spec.epsilon, ctx.spec.delta, params.calibration).sigma
            check_gram_factor(factor, "P_s", trace_bound=1.0,
                              noise_norm_bound=symmetric_gaussian_norm_bound(sigma, p))

        # The answer is P_s (p x R float64) plus a small envelope (metadata, spend).
        expected = p * params.rank * 8
        results = await ctx.dispatch("pca", params.to_mapping(), round_name="pca",
                                     check_result=check, progress=(0.05, 0.9),
                                     max_result_bytes=expected + RESULT_ENVELOPE_BYTES)
        ctx.emit("combine", f"combining {len(results)} site factor(s) (p={p}, "
                 f"R={params.rank}) into K={params.n_components} components", 0.92)
        site_ids = sorted(results)
        factors = [results[s].arrays["factor"] for s in site_ids]
        estimate = await asyncio.to_thread(combine, factors, params.n_components)
        sites: list[dict[str, Any]] = [
            {"site_id": s, "n_rows": int(results[s].metadata["n_rows"]),
             "epsilon": results[s].spend.epsilon, "delta": results[s].spend.delta,
             "noise_sigma": results[s].spend.noise_scale} for s in site_ids]
        n_rows_total = sum(int(s["n_rows"]) for s in sites)
        metadata: dict[str, Any] = {
            "job_id": ctx.job_id, "kind": self.kind, "epsilon": ctx.spec.epsilon,
            "delta": ctx.spec.delta, **params.to_mapping(),
            "total_variance": estimate.total_variance, "sites": sites,
            "n_rows_total": n_rows_total,
            "schema_toml": ctx.federation.schema.to_toml(),
            "software_version": __version__,
        }
        ratio = estimate.explained_variance_ratio
        summary = {"n_components": params.n_components, "rank": params.rank,
                   "sites": len(site_ids), "n_rows_total": n_rows_total,
                   "top_eigenvalues": [float(v) for v in estimate.eigenvalues[:5]],
                   "explained_variance_ratio_sum": float(np.sum(ratio))}
        result = PCAResult(estimate.components, estimate.eigenvalues, ratio, tuple(names),
                           metadata, estimate.spectrum)
        return JobOutput(result.arrays(), metadata, summary)
