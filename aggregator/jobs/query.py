"""Coordinator side of the ``query`` job: the matrix mechanism across sites.

1. Validate the domain, workload, noise and reconstruction (public information only).
2. Choose the strategy (``auto``: the smallest expected RMSE under replace-one) and send it
   verifiably: a named strategy as ``(name, n)``, an optimised one as its matrix plus its
   SHA-256 digest (each site recomputes it and refuses on mismatch).
3. Every site releases ``A x_s + noise``; the coordinator sums, reconstructs (least squares,
   or NNLS / the seed's L1 programme on request) and answers the workload, each answer with
   its closed-form standard error for the number of sites that answered.

With ``aggregation = "secure"`` step 3 is one secure sum of ``Ã x_s`` with distributed
Skellam noise instead (:mod:`dpfed.aggregator.jobs.query_secure`).

The choice is deterministic (the optimiser uses a fixed seed), so a resumed job sends the same
task payload and every site replays its ledger's answer instead of charging again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.aggregator.federation import Federation
from dpfed.aggregator.jobs.base import JobContext, JobOutput, JobType
from dpfed.aggregator.jobs.query_secure import run_secure_query
from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.queries.federated_matrix import (
    SiteMatrixRelease,
    per_query_std_error,
    strategy_digest,
    strategy_transport,
)
from dpfed.common.queries.matrix_mechanism import reconstruct
from dpfed.common.queries.query_language import Domain, parse_domain
from dpfed.common.queries.workload_spec import (
    STRATEGY_CHOICES,
    build_workload,
    check_domain_for,
    choose_strategy,
)
from dpfed.common.queries.workloads import Workload, identity_workload
from dpfed.common.transport.protocol import JobSpec, TaskResult
from dpfed.common.validation import check_delta, check_epsilon

NOISE_CHOICES: tuple[str, ...] = ("auto", "laplace", "gaussian")
RECONSTRUCTIONS: tuple[str, ...] = ("least_squares", "nnls", "l1")
AGGREGATIONS: tuple[str, ...] = ("site", "secure")
_KEYS = {"domain", "workload", "strategy", "noise", "reconstruction", "aggregation"}


def parse_query_params(spec: JobSpec, federation: Federation
                       ) -> tuple[Domain, Workload, dict[str, Any]]:
    """Validate an analyst's query parameters; return domain, workload and canonical params."""
    params = dict(spec.params)
    extra = sorted(set(params) - _KEYS)
    if extra:
        raise ValidationError(f"unknown query parameter(s) {extra}; known: {sorted(_KEYS)}")
    d = params.get("domain")
    if not isinstance(d, dict):
        raise ValidationError("query needs a domain: {columns = [...], bins = {...}}")
    domain = parse_domain(federation.schema, d.get("columns"), d.get("bins"))
    w = params.get("workload", {"kind": "identity"})
    if isinstance(w, str):
        w = {"kind": w}
    if not isinstance(w, dict):
        raise ValidationError(f"workload must be a name or an object, got {w!r}")
    workload = build_workload(domain, w)
    strategy_name = params.get("strategy", "auto")
    if strategy_name not in STRATEGY_CHOICES:
        raise ValidationError(f"strategy must be one of {list(STRATEGY_CHOICES)}, got "
                              f"{strategy_name!r}")
    check_domain_for(str(strategy_name), domain.n_cells)
    noise = params.get("noise", "auto")
    if noise not in NOISE_CHOICES:
        raise ValidationError(f"noise must be one of {list(NOISE_CHOICES)}, got {noise!r}")
    aggregation = params.get("aggregation", "site")
    if aggregation not in AGGREGATIONS:
        raise ValidationError(f"aggregation must be one of {list(AGGREGATIONS)}, got "
                              f"{aggregation!r}")
    if aggregation == "secure":
        if noise == "laplace":
            raise ValidationError("aggregation 'secure' sums the answers with distributed "
                                  "Skellam noise, an (epsilon, delta) mechanism: use noise "
                                  "'auto' or 'gaussian', not 'laplace'")
        if spec.delta == 0.0:
            raise ValidationError("aggregation 'secure' needs delta in (0, 1) (--delta): its "
                                  "Skellam noise is an (epsilon, delta) mechanism")
    check_epsilon(spec.epsilon)
    if noise == "laplace" and spec.delta != 0.0:
        raise ValidationError(f"Laplace noise is pure epsilon-DP: delta must be 0, got "
                              f"{spec.delta!r}")
    if noise == "gaussian":
        check_delta(spec.delta)
    if noise == "auto" and spec.delta != 0.0:
        check_delta(spec.delta)
    recon = params.get("reconstruction", "least_squares")
    if recon not in RECONSTRUCTIONS:
        raise ValidationError(f"reconstruction must be one of {list(RECONSTRUCTIONS)}, got "
                              f"{recon!r}")
    canonical = {"domain": domain.to_json(), "workload": w, "strategy": strategy_name,
                 "noise": noise, "reconstruction": recon}
    if aggregation == "secure":  # absent for site level: older jobs' parameters unchanged
        canonical["aggregation"] = aggregation
    return domain, workload, canonical


