"""The ``synth`` job's model rounds: ``links``, ``pca`` and (row-aligned) ``factors``.

``links`` releases a histogram of every column (public bins for continuous columns); the
coordinator builds the links from the pooled DP proportions. ``pca`` releases the second
moment of the latent rows under those links (their digest checked at the site), clipped to
the unit ball. ``factors`` (row-aligned mode, task kind ``synth_rows`` that a site opts in
to) releases one noisy factor row per real row. With an evaluation (``evaluate_rows``) every
round reads only the site's training rows. Site-level task parameters: the job's canonical
ones plus ``round``, ``schema_digest``, ``links_digest``; a secure contribution carries the
job's parameters under ``job``. Mechanisms and proofs: docs/synthesis.md, docs/privacy.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dpfed.common.data.schema import Schema
from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.evaluation.holdout import job_key
from dpfed.common.evaluation.site_holdout import TrainingRows, site_secret
from dpfed.common.job_params import PAIR_ROUNDS, SynthParams
from dpfed.common.jobs.contract import (
    Ask,
    Contribution,
    DataAccess,
    Release,
    Request,
    SecureSum,
    Site,
    SumEncoding,
    SumRound,
)
from dpfed.common.jobs.contract import Round as BaseRound
from dpfed.common.jobs.pca import decompose_second_moment, symmetric_from_upper
from dpfed.common.jobs.release import (
    job_params,
    noisy_release,
    planned_contribution,
    require_rows,
    rows_statistic,
)
from dpfed.common.pca.dppca import GramAccumulator, PCAEstimate, site_cost, site_release
from dpfed.common.privacy.rng import production_rng
from dpfed.common.synth.factor_model import factor_cost, factor_release
from dpfed.common.synth.link_release import (
    LinkHistogramAccumulator,
    histogram_sizes,
    link_histogram_mechanism,
    link_round_cost,
    links_digest,
    links_from_proportions,
    proportions_from_histograms,
    release_link_histograms,
    release_noise_sd,
    secure_cell_weights,
    secure_link_groups,
    secure_link_row_norm,
    secure_pooled_counts,
    sum_histograms,
)
from dpfed.common.synth.links import LatentLinks, clip_to_unit_ball, default_clip_norm, latent_dim
from dpfed.common.synth.missing_cells import CellRows, synth_schema
from dpfed.common.synth.pipeline import combine_factors
from dpfed.common.transport.protocol import Task, TaskResult

log = logging.getLogger(__name__)

#: Parameters a site-level round adds to the job's canonical ones.
ROUND_KEYS = ("round", "schema_digest", "links_digest", "pair_edges")
#: Largest row count a site may report with a synth release.
MAX_SITE_ROWS = 50_000_000
_ORTHONORMAL_TOL = 1e-8


# --------------------------------------------------------------------------- site side


def site_params(task: Task, site: Site) -> tuple[dict[str, Any], SynthParams]:
    """Return A site-level synth task's round keys and the job's parameters, all validated.

    The round must be one of the job's (the row-aligned ``factors`` round only as a
    ``synth_rows`` task) and the job planned for this site's schema.
    """
    schema = site.data.schema
    extra = {k: task.params[k] for k in ROUND_KEYS if k in task.params}
    params = job_params(SynthParams, task, site, ROUND_KEYS)
    rnd = extra.get("round")
    if (rnd == "factors") != (task.kind == "synth_rows"):
        raise ValidationError(
            "the row-aligned factors round runs only as a 'synth_rows' task (sites opt in "
            "to releasing one noisy row per real row by allowing that kind)"
            if rnd == "factors" else f"a {task.kind!r} task carries only the factors round")
    if rnd not in params.rounds:
        raise ValidationError(f"round must be one of {params.rounds} for this job (mode "
                              f"{params.mode!r}), got {rnd!r}")
    check_schema(extra.get("schema_digest"), schema)
    return extra, params


def secure_params(task: Task, site: Site) -> SynthParams:
    """Return the job's parameters a secure contribution carries under ``job`` (schema checked)."""
    job = task.params.get("job")
    if not isinstance(job, Mapping):
        raise ValidationError("a synth secure round carries the job's parameters under 'job'")
    params = SynthParams.parse(dict(job), site.data.schema)
    check_schema(task.params.get("schema_digest"), site.data.schema)
    return params


