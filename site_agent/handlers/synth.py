"""Site step of the ``synth`` job (federated factor-model synthesis), one task per round.

Rounds (``task.params["round"]``):

``links``
    one streaming pass: a histogram of every column (codes; public equal-width bins for
    continuous columns), released with Gaussian noise
    (:func:`dpfed.common.synth.link_release.release_link_histograms`).
``pca``
    the coordinator sends the DP link proportions and their digest; the site rebuilds the
    links, checks the digest (a mismatch is a refusal saying so), maps its rows to the latent
    space, clips them to the public norm and releases its DP-PCA factor
    (:func:`dpfed.common.pca.dppca.site_release`, all p eigenpairs).
``factors`` (row-aligned mode only; task kind ``synth_rows``, which a site must allow
    explicitly)
    the same links plus the DP loadings ``V`` (p x r); the site releases ``X V + C``, one
    noisy factor row per real row (:func:`dpfed.common.synth.factor_model.factor_release`).
``pair_scores`` (generative mode with ``pairs > 0``)
    the same links (digest checked); the site builds the pair grid from the DP proportions
    (:class:`dpfed.common.synth.pair_marginals.PairGrid`), counts the exact 2-way table of
    every candidate pair and releases each pair's dependence score (L1 distance to the
    independence table ``N_s p_a p_b``) with Gaussian noise
    (:func:`~dpfed.common.synth.pair_marginals.score_mechanism`), array ``pair_scores``.
``pairs``
    the same links plus the chosen edges (``pair_edges``, a list of ``[parent, child]``
    column indices, each a candidate pair, no pair twice, at most the job's ``pairs``); the
    site releases the edges' 2-way tables with Gaussian noise
    (:func:`~dpfed.common.synth.pair_marginals.pair_table_mechanism`), array
    ``pair_tables``.

Privacy
-------
Relation: replace-one row at this site, ``N_s`` public. ``links``: L2 sensitivity
``sqrt(2 n_columns)``, analytic Gaussian. ``pca``: rows in the unit ball by the public clip
norm; the DP-PCA mechanism of :mod:`dpfed.common.pca.dppca`. ``factors``: one row of ``X V``
moves by at most 2 in L2 (``2 sqrt(r)`` in L1), Laplace on every entry. ``pair_scores``:
each of the ``P`` scores moves by at most 2 (one count down and one up in the pair's table;
the independence table depends on public values only), L2 ``2 sqrt(P)``, analytic Gaussian.
``pairs``: one count down and one up in each of the ``K`` tables, L2 ``sqrt(2 K)``, analytic
Gaussian. The grid, the candidate pairs and the edges are public (functions of the DP
proportions and of the earlier noisy scores). Each release is
charged by the runner before it leaves. The number of clipped rows stays in the local log.

Evaluation holdout: when the job asks for an evaluation (``evaluate_rows > 0``), every round
reads only the site's training rows -- its table minus a holdout of ``holdout_size(N_s)``
rows chosen by position under a site secret (:mod:`dpfed.site_agent.synth_holdout`) -- and
reports the public training count as ``n_rows``. A replaced held-out row moves nothing; a
replaced training row moves each statistic by the sensitivity stated above.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import ContinuousColumn, OrdinalColumn, Schema
from dpfed.common.errors import DataError, ValidationError
from dpfed.common.evaluation.holdout import job_key
from dpfed.common.job_params import PAIR_ROUNDS, SynthParams
from dpfed.common.pca.dppca import GramAccumulator, site_cost, site_release
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.rng import production_rng
from dpfed.common.synth.factor_model import factor_cost, factor_release
from dpfed.common.synth.link_release import (
    LinkHistogramAccumulator,
    link_round_cost,
    links_digest,
    links_from_proportions,
    release_link_histograms,
)
from dpfed.common.synth.links import LatentLinks, clip_to_unit_ball, default_clip_norm, latent_dim
from dpfed.common.synth.pair_marginals import (
    MAX_PAIR_CELLS,
    Pair,
    PairGrid,
    PairTableAccumulator,
    check_pairs,
    dependence_scores,
    pair_table_mechanism,
    score_mechanism,
)
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.site_agent.handlers.base import DataAccess, PreparedRelease, TaskHandler
from dpfed.site_agent.synth_holdout import TrainingRows, site_secret, split_rows

log = logging.getLogger(__name__)

#: Parameters a round adds to the job's canonical ones.
ROUND_KEYS = ("round", "schema_digest", "links_digest", "pair_edges")
_ORTHONORMAL_TOL = 1e-8


def split_task_params(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a task's params into (round keys, the job's canonical parameters)."""
    extra = {k: params[k] for k in ROUND_KEYS if k in params}
    job = {k: v for k, v in params.items() if k not in ROUND_KEYS}
    return extra, job


