"""The ``query`` job kind: the matrix mechanism's answers ``A x_s`` over a public domain.

The coordinator chooses the strategy ``A`` (public information only) and sends it
verifiably: a named strategy as ``(name, n)``, any other as its matrix with its SHA-256
digest (every site recomputes it and refuses on mismatch). Each site counts its exact
histogram ``x_s`` over the domain; at site level it releases ``A x_s + noise``, as a secure
sum ``Ã x_s`` for ``Ã = rint(s A)`` (docs/secure-aggregation.md, "Secure linear queries")
with Skellam or, named ``noise = "dlaplace"`` in its task, distributed discrete Laplace noise.
Task parameters: ``domain``, ``noise``, ``strategy`` (and the secure sum's plan). Privacy:
:class:`dpfed.common.queries.federated_matrix.SiteMatrixRelease` and
:mod:`dpfed.common.secagg.linear_sum`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfed.common.errors import DataError, ImpossibleSumError, ProtocolError, ValidationError
from dpfed.common.job_params import QueryParams, secure_variance_factors
from dpfed.common.jobs.contract import (
    Ask,
    Budget,
    Contribution,
    JobKind,
    PlannedSum,
    Release,
    Request,
    SecureSum,
    Site,
    SumEncoding,
    SumRound,
)
from dpfed.common.jobs.release import noisy_release
from dpfed.common.queries.federated_matrix import (
    MAX_CELLS_OPTIMIZED,
    NAMED_STRATEGIES,
    SiteMatrixRelease,
    named_strategy,
    strategy_digest,
    strategy_transport,
)
from dpfed.common.queries.query_language import compile_query_set, parse_domain
from dpfed.common.queries.workload_spec import StrategyPick, choose_strategy
from dpfed.common.queries.workloads import Workload
from dpfed.common.secagg.linear_sum import (
    LinearSumPlan,
    check_linear_decoded,
    choose_linear_scale,
    linear_answers,
    plan_linear,
)
from dpfed.common.transport.protocol import Task, TaskResult

log = logging.getLogger(__name__)

#: Most strategy rows accepted per cell (p-Identity has n + p rows with p <= n).
MAX_ROWS_PER_CELL = 2
_TASK_KEYS = {"domain", "noise", "strategy"}


def resolve_strategy(spec: Any, n: int, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """Rebuild or verify the strategy matrix a task names (raises ValidationError)."""
    if not isinstance(spec, dict):
        raise ValidationError(f"query needs a strategy object, got {spec!r}")
    name = spec.get("name")
    if name in NAMED_STRATEGIES:
        if spec.get("n") != n or set(spec) != {"name", "n"}:
            raise ValidationError(f"strategy {name!r} must be given as (name, n={n}) for this "
                                  f"domain, got {spec!r}")
        return named_strategy(str(name), n)
    if name != "matrix":
        raise ValidationError(f"strategy name must be one of {list(NAMED_STRATEGIES)} or "
                              f"'matrix', got {name!r}")
    if n > MAX_CELLS_OPTIMIZED:
        raise ValidationError(f"a strategy matrix is accepted for at most {MAX_CELLS_OPTIMIZED} "
                              f"cells, the domain has {n}")
    a = arrays.get("strategy")
    if not isinstance(a, np.ndarray) or a.dtype != np.float64 or a.ndim != 2:
        raise ValidationError("strategy 'matrix' needs a float64 2-D 'strategy' array")
    k = a.shape[0]
    if a.shape[1] != n or not 1 <= k <= MAX_ROWS_PER_CELL * n:
        raise ValidationError(f"strategy matrix has shape {a.shape}; expected (k, {n}) with "
                              f"1 <= k <= {MAX_ROWS_PER_CELL * n}")
    if list(spec.get("shape", [])) != [k, n]:
        raise ValidationError("strategy shape does not match the matrix sent")
    if not np.all(np.isfinite(a)) or float(np.abs(a).max()) > 1e6:
        raise ValidationError("strategy matrix entries must be finite and at most 1e6")
    if strategy_digest(a) != spec.get("digest"):
        raise ValidationError("the strategy matrix does not match its digest: refusing to "
                              "release with a strategy the coordinator did not announce")
    return a


def _domain_strategy(task: Task, site: Site) -> tuple[Any, np.ndarray]:
    """Return the task's domain and its verified strategy matrix."""
    d = task.params.get("domain")
    if not isinstance(d, dict):
        raise ValidationError("query needs a domain {columns, bins}")
    domain = parse_domain(site.data.schema, d.get("columns"), d.get("bins"))
    return domain, resolve_strategy(task.params.get("strategy"), domain.n_cells, task.arrays)


