"""Site step of the ``query`` job: the matrix mechanism's ``A x_s + noise`` on this site's rows.

Task parameters: ``domain`` (1-3 columns, continuous ones with public bins; see
:func:`dpfed.common.queries.query_language.parse_domain`), ``noise`` (``laplace`` or
``gaussian``) and ``strategy``: either ``{"name": NAME, "n": n}`` for a named strategy the site
rebuilds itself, or ``{"name": "matrix", "digest": SHA256, "shape": [k, n]}`` with the matrix
in the task's ``strategy`` array; the site recomputes the digest and refuses on any mismatch.
The sensitivity is always derived here from the matrix the site multiplies by.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.common.errors import DataError, ValidationError
from dpfed.common.queries.federated_matrix import (
    MAX_CELLS_OPTIMIZED,
    NAMED_STRATEGIES,
    SiteMatrixRelease,
    named_strategy,
    strategy_digest,
)
from dpfed.common.queries.query_language import compile_query_set, parse_domain
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.site_agent.handlers.base import DataAccess, PreparedRelease, TaskHandler

log = logging.getLogger(__name__)

#: Most strategy rows accepted per cell (p-Identity has n + p rows with p <= n).
MAX_ROWS_PER_CELL = 2


def resolve_strategy(spec: Any, n: int, arrays: Any) -> np.ndarray:
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


class QueryHandler(TaskHandler):
    """Histogram over the public domain -> ``A x_s + noise`` (one release per task).

    Privacy
    -------
    Replace-one neighbours; every row falls in exactly one public cell; sensitivity
    ``max_{i,j} ||a_i - a_j||`` (L1 Laplace, L2 Gaussian with analytic calibration), see
    :class:`dpfed.common.queries.federated_matrix.SiteMatrixRelease`. Only ``A x_s + noise``
    and the public N_s leave the site; the cost is charged before the release.
    """

    kind = "query"

    def prepare(self, task: Task, data: DataAccess) -> PreparedRelease:
        """Validate the domain and strategy, count the histogram, price the release."""
        params = dict(task.params)
        unknown = sorted(set(params) - {"domain", "noise", "strategy"})
        if unknown:
            raise ValidationError(f"unknown query parameter(s) {unknown}")
        d = params.get("domain")
        if not isinstance(d, dict):
            raise ValidationError("query needs a domain {columns, bins}")
        domain = parse_domain(data.schema, d.get("columns"), d.get("bins"))
        a = resolve_strategy(params.get("strategy"), domain.n_cells, task.arrays)
        noise = params.get("noise")
        delta = task.delta if noise == "gaussian" else 0.0
        mech = SiteMatrixRelease(a, task.epsilon, delta, str(noise))
        hist_set = compile_query_set(data.schema, [{"name": "hist", "domain": domain.to_json()}],
                                     canonical=True)
        x, n_rows = hist_set.counts(t for t, _ in data.iter_chunks())
        if n_rows == 0:
            raise DataError("the site has no valid rows to count")
        cost = mech.cost()
        log.info("[QueryHandler.prepare] task=%s n=%d k=%d noise=%s sensitivity=%g (exact=%s)",
                 task.task_id, domain.n_cells, a.shape[0], mech.noise, mech.sensitivity,
                 mech.sensitivity_exact)

        def release(rng: np.random.Generator) -> TaskResult:
            y = mech.release(x, rng)
            return TaskResult(task.task_id, cost, {"y": y.astype(np.float64)}, {
                "n_rows": n_rows, "n_cells": domain.n_cells, "sensitivity": mech.sensitivity,
                "sensitivity_exact": mech.sensitivity_exact, "noise": mech.noise,
                "noise_scale": mech.noise_scale, "strategy_digest": strategy_digest(a),
                "software_version": __version__})

        return PreparedRelease(cost, release)