class QueryJob(JobType):
    """Answer a linear workload over a public histogram domain with the matrix mechanism."""

    kind = "query"
    pure_epsilon = True

    def validate(self, spec: JobSpec, federation: Federation) -> dict[str, Any]:
        """Validate everything before anything is sent or charged."""
        return parse_query_params(spec, federation)[2]

    async def run(self, ctx: JobContext) -> JobOutput:
        """Choose the strategy, dispatch, sum, reconstruct, answer with standard errors."""
        domain, workload, params = parse_query_params(ctx.spec, ctx.federation)
        if params.get("aggregation") == "secure":
            return await run_secure_query(ctx, domain, workload, params)
        eps, delta = ctx.spec.epsilon, ctx.spec.delta
        noises = {"auto": ("laplace", "gaussian") if delta > 0 else ("laplace",),
                  "laplace": ("laplace",), "gaussian": ("gaussian",)}[params["noise"]]
        n_expected = max(1, len(ctx.registry.connected()))
        ctx.emit("strategy", f"choosing a strategy for {workload.name} over {domain.n_cells} "
                 f"cells (candidates: {params['strategy']})", 0.02)
        pick = await asyncio.to_thread(choose_strategy, workload,
                                       strategy_name=params["strategy"], noises=noises,
                                       epsilon=eps, delta=delta, n_sites=n_expected)
        a = pick.matrix
        digest = strategy_digest(a)
        strategy_spec, arrays = strategy_transport(pick.name, a, domain.n_cells)
        ctx.emit("strategy", f"strategy {pick.name} with {pick.noise} noise: expected RMSE "
                 f"{pick.rmse:.4g} per query (identity {pick.identity_rmse:.4g})", 0.04)
        site_delta = delta if pick.noise == "gaussian" else 0.0
        task_params = {"domain": domain.to_json(), "noise": pick.noise,
                       "strategy": strategy_spec}
        k = a.shape[0]

        def check(result: TaskResult) -> None:
            y = result.arrays.get("y")
            if y is None or y.shape != (k,) or y.dtype != np.float64 or not np.all(
                    np.isfinite(y)):
                raise ProtocolError(f"expected a finite float64 vector y of length {k}")
            if result.metadata.get("strategy_digest") != digest:
                raise ProtocolError("the site released with a different strategy")
            n = result.metadata.get("n_rows")
            if not isinstance(n, int) or n <= 0:
                raise ProtocolError("result lacks a positive n_rows")

        results = await ctx.dispatch("query", task_params, round_name="query", arrays=arrays,
                                     check_result=check, progress=(0.05, 0.9), epsilon=eps,
                                     delta=site_delta)
        site_ids = sorted(results)
        total = np.sum([results[s].arrays["y"] for s in site_ids], axis=0)
        recon = params["reconstruction"]
        ctx.emit("combine", f"summing {len(site_ids)} release(s), reconstructing "
                 f"({recon})", 0.92)
        x_hat = await asyncio.to_thread(reconstruct, total, a,
                                        nonnegative=None if recon == "least_squares" else recon)
        answers = workload.answer(x_hat)
        var = SiteMatrixRelease(a, eps, site_delta, pick.noise).noise_variance
        s_count = len(site_ids)
        answer_se = per_query_std_error(workload, a, noise_variance=var, n_sites=s_count)
        cell_se = per_query_std_error(identity_workload(domain.n_cells), a, noise_variance=var,
                                      n_sites=s_count)
        scale = float(np.sqrt(s_count / max(1, n_expected)))
        sites = [{"site_id": s, "n_rows": int(results[s].metadata["n_rows"]),
                  "epsilon": results[s].spend.epsilon, "delta": results[s].spend.delta,
                  "sensitivity": results[s].metadata.get("sensitivity"),
                  "noise_scale": results[s].spend.noise_scale} for s in site_ids]
        w = params["workload"]
        metadata: dict[str, Any] = {
            "job_id": ctx.job_id, "kind": "query", "epsilon": eps, "delta": site_delta,
            "domain": domain.to_json(), "workload": {"kind": w["kind"], "k": w.get("k", 0)},
            "workload_name": workload.name, "strategy": pick.name, "noise": pick.noise,
            "strategy_digest": digest, "reconstruction": recon,
            "expected_rmse": pick.rmse * scale, "identity_expected_rmse":
                pick.identity_rmse * scale,
            "ranking": [[nm, nz, r * scale] for nm, nz, r in pick.ranking],
            "sites": sites, "n_sites": s_count,
            "n_rows_total": sum(int(results[s].metadata["n_rows"]) for s in site_ids),
            "schema_toml": ctx.federation.schema.to_toml(), "software_version": __version__}
        summary = {"strategy": pick.name, "noise": pick.noise, "cells": domain.n_cells,
                   "queries": workload.n_queries, "sites": s_count,
                   "expected_rmse": round(pick.rmse * scale, 4),
                   "identity_expected_rmse": round(pick.identity_rmse * scale, 4)}
        out = {"x_hat": x_hat, "x_std_error": cell_se, "answers": answers,
               "answer_std_error": answer_se}
        if w["kind"] == "custom":
            out["workload_matrix"] = np.asarray(w["matrix"], dtype=np.float64)
        return JobOutput(out, metadata, summary)