def check_links(schema: Schema, params: SynthParams, extra: dict[str, Any],
                arrays: dict[str, np.ndarray]) -> LatentLinks:
    """Rebuild the links a task carries and check their digest (ValidationError on mismatch)."""
    props = arrays.get("link_proportions")
    if props is None:
        raise ValidationError("the task carries no link_proportions")
    sent = extra.get("links_digest")
    if not isinstance(sent, str):
        raise ValidationError("the task carries no links_digest")
    mine = links_digest(schema, props, params.n_bins, params.continuous_link, params.resolution)
    if mine != sent:
        raise ValidationError(
            f"link digest mismatch: the links sent hash to {mine[:12]}..., the task says "
            f"{sent[:12]}... (corrupted or altered in transit); refusing to use them")
    return links_from_proportions(schema, props, params.n_bins, params.continuous_link,
                                  params.resolution)


def check_pair_edges(raw: Any, candidates: list[Pair], n_columns: int,
                     most: int) -> list[Pair]:
    """Validate the ``pair_edges`` a ``pairs`` task carries (ValidationError naming them).

    A non-empty list of at most ``most`` ``[parent, child]`` pairs of column indices, no
    pair twice, each one of ``candidates`` (:meth:`PairGrid.candidate_pairs`, either order).
    """
    if not isinstance(raw, list) or not raw:
        raise ValidationError("the pairs round needs pair_edges: a non-empty list of "
                              "[parent, child] column indices")
    if len(raw) > most:
        raise ValidationError(f"pair_edges has {len(raw)} pairs; this job measures at most "
                              f"{most}")
    if not all(isinstance(e, list) for e in raw):
        raise ValidationError("pair_edges must be a list of [parent, child] column indices")
    edges = check_pairs(raw, n_columns)
    allowed = set(candidates)
    for a, b in edges:
        if (min(a, b), max(a, b)) not in allowed:
            raise ValidationError(f"pair_edges names ({a}, {b}), which is not a candidate pair "
                                  f"(unknown column or a table of more than {MAX_PAIR_CELLS} "
                                  "cells)")
    return edges


def pair_grid(schema: Schema, params: SynthParams, proportions: np.ndarray) -> PairGrid:
    """Return the pair rounds' cells for the job's ``pair_groups`` and the (checked) links."""
    return PairGrid.from_proportions(schema, proportions, params.n_bins, params.pair_groups,
                                     params.resolution)


def pair_candidates(grid: PairGrid) -> list[Pair]:
    """Return the candidate pairs; refuse (ValidationError) a schema that has none."""
    candidates = grid.candidate_pairs()
    if not candidates:
        raise ValidationError(f"no column pair has a table of at most {MAX_PAIR_CELLS} cells; "
                              "the pair rounds do not apply to this schema")
    return candidates


def exact_pair_tables(grid: PairGrid, pairs: list[Pair], data: DataAccess
                      ) -> PairTableAccumulator:
    """Return the exact 2-way tables of ``pairs`` over ``data``'s rows (site-internal)."""
    acc = PairTableAccumulator(grid, pairs)
    for table, _report in data.iter_chunks():
        acc.add(table)
    return acc


class SiteBoundHandler(TaskHandler):
    """A handler that reads the site's holdout secret from its state directory."""

    #: The site's state directory (the ledger's), set by :meth:`for_site`.
    state_dir: Path | None = None

    def for_site(self, ledger_path: Path) -> TaskHandler:
        """Return a copy bound to the directory of ``ledger_path``."""
        bound = copy.copy(self)
        bound.state_dir = Path(ledger_path).parent
        return bound

    def holdout_secret(self) -> bytes:
        """Return the site's holdout secret (ValidationError when unbound)."""
        if self.state_dir is None:
            raise ValidationError("this handler is not bound to a site directory; the "
                                  "evaluation holdout needs the site's secret")
        return site_secret(self.state_dir)

    def training_data(self, task: Task, data: DataAccess, params: SynthParams) -> DataAccess:
        """Return what every round of the job reads (see :func:`training_rows`)."""
        return training_rows(task, data, params, self.state_dir)