def _histogram(site: Site, domain: Any) -> tuple[np.ndarray, int]:
    """Return the site's exact histogram over the domain, and its number of rows."""
    hist_set = compile_query_set(site.data.schema,
                                 [{"name": "hist", "domain": domain.to_json()}], canonical=True)
    x, n_rows = hist_set.counts(t for t, _ in site.data.iter_chunks())
    return x, n_rows


@dataclass(frozen=True)
class Chosen:
    """The strategy the coordinator chose for the job, and how it travels to the sites."""

    pick: StrategyPick
    workload: Workload
    digest: str
    spec: dict[str, Any]
    arrays: dict[str, np.ndarray]


def choose(params: QueryParams, workload: Workload, budget: Budget, *, draws: int,
           secure: bool) -> Chosen:
    """Rank the strategies for ``draws`` independent noise draws in the pooled answer.

    A secure sum carries one pooled draw of the noises its parameters allow
    (:meth:`~dpfed.common.job_params.QueryParams.secure_noises`: Skellam, ranked as the
    Gaussian with its slack, or the discrete Laplace, ranked as the Laplace; the pooled
    factor ``n / (n - t - d)`` is the same for both); site-level releases carry one per site,
    of the noise the parameters allow. Deterministic (the optimiser uses a fixed seed), so a
    resumed job sends the same task.
    """
    factors = None
    if secure:
        noises: Sequence[str] = params.secure_noises(budget.delta)
        factors = secure_variance_factors()
    else:
        noises = params.site_noises(budget.delta)
    pick = choose_strategy(workload, strategy_name=params.strategy, noises=noises,
                           epsilon=budget.epsilon, delta=budget.delta, n_sites=draws,
                           variance_factors=factors)
    spec, arrays = strategy_transport(pick.name, pick.matrix, workload.n)
    return Chosen(pick, workload, strategy_digest(pick.matrix), spec, arrays)


@dataclass(frozen=True)
class Answers:
    """The pooled noisy answers ``Ã x + noise`` and what their errors follow from.

    ``strategy`` is the matrix actually used (``Ã / s`` for a secure sum), ``noise_variance``
    one draw's per-entry variance and ``draws`` how many independent draws the sum holds.
    Per site: the sensitivity and noise scale of its part.
    """

    y: np.ndarray
    strategy: np.ndarray
    noise: str
    noise_variance: float
    draws: int
    sensitivity: Mapping[str, float | None]
    noise_scale: Mapping[str, float]
    sensitivity_exact: bool


