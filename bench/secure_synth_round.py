"""The ``synth`` job's secure rounds, in-process with the real code (shared by the benches).

:func:`fit_secure` runs ``dpfed synth --aggregation secure`` without the network: every site's
``synth_counts`` and ``synth_latent`` sources, and with the pair rounds its
``synth_pair_scores`` and ``synth_pairs`` sources (the site-agent code), its Skellam share and its
pairwise masks (real X25519 keys signed with certificates from dpfed's CA,
:func:`federation`); the coordinator decodes only the sums and post-processes them exactly as
:mod:`dpfed.aggregator.jobs.synth` and :mod:`dpfed.aggregator.jobs.synth_secure` do (links
from the pooled counts projected onto the public N, ``G / N`` eigendecomposed, the factor model
with the job's rank rule, calibration to the released marginals in ``SynthModel.build``; the
job's pair planning, forest, table fit and ``with_pairs`` with the decoded sum's noise).

Used by ``bench/synth_secure.py`` and ``bench/synth_quality.py`` (methods ``fed-secure-*``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from secure_aggregation import masked_shares  # noqa: E402

from dpfed.aggregator.jobs.pca_secure import decompose_second_moment  # noqa: E402
from dpfed.aggregator.jobs.secure_rounds import symmetric_from_upper  # noqa: E402
from dpfed.aggregator.jobs.synth import _correlation  # noqa: E402
from dpfed.aggregator.jobs.synth_pairs import pair_noise, plan_pairs  # noqa: E402
from dpfed.aggregator.jobs.synth_secure import rho_share  # noqa: E402
from dpfed.aggregator.synth_model import SynthModel  # noqa: E402
from dpfed.common.data.encoding import EncodedTable, EncodingReport  # noqa: E402
from dpfed.common.data.schema import Schema  # noqa: E402
from dpfed.common.job_params import SynthParams  # noqa: E402
from dpfed.common.secagg.masking import MaskContext  # noqa: E402
from dpfed.common.secagg.messages import plan_params  # noqa: E402
from dpfed.common.secagg.secure_sum import (  # noqa: E402
    SecureSumPlan,
    decode_sum,
    plan_for,
    plan_within_rho,
)
from dpfed.common.synth.factor_model import dp_second_moment  # noqa: E402
from dpfed.common.synth.generative import fit_factor_model  # noqa: E402
from dpfed.common.synth.link_release import (  # noqa: E402
    histogram_sizes,
    links_digest,
    release_noise_sd,
    secure_link_row_norm,
    secure_pooled_counts,
)
from dpfed.common.synth.links import default_clip_norm, latent_dim  # noqa: E402
from dpfed.common.synth.pair_marginals import (  # noqa: E402
    DEFAULT_GROUPS,
    SCORE_SENSITIVITY,
    fit_pair_tables,
)
from dpfed.common.synth.pipeline import links_from_histograms, pair_forest  # noqa: E402
from dpfed.common.transport.certs import init_federation  # noqa: E402
from dpfed.common.transport.protocol import Task  # noqa: E402
from dpfed.site_agent.handlers.secagg_sources import ContributionBuilder  # noqa: E402
from dpfed.site_agent.handlers.synth_secure import (  # noqa: E402
    synth_counts_contribution,
    synth_latent_contribution,
    synth_pair_scores_contribution,
    synth_pairs_contribution,
)


class SiteRows:
    """One site's encoded rows as the site sources read them (schema + chunked pass)."""

    def __init__(self, schema: Schema, table: EncodedTable) -> None:
        self._schema, self.table = schema, table

    @property
    def schema(self) -> Schema:
        return self._schema

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        yield self.table, EncodingReport()


def federation(directory: Path, ids: list[str]) -> Path:
    """Create a federation (CA, site certificates) for ``ids`` under ``directory``."""
    fed = directory / "fed"
    init_federation(fed, coordinator_hosts=["localhost"], sites=ids, analysts=[])
    return fed


def secure_round(source: ContributionBuilder, statistic: str, params: dict[str, object],
                 arrays: dict[str, np.ndarray], sites: list[SiteRows], ids: list[str],
                 fed: Path, eps: float, delta: float, *, dim: int, row_norm: float,
                 rng: np.random.Generator,
                 rho: float | None = None) -> tuple[np.ndarray, int, SecureSumPlan]:
    """One secure sum through the sites' real source code; return (decoded sum, N, plan).

    ``dim`` and ``row_norm`` are what the job's coordinator plans the sum with
    (:mod:`dpfed.aggregator.jobs.synth_secure`); every site recomputes the plan from its own
    rows and the task and must agree. ``rho`` (zCDP composition) plans it as the job does:
    the least noise charged at most ``rho``, at that plan's epsilon.
    """
    n = sum(s.table.n_rows for s in sites)
    if rho is None:
        plan = plan_for(statistic, dim=dim, total_rows=n, epsilon=eps, delta=delta,
                        participants=ids, row_norm=row_norm)
    else:
        plan = plan_within_rho(statistic, dim=dim, total_rows=n, epsilon=eps, delta=delta,
                               rho=rho, participants=ids, row_norm=row_norm)
    task = Task("bench/sum", "bench", "secagg", plan.calibration.epsilon, delta,
                {**params, **plan_params(plan, row_norm=row_norm)}, arrays)
    given = [source(task, s, ids, 0) for s in sites]
    assert all(g.plan == plan for g in given)  # each site recomputed the coordinator's plan
    ctx = MaskContext("bench", statistic, f"bench/{statistic}/{rng.integers(1 << 30)}")
    masked = masked_shares({s: g.compute(rng)[0] for s, g in zip(ids, given, strict=True)},
                           plan, fed, ctx, rng)
    return decode_sum(masked, plan), n, plan


