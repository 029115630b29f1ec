"""Site step of the ``pca`` job: one handler for its three rounds (``params["stage"]``).

``mean``
    The DP sum of the rows scaled into the unit ball (:mod:`dpfed.common.pca.centring`).
``norms``
    The DP histogram of the row norms on a public grid (:mod:`dpfed.common.pca.clipping`).
``pca`` (the default stage)
    DPdisPCA's noisy local second-moment matrix, sent as P_s -- of the rows centred at the
    coordinator's DP mean (array ``center``) when ``centering="mean"``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.common.errors import DataError, ValidationError
from dpfed.common.job_params import PCA_STAGES, PCAParams
from dpfed.common.pca.centring import (
    centre_rows,
    centred_pca_mechanism,
    check_center,
    mean_sum_mechanism,
)
from dpfed.common.pca.clipping import (
    norm_bound,
    norm_grid,
    norm_histogram,
    norm_histogram_mechanism,
)
from dpfed.common.pca.dppca import GramAccumulator, site_cost, site_release
from dpfed.common.pca.features import UnitBallMap, feature_names, max_feature_norm
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.common.validation import check_choice
from dpfed.site_agent.handlers.base import DataAccess, PreparedRelease, TaskHandler

log = logging.getLogger(__name__)


def _split_stage(task: Task) -> tuple[str, dict[str, Any]]:
    params = dict(task.params)
    stage = check_choice(params.pop("stage", "pca"), "stage", PCA_STAGES)
    return stage, params


class PCAHandler(TaskHandler):
    """Streaming passes: rows -> [-1, 1] per column -> the round's statistic -> noise.

    Privacy
    -------
    Replace-one, ``N_s`` public. ``mean``: :func:`dpfed.common.pca.centring.mean_sum_mechanism`
    (L2 sensitivity 2). ``norms``: :func:`dpfed.common.pca.clipping.norm_histogram_mechanism`
    (L2 sensitivity sqrt(2)). ``pca``: uncentred, :func:`dpfed.common.pca.dppca.pca_mechanism`
    (sqrt(2)/N_s); centred, :func:`dpfed.common.pca.centring.centred_pca_mechanism`
    (sqrt(2)/N_s on the upper triangle of the centred, clipped rows' second moment). Only the
    noisy statistic (or its post-processing P_s) and the public row count N_s leave the site;
    the number of clipped rows is data-dependent and stays in the local log.
    """

    kind = "pca"

    def prepare(self, task: Task, data: DataAccess) -> PreparedRelease:
        """Validate, stream the rows into the round's statistic, and price the release."""
        stage, raw = _split_stage(task)
        n_features = len(feature_names(data.schema))
        params = PCAParams.from_mapping(raw, n_features=n_features)
        if params.aggregation == "secure":  # its rounds are secure sums (kind 'secagg')
            raise ValidationError("this job runs with --aggregation secure: a site-level pca "
                                  "release of it is refused")
        gaussian_sigma(task.epsilon, task.delta, 1.0, params.calibration)  # calibratable?
        if stage == "mean":
            return self._mean(task, data, params)
        center = None
        if params.centering == "mean":
            center = check_center(task.arrays.get("center"), n_features,
                                  max_feature_norm(data.schema))
        if stage == "norms":
            return self._norms(task, data, params, center)
        return self._pca(task, data, params, center)

    # ------------------------------------------------------------------ rounds
    def _mean(self, task: Task, data: DataAccess, params: PCAParams) -> PreparedRelease:
        unit_ball = UnitBallMap(data.schema)  # worst-case bound: nothing is clipped
        total = np.zeros(unit_ball.n_features)
        n_rows = 0
        for table, _report in data.iter_chunks():
            total += unit_ball.scaled(table).sum(axis=0)
            n_rows += table.n_rows
        _require_rows(n_rows)
        total /= unit_ball.norm
        mech = mean_sum_mechanism(task.epsilon, task.delta, params.calibration)
        log.info("[PCAHandler._mean] task=%s rows=%d", task.task_id, n_rows)
        return self._prepared(task, mech.cost(), lambda rng: {"sum": mech.release(total, rng)},
                              n_rows, mech.sigma)

    def _norms(self, task: Task, data: DataAccess, params: PCAParams,
               center: np.ndarray | None) -> PreparedRelease:
        unit_ball = UnitBallMap(data.schema)
        edges = norm_grid(norm_bound(data.schema, center is not None))
        counts = np.zeros(len(edges))
        n_rows = 0
        for table, _report in data.iter_chunks():
            u = unit_ball.scaled(table)
            if center is not None:
                u -= center[None, :]
            counts += norm_histogram(np.sqrt(np.einsum("ij,ij->i", u, u)), edges)
            n_rows += table.n_rows
        _require_rows(n_rows)
        mech = norm_histogram_mechanism(task.epsilon, task.delta, params.calibration)
        log.info("[PCAHandler._norms] task=%s rows=%d bins=%d", task.task_id, n_rows, len(edges))
        return self._prepared(task, mech.cost(),
                              lambda rng: {"histogram": mech.release(counts, rng)},
                              n_rows, mech.sigma)

    def _pca(self, task: Task, data: DataAccess, params: PCAParams,
             center: np.ndarray | None) -> PreparedRelease:
        if params.clip_norm == "auto":
            raise ValidationError("the pca round needs a resolved clip_norm (a number or "
                                  "'schema'), not 'auto'")
        clip = params.clip_norm if isinstance(params.clip_norm, float) else None
        if center is not None and clip is None:
            clip = norm_bound(data.schema, centred=True)
        unit_ball = UnitBallMap(data.schema, clip_norm=clip)
        gram = GramAccumulator(unit_ball.n_features)
        clipped = 0
        for table, _report in data.iter_chunks():
            if center is None:
                x, n_clipped = unit_ball.transform(table)
            else:
                x, n_clipped = centre_rows(unit_ball.scaled(table), center, unit_ball)
            clipped += n_clipped
            gram.add(x)
        n_rows = gram.n_rows
        _require_rows(n_rows)
        log.info("[PCAHandler._pca] task=%s rows=%d features=%d centred=%s clipped_rows=%d "
                 "(local only)", task.task_id, n_rows, unit_ball.n_features, center is not None,
                 clipped)
        g = gram.gram()
        if center is None:
            cost = site_cost(n_rows, task.epsilon, task.delta, params.calibration)
            mechanism = None
        else:
            mechanism = centred_pca_mechanism(n_rows, task.epsilon, task.delta,
                                              params.calibration)
            cost = mechanism.cost()

        def release(rng: np.random.Generator) -> dict[str, np.ndarray]:
            out = site_release(g, n_rows, epsilon=task.epsilon, delta=task.delta,
                               rank=params.rank, rng=rng, calibration=params.calibration,
                               mechanism=mechanism)
            return {"factor": out.factor}

        return self._prepared(task, cost, release, n_rows, cost.noise_scale,
                              {"rank": params.rank, "n_features": unit_ball.n_features})

    @staticmethod
    def _prepared(task: Task, cost: PrivacyCost,
                  arrays: Callable[[np.random.Generator], dict[str, np.ndarray]], n_rows: int,
                  sigma: float, extra: dict[str, Any] | None = None) -> PreparedRelease:
        def release(rng: np.random.Generator) -> TaskResult:
            return TaskResult(task_id=task.task_id, spend=cost, arrays=arrays(rng),
                              metadata={"n_rows": n_rows, "noise_sigma": sigma,
                                        "software_version": __version__, **(extra or {})})

        return PreparedRelease(cost, release)


def _require_rows(n_rows: int) -> None:
    if n_rows == 0:
        raise DataError("the site has no valid rows to compute a summary from")
