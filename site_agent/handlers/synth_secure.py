"""The ``synth`` job's contributions to secure sums (sources of the ``secagg`` contribute stage).

``synth_counts`` (round ``links`` under ``--aggregation secure``)
    The site's exact count vector: the histogram of every column (codes; public equal-width
    bins for continuous columns), concatenated in schema order as
    :func:`dpfed.common.synth.link_release.histogram_sizes` lays them out — the same
    accumulator the site-level round noises with Gaussian noise — with column ``j``'s counts
    multiplied by its public integer weight ``m_j``
    (:func:`dpfed.common.synth.link_release.secure_link_weights`; more for columns with more
    cells, so the pooled counts divided by ``m_j`` carry less noise there).
``synth_latent`` (round ``pca`` under ``--aggregation secure``)
    The site's latent rows: the links the task carries are rebuilt and their digest checked
    exactly as in the site-level round (:func:`dpfed.site_agent.handlers.synth.check_links`),
    rows are mapped to the latent space and clipped to the unit ball by the public clip norm;
    the contribute stage sums their Gram matrix.
``synth_pair_scores`` (round ``pair_scores``)
    The links are checked as for ``synth_latent``; the site builds the pair grid from their
    DP proportions and the task's ``pair_groups``
    (:meth:`dpfed.common.synth.pair_marginals.PairGrid.from_proportions`), the exact 2-way
    tables of every candidate pair over its training rows, and their dependence scores
    (:func:`dpfed.common.synth.pair_marginals.dependence_scores`), floored to integers in
    ``[0, 2 N_s]`` (:func:`floored_scores`) — the ``scores`` statistic.
``synth_pairs`` (round ``pairs``)
    The same grid; the task's ``pair_edges`` (``[parent, child]`` pairs the coordinator chose
    from the noisy scores) are validated — distinct pairs of distinct columns, each a
    candidate pair — and the exact tables of those edges, concatenated in edge order, are the
    ``counts`` statistic with one group per edge.

The task carries the job's canonical synth parameters under ``job`` and the schema digest;
both are validated exactly as the site-level rounds validate them.

Privacy
-------
Replace-one at this site (``N_s`` public). ``synth_counts``: one replaced row moves ``m_j``
down in one cell and up in another of each column ``j``'s weighted histogram: L2 sensitivity
``sqrt(2 sum m_j^2)``, L1 ``2 sum m_j`` (bounded by ``2 sum m_j^2``), integer already (plan
scale 1, no rounding) — the ``weighted_counts`` statistic of
:mod:`dpfed.common.secagg.secure_sum`, whose ``row_norm`` is ``sqrt(sum m_j^2)`` from this
site's schema and bin count.
``synth_latent``: rows in the unit ball (``row_norm`` 1), the ``gram`` statistic (fixed-point
rounding bounded by the plan's ``B``; L2 ``sqrt(2) B^2``). ``synth_pair_scores``: each score
``sum |n_ab - N_s p_a p_b|`` moves by at most 2 (one count down and one up in the pair's table;
the independence table depends on public values only); flooring keeps the per-entry change
at most 2 (``floor x - floor y < x - y + 1 <= 3``) and clipping into the public range
``[0, 2 N_s]`` never increases it: the ``scores`` statistic with ``b = 2``, L2 ``2 sqrt(P)``,
L1 ``2 P`` for ``P`` candidate pairs. ``synth_pairs``: one count down and one up in each of
the ``K`` edges' tables: the ``counts`` statistic with ``C = K`` (``row_norm = sqrt(K)``), L2
``sqrt(2 K)``, L1 ``2 K``. The Skellam share, the masks and the ledger charge are the
contribute stage's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.job_params import SynthParams
from dpfed.common.secagg.secure_sum import SecureSumPlan
from dpfed.common.synth.link_release import (
    LinkHistogramAccumulator,
    histogram_sizes,
    secure_cell_weights,
    secure_link_row_norm,
)
from dpfed.common.synth.links import clip_to_unit_ball, default_clip_norm, latent_dim
from dpfed.common.synth.pair_marginals import (
    MAX_GROUPS,
    SCORE_SENSITIVITY,
    PairGrid,
    dependence_scores,
)
from dpfed.common.transport.protocol import Task
from dpfed.common.validation import check_int
from dpfed.site_agent.handlers.base import DataAccess
from dpfed.site_agent.handlers.secagg_sources import (
    Contribution,
    ContributionSource,
    planned_contribution,
    row_statistic,
)
from dpfed.site_agent.handlers.synth import (
    check_links,
    check_pair_edges,
    exact_pair_tables,
    pair_candidates,
    pair_grid,
    training_rows,
)

log = logging.getLogger(__name__)

#: Per-entry replace-one bound ``b`` of the floored dependence scores (the ``scores`` plan's
#: ``row_norm``); a site's scores lie in ``[0, b N_s]``.
SCORE_BOUND = int(SCORE_SENSITIVITY)


def _synth_params(task: Task, data: DataAccess) -> SynthParams:
    """Validate the job parameters and the schema digest the task carries."""
    job = task.params.get("job")
    if not isinstance(job, Mapping):
        raise ValidationError("a synth secure round carries the job's parameters under 'job'")
    params = SynthParams.from_mapping(dict(job), latent_dim=latent_dim(data.schema))
    sent = task.params.get("schema_digest")
    if sent != data.schema.digest():
        raise ValidationError(
            f"schema digest mismatch: the job was planned for schema {str(sent)[:12]}..., this "
            f"site's schema is {data.schema.digest()[:12]}...; refusing")
    return params


def count_vector_norm(n_columns: int) -> float:
    """Return ``sqrt(C)``: the exact L2 norm of one row's contribution to C histograms."""
    return math.sqrt(n_columns)


