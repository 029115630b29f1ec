"""The ``pca`` job kind (DPdisPCA, centred and auto-clipped by default): its three rounds.

``norms`` (``clip_norm="auto"``) releases a DP histogram of the row norms whose quantile is
the clip radius; ``mean`` (centred jobs) sums the sites' rows, clipped to that radius, into
the DP mean; ``pca`` releases the second moment of the clipped (centred) rows -- at site level
as DPdisPCA's factor ``P_s`` of each site's noisy matrix, as a secure sum the pooled Gram
matrix, centred at the coordinator. Jobs with a ``split`` run in that order (clip first);
jobs made before it run ``mean`` of the box-bounded rows, then ``norms`` of the centred rows.
Task parameters: the job's canonical ones plus ``stage`` (absent: ``pca``). Mechanisms and
their proofs: docs/pca.md and docs/privacy.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import linalg

from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.job_params import PCAParams
from dpfed.common.jobs.contract import (
    Ask,
    Contribution,
    JobKind,
    Release,
    Request,
    SecureSum,
    Site,
    SumEncoding,
    SumRound,
)
from dpfed.common.jobs.release import (
    job_params,
    noisy_release,
    planned_contribution,
    require_rows,
    rows_statistic,
)
from dpfed.common.jobs.results import (
    RESULT_ENVELOPE_BYTES,
    check_gram_factor,
    require_array,
    require_positive_int,
    symmetric_gaussian_norm_bound,
    vector_bound,
)
from dpfed.common.pca.centring import (
    centre_rows,
    centred_pca_mechanism,
    check_center,
    clipped_mean,
    dp_mean,
    mean_sum_mechanism,
)
from dpfed.common.pca.clipping import (
    dp_quantile,
    norm_bound,
    norm_grid,
    norm_histogram,
    norm_histogram_mechanism,
)
from dpfed.common.pca.dppca import (
    GramAccumulator,
    PCAEstimate,
    combine,
    pca_mechanism,
    site_cost,
    site_release,
    site_weights,
)
from dpfed.common.pca.features import UnitBallMap, feature_names, max_feature_norm
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.common.validation import check_choice, check_positive

#: The task parameter naming the round of a site-level task.
STAGE = "stage"
STAGES: tuple[str, ...] = ("mean", "norms", "pca")


def _stage(task: Task) -> str:
    return check_choice(task.params.get(STAGE, "pca"), STAGE, STAGES)


def _params(task: Task, site: Site) -> PCAParams:
    params = job_params(PCAParams, task, site, (STAGE,))
    gaussian_sigma(task.epsilon, task.delta, 1.0, params.calibration)  # calibratable?
    return params


def _unit_rows(site: Site, clip: float | None, center: np.ndarray | None = None
               ) -> Iterator[tuple[np.ndarray, int]]:
    """Stream the site's rows in the unit ball: ``(rows, n_clipped)`` per chunk.

    Scaled by the public map (clip radius ``clip``; None: the schema's worst case), centred at
    ``center`` first when one is given.
    """
    unit = UnitBallMap(site.data.schema, clip_norm=clip)
    for table, _report in site.data.iter_chunks():
        if center is None:
            yield unit.transform(table)
        else:
            yield centre_rows(unit.scaled(table), center, unit)


def _base(params: PCAParams, stage: str, **override: Any) -> dict[str, Any]:
    return {**params.to_mapping(), **override, STAGE: stage}


def _center_arrays(center: np.ndarray | None) -> dict[str, np.ndarray]:
    return {} if center is None else {"center": center}


def _site_center(task: Task, site: Site, params: PCAParams) -> np.ndarray | None:
    if params.centering != "mean":
        return None
    schema = site.data.schema
    return check_center(task.arrays.get("center"), len(feature_names(schema)),
                        max_feature_norm(schema))


def _contribution(task: Task, site: Site, participants: list[str], tolerated: int,
                  statistic: str) -> Contribution:
    """Both secure pca sums: the Gram or the row sum of the clipped unit-ball rows.

    A Gram task that carries the array ``center`` (clip-first jobs) sums the rows centred at
    it and clipped to the radius, ``clip_c(u - mu) / c``: every row still in the unit ball.
    """
    clip = task.params.get("clip_norm")
    unit = UnitBallMap(site.data.schema, clip_norm=clip)  # validates clip_norm
    row_norm = check_positive(task.params.get("row_norm", 1.0), "row_norm")
    center = None
    if statistic == "gram" and "center" in task.arrays:
        center = check_center(task.arrays["center"], unit.n_features,
                              max_feature_norm(site.data.schema))

    def rows(_rng: np.random.Generator) -> Iterator[np.ndarray]:
        for x, _clipped in _unit_rows(site, unit.clip_norm, center):
            yield x

    return planned_contribution(task, participants, tolerated, statistic=statistic,
                                dim=unit.n_features, row_norm=row_norm,
                                compute=rows_statistic(rows, row_norm))


def _resolved(params: PCAParams, clip: float | None) -> float | None:
    """Return the radius a clip-first job's secure mean clips to (the norms round's, or None)."""
    return clip if params.clip_first else None


def _secure_params(params: PCAParams, clip: float | None = None) -> dict[str, Any]:
    """Return the secure sums' ``clip_norm``: the resolved radius, the job's number, or none."""
    if clip is None and isinstance(params.clip_norm, float):
        clip = params.clip_norm
    return {} if clip is None else {"clip_norm": clip}


def _secure_scale(params: PCAParams, schema: Any, clip: float | None = None) -> float:
    """Return the radius the secure sums' rows were divided by (the clip norm, or the schema's)."""
    found = _secure_params(params, clip).get("clip_norm")
    return float(found) if found is not None else max_feature_norm(schema)


def _vector_check(result: TaskResult, name: str, length: int, sigma: float) -> None:
    """Require what an honest noisy sum of row vectors of norm at most 1 can be.

    Both vector rounds release such a sum (rows scaled into the unit ball; one-hot norm
    histograms): its exact part has norm at most ``N_s``.
    """
    v = require_array(result, name, (length,))
    n = require_positive_int(result.metadata, "n_rows")
    bound = vector_bound(n, sigma, length)
    if float(np.linalg.norm(v)) > bound:
        raise ProtocolError(f"{name!r} has norm {float(np.linalg.norm(v)):.4g}, more than "
                            f"an honest release can have ({bound:.4g})")


def _mean_clip(params: PCAParams) -> float | None:
    """Return the radius a clip-first job's mean round clips rows to (None: the box)."""
    if not params.clip_first or params.clip_norm is None:
        return None
    if params.clip_norm == "auto":
        raise ValidationError("the mean round of this job needs a resolved clip_norm (the "
                              "norms round's radius), not 'auto'")
    return float(params.clip_norm)