def fit_secure(schema: Schema, tables: list[EncodedTable], ids: list[str], fed: Path,
               eps: float, delta: float, rng: np.random.Generator, *, n_bins: int,
               split: Mapping[str, tuple[float, float]] | tuple[float, float] | None = None,
               pairs: int | None = None, pair_groups: int = DEFAULT_GROUPS,
               composition: str = "basic", resolution: str = "fine",
               pair_gate: bool = True) -> SynthModel:
    """The job's secure rounds (sites' real sources), then the job's post-processing.

    ``split`` maps round names to (epsilon share, delta share) as the job's ``split``
    parameter (None: the job's default for ``pairs``); a bare (epsilon, delta) pair is the
    links round's share with the rest to the pca round (no pair rounds). ``pairs`` (None: the
    job's default, columns - 1; 0: no pair rounds) and ``pair_groups`` are the job's. With
    pair rounds, ``pair_scores`` and ``pairs`` are secure sums too (the sites'
    ``synth_pair_scores`` and ``synth_pairs`` sources) and the model is fitted to the decoded
    tables with their public Skellam noise, as :mod:`dpfed.aggregator.jobs.synth_pairs` does.
    ``composition`` is the job's (``zcdp``: every round its share of rho), and so are
    ``resolution`` (the continuous columns' cells) and ``pair_gate``.
    """
    dim = latent_dim(schema)
    raw: dict[str, object] = {"n_bins": n_bins, "aggregation": "secure",
                              "pair_groups": pair_groups, "composition": composition,
                              "resolution": resolution, "pair_gate": pair_gate}
    if isinstance(split, Mapping):
        raw["split"] = {k: [float(v[0]), float(v[1])] for k, v in split.items()}
    elif split is not None:
        raw["split"] = {"links": [split[0], split[1]], "pca": [1.0 - split[0], 1.0 - split[1]]}
        pairs = 0
    if pairs is not None:
        raw["pairs"] = pairs
    params = SynthParams.from_mapping(raw, latent_dim=dim)
    budget = {name: (e, d) for name, e, d in params.plan(eps, delta)}
    base = {"job": params.to_mapping(), "schema_digest": schema.digest()}
    sites = [SiteRows(schema, t) for t in tables]
    weighted, n, links_plan = secure_round(
        synth_counts_contribution, "weighted_counts", base, {}, sites, ids, fed,
        *budget["links"], dim=sum(histogram_sizes(schema, n_bins, resolution)),
        row_norm=secure_link_row_norm(schema, n_bins, resolution), rng=rng,
        rho=rho_share(params, *budget["links"]))
    # as the job's secure_links and its links step
    counts = secure_pooled_counts(weighted, schema, n_bins, resolution)
    noise = release_noise_sd(schema, n_bins, math.sqrt(links_plan.pooled_variance), resolution,
                             secure=True)
    props, links = links_from_histograms(counts, schema, n_bins, n_rows=n,
                                         continuous_link=params.continuous_link,
                                         resolution=resolution, noise_sd=noise)
    digest = links_digest(schema, props, n_bins, params.continuous_link, resolution)
    arrays = {"link_proportions": props}
    upper, n, _ = secure_round(synth_latent_contribution, "gram",
                               {**base, "links_digest": digest}, arrays, sites, ids, fed,
                               *budget["pca"], dim=dim, row_norm=1.0, rng=rng,
                               rho=rho_share(params, *budget["pca"]))
    est = decompose_second_moment(symmetric_from_upper(upper, dim) / n, dim)
    clip = params.clip_norm if params.clip_norm is not None else default_clip_norm(dim)
    fm, corr = fit_factor_model(est, links, clip_norm=clip, rng=rng, rank=params.rank,
                                info_threshold=params.info_threshold, n_rows=n)
    model = SynthModel.build(schema, mode="generative",
                             continuous_link=params.continuous_link, n_bins=n_bins,
                             proportions=props, factor_model=fm,
                             dp_correlation=_correlation(dp_second_moment(est, dim)), rng=rng,
                             latent_correlation=corr, resolution=resolution)
    planned = plan_pairs(schema, params, props)  # the job's: None without pair rounds
    if planned is None:
        return model
    grid, cands, most = planned
    pair_base = {**base, "links_digest": digest, "pair_groups": params.pair_groups}
    scores, _, _ = secure_round(synth_pair_scores_contribution, "scores", pair_base, arrays,
                                sites, ids, fed, *budget["pair_scores"], dim=len(cands),
                                row_norm=SCORE_SENSITIVITY, rng=rng,
                                rho=rho_share(params, *budget["pair_scores"]))
    edges = pair_forest(np.asarray(scores, dtype=np.float64), grid, most,
                        pair_noise(params, *budget["pairs"], len(ids))
                        if params.pair_gate else None)  # as the job's pair rounds
    if not edges:
        return model
    tables_sum, n, plan = secure_round(
        synth_pairs_contribution, "counts",
        {**pair_base, "pair_edges": [[a, b] for a, b in edges]}, arrays, sites, ids, fed,
        *budget["pairs"], dim=sum(grid.cells(e) for e in edges),
        row_norm=math.sqrt(len(edges)), rng=rng, rho=rho_share(params, *budget["pairs"]))
    joint = fit_pair_tables(np.asarray(tables_sum, dtype=np.float64), grid, edges, props,
                            float(n))
    noise_sd = math.sqrt(plan.pooled_variance)  # counts (scale 1), as the job
    return model.with_pairs(grid, edges, joint, rng, noise_sd=noise_sd / max(n, 1))