def training_rows(task: Task, data: DataAccess, params: SynthParams,
                  state_dir: Path | None) -> DataAccess:
    """Return what every round of a synth job reads: its training rows when it evaluates.

    A job with ``evaluate_rows > 0`` holds out ``holdout_size(N_s)`` rows, keyed by the site
    secret (kept in ``state_dir``, the ledger's directory) and the job id, from every round —
    the site-level and the secure ones alike.
    """
    if params.evaluate_rows <= 0:
        return data
    if state_dir is None:
        raise ValidationError("this handler is not bound to a site directory; the evaluation "
                              "holdout needs the site's secret")
    return TrainingRows(data, job_key(site_secret(state_dir), task.job_id))


class SynthHandler(SiteBoundHandler):
    """The rounds of the federated synthesizer at one site (see the module docstring)."""

    kind = "synth"

    # ------------------------------------------------------------------ exact statistics
    def exact(self, task: Task, data: DataAccess,
              latent_rng: np.random.Generator | None = None
              ) -> tuple[str, SynthParams, int, Any]:
        """Validate ``task`` and compute the round's exact (un-noised) statistic.

        Returns (round, params, N_s, statistic): the histogram vector (links), the Gram
        matrix of the unit-ball latent rows (pca), (unit-ball latent rows, loadings)
        (factors), the exact dependence scores of the candidate pairs (pair_scores) or
        (the edges' concatenated exact tables, edges) (pairs). Site-internal: nothing here
        leaves the site. ``latent_rng`` draws the
        links' latent values (tests couple neighbouring tables through it).
        """
        schema = data.schema
        extra, job = split_task_params(dict(task.params))
        dim = latent_dim(schema)
        params = SynthParams.from_mapping(job, latent_dim=dim)
        if params.aggregation == "secure":
            raise ValidationError(
                "this job runs with --aggregation secure: its rounds are secure sums (kind "
                "'secagg'), so a site-level synth release of it is refused")
        rnd = extra.get("round")
        if (rnd == "factors") != (self.kind == "synth_rows"):
            raise ValidationError(
                "the row-aligned factors round runs only as a 'synth_rows' task (sites opt in "
                "to releasing one noisy row per real row by allowing that kind)"
                if rnd == "factors" else f"a {self.kind!r} task carries only the factors round")
        if rnd not in params.rounds:
            raise ValidationError(f"round must be one of {params.rounds} for this job (mode "
                                  f"{params.mode!r}), got {rnd!r}")
        sent_schema = extra.get("schema_digest")
        if sent_schema != schema.digest():
            raise ValidationError(
                f"schema digest mismatch: the job was planned for schema {str(sent_schema)[:12]}"
                f"..., this site's schema is {schema.digest()[:12]}...; refusing")
        arrays = dict(task.arrays)
        data = self.training_data(task, data, params)
        if rnd == "links":
            acc = LinkHistogramAccumulator(schema, params.n_bins, params.resolution)
            for table, _report in data.iter_chunks():
                acc.add(table)
            return rnd, params, acc.n_rows, acc.counts
        links = check_links(schema, params, extra, arrays)
        if rnd in PAIR_ROUNDS:
            return self._pair_statistic(rnd, schema, params, extra, arrays, data)
        clip = params.clip_norm if params.clip_norm is not None else default_clip_norm(dim)
        rng = latent_rng if latent_rng is not None else production_rng()
        if rnd == "pca":
            gram = GramAccumulator(dim)
            clipped = 0
            for table, _report in data.iter_chunks():
                unit, n_clipped = clip_to_unit_ball(links.to_latent(table, rng), clip)
                clipped += n_clipped
                gram.add(unit)
            log.info("[SynthHandler.exact] task=%s rows=%d clipped_rows=%d (local only)",
                     task.task_id, gram.n_rows, clipped)
            return rnd, params, gram.n_rows, gram.gram()
        loadings = arrays.get("loadings")
        if loadings is None:
            raise ValidationError("the factors round needs the loadings")
        v = np.asarray(loadings, dtype=np.float64)
        if v.ndim != 2 or v.shape[0] != dim or not 1 <= v.shape[1] <= dim or not np.all(
                np.isfinite(v)):
            raise ValidationError(f"loadings must be a finite {dim} x r matrix, got {v.shape}")
        if float(np.abs(v.T @ v - np.eye(v.shape[1])).max()) > _ORTHONORMAL_TOL:
            raise ValidationError("loadings must have orthonormal columns")
        parts = [clip_to_unit_ball(links.to_latent(table, rng), clip)[0]
                 for table, _report in data.iter_chunks()]
        unit = np.concatenate(parts) if parts else np.zeros((0, dim))
        return rnd, params, unit.shape[0], (unit, v)

    @staticmethod
    def _pair_statistic(rnd: str, schema: Schema, params: SynthParams, extra: dict[str, Any],
                        arrays: dict[str, np.ndarray], data: DataAccess
                        ) -> tuple[str, SynthParams, int, Any]:
        """Exact scores (pair_scores) or (tables, edges) (pairs) over the training rows."""
        props = np.asarray(arrays["link_proportions"], dtype=np.float64)  # digest checked
        grid = pair_grid(schema, params, props)
        candidates = pair_candidates(grid)
        if rnd == "pair_scores":
            pairs = candidates
        else:
            d = len(schema.columns)
            pairs = check_pair_edges(extra.get("pair_edges"), candidates, d,
                                     params.max_pairs(d))
        acc = exact_pair_tables(grid, pairs, data)
        if rnd == "pair_scores":
            return rnd, params, acc.n_rows, dependence_scores(acc.counts, grid, pairs, props,
                                                              acc.n_rows)
        return rnd, params, acc.n_rows, (acc.counts, pairs)

    # ------------------------------------------------------------------ release
    def prepare(self, task: Task, data: DataAccess) -> PreparedRelease:
        """Validate, compute the round's exact statistic, and price its release."""
        rnd, params, n_rows, stat = self.exact(task, data)
        if n_rows == 0:
            raise DataError("the site has no valid rows to compute a summary from")
        schema = data.schema
        meta: dict[str, Any] = {"n_rows": n_rows, "round": rnd, "software_version": __version__}
        cost: PrivacyCost
        if rnd == "links":
            cost = link_round_cost(schema, task.epsilon, task.delta)

            def release(rng: np.random.Generator) -> TaskResult:
                noisy = release_link_histograms(stat, schema, params.n_bins, epsilon=task.epsilon,
                                                delta=task.delta, rng=rng,
                                                resolution=params.resolution)
                return TaskResult(task.task_id, cost, {"histograms": noisy}, meta)

            return PreparedRelease(cost, release)
        if rnd == "pca":
            cost = site_cost(n_rows, task.epsilon, task.delta, params.calibration)
            dim = stat.shape[0]

            def release_pca(rng: np.random.Generator) -> TaskResult:
                out = site_release(stat, n_rows, epsilon=task.epsilon, delta=task.delta,
                                   rank=dim, rng=rng, calibration=params.calibration)
                return TaskResult(task.task_id, cost, {"factor": out.factor},
                                  {**meta, "noise_sigma": out.sigma})

            return PreparedRelease(cost, release_pca)
        if rnd in PAIR_ROUNDS:
            return self._prepare_pairs(task, rnd, stat, meta)
        unit, v = stat
        cost = factor_cost(v.shape[1], task.epsilon)

        def release_factors(rng: np.random.Generator) -> TaskResult:
            w, _ = factor_release(unit, v, epsilon=task.epsilon, rng=rng)
            return TaskResult(task.task_id, cost, {"factors": w},
                              {**meta, "noise_scale": cost.noise_scale})

        return PreparedRelease(cost, release_factors)

    @staticmethod
    def _prepare_pairs(task: Task, rnd: str, stat: Any, meta: dict[str, Any]) -> PreparedRelease:
        """Price and release the noisy scores (pair_scores) or tables (pairs)."""
        if rnd == "pair_scores":
            values = np.asarray(stat, dtype=np.float64)
            mech = score_mechanism(values.shape[0], task.epsilon, task.delta)
            name = "pair_scores"
        else:
            counts, edges = stat
            values = np.asarray(counts, dtype=np.float64)
            mech = pair_table_mechanism(len(edges), task.epsilon, task.delta)
            name = "pair_tables"
        cost = mech.cost()

        def release(rng: np.random.Generator) -> TaskResult:
            return TaskResult(task.task_id, cost, {name: mech.release(values, rng)},
                              {**meta, "noise_sigma": mech.sigma})

        return PreparedRelease(cost, release)