class Mean(SumRound[PCAParams, "float | None", np.ndarray]):
    """``mean``: the sum of the unit-ball rows, pooled into the DP mean (in the ``u`` space).

    The input is the clip radius ``c`` of a clip-first job (None: the rows are bounded by
    the schema's box ``B``). Each site sums ``clip_c(u)/c`` (or ``u/B``): rows in the unit
    ball. Privacy: :func:`dpfed.common.pca.centring.mean_sum_mechanism` (replace-one, L2
    sensitivity 2 in those units, i.e. ``2c`` in ``u`` as
    :func:`~dpfed.common.pca.centring.clipped_mean_sum_mechanism` states); secure: the
    ``row_sum`` statistic of docs/secure-aggregation.md.
    """

    name = "mean"
    task_kind = "pca"
    source = "pca"
    statistic = "row_sum"
    secure_releases = ("a masked integer row sum with a share of Skellam noise; only the total "
                       "is decoded -> the DP mean")

    def answers(self, task: Task) -> bool:
        """Answer A ``pca`` task of stage ``mean``."""
        return _stage(task) == "mean"

    def prepare(self, task: Task, site: Site) -> Release:
        """Sum the unit-ball rows (clipped to the task's radius, or by the box) and price it."""
        params = _params(task, site)
        total = np.zeros(len(feature_names(site.data.schema)))
        n_rows = 0
        for x, _clipped in _unit_rows(site, _mean_clip(params)):
            total += x.sum(axis=0)
            n_rows += x.shape[0]
        require_rows(n_rows)
        mech = mean_sum_mechanism(task.epsilon, task.delta, params.calibration)
        return noisy_release(task, mech.cost(), lambda rng: {"sum": mech.release(total, rng)},
                             {"n_rows": n_rows, "noise_sigma": mech.sigma})

    def request(self, ask: Ask[PCAParams, float | None]) -> Request:
        """Return the job's parameters, stage ``mean`` (clip first: with the resolved radius)."""
        if not ask.params.clip_first:
            return Request(_base(ask.params, "mean"))
        clip = ask.inputs
        return Request(_base(ask.params, "mean", clip_norm="schema" if clip is None else clip))

    def check(self, result: TaskResult, ask: Ask[PCAParams, float | None]) -> None:
        """Require A sum of unit vectors plus the round's noise."""
        b = ask.budget
        _vector_check(result, "sum", len(feature_names(ask.schema)),
                      mean_sum_mechanism(b.epsilon, b.delta, ask.params.calibration).sigma)

    def pool(self, results: Mapping[str, TaskResult],
             ask: Ask[PCAParams, float | None]) -> np.ndarray:
        """Return the DP mean, projected into the box and the ball the true mean lies in."""
        sums = [results[s].arrays["sum"] for s in sorted(results)]
        n_total = sum(int(r.metadata["n_rows"]) for r in results.values())
        clip = ask.inputs if ask.params.clip_first else None
        if clip is None:
            return dp_mean(sums, n_total, max_feature_norm(ask.schema))
        mu = clipped_mean([s * clip for s in sums], n_total, clip)  # the sums were of rows / c
        return np.asarray(np.clip(mu, -1.0, 1.0))  # ... and in the schema's box

    def contribution(self, task: Task, site: Site, participants: list[str],
                     tolerated: int) -> Contribution:
        """Return the exact integer row sum of the clipped unit-ball rows."""
        return _contribution(task, site, participants, tolerated, self.statistic)

    def encoding(self, ask: Ask[PCAParams, float | None]) -> SumEncoding:
        """Return A row sum of dimension p over rows of norm at most 1."""
        return SumEncoding(dim=len(feature_names(ask.schema)),
                           params=_secure_params(ask.params, _resolved(ask.params, ask.inputs)))

    def pool_secure(self, summed: SecureSum, ask: Ask[PCAParams, float | None]) -> np.ndarray:
        """``S / N``, projected into the unit ball and the schema's box (post-processing)."""
        c = _secure_scale(ask.params, ask.schema, _resolved(ask.params, ask.inputs))
        mu = summed.value / summed.n_rows_total
        norm = float(np.linalg.norm(mu))
        if norm > 1.0:  # the true mean of unit-ball rows lies in the ball
            mu /= norm
        return np.asarray(np.clip(mu * c, -1.0, 1.0))  # ... and in the schema's box


