"""The ``synth`` job's contributions to secure sums (sources of the ``secagg`` contribute stage).

``synth_counts`` (round ``links`` under ``--aggregation secure``)
    The site's exact count vector: the histogram of every column (codes; public equal-width
    bins for continuous columns), concatenated in schema order as
    :func:`dpfed.common.synth.link_release.histogram_sizes` lays them out — the same
    accumulator the site-level round noises with Gaussian noise.
``synth_latent`` (round ``pca`` under ``--aggregation secure``)
    The site's latent rows: the links the task carries are rebuilt and their digest checked
    exactly as in the site-level round (:func:`dpfed.site_agent.handlers.synth.check_links`),
    rows are mapped to the latent space and clipped to the unit ball by the public clip norm;
    the contribute stage sums their Gram matrix.

The task carries the job's canonical synth parameters under ``job`` and the schema digest;
both are validated exactly as the site-level rounds validate them.

Privacy
-------
Replace-one at this site (``N_s`` public). ``synth_counts``: one replaced row moves one count
down and another up in each of the ``C`` columns' histograms: L2 sensitivity ``sqrt(2 C)``,
L1 ``2 C``, integer already (plan scale 1, no rounding) — the ``counts`` statistic of
:mod:`dpfed.common.secagg.secure_sum`, whose ``row_norm`` is ``sqrt(C)`` from this site's schema.
``synth_latent``: rows in the unit ball (``row_norm`` 1), the ``gram`` statistic (fixed-point
rounding bounded by the plan's ``B``; L2 ``sqrt(2) B^2``). The Skellam share, the masks and the
ledger charge are the contribute stage's.
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
from dpfed.common.synth.link_release import LinkHistogramAccumulator, histogram_sizes
from dpfed.common.synth.links import clip_to_unit_ball, default_clip_norm, latent_dim
from dpfed.common.transport.protocol import Task
from dpfed.site_agent.handlers.base import DataAccess
from dpfed.site_agent.handlers.secagg_sources import (
    Contribution,
    ContributionSource,
    planned_contribution,
    row_statistic,
)
from dpfed.site_agent.handlers.synth import check_links, training_rows

log = logging.getLogger(__name__)


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
        acc = LinkHistogramAccumulator(schema, params.n_bins)
        for table, _report in data.iter_chunks():
            acc.add(table)
        return acc.counts, acc.n_rows

    return planned_contribution(task, participants, tolerated, statistics=("counts",),
                                dim=sum(histogram_sizes(schema, params.n_bins)),
                                row_norm=count_vector_norm(len(schema.columns)),
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


SYNTH_COUNTS_SOURCE = ContributionSource("synth", synth_counts_contribution)
SYNTH_LATENT_SOURCE = ContributionSource("synth", synth_latent_contribution)