def check_schema(sent: Any, schema: Schema) -> None:
    """Refuse a task planned for another schema."""
    if sent != schema.digest():
        raise ValidationError(
            f"schema digest mismatch: the job was planned for schema {str(sent)[:12]}..., this "
            f"site's schema is {schema.digest()[:12]}...; refusing")


def training_rows(task: Task, site: Site, params: SynthParams) -> DataAccess:
    """Return what every round of a synth job reads: its training rows when it evaluates.

    A job with ``evaluate_rows > 0`` holds out ``holdout_size(N_s)`` rows, keyed by the site
    secret (kept beside the ledger) and the job id, from every round -- the site-level and
    the secure ones alike (:mod:`dpfed.common.evaluation.site_holdout`).
    """
    if params.evaluate_rows <= 0:
        return site.data
    if site.state_dir is None:
        raise ValidationError("this round is not bound to a site directory; the evaluation "
                              "holdout needs the site's secret")
    return TrainingRows(site.data, job_key(site_secret(site.state_dir), task.job_id))


def cells_schema(schema: Schema, params: SynthParams) -> Schema:
    """Return the schema the job's cells follow.

    A missing cell per ``missing = "category"`` column if the job has ``missing_cells``
    (:mod:`dpfed.common.synth.missing_cells`).
    """
    return synth_schema(schema, params.missing_cells)


def check_links(schema: Schema, params: SynthParams, links_digest_sent: Any,
                arrays: Mapping[str, np.ndarray]) -> LatentLinks:
    """Rebuild the links a task carries and check their digest (ValidationError on mismatch).

    ``schema`` is the federation schema; the links follow :func:`cells_schema`.
    """
    schema = cells_schema(schema, params)
    props = arrays.get("link_proportions")
    if props is None:
        raise ValidationError("the task carries no link_proportions")
    if not isinstance(links_digest_sent, str):
        raise ValidationError("the task carries no links_digest")
    mine = links_digest(schema, props, params.n_bins, params.continuous_link, params.resolution)
    if mine != links_digest_sent:
        raise ValidationError(
            f"link digest mismatch: the links sent hash to {mine[:12]}..., the task says "
            f"{links_digest_sent[:12]}... (corrupted or altered in transit); refusing to use "
            "them")
    return links_from_proportions(schema, props, params.n_bins, params.continuous_link,
                                  params.resolution)


def latent_rows(site: Site, data: DataAccess, links: LatentLinks, params: SynthParams,
                rng: np.random.Generator) -> Iterator[tuple[np.ndarray, int]]:
    """Stream the latent rows under ``links``, clipped into the unit ball by the public norm."""
    del site
    dim = links.dim
    clip = params.clip_norm if params.clip_norm is not None else default_clip_norm(dim)
    for table, _report in CellRows(data, links.schema).iter_chunks():
        yield clip_to_unit_ball(links.to_latent(table, rng), clip)


class SynthRound:
    """What every site-level synth round shares: it answers the task naming it."""

    name: ClassVar[str]

    def answers(self, task: Task) -> bool:
        """Answer the task names this round."""
        return task.params.get("round") == self.name

    def unanswered(self, task: Task) -> ValidationError:
        """Why no synth round answers ``task``, naming what is wrong."""
        rnd = task.params.get("round")
        if rnd == "factors":
            return ValidationError(
                "the row-aligned factors round runs only as a 'synth_rows' task (sites opt in "
                "to releasing one noisy row per real row by allowing that kind)")
        if task.kind == "synth_rows":
            return ValidationError(f"a {task.kind!r} task carries only the factors round")
        return ValidationError(f"round must be one of the synth job's rounds, got {rnd!r}")


def base_params(params: SynthParams, schema: Schema) -> dict[str, Any]:
    """Return A site-level task's parameters: the job's, and the schema they were planned for."""
    return {**params.to_mapping(), "schema_digest": schema.digest()}