class Norms(SumRound[PCAParams, "np.ndarray | None", float]):
    """``norms``: a DP histogram of the row norms on a public grid; its quantile clips.

    Of the uncentred rows in clip-first jobs; of the rows centred at the DP mean (the input)
    in centred jobs made before.

    Privacy: :func:`dpfed.common.pca.clipping.norm_histogram_mechanism` (replace-one, L2
    sensitivity sqrt(2)); secure (clip-first jobs): the ``counts`` statistic with one group
    (every row adds one count to one bin: L2 sensitivity sqrt(2), L1 2), Skellam noise
    calibrated to the round's (epsilon, delta) (docs/secure-aggregation.md).
    """

    name = "norms"
    task_kind = "pca"
    source = "pca"
    statistic = "counts"
    secure_releases = ("a masked exact histogram of the row norms with a share of Skellam "
                       "noise; only the total is decoded -> the clip radius")

    def answers(self, task: Task) -> bool:
        """Answer A ``pca`` task of stage ``norms``."""
        return _stage(task) == "norms"

    def prepare(self, task: Task, site: Site) -> Release:
        """Histogram the (centred) row norms and price the noise."""
        params = _params(task, site)
        center = None if params.clip_first else _site_center(task, site, params)
        edges = norm_grid(norm_bound(site.data.schema, center is not None))
        unit = UnitBallMap(site.data.schema)
        counts = np.zeros(len(edges))
        n_rows = 0
        for table, _report in site.data.iter_chunks():
            u = unit.scaled(table)
            if center is not None:
                u -= center[None, :]
            counts += norm_histogram(np.sqrt(np.einsum("ij,ij->i", u, u)), edges)
            n_rows += table.n_rows
        require_rows(n_rows)
        mech = norm_histogram_mechanism(task.epsilon, task.delta, params.calibration)
        return noisy_release(task, mech.cost(),
                             lambda rng: {"histogram": mech.release(counts, rng)},
                             {"n_rows": n_rows, "noise_sigma": mech.sigma})

    def _edges(self, ask: Ask[PCAParams, np.ndarray | None]) -> np.ndarray:
        centred = ask.params.centering == "mean" and not ask.params.clip_first
        return norm_grid(norm_bound(ask.schema, centred))

    def request(self, ask: Ask[PCAParams, np.ndarray | None]) -> Request:
        """Return the job's parameters, stage ``norms``, and the DP centre."""
        return Request(_base(ask.params, "norms"), _center_arrays(ask.inputs))

    def check(self, result: TaskResult, ask: Ask[PCAParams, np.ndarray | None]) -> None:
        """Require A histogram of unit counts plus the round's noise."""
        b = ask.budget
        _vector_check(result, "histogram", len(self._edges(ask)),
                      norm_histogram_mechanism(b.epsilon, b.delta, ask.params.calibration).sigma)

    def pool(self, results: Mapping[str, TaskResult],
             ask: Ask[PCAParams, np.ndarray | None]) -> float:
        """Return the DP quantile of the pooled histograms: the clip radius."""
        hists = [results[s].arrays["histogram"] for s in sorted(results)]
        n_total = sum(int(r.metadata["n_rows"]) for r in results.values())
        return dp_quantile(hists, self._edges(ask), ask.params.clip_quantile, n_total)

    def contribution(self, task: Task, site: Site, participants: list[str],
                     tolerated: int) -> Contribution:
        """Return the exact histogram of the uncentred row norms on the schema's grid."""
        edges = norm_grid(norm_bound(site.data.schema, centred=False))
        unit = UnitBallMap(site.data.schema)

        def compute(_plan: Any, _rng: np.random.Generator) -> tuple[np.ndarray, int]:
            counts = np.zeros(len(edges), dtype=np.int64)
            n_rows = 0
            for table, _report in site.data.iter_chunks():
                u = unit.scaled(table)
                counts += norm_histogram(np.sqrt(np.einsum("ij,ij->i", u, u)),
                                         edges).astype(np.int64)
                n_rows += table.n_rows
            return counts, n_rows

        return planned_contribution(task, participants, tolerated, statistic=self.statistic,
                                    dim=len(edges), row_norm=1.0, compute=compute)

    def encoding(self, ask: Ask[PCAParams, np.ndarray | None]) -> SumEncoding:
        """Return counts of one group: every row adds one to one bin of the grid."""
        if not ask.params.clip_first:
            raise ValidationError("a secure norms round histograms the uncentred rows "
                                  "(clip-first jobs only)")
        bins = len(self._edges(ask))
        return SumEncoding(dim=bins, row_norm=1.0, groups=(bins,))

    def pool_secure(self, summed: SecureSum, ask: Ask[PCAParams, np.ndarray | None]) -> float:
        """Return the DP quantile of the decoded histogram: the clip radius."""
        return dp_quantile([np.asarray(summed.value, dtype=np.float64)], self._edges(ask),
                           ask.params.clip_quantile, summed.n_rows_total)


