"""The DP summary of a site's synthetic-data evaluation (kind ``synth_eval_dp``).

A site runs this kind only when its policy says ``evaluation_summary = "dp"`` (the kind is
then advertised; it cannot be listed in ``allowed_jobs`` directly). The coordinator sends the
synthetic sample; the site computes :class:`dpfed.common.evaluation.dp_summary.ExactSummary`
on its training rows and its holdout (the same split as the job's rounds,
:mod:`dpfed.site_agent.synth_holdout`) and releases it with Gaussian noise, charged to its
ledger by the runner before it leaves.

Privacy
-------
See :mod:`dpfed.common.evaluation.dp_summary`: replace-one, L2 sensitivity ``sqrt(d + 1)`` of
the scaled vector, analytic Gaussian for the task's (epsilon, delta).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.common.data.encoding import EncodedTable
from dpfed.common.errors import ValidationError
from dpfed.common.evaluation.dp_summary import (
    MAX_COMPARED_ROWS,
    ExactSummary,
    SummaryAccumulator,
    release_summary,
    summary_cost,
)
from dpfed.common.evaluation.holdout import holdout_positions, job_key, position_mask
from dpfed.common.job_params import SYNTH_MAX_BINS
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.common.validation import check_int
from dpfed.site_agent.handlers.base import DataAccess, PreparedRelease
from dpfed.site_agent.handlers.synth import SiteBoundHandler, synthetic_from_arrays
from dpfed.site_agent.synth_holdout import TrainingRows

log = logging.getLogger(__name__)

#: Task kind of the DP evaluation summary.
SUMMARY_KIND = "synth_eval_dp"


class SynthEvaluationSummaryHandler(SiteBoundHandler):
    """Release a DP summary of the site's evaluation of a synthetic sample."""

    kind = SUMMARY_KIND

    def exact(self, task: Task, data: DataAccess) -> ExactSummary:
        """Validate ``task`` and compute the exact summary (site-internal, never sent)."""
        schema = data.schema
        params: dict[str, Any] = dict(task.params)
        if params.get("schema_digest") != schema.digest():
            raise ValidationError("schema digest mismatch: the sample was made for another "
                                  "schema; refusing")
        n_bins = check_int(params.get("n_bins"), "n_bins", minimum=2, maximum=SYNTH_MAX_BINS)
        synthetic = synthetic_from_arrays(schema, dict(task.arrays))
        if synthetic.n_rows < 2:
            raise ValidationError("the evaluation sample needs at least 2 rows")
        secret = self.holdout_secret()
        view = TrainingRows(data, job_key(secret, task.job_id))
        n_train = view.n_total - view.n_holdout
        compared = holdout_positions(job_key(secret, task.job_id + "/compared"), n_train,
                                     size=min(n_train, MAX_COMPARED_ROWS))
        acc = SummaryAccumulator(schema, n_bins, synthetic)
        held = []
        seen = 0
        for train, holdout, _report in view.iter_parts():
            acc.add_training(train, position_mask(compared, seen, train.n_rows))
            seen += train.n_rows
            held.append(holdout)
        exact = acc.finish(EncodedTable.concatenate(held) if held else EncodedTable(
            schema, {c.name: np.zeros(0) for c in schema.columns}, 0))
        log.info("[SynthEvaluationSummaryHandler.exact] task=%s training=%d compared=%d "
                 "holdout=%d (exact values stay local)", task.task_id, exact.n_train,
                 exact.n_compared, exact.n_holdout)
        return exact

    def prepare(self, task: Task, data: DataAccess) -> PreparedRelease:
        """Compute the summary and price its release (charged by the runner before it leaves)."""
        cost = summary_cost(len(data.schema.columns), task.epsilon, task.delta)
        exact = self.exact(task, data)

        def release(rng: np.random.Generator) -> TaskResult:
            arrays, meta = release_summary(exact, epsilon=task.epsilon, delta=task.delta,
                                           rng=rng)
            return TaskResult(task.task_id, cost, arrays,
                              {**meta, "n_rows": exact.n_train,
                               "software_version": __version__})

        return PreparedRelease(cost, release)