def secure_base(params: SynthParams, schema: Schema, source: str) -> dict[str, Any]:
    """Return a secure contribution's parameters: source, job (under ``job``), schema."""
    return {"source": source, "job": params.to_mapping(), "schema_digest": schema.digest()}


def check_rows(result: TaskResult) -> int:
    """Return A release's public row count: a positive integer of plausible size."""
    n = result.metadata.get("n_rows")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0 or n > MAX_SITE_ROWS:
        raise ProtocolError("result lacks a valid positive n_rows")
    return n


def check_finite(a: Any, shape: tuple[int, ...], name: str, most: float) -> None:
    """Return A finite float64 array of ``shape`` with entries at most ``most`` in size."""
    if (not isinstance(a, np.ndarray) or a.shape != shape or a.dtype != np.float64
            or not np.all(np.isfinite(a)) or float(np.abs(a).max(initial=0.0)) > most):
        raise ProtocolError(f"expected finite float64 {name} of shape {shape}")


# --------------------------------------------------------------------------- links


@dataclass(frozen=True)
class PooledCounts:
    """Every column's pooled noisy counts, the public pooled row count and each cell's noise.

    ``noise_sd`` is public: the release's calibration divided by the cells' weights
    (:func:`dpfed.common.synth.link_release.release_noise_sd`).
    """

    counts: np.ndarray
    n_rows: int
    noise_sd: np.ndarray


class Links(SynthRound, SumRound[SynthParams, None, PooledCounts]):
    """``links``: a histogram of every column, concatenated in schema order.

    Privacy: replace-one; site level L2 sensitivity ``sqrt(2 n_columns)`` of the weighted
    histograms (:func:`dpfed.common.synth.link_release.link_histogram_mechanism`), analytic
    Gaussian; secure: the ``weighted_counts`` statistic (column ``j`` times its public
    integer weight ``m_j``).
    """

    name = "links"
    task_kind = "synth"
    source = "synth_counts"
    statistic = "weighted_counts"
    secure_releases = ("a masked exact count vector (every column's histogram) with a share of "
                       "Skellam noise; only the pooled total is decoded -> the DP marginals "
                       "and the links")

    def prepare(self, task: Task, site: Site) -> Release:
        """Count every column, price the noise."""
        _extra, params = site_params(task, site)
        schema = cells_schema(site.data.schema, params)
        acc = link_counts(training_rows(task, site, params), params)
        require_rows(acc.n_rows)
        return noisy_release(
            task, link_round_cost(schema, task.epsilon, task.delta),
            lambda rng: {"histograms": release_link_histograms(
                acc.counts, schema, params.n_bins, epsilon=task.epsilon, delta=task.delta,
                rng=rng, resolution=params.resolution)}, {"n_rows": acc.n_rows, "round": self.name})

    def contribution(self, task: Task, site: Site, participants: list[str],
                     tolerated: int) -> Contribution:
        """Return the exact weighted counts."""
        params = secure_params(task, site)
        schema = cells_schema(site.data.schema, params)
        data = training_rows(task, site, params)  # the evaluation holdout trains nothing

        def compute(_plan: Any, _rng: np.random.Generator) -> tuple[np.ndarray, int]:
            acc = link_counts(data, params)
            return (acc.counts * secure_cell_weights(schema, params.n_bins, params.resolution),
                    acc.n_rows)

        return planned_contribution(
            task, participants, tolerated, statistic=self.statistic,
            dim=sum(histogram_sizes(schema, params.n_bins, params.resolution)),
            row_norm=secure_link_row_norm(schema, params.n_bins, params.resolution),
            compute=compute)

    def request(self, ask: Ask[SynthParams, None]) -> Request:
        """Return the job's parameters, round ``links``."""
        return Request({**base_params(ask.params, ask.schema), "round": self.name})

    def check(self, result: TaskResult, ask: Ask[SynthParams, None]) -> None:
        """Finite histograms of the schema's size."""
        check_rows(result)
        size = sum(histogram_sizes(cells_schema(ask.schema, ask.params), ask.params.n_bins,
                                   ask.params.resolution))
        check_finite(result.arrays.get("histograms"), (size,), "histograms", 1e12)

    def pool(self, results: Mapping[str, TaskResult],
             ask: Ask[SynthParams, None]) -> PooledCounts:
        """Return the sum of the sites' histograms, their public row count and noise."""
        order = sorted(results)
        params = ask.params
        schema = cells_schema(ask.schema, params)
        total = sum_histograms([results[s].arrays["histograms"] for s in order], schema,
                               params.n_bins, params.resolution)
        sigma = link_histogram_mechanism(schema, ask.budget.epsilon, ask.budget.delta).sigma
        return PooledCounts(total, sum(int(results[s].metadata["n_rows"]) for s in order),
                            release_noise_sd(schema, params.n_bins,
                                             sigma * math.sqrt(len(order)), params.resolution))

    def encoding(self, ask: Ask[SynthParams, None]) -> SumEncoding:
        """Return the weighted counts: every row adds ``m_j`` to one cell of each column.

        Under "fine" a column's leaves are a group of their own, which only the rows inside
        its bins add to (:func:`dpfed.common.synth.link_release.secure_link_groups`).
        """
        n_bins, resolution = ask.params.n_bins, ask.params.resolution
        schema = cells_schema(ask.schema, ask.params)
        groups, weights, partial = secure_link_groups(schema, n_bins, resolution)
        return SumEncoding(
            dim=sum(histogram_sizes(schema, n_bins, resolution)),
            row_norm=secure_link_row_norm(schema, n_bins, resolution),
            params=secure_base(ask.params, ask.schema, self.source), groups=groups,
            weights=weights, partial=partial)

    def pool_secure(self, summed: SecureSum, ask: Ask[SynthParams, None]) -> PooledCounts:
        """Return the pooled counts, each column divided by its weight, and their noise."""
        n_bins, resolution = ask.params.n_bins, ask.params.resolution
        schema = cells_schema(ask.schema, ask.params)
        return PooledCounts(
            secure_pooled_counts(summed.value, schema, n_bins, resolution),
            summed.n_rows_total,
            release_noise_sd(schema, n_bins, math.sqrt(summed.plan.pooled_variance),
                             resolution, secure=True))


