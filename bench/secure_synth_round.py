"""The ``synth`` job's secure rounds, in-process with the real code (shared by the benches).

:func:`fit_secure` runs ``dpfed synth --aggregation secure`` without the network: every site's
``synth_counts`` and ``synth_latent`` sources (the site-agent code), its Skellam share and its
pairwise masks (real X25519 keys signed with certificates from dpfed's CA,
:func:`federation`); the coordinator decodes only the sums and post-processes them exactly as
:mod:`dpfed.aggregator.jobs.synth` and :mod:`dpfed.aggregator.jobs.synth_secure` do (links
from the pooled counts projected onto the public N, ``G / N`` eigendecomposed, the factor model
with the job's rank rule, calibration to the released marginals in ``SynthModel.build``).

Used by ``bench/synth_secure.py`` and ``bench/synth_quality.py`` (methods ``fed-secure-*``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives import serialization

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfed.aggregator.jobs.pca_secure import decompose_second_moment  # noqa: E402
from dpfed.aggregator.jobs.secure_rounds import symmetric_from_upper  # noqa: E402
from dpfed.aggregator.jobs.synth import _correlation  # noqa: E402
from dpfed.aggregator.synth_model import SynthModel  # noqa: E402
from dpfed.common.data.encoding import EncodedTable, EncodingReport  # noqa: E402
from dpfed.common.data.schema import Schema  # noqa: E402
from dpfed.common.job_params import SynthParams  # noqa: E402
from dpfed.common.secagg.keys import generate_ephemeral, sign_ephemeral  # noqa: E402
from dpfed.common.secagg.masking import MaskContext  # noqa: E402
from dpfed.common.secagg.messages import plan_params  # noqa: E402
from dpfed.common.secagg.secure_sum import decode_sum, plan_for, site_contribution  # noqa: E402
from dpfed.common.synth.factor_model import dp_second_moment  # noqa: E402
from dpfed.common.synth.generative import fit_factor_model  # noqa: E402
from dpfed.common.synth.link_release import histogram_sizes, links_digest  # noqa: E402
from dpfed.common.synth.links import default_clip_norm, latent_dim  # noqa: E402
from dpfed.common.synth.pipeline import links_from_histograms  # noqa: E402
from dpfed.common.transport.certs import init_federation  # noqa: E402
from dpfed.common.transport.protocol import Task  # noqa: E402
from dpfed.site_agent.handlers.secagg_sources import ContributionBuilder  # noqa: E402
from dpfed.site_agent.handlers.synth_secure import (  # noqa: E402
    synth_counts_contribution,
    synth_latent_contribution,
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
                 fed: Path, eps: float, delta: float, n_bins: int,
                 rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """One secure sum through the sites' real source code; return (decoded sum, N)."""
    schema = sites[0].schema
    n = sum(s.table.n_rows for s in sites)
    dim, row_norm = ((sum(histogram_sizes(schema, n_bins)), math.sqrt(len(schema.columns)))
                     if statistic == "counts" else (latent_dim(schema), 1.0))
    plan = plan_for(statistic, dim=dim, total_rows=n, epsilon=eps, delta=delta,
                    participants=ids, row_norm=row_norm)
    task = Task("bench/sum", "bench", "secagg", eps, delta,
                {**params, **plan_params(plan, row_norm=row_norm)}, arrays)
    given = [source(task, s, ids, 0) for s in sites]
    assert all(g.plan == plan for g in given)  # each site recomputed the coordinator's plan
    ctx = MaskContext("bench", statistic, f"bench/{statistic}/{rng.integers(1 << 30)}")
    ca = x509.load_pem_x509_certificate((fed / "ca.pem").read_bytes())
    keys = {s: generate_ephemeral() for s in ids}
    signed = {}
    for s in ids:
        kit = fed / "sites" / s
        signing = serialization.load_pem_private_key((kit / "site.key").read_bytes(), None)
        signed[s] = sign_ephemeral(site_id=s, public_key=keys[s][1], context=ctx,
                                   signing_key=signing,  # type: ignore[arg-type]
                                   certificate_pem=(kit / "site.pem").read_bytes())
    masked = {}
    for s, g in zip(ids, given, strict=True):
        stat, _ = g.compute(rng)
        masked[s] = site_contribution(stat, plan=plan, own_id=s, own_key=keys[s][0],
                                      signed_keys=signed, context=ctx, ca=ca,
                                      min_participants=2, tolerated=0, rng=rng)
    return decode_sum(masked, plan), n


def fit_secure(schema: Schema, tables: list[EncodedTable], ids: list[str], fed: Path,
               eps: float, delta: float, rng: np.random.Generator, *, n_bins: int,
               links_share: tuple[float, float]) -> SynthModel:
    """The job's secure rounds (sites' real sources), then the job's post-processing.

    ``links_share`` is the (epsilon, delta) share of the links round; the pca round gets the
    rest (the job's ``split``).
    """
    dim = latent_dim(schema)
    split = {"links": list(links_share), "pca": [1.0 - links_share[0], 1.0 - links_share[1]]}
    params = SynthParams.from_mapping({"n_bins": n_bins, "aggregation": "secure",
                                       "split": split}, latent_dim=dim)
    budget = {name: (e, d) for name, e, d in params.plan(eps, delta)}
    base = {"job": params.to_mapping(), "schema_digest": schema.digest()}
    sites = [SiteRows(schema, t) for t in tables]
    counts, n = secure_round(synth_counts_contribution, "counts", base, {}, sites, ids, fed,
                             *budget["links"], n_bins, rng)
    props, links = links_from_histograms(counts, schema, n_bins, n_rows=n,
                                         continuous_link=params.continuous_link)
    digest = links_digest(schema, props, n_bins, params.continuous_link)
    upper, n = secure_round(synth_latent_contribution, "gram", {**base, "links_digest": digest},
                            {"link_proportions": props}, sites, ids, fed, *budget["pca"],
                            n_bins, rng)
    est = decompose_second_moment(symmetric_from_upper(upper, dim) / n, dim)
    clip = params.clip_norm if params.clip_norm is not None else default_clip_norm(dim)
    fm, corr = fit_factor_model(est, links, clip_norm=clip, rng=rng, rank=params.rank,
                                info_threshold=params.info_threshold)
    return SynthModel.build(schema, mode="generative", continuous_link=params.continuous_link,
                            n_bins=n_bins, proportions=props, factor_model=fm,
                            dp_correlation=_correlation(dp_second_moment(est, dim)), rng=rng,
                            latent_correlation=corr)