class SynthRowsHandler(SynthHandler):
    """The row-aligned ``factors`` round, as its own job kind ``synth_rows``.

    A separate kind so that a site releases one noisy factor row per real row only when its
    operator lists ``synth_rows`` in the policy's ``allowed_jobs`` (it is not allowed by
    default).
    """

    kind = "synth_rows"


#: Largest synthetic sample an evaluation task may carry.
MAX_EVALUATION_ROWS = 50_000


def synthetic_from_arrays(schema: Schema, arrays: dict[str, np.ndarray]) -> EncodedTable:
    """Validate a synthetic sample sent by the coordinator (one array per column, ``col:<name>``).

    Continuous columns must be finite and within the schema bounds, categorical columns valid
    codes; every column the same length (1..MAX_EVALUATION_ROWS).
    """
    columns: dict[str, np.ndarray] = {}
    n: int | None = None
    for col in schema.columns:
        a = arrays.get(f"col:{col.name}")
        if a is None or a.ndim != 1:
            raise ValidationError(f"the evaluation sample lacks column {col.name!r}")
        if n is None:
            n = int(a.shape[0])
        if a.shape[0] != n or not 1 <= n <= MAX_EVALUATION_ROWS:
            raise ValidationError("evaluation sample columns must have the same length, "
                                  f"1..{MAX_EVALUATION_ROWS}")
        if isinstance(col, ContinuousColumn):
            v = np.asarray(a, dtype=np.float64)
            if not np.all(np.isfinite(v)) or v.min() < col.min or v.max() > col.max:
                raise ValidationError(f"evaluation column {col.name!r} outside the schema bounds")
            columns[col.name] = v
        else:
            size = col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories
            if not np.issubdtype(a.dtype, np.integer) or a.min() < 0 or a.max() >= size:
                raise ValidationError(f"evaluation column {col.name!r} has invalid codes")
            columns[col.name] = a.astype(np.int32)
    assert n is not None
    return EncodedTable(schema, columns, n)


