"""Site step of the ``pca`` job: DPdisPCA's noisy local second-moment matrix, sent as P_s."""

from __future__ import annotations

import logging

import numpy as np

from dpfed import __version__
from dpfed.common.errors import DataError
from dpfed.common.job_params import PCAParams
from dpfed.common.pca.dppca import GramAccumulator, site_cost, site_release
from dpfed.common.pca.features import UnitBallMap, feature_names
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.site_agent.handlers.base import DataAccess, PreparedRelease, TaskHandler

log = logging.getLogger(__name__)


class PCAHandler(TaskHandler):
    """One streaming pass: rows -> unit ball -> G_s; then noise -> top-R eigenpairs -> P_s.

    Privacy
    -------
    See :func:`dpfed.common.pca.dppca.pca_mechanism`: replace-one (neighbouring tables have
    the same N_s and differ in one row; N_s is public), rows in the unit ball by the schema's
    public bounds and the job's public ``clip_norm``, sensitivity sqrt(2)/N_s on the upper
    triangle of G_s/N_s, Gaussian noise calibrated analytically (or classic where DP). Only
    P_s (post-processing) and the public row count N_s leave the site; the number of clipped
    rows is data-dependent and stays in the local log.
    """

    kind = "pca"

    def prepare(self, task: Task, data: DataAccess) -> PreparedRelease:
        """Validate, stream the rows into G_s, and price the release."""
        params = PCAParams.from_mapping(task.params,
                                        n_features=len(feature_names(data.schema)))
        params.check_privacy(task.epsilon, task.delta)
        unit_ball = UnitBallMap(data.schema, clip_norm=params.clip_norm)
        gram = GramAccumulator(unit_ball.n_features)
        clipped = 0
        for table, _report in data.iter_chunks():
            x, n_clipped = unit_ball.transform(table)
            clipped += n_clipped
            gram.add(x)
        n_rows = gram.n_rows
        if n_rows == 0:
            raise DataError("the site has no valid rows to compute a summary from")
        log.info("[PCAHandler.prepare] task=%s rows=%d features=%d clipped_rows=%d (local only)",
                 task.task_id, n_rows, unit_ball.n_features, clipped)
        g = gram.gram()
        cost = site_cost(n_rows, task.epsilon, task.delta, params.calibration)

        def release(rng: np.random.Generator) -> TaskResult:
            out = site_release(g, n_rows, epsilon=task.epsilon, delta=task.delta,
                               rank=params.rank, rng=rng, calibration=params.calibration)
            return TaskResult(
                task_id=task.task_id, spend=cost, arrays={"factor": out.factor},
                metadata={"n_rows": n_rows, "rank": params.rank,
                          "n_features": unit_ball.n_features, "noise_sigma": out.sigma,
                          "software_version": __version__},
            )

        return PreparedRelease(cost, release)
