"""Coordinator side of the ``pca`` job: DP mean, DP clip radius, DPdisPCA's aggregation."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.aggregator.federation import Federation
from dpfed.aggregator.jobs.base import JobContext, JobOutput, JobType
from dpfed.aggregator.jobs.pca_secure import run_secure_pca
from dpfed.aggregator.jobs.validators import (
    NOISE_BOUND_TAIL,
    RESULT_ENVELOPE_BYTES,
    check_gram_factor,
    require_array,
    require_positive_int,
    symmetric_gaussian_norm_bound,
)
from dpfed.aggregator.pca_result import PCAResult
from dpfed.common.errors import ProtocolError
from dpfed.common.job_params import PCAParams
from dpfed.common.pca.centring import dp_mean, mean_sum_mechanism
from dpfed.common.pca.clipping import dp_quantile, norm_bound, norm_grid, norm_histogram_mechanism
from dpfed.common.pca.dppca import combine, pca_mechanism, site_weights
from dpfed.common.pca.features import max_feature_norm
from dpfed.common.transport.protocol import JobSpec, TaskResult
from dpfed.common.validation import check_delta, check_epsilon


class PCAJob(JobType):
    """Up to three rounds: DP mean, DP row-norm quantile, then DPdisPCA's P_s and the combination.

    Every round is a deterministic function of the job's parameters and of the earlier rounds'
    releases, so a resumed job re-sends identical tasks (same ids, same centre and clip radius)
    and the sites replay their ledgers instead of charging again.
    """

    kind = "pca"

    def validate(self, spec: JobSpec, federation: Federation) -> dict[str, Any]:
        """Validate K, R, calibration, clip_norm, centring and weighting against the schema."""
        epsilon = check_epsilon(spec.epsilon)
        delta = check_delta(spec.delta)
        params = PCAParams.from_mapping(spec.params, n_features=len(federation.feature_names))
        params.check_privacy(epsilon, delta)
        return params.to_mapping()

    async def run(self, ctx: JobContext) -> JobOutput:
        """Run the rounds, validate every release, combine."""
        names = ctx.federation.feature_names
        schema = ctx.federation.schema
        params = PCAParams.from_mapping(ctx.params, n_features=len(names))
        if params.aggregation == "secure":
            return await run_secure_pca(ctx, params, self.kind)
        p = len(names)
        base = params.to_mapping()
        rounds = params.rounds(ctx.spec.epsilon, ctx.spec.delta)
        budget = {name: (eps, dl) for name, eps, dl in rounds}
        span = 0.85 / len(rounds)
        start = 0.05
        arrays: dict[str, np.ndarray] = {}
        center = np.zeros(p)
        centred = params.centering == "mean"
        round_log: list[dict[str, Any]] = []
        if len(rounds) > 1:
            ctx.refuse_over_budget()

        def record(name: str, results: dict[str, TaskResult]) -> None:
            round_log.append({"round": name, "epsilon": budget[name][0],
                              "delta": budget[name][1], "sites": sorted(results)})

        if centred:
            eps, dl = budget["mean"]
            mean_sigma = mean_sum_mechanism(eps, dl, params.calibration).sigma
            res = await ctx.dispatch("pca", {**base, "stage": "mean"}, round_name="mean",
                                     epsilon=eps, delta=dl,
                                     check_result=_check_vector("sum", p, mean_sigma),
                                     progress=(start, start + span))
            start += span
            record("mean", res)
            center = dp_mean([res[s].arrays["sum"] for s in sorted(res)], _rows(res),
                             max_feature_norm(schema))
            arrays = {"center": center}
            ctx.emit("combine", "DP mean formed from "
                     f"{len(res)} site sum(s) over {_rows(res)} rows", start)
        clip: float | None
        if params.clip_norm == "auto":
            eps, dl = budget["norms"]
            edges = norm_grid(norm_bound(schema, centred))
            res = await ctx.dispatch("pca", {**base, "stage": "norms"}, round_name="norms",
                                     arrays=arrays, epsilon=eps, delta=dl,
                                     check_result=_check_vector(
                                         "histogram", len(edges),
                                         norm_histogram_mechanism(
                                             eps, dl, params.calibration).sigma),
                                     progress=(start, start + span))
            start += span
            record("norms", res)
            clip = dp_quantile([res[s].arrays["histogram"] for s in sorted(res)], edges,
                               params.clip_quantile, _rows(res))
            ctx.emit("combine", f"clip radius {clip:.4g} = DP {params.clip_quantile:g}-quantile "
                     "of the row norms", start)
        else:
            clip = params.clip_norm if isinstance(params.clip_norm, float) else None
        clip_used = clip if clip is not None else norm_bound(schema, centred)

        def check(result: TaskResult) -> None:
            factor = require_array(result, "factor", (p, params.rank))
            n = require_positive_int(result.metadata, "n_rows")
            # What an honest P_s can be: ||z z^T|| <= 1 for every row (unit-ball rows, centred
            # or not) plus the noise, whose sigma is public (the round's epsilon and delta,
            # the calibration and the site's N_s; both PCA releases have sensitivity sqrt2/N_s).
            sigma = pca_mechanism(n, eps, dl, params.calibration).sigma
            check_gram_factor(factor, "P_s", trace_bound=1.0,
                              noise_norm_bound=symmetric_gaussian_norm_bound(sigma, p))

        eps, dl = budget["pca"]
        # The answer is P_s (p x R float64) plus a small envelope (metadata, spend).
        expected = p * params.rank * 8
        results = await ctx.dispatch(
            "pca", {**base, "clip_norm": "schema" if clip is None else clip, "stage": "pca"},
            round_name="pca", arrays=arrays, epsilon=eps, delta=dl, check_result=check,
            progress=(start, 0.9), max_result_bytes=expected + RESULT_ENVELOPE_BYTES)
        record("pca", results)
        ctx.emit("combine", f"combining {len(results)} site factor(s) (p={p}, "
                 f"R={params.rank}) into K={params.n_components} components "
                 f"({params.site_weighting} weighting)", 0.92)
        site_ids = sorted(results)
        factors = [results[s].arrays["factor"] for s in site_ids]
        weights = site_weights([int(results[s].metadata["n_rows"]) for s in site_ids],
                               params.site_weighting)
        estimate = await asyncio.to_thread(combine, factors, params.n_components,
                                           list(weights))
        sites: list[dict[str, Any]] = [
            {"site_id": s, "n_rows": int(results[s].metadata["n_rows"]),
             "epsilon": sum(r["epsilon"] for r in round_log if s in r["sites"]),
             "delta": sum(r["delta"] for r in round_log if s in r["sites"]),
             "noise_sigma": results[s].spend.noise_scale,
             "weight": float(w)} for s, w in zip(site_ids, weights, strict=True)]
        n_rows_total = sum(int(s["n_rows"]) for s in sites)
        metadata: dict[str, Any] = {
            "job_id": ctx.job_id, "kind": self.kind, "epsilon": ctx.spec.epsilon,
            "delta": ctx.spec.delta, **base,
            "clip_norm_requested": base["clip_norm"], "clip_norm": clip_used,
            "rounds": round_log,
            "total_variance": estimate.total_variance, "sites": sites,
            "n_rows_total": n_rows_total,
            "schema_toml": schema.to_toml(),
            "software_version": __version__,
        }
        ratio = estimate.explained_variance_ratio
        summary = {"n_components": params.n_components, "rank": params.rank,
                   "sites": len(site_ids), "n_rows_total": n_rows_total,
                   "centering": params.centering, "clip_norm": clip_used,
                   "top_eigenvalues": [float(v) for v in estimate.eigenvalues[:5]],
                   "explained_variance_ratio_sum": float(np.sum(ratio))}
        result = PCAResult(estimate.components, estimate.eigenvalues, ratio, tuple(names),
                           metadata, estimate.spectrum, center)
        return JobOutput(result.arrays(), metadata, summary)


def _rows(results: dict[str, TaskResult]) -> int:
    return sum(int(r.metadata["n_rows"]) for r in results.values())


def _check_rows(result: TaskResult) -> None:
    n = result.metadata.get("n_rows")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ProtocolError("result lacks a positive n_rows")


def _check_vector(name: str, length: int, sigma: float) -> Callable[[TaskResult], None]:
    """Return a check for a site's noisy vector ``name``: what an honest release can be.

    Both vector rounds release a sum over the site's rows of vectors of norm at most 1 (the
    rows scaled into the unit ball; one-hot norm histograms), so the exact part has norm at most
    ``N_s``; the Gaussian noise's norm is at most ``sigma (sqrt(length) + NOISE_BOUND_TAIL)``
    with overwhelming probability.
    """

    def check(result: TaskResult) -> None:
        v = require_array(result, name, (length,))
        n = require_positive_int(result.metadata, "n_rows")
        bound = n + sigma * (math.sqrt(length) + NOISE_BOUND_TAIL)
        if float(np.linalg.norm(v)) > bound:
            raise ProtocolError(f"{name!r} has norm {float(np.linalg.norm(v)):.4g}, more than "
                                f"an honest release can have ({bound:.4g})")

    return check