def link_counts(data: DataAccess, params: SynthParams) -> LinkHistogramAccumulator:
    """Every column's exact histogram over ``data`` (site-internal), on the job's cells."""
    rows = CellRows(data, cells_schema(data.schema, params))
    acc = LinkHistogramAccumulator(rows.schema, params.n_bins, params.resolution)
    for table, _report in rows.iter_chunks():
        acc.add(table)
    return acc


def proportions(pooled: PooledCounts, schema: Schema, params: SynthParams) -> np.ndarray:
    """Return the DP proportions of every column's cells (post-processing of the pooled counts)."""
    return proportions_from_histograms(pooled.counts, cells_schema(schema, params), params.n_bins,
                                       n_rows=pooled.n_rows, resolution=params.resolution,
                                       noise_sd=pooled.noise_sd, heaps=params.heaps)


# --------------------------------------------------------------------------- pca


@dataclass(frozen=True)
class LinksInput:
    """The DP proportions the links are built from, and their digest (checked at the sites)."""

    proportions: np.ndarray
    digest: str

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays every later round carries."""
        return {"link_proportions": self.proportions}


class Latent(SynthRound, SumRound[SynthParams, LinksInput, PCAEstimate]):
    """``pca``: the second moment of the unit-ball latent rows (all p eigenpairs).

    Privacy: rows in the unit ball by the public clip norm; site level the DP-PCA mechanism
    of :mod:`dpfed.common.pca.dppca`; secure: the ``gram`` statistic.
    """

    name = "pca"
    task_kind = "synth"
    source = "synth_latent"
    statistic = "gram"
    secure_releases = ("a masked integer Gram matrix of the unit-ball latent rows with a share "
                       "of Skellam noise; only the pooled total is decoded -> G / N and its "
                       "eigenvectors")

    def prepare(self, task: Task, site: Site) -> Release:
        """Accumulate the Gram matrix of the latent rows, price DPdisPCA's factor."""
        extra, params = site_params(task, site)
        n_rows, gram = latent_gram(task, site, params, extra.get("links_digest"))
        require_rows(n_rows)
        cost = site_cost(n_rows, task.epsilon, task.delta, params.calibration)
        dim = gram.shape[0]

        def factor(rng: np.random.Generator) -> dict[str, np.ndarray]:
            return {"factor": site_release(gram, n_rows, epsilon=task.epsilon,
                                           delta=task.delta, rank=dim, rng=rng,
                                           calibration=params.calibration).factor}

        return noisy_release(task, cost, factor, {"n_rows": n_rows, "round": self.name,
                                                  "noise_sigma": cost.noise_scale})

    def contribution(self, task: Task, site: Site, participants: list[str],
                     tolerated: int) -> Contribution:
        """Return the exact integer Gram matrix of the latent rows (links digest checked first)."""
        params = secure_params(task, site)
        links = check_links(site.data.schema, params, task.params.get("links_digest"),
                            task.arrays)
        data = training_rows(task, site, params)

        def rows(rng: np.random.Generator) -> Iterator[np.ndarray]:
            clipped = 0
            for unit, n_clipped in latent_rows(site, data, links, params, rng):
                clipped += n_clipped
                yield unit
            log.info("task=%s clipped_rows=%d (local only)", task.task_id, clipped)

        return planned_contribution(task, participants, tolerated, statistic=self.statistic,
                                    dim=links.dim, row_norm=1.0,
                                    compute=rows_statistic(rows))

    def request(self, ask: Ask[SynthParams, LinksInput]) -> Request:
        """Return the job's parameters, round ``pca``, the links and their digest."""
        return Request({**base_params(ask.params, ask.schema), "round": self.name,
                        "links_digest": ask.inputs.digest}, ask.inputs.arrays)

    def check(self, result: TaskResult, ask: Ask[SynthParams, LinksInput]) -> None:
        """Require A finite p x p factor."""
        check_rows(result)
        dim = latent_dim(cells_schema(ask.schema, ask.params))
        check_finite(result.arrays.get("factor"), (dim, dim), "factor", 1e6)

    def pool(self, results: Mapping[str, TaskResult],
             ask: Ask[SynthParams, LinksInput]) -> PCAEstimate:
        """Return the size-weighted combination of the sites' factors."""
        sites = sorted(results)
        return combine_factors([results[s].arrays["factor"] for s in sites],
                               [int(results[s].metadata["n_rows"]) for s in sites],
                               latent_dim(cells_schema(ask.schema, ask.params)))

    def encoding(self, ask: Ask[SynthParams, LinksInput]) -> SumEncoding:
        """Return A Gram sum of the latent dimension over unit-ball rows."""
        return SumEncoding(
            dim=latent_dim(cells_schema(ask.schema, ask.params)), row_norm=1.0,
            params={**secure_base(ask.params, ask.schema, self.source),
                    "links_digest": ask.inputs.digest}, arrays=ask.inputs.arrays)

    def pool_secure(self, summed: SecureSum, ask: Ask[SynthParams, LinksInput]) -> PCAEstimate:
        """``G / N`` and its eigendecomposition."""
        dim = latent_dim(cells_schema(ask.schema, ask.params))
        a = symmetric_from_upper(summed.value, dim) / summed.n_rows_total
        return decompose_second_moment(a, dim)