@dataclass(frozen=True)
class MomentInputs:
    """What the ``pca`` round needs from the earlier ones: the DP centre and the clip radius."""

    center: np.ndarray | None
    clip: float | None


@dataclass(frozen=True)
class SecondMoment:
    """The DP (centred) second moment: weighted site factors, or one decoded matrix.

    ``weights`` and ``noise_sigma`` are per site (the noise each site's part carries, in the
    units of the rows' second moment); ``clip_norm`` is the radius the rows obeyed in the
    scaled feature space.
    """

    clip_norm: float
    factors: tuple[np.ndarray, ...] = ()
    matrix: np.ndarray | None = None
    weights: Mapping[str, float] = field(default_factory=dict)
    noise_sigma: Mapping[str, float] = field(default_factory=dict)

    def top(self, k: int) -> PCAEstimate:
        """Return the top-``k`` eigenpairs (post-processing)."""
        if self.matrix is not None:
            return decompose_second_moment(self.matrix, k)
        return combine(list(self.factors), k, [self.weights[s] for s in sorted(self.weights)])


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


def symmetric_from_upper(upper: np.ndarray, dim: int) -> np.ndarray:
    """Rebuild a symmetric matrix from its row-major upper triangle."""
    m = np.zeros((dim, dim))
    m[np.triu_indices(dim)] = upper
    return m + np.triu(m, 1).T