def synth_counts_contribution(task: Task, data: DataAccess, participants: list[str],
                              tolerated: int, *, site_dir: Path | None = None) -> Contribution:
    """Build ``synth_counts``: exact per-column histograms, concatenated (module docstring)."""
    schema = data.schema
    params = _synth_params(task, data)
    data = training_rows(task, data, params, site_dir)  # the evaluation holdout trains nothing

    def compute(plan: SecureSumPlan, _rng: np.random.Generator) -> tuple[np.ndarray, int]:
        acc = LinkHistogramAccumulator(schema, params.n_bins, params.resolution)
        for table, _report in data.iter_chunks():
            acc.add(table)
        return (acc.counts * secure_cell_weights(schema, params.n_bins, params.resolution),
                acc.n_rows)

    return planned_contribution(task, participants, tolerated, statistics=("weighted_counts",),
                                dim=sum(histogram_sizes(schema, params.n_bins,
                                                        params.resolution)),
                                row_norm=secure_link_row_norm(schema, params.n_bins,
                                                              params.resolution),
                                compute=compute)


def synth_latent_contribution(task: Task, data: DataAccess, participants: list[str],
                              tolerated: int, *, site_dir: Path | None = None) -> Contribution:
    """Build ``synth_latent``: unit-ball latent rows under the links the task carries.

    The links' digest is checked before anything else (a mismatch refuses, uncharged).
    """
    schema = data.schema
    params = _synth_params(task, data)
    data = training_rows(task, data, params, site_dir)  # the evaluation holdout trains nothing
    extra: dict[str, Any] = {"links_digest": task.params.get("links_digest")}
    links = check_links(schema, params, extra, dict(task.arrays))
    dim = latent_dim(schema)
    clip = params.clip_norm if params.clip_norm is not None else default_clip_norm(dim)

    def rows(rng: np.random.Generator) -> Iterator[np.ndarray]:
        clipped = 0
        for table, _report in data.iter_chunks():
            unit, n_clipped = clip_to_unit_ball(links.to_latent(table, rng), clip)
            clipped += n_clipped
            yield unit
        log.info("[synth_latent_contribution] task=%s clipped_rows=%d (local only)",
                 task.task_id, clipped)

    return planned_contribution(task, participants, tolerated, statistics=("gram",), dim=dim,
                                row_norm=1.0, compute=row_statistic(rows))