def latent_gram(task: Task, site: Site, params: SynthParams, digest: Any,
                latent_rng: np.random.Generator | None = None) -> tuple[int, np.ndarray]:
    """Return the exact Gram matrix of the site's clipped latent rows (site-internal).

    ``latent_rng`` draws the links' latent values (tests couple neighbouring tables
    through it; by default a fresh production generator).
    """
    links = check_links(site.data.schema, params, digest, task.arrays)
    gram = GramAccumulator(links.dim)
    clipped = 0
    rng = latent_rng if latent_rng is not None else production_rng()
    for unit, n_clipped in latent_rows(site, training_rows(task, site, params), links, params,
                                       rng):
        clipped += n_clipped
        gram.add(unit)
    log.info("task=%s rows=%d clipped_rows=%d (local only)", task.task_id, gram.n_rows,
             clipped)
    return gram.n_rows, gram.gram()


# --------------------------------------------------------------------------- factors


@dataclass(frozen=True)
class LoadingsInput:
    """The links, and the DP loadings ``V`` (p x r) every site projects its rows onto."""

    links: LinksInput
    loadings: np.ndarray


@dataclass(frozen=True)
class Factors:
    """The sites' noisy factor rows in site order, and the largest noise scale among them."""

    rows: np.ndarray
    noise_scale: float