class Query(SumRound[QueryParams, Chosen, Answers]):
    """``query``: the strategy's answers on every site's histogram.

    Privacy: replace-one, every row in exactly one public cell; sensitivity
    ``max_{i,j} ||a_i - a_j||`` (L1 Laplace, L2 analytic Gaussian); secure: the same for the
    integer ``Ã``, Skellam shares.
    """

    name = "query"
    task_kind = "query"
    source = "query"
    statistic = "linear"
    secure_releases = ("a masked integer vector of the strategy's answers with a share of "
                       "Skellam or Pólya (discrete Laplace) noise; only the pooled total is "
                       "decoded -> the reconstruction")

    def task_budget(self, budget: Budget, inputs: Chosen) -> Budget:
        """Laplace noise (site-level, or the secure discrete Laplace) charges no delta."""
        return Budget(budget.epsilon, budget.delta if inputs.pick.noise == "gaussian" else 0.0,
                      budget.rho)

    # ------------------------------------------------------------------ site
    def prepare(self, task: Task, site: Site) -> Release:
        """Validate the domain and strategy, count the histogram, price the release."""
        unknown = sorted(set(task.params) - _TASK_KEYS)
        if unknown:
            raise ValidationError(f"unknown query parameter(s) {unknown}")
        domain, a = _domain_strategy(task, site)
        x, n_rows = _histogram(site, domain)
        noise = task.params.get("noise")
        mech = SiteMatrixRelease(a, task.epsilon, task.delta if noise == "gaussian" else 0.0,
                                 str(noise))
        if n_rows == 0:
            raise DataError("the site has no valid rows to count")
        log.info("task=%s n=%d k=%d noise=%s sensitivity=%g (exact=%s)", task.task_id,
                 domain.n_cells, a.shape[0], mech.noise, mech.sensitivity,
                 mech.sensitivity_exact)
        return noisy_release(
            task, mech.cost(), lambda rng: {"y": mech.release(x, rng).astype(np.float64)},
            {"n_rows": n_rows, "n_cells": domain.n_cells, "sensitivity": mech.sensitivity,
             "sensitivity_exact": mech.sensitivity_exact, "noise": mech.noise,
             "noise_scale": mech.noise_scale, "strategy_digest": strategy_digest(a)})

    def contribution(self, task: Task, site: Site, participants: list[str],
                     tolerated: int) -> Contribution:
        """Rebuild ``Ã``, its sensitivities and the plan (its noise named); bind ``Ã x_s``."""
        domain, a = _domain_strategy(task, site)
        linear = plan_linear(a, scale=task.params.get("scale"), epsilon=task.epsilon,
                             delta=task.delta, participants=participants, tolerated=tolerated,
                             noise=str(task.params.get("noise", "skellam")))
        log.info("task=%s k=%d scale=%g l2=%g l1=%g (exact=%s) noise=%s mu=%g", task.task_id,
                 a.shape[0], linear.plan.scale, linear.plan.calibration.l2_sensitivity,
                 linear.plan.calibration.l1_sensitivity, linear.sensitivity_exact,
                 linear.plan.noise, linear.plan.mu_total)

        def compute(_rng: np.random.Generator) -> tuple[np.ndarray, int]:
            x, n_rows = _histogram(site, domain)
            if n_rows == 0:
                return np.zeros(linear.plan.n_values, dtype=np.int64), 0
            return linear_answers(linear, x, n_rows), n_rows

        return Contribution(linear.plan, compute, {
            "strategy_digest": strategy_digest(a), "n_cells": a.shape[1],
            "sensitivity_exact": linear.sensitivity_exact})

    # ------------------------------------------------------------------ coordinator
    def request(self, ask: Ask[QueryParams, Chosen]) -> Request:
        """Return the domain, the chosen noise and the strategy (named, or matrix + digest)."""
        return Request({"domain": ask.params.domain, "noise": ask.inputs.pick.noise,
                        "strategy": ask.inputs.spec}, ask.inputs.arrays)

    def check(self, result: TaskResult, ask: Ask[QueryParams, Chosen]) -> None:
        """Require A finite answer vector, released with the announced strategy."""
        k = ask.inputs.pick.matrix.shape[0]
        y = result.arrays.get("y")
        if y is None or y.shape != (k,) or y.dtype != np.float64 or not np.all(np.isfinite(y)):
            raise ProtocolError(f"expected a finite float64 vector y of length {k}")
        if result.metadata.get("strategy_digest") != ask.inputs.digest:
            raise ProtocolError("the site released with a different strategy")
        n = result.metadata.get("n_rows")
        if not isinstance(n, int) or n <= 0:
            raise ProtocolError("result lacks a positive n_rows")

    def pool(self, results: Mapping[str, TaskResult],
             ask: Ask[QueryParams, Chosen]) -> Answers:
        """Return the sum of the sites' answers (one noise draw per site)."""
        a = ask.inputs.pick.matrix
        b = ask.budget
        mech = SiteMatrixRelease(a, b.epsilon, b.delta, ask.inputs.pick.noise)
        sites = sorted(results)
        y = np.sum([results[s].arrays["y"] for s in sites], axis=0) if sites else np.zeros(
            a.shape[0])
        return Answers(y, a, mech.noise, mech.noise_variance, len(sites),
                       {s: results[s].metadata.get("sensitivity") for s in sites},
                       {s: results[s].spend.noise_scale for s in sites},
                       mech.sensitivity_exact)

    def encoding(self, ask: Ask[QueryParams, Chosen]) -> SumEncoding:
        """``Ã x_s`` at the largest power-of-two scale that cannot wrap, with the noise chosen.

        A discrete Laplace sum names its noise in the task (``noise = "dlaplace"``); a Skellam
        sum's task is the one sent before the discrete Laplace existed.
        """
        a = ask.inputs.pick.matrix
        b = ask.budget
        noise = "dlaplace" if ask.inputs.pick.noise == "laplace" else "skellam"

        async def planner(participants: list[str], tolerated: int,
                          total_rows: int) -> PlannedSum:
            def plan() -> PlannedSum:
                scale = choose_linear_scale(a, total_rows=total_rows, epsilon=b.epsilon,
                                            delta=b.delta, n_participants=len(participants),
                                            noise=noise)
                linear = plan_linear(a, scale=scale, epsilon=b.epsilon, delta=b.delta,
                                     participants=participants, tolerated=tolerated,
                                     noise=noise)
                return PlannedSum(linear.plan, linear)

            return await asyncio.to_thread(plan)  # O(k n^2) sensitivities: off the loop

        params: dict[str, Any] = {"source": self.source, "domain": ask.params.domain,
                                  "strategy": ask.inputs.spec}
        if noise == "dlaplace":
            params["noise"] = noise
        return SumEncoding(dim=int(a.shape[0]), params=params, arrays=ask.inputs.arrays,
                           planner=planner)

    def check_sum(self, total: np.ndarray, summed: PlannedSum, n_rows_total: int,
                  encoding: SumEncoding) -> None:
        """Every answer lies between ``N`` times its row's smallest and largest entry."""
        linear = summed.detail
        if not isinstance(linear, LinearSumPlan):
            raise ImpossibleSumError(f"{ImpossibleSumError.REASON}: a linear sum without its "
                                     "integer strategy")
        check_linear_decoded(total, linear, n_rows_total)

    def pool_secure(self, summed: SecureSum, ask: Ask[QueryParams, Chosen]) -> Answers:
        """One pooled draw; reconstruct with ``Ã / s``, the strategy actually used.

        The sensitivity reported is the one the noise was calibrated to (Skellam: ``Δ₂``;
        discrete Laplace: ``Δ₁``), in the units of ``A x``.
        """
        linear = summed.detail
        assert isinstance(linear, LinearSumPlan)
        plan = linear.plan
        cal = plan.calibration
        share_sigma = float(np.sqrt(plan.share)) / plan.scale
        sens = cal.l1_sensitivity if plan.noise == "dlaplace" else cal.l2_sensitivity
        return Answers(summed.value, linear.strategy, plan.noise, linear.answer_variance, 1,
                       dict.fromkeys(summed.rows, sens / plan.scale),
                       dict.fromkeys(summed.rows, share_sigma), linear.sensitivity_exact)


QUERY = Query()

KIND: JobKind[QueryParams] = JobKind(
    name="query", params=QueryParams, rounds=(QUERY,), run="dpfed.aggregator.jobs.query:run",
    report="dpfed.aggregator.result_reports:query", pure_epsilon=True,
    summary="linear queries with the matrix mechanism")