def floored_scores(scores: np.ndarray, n_rows: int) -> np.ndarray:
    """Return dependence scores floored to int64 and clipped into ``[0, SCORE_BOUND * N_s]``.

    Privacy
    -------
    Replace-one at this site, ``N_s`` public. A score moves by at most 2; so does its floor
    (``floor x - floor y < x - y + 1 <= 3``, an integer). The scores lie in ``[0, 2 N_s]``
    mathematically (``sum |n - N_s q| <= N_s + N_s sum q`` with ``q`` a distribution);
    clipping to that public range only absorbs the floating-point slack of the DP
    proportions' sums and, being 1-Lipschitz with the same bounds on both neighbours, never
    increases the change. The range is what the ``scores`` plan's no-wrap check assumes.
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or not np.all(np.isfinite(s)):
        raise ValidationError("dependence scores must be a finite vector")
    top = SCORE_BOUND * check_int(n_rows, "n_rows", minimum=0)
    if s.size and (float(s.min()) < 0.0 or float(s.max()) > top * (1.0 + 1e-6) + 1.0):
        raise ValidationError(f"dependence scores outside their range [0, {top}] (the link "
                              "proportions are not distributions)")
    return np.clip(np.floor(s), 0, top).astype(np.int64)


def _pair_grid(task: Task, data: DataAccess, params: SynthParams) -> tuple[PairGrid, np.ndarray]:
    """Check the links the task carries and build the pair grid from their proportions."""
    if params.mode != "generative":
        raise ValidationError(f"the pair rounds run only in generative mode, got mode "
                              f"{params.mode!r}")
    if len(data.schema.columns) < 2:
        raise ValidationError("the pair rounds need a schema of at least 2 columns")
    extra: dict[str, Any] = {"links_digest": task.params.get("links_digest")}
    check_links(data.schema, params, extra, dict(task.arrays))  # digest and proportions
    groups = check_int(task.params.get("pair_groups"), "pair_groups", minimum=2,
                       maximum=MAX_GROUPS)
    if groups != params.pair_groups:
        raise ValidationError(f"pair_groups {groups} differs from the job's "
                              f"{params.pair_groups}; refusing")
    proportions = np.asarray(task.arrays["link_proportions"], dtype=np.float64)
    return pair_grid(data.schema, params, proportions), proportions


def synth_pair_scores_contribution(task: Task, data: DataAccess, participants: list[str],
                                   tolerated: int, *,
                                   site_dir: Path | None = None) -> Contribution:
    """Build ``synth_pair_scores``: floored dependence scores of every candidate pair.

    The links' digest is checked before anything else (a mismatch refuses, uncharged). The
    scores follow :meth:`PairGrid.candidate_pairs` order.
    """
    params = _synth_params(task, data)
    grid, proportions = _pair_grid(task, data, params)
    cands = pair_candidates(grid)
    data = training_rows(task, data, params, site_dir)  # the evaluation holdout trains nothing

    def compute(plan: SecureSumPlan, _rng: np.random.Generator) -> tuple[np.ndarray, int]:
        acc = exact_pair_tables(grid, cands, data)
        scores = dependence_scores(acc.counts, grid, cands, proportions, acc.n_rows)
        return floored_scores(scores, acc.n_rows), acc.n_rows

    return planned_contribution(task, participants, tolerated, statistics=("scores",),
                                dim=len(cands), row_norm=float(SCORE_BOUND), compute=compute)


def synth_pairs_contribution(task: Task, data: DataAccess, participants: list[str],
                             tolerated: int, *, site_dir: Path | None = None) -> Contribution:
    """Build ``synth_pairs``: the exact tables of the task's edges, concatenated in edge order.

    Links digest and edges are checked before anything else (refusals are uncharged).
    """
    params = _synth_params(task, data)
    grid, _proportions = _pair_grid(task, data, params)
    d = len(data.schema.columns)
    edges = check_pair_edges(task.params.get("pair_edges"), pair_candidates(grid), d,
                             params.max_pairs(d))
    data = training_rows(task, data, params, site_dir)  # the evaluation holdout trains nothing

    def compute(plan: SecureSumPlan, _rng: np.random.Generator) -> tuple[np.ndarray, int]:
        acc = exact_pair_tables(grid, edges, data)
        return acc.counts, acc.n_rows

    return planned_contribution(task, participants, tolerated, statistics=("counts",),
                                dim=sum(grid.cells(e) for e in edges),
                                row_norm=count_vector_norm(len(edges)), compute=compute)


SYNTH_COUNTS_SOURCE = ContributionSource("synth", synth_counts_contribution)
SYNTH_LATENT_SOURCE = ContributionSource("synth", synth_latent_contribution)
SYNTH_PAIR_SCORES_SOURCE = ContributionSource("synth", synth_pair_scores_contribution)
SYNTH_PAIRS_SOURCE = ContributionSource("synth", synth_pairs_contribution)