class FactorRows(SynthRound, BaseRound[SynthParams, LoadingsInput, Factors]):
    """``factors`` (row-aligned mode): ``X V + C``, one noisy factor row per real row.

    Privacy: one row of ``X V`` moves by at most 2 in L2 (``2 sqrt(r)`` in L1) under
    replace-one; Laplace on every entry (:func:`dpfed.common.synth.factor_model.
    factor_release`). Its own task kind ``synth_rows``, which a site must allow explicitly.
    """

    name = "factors"
    task_kind = "synth_rows"
    opt_in = True

    def prepare(self, task: Task, site: Site) -> Release:
        """Project the clipped latent rows onto the loadings, price the noise."""
        extra, params = site_params(task, site)
        unit, v = factor_rows(task, site, params, extra.get("links_digest"))
        require_rows(unit.shape[0])
        cost = factor_cost(v.shape[1], task.epsilon)
        return noisy_release(
            task, cost, lambda rng: {"factors": factor_release(unit, v, epsilon=task.epsilon,
                                                               rng=rng)[0]},
            {"n_rows": unit.shape[0], "round": self.name, "noise_scale": cost.noise_scale})

    def request(self, ask: Ask[SynthParams, LoadingsInput]) -> Request:
        """Return the job's parameters, round ``factors``, the links and the loadings."""
        links = ask.inputs.links
        return Request({**base_params(ask.params, ask.schema), "round": self.name,
                        "links_digest": links.digest},
                       {**links.arrays, "loadings": ask.inputs.loadings})

    def check(self, result: TaskResult, ask: Ask[SynthParams, LoadingsInput]) -> None:
        """Finite factors, one row per reported row."""
        n = check_rows(result)
        r = ask.inputs.loadings.shape[1]
        w = result.arrays.get("factors")
        if w is None or w.shape != (n, r) or w.dtype != np.float64 or not np.all(
                np.isfinite(w)):
            raise ProtocolError(f"expected finite float64 factors of shape ({n}, {r})")

    def pool(self, results: Mapping[str, TaskResult],
             ask: Ask[SynthParams, LoadingsInput]) -> Factors:
        """Return the factor rows in site order."""
        sites = sorted(results)
        rows = (np.concatenate([results[s].arrays["factors"] for s in sites]) if sites
                else np.zeros((0, ask.inputs.loadings.shape[1])))
        return Factors(rows, max((float(r.spend.noise_scale) for r in results.values()),
                                 default=0.0))


def factor_rows(task: Task, site: Site, params: SynthParams, digest: Any,
                latent_rng: np.random.Generator | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Return the site's clipped latent rows and the task's checked loadings (site-internal)."""
    links = check_links(site.data.schema, params, digest, task.arrays)
    dim = links.dim
    loadings = task.arrays.get("loadings")
    if loadings is None:
        raise ValidationError("the factors round needs the loadings")
    v = np.asarray(loadings, dtype=np.float64)
    if v.ndim != 2 or v.shape[0] != dim or not 1 <= v.shape[1] <= dim or not np.all(
            np.isfinite(v)):
        raise ValidationError(f"loadings must be a finite {dim} x r matrix, got {v.shape}")
    if float(np.abs(v.T @ v - np.eye(v.shape[1])).max()) > _ORTHONORMAL_TOL:
        raise ValidationError("loadings must have orthonormal columns")
    rng = latent_rng if latent_rng is not None else production_rng()
    parts = [unit for unit, _n in latent_rows(site, training_rows(task, site, params), links,
                                              params, rng)]
    return (np.concatenate(parts) if parts else np.zeros((0, dim))), v


LINKS = Links()
LATENT = Latent()
FACTORS = FactorRows()

__all__ = ["FACTORS", "LATENT", "LINKS", "PAIR_ROUNDS"]