class SynthEvaluationHandler(SiteBoundHandler):
    """Site-local evaluation of a synthetic sample (kind ``synth_eval``): local output only.

    The coordinator sends a synthetic sample; the site compares it with its own rows
    (:func:`dpfed.site_agent.synth_evaluation.evaluate_at_site`) and writes
    ``synth_evaluation.html`` in its own directory. Nothing computed on real rows is sent back
    (the answer says only that the report was written), so nothing is charged. The rows it
    compares are split as the job's rounds split them: the training rows, and the holdout
    that trained nothing (:mod:`dpfed.site_agent.synth_holdout`).
    """

    kind = "synth_eval"

    def prepare(self, task: Task, data: DataAccess) -> PreparedRelease:
        """Validate the sample and read the site's rows; the report is written by the runner."""
        from dpfed.site_agent.synth_evaluation import evaluate_at_site

        schema = data.schema
        if task.epsilon != 0.0 or task.delta != 0.0:
            raise ValidationError("an evaluation task spends no budget: epsilon and delta "
                                  "must be 0")
        sent_schema = task.params.get("schema_digest")
        if sent_schema != schema.digest():
            raise ValidationError("schema digest mismatch: the sample was made for another "
                                  "schema; refusing")
        synthetic = synthetic_from_arrays(schema, dict(task.arrays))
        job = task.job_id
        train, holdout = split_rows(data, job_key(self.holdout_secret(), job))

        def write(site_dir: Path) -> str:
            path, _ = evaluate_at_site(schema, train, holdout, synthetic.to_frame(),
                                       site_id=f"job {job}",
                                       out_dir=site_dir / "evaluations" / _safe(job))
            return str(path)

        zero = PrivacyCost(0.0, 0.0, 0.0, "none")

        def done(_rng: np.random.Generator) -> TaskResult:
            return TaskResult(task.task_id, zero, {}, {"evaluated": True,
                                                       "n_synthetic": synthetic.n_rows})

        return PreparedRelease(zero, done, local_output=write)


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)[:100] or "job"
