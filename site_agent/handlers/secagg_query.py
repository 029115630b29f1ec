"""The ``query`` source of a secure sum: the matrix mechanism's answers ``Ã x_s`` at this site.

Task parameters (besides the secure round's): ``domain`` and ``strategy`` exactly as in the
site-level ``query`` job (a named strategy rebuilt here, or a matrix verified against its
SHA-256 digest — :func:`dpfed.site_agent.handlers.query.resolve_strategy`), ``statistic =
"linear"`` and the public power-of-two ``scale``. The site rebuilds ``Ã = rint(s A)``, its
replace-one sensitivities and the Skellam variance itself
(:func:`dpfed.common.secagg.linear_sum.plan_linear`), counts its exact histogram over the domain
and contributes ``Ã x_s``.

Privacy
-------
Replace-one at this site; every row falls in exactly one public cell (checked: the counts add
up to the rows), so one replaced row moves ``Ã x_s`` by ``ã_j - ã_i``; sensitivities
``max_{i≠j} ||ã_i - ã_j||`` in L2 and L1 from ``Ã`` (see :mod:`dpfed.common.secagg.linear_sum`);
noise ``Sk(μ / (n - t))`` from this site, ``μ`` calibrated for the pooled (epsilon, delta).
Only the masked vector and the public row count leave the site, after the charge.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.queries.federated_matrix import strategy_digest
from dpfed.common.queries.query_language import compile_query_set, parse_domain
from dpfed.common.secagg.linear_sum import linear_answers, plan_linear
from dpfed.common.transport.protocol import Task
from dpfed.common.validation import check_choice
from dpfed.site_agent.handlers.base import DataAccess
from dpfed.site_agent.handlers.query import resolve_strategy
from dpfed.site_agent.handlers.secagg_sources import Contribution, ContributionSource

__all__ = ["QUERY_SOURCE", "query_contribution"]

log = logging.getLogger(__name__)


def query_contribution(task: Task, data: DataAccess, participants: list[str],
                       tolerated: int, *, site_dir: Path | None = None) -> Contribution:
    """Build this site's ``Ã x_s`` contribution (raises ValidationError on any bad field)."""
    del site_dir  # no site state: the statistic depends on the task and the rows only
    p = task.params
    check_choice(p.get("statistic"), "statistic", ("linear",))
    d = p.get("domain")
    if not isinstance(d, dict):
        raise ValidationError("a secure query needs a domain {columns, bins}")
    domain = parse_domain(data.schema, d.get("columns"), d.get("bins"))
    a = resolve_strategy(p.get("strategy"), domain.n_cells, task.arrays)
    linear = plan_linear(a, scale=p.get("scale"), epsilon=task.epsilon, delta=task.delta,
                         participants=participants, tolerated=tolerated)
    log.info("[query_contribution] task=%s n=%d k=%d scale=%g l2=%g l1=%g (exact=%s) mu=%g",
             task.task_id, domain.n_cells, a.shape[0], linear.plan.scale,
             linear.plan.calibration.l2_sensitivity, linear.plan.calibration.l1_sensitivity,
             linear.sensitivity_exact, linear.plan.mu_total)
    hist_set = compile_query_set(data.schema, [{"name": "hist", "domain": domain.to_json()}],
                                 canonical=True)

    def compute(_rng: np.random.Generator) -> tuple[np.ndarray, int]:
        x, n_rows = hist_set.counts(t for t, _ in data.iter_chunks())
        if n_rows == 0:
            return np.zeros(linear.plan.n_values, dtype=np.int64), 0
        return linear_answers(linear, x, n_rows), n_rows

    return Contribution(linear.plan, compute, {
        "strategy_digest": strategy_digest(a), "n_cells": domain.n_cells,
        "sensitivity_exact": linear.sensitivity_exact})


#: Registered as ``source = "query"`` in
#: :data:`dpfed.site_agent.handlers.secagg.CONTRIBUTION_SOURCES`.
QUERY_SOURCE = ContributionSource("query", query_contribution)