class Moment(SumRound[PCAParams, MomentInputs, SecondMoment]):
    """``pca``: the second moment of the clipped (centred) unit-ball rows.

    Site level, DPdisPCA: each site sends ``P_s = U_R Sigma_R^{1/2}`` of its noisy matrix
    (:func:`dpfed.common.pca.dppca.pca_mechanism`, or
    :func:`dpfed.common.pca.centring.centred_pca_mechanism` for centred rows; L2 sensitivity
    sqrt(2)/N_s). Secure: the ``gram`` statistic of the uncentred rows, centred at the
    coordinator at the DP mean (exact post-processing).
    """

    name = "pca"
    task_kind = "pca"
    source = "pca"
    statistic = "gram"
    secure_releases = ("a masked integer Gram matrix with a share of Skellam noise; only the "
                       "total is decoded and centred at the coordinator -> the components")

    def answers(self, task: Task) -> bool:
        """Answer A ``pca`` task of stage ``pca`` (the default)."""
        return _stage(task) == "pca"

    def prepare(self, task: Task, site: Site) -> Release:
        """Accumulate the Gram matrix of the clipped (centred) rows and price DPdisPCA's P_s."""
        params = _params(task, site)
        if params.clip_norm == "auto":
            raise ValidationError("the pca round needs a resolved clip_norm (a number or "
                                  "'schema'), not 'auto'")
        center = _site_center(task, site, params)
        clip = params.clip_norm if isinstance(params.clip_norm, float) else None
        if center is not None and clip is None:
            clip = norm_bound(site.data.schema, centred=True)
        n_features = len(feature_names(site.data.schema))
        gram = GramAccumulator(n_features)
        for x, _clipped in _unit_rows(site, clip, center):
            gram.add(x)  # the clipped rows' count is data-dependent: it is not released
        n_rows = gram.n_rows
        require_rows(n_rows)
        g = gram.gram()
        mechanism = None if center is None else centred_pca_mechanism(
            n_rows, task.epsilon, task.delta, params.calibration)
        cost = (site_cost(n_rows, task.epsilon, task.delta, params.calibration)
                if mechanism is None else mechanism.cost())

        def factor(rng: np.random.Generator) -> dict[str, np.ndarray]:
            out = site_release(g, n_rows, epsilon=task.epsilon, delta=task.delta,
                               rank=params.rank, rng=rng, calibration=params.calibration,
                               mechanism=mechanism)
            return {"factor": out.factor}

        return noisy_release(task, cost, factor,
                             {"n_rows": n_rows, "noise_sigma": cost.noise_scale,
                              "rank": params.rank, "n_features": n_features})

    def request(self, ask: Ask[PCAParams, MomentInputs]) -> Request:
        """Return the job's parameters with the resolved clip norm, and the DP centre."""
        clip = ask.inputs.clip
        p = len(feature_names(ask.schema))
        return Request(_base(ask.params, "pca", clip_norm="schema" if clip is None else clip),
                       _center_arrays(ask.inputs.center),
                       max_result_bytes=p * ask.params.rank * 8 + RESULT_ENVELOPE_BYTES)

    def check(self, result: TaskResult, ask: Ask[PCAParams, MomentInputs]) -> None:
        """Require what an honest P_s can be: ||z z^T|| <= 1 per row, plus the public noise."""
        p = len(feature_names(ask.schema))
        factor = require_array(result, "factor", (p, ask.params.rank))
        n = require_positive_int(result.metadata, "n_rows")
        b = ask.budget
        sigma = pca_mechanism(n, b.epsilon, b.delta, ask.params.calibration).sigma
        check_gram_factor(factor, "P_s", trace_bound=1.0,
                          noise_norm_bound=symmetric_gaussian_norm_bound(sigma, p))

    def pool(self, results: Mapping[str, TaskResult],
             ask: Ask[PCAParams, MomentInputs]) -> SecondMoment:
        """Return the site factors, weighted by rows (or equally)."""
        sites = sorted(results)
        weights = site_weights([int(results[s].metadata["n_rows"]) for s in sites],
                               ask.params.site_weighting)
        clip = ask.inputs.clip
        if clip is None:
            clip = norm_bound(ask.schema, centred=ask.inputs.center is not None)
        return SecondMoment(clip, tuple(results[s].arrays["factor"] for s in sites),
                            weights=dict(zip(sites, (float(w) for w in weights), strict=True)),
                            noise_sigma={s: results[s].spend.noise_scale for s in sites})

    def contribution(self, task: Task, site: Site, participants: list[str],
                     tolerated: int) -> Contribution:
        """Return the exact integer Gram matrix of the clipped unit-ball rows."""
        return _contribution(task, site, participants, tolerated, self.statistic)

    def encoding(self, ask: Ask[PCAParams, MomentInputs]) -> SumEncoding:
        """Return A Gram sum of dimension p over rows of norm at most 1.

        Clip-first jobs send the DP centre: the sites centre their rows before clipping.
        """
        arrays = {}
        if ask.params.clip_first and ask.inputs.center is not None:
            arrays = {"center": ask.inputs.center}
        return SumEncoding(dim=len(feature_names(ask.schema)),
                           params=_secure_params(ask.params, ask.inputs.clip), arrays=arrays)

    def pool_secure(self, summed: SecureSum,
                    ask: Ask[PCAParams, MomentInputs]) -> SecondMoment:
        """Return ``A = G / N - mu mu^T`` (centred at the DP mean: exact post-processing).

        In clip-first jobs the sites centred their rows already: ``A = G / N``.
        """
        p = len(feature_names(ask.schema))
        n_total = summed.n_rows_total
        c = _secure_scale(ask.params, ask.schema, ask.inputs.clip)
        center = ask.inputs.center
        centred_at_sites = ask.params.clip_first and center is not None
        mu = np.zeros(p) if center is None or centred_at_sites else center / c
        plan = summed.plan
        sigma = math.sqrt(plan.share) / plan.scale ** 2 / n_total
        return SecondMoment(
            c, matrix=symmetric_from_upper(summed.value, p) / n_total - np.outer(mu, mu),
            weights={s: n / n_total for s, n in summed.rows.items()},
            noise_sigma=dict.fromkeys(summed.rows, sigma))


MEAN = Mean()
NORMS = Norms()
MOMENT = Moment()

KIND: JobKind[PCAParams] = JobKind(
    name="pca", params=PCAParams, rounds=(MEAN, NORMS, MOMENT),
    run="dpfed.aggregator.jobs.pca:run", report="dpfed.aggregator.result_reports:pca",
    summary="DP-PCA (DPdisPCA): a DP principal subspace")
