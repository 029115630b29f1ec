"""The synth job's secure pair rounds (``pair_scores``, ``pairs``) over a real federation:
a real coordinator on loopback, three real site agents over mTLS with their
own certificates, secure-aggregation handlers and SQLite ledgers, the real ``secagg`` key
exchange and contributions. At a large epsilon the decoded sums equal the pooled exact
floored scores (candidate-pair order) and the pooled exact tables (edge order) computed from
the sites' files; every site is charged once per sum with the secure mechanism; a site left
out by ``among`` is neither asked nor charged.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from dpfed.aggregator.jobs.job import Job
from dpfed.aggregator.jobs.records import secure_record
from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.schema import Schema
from dpfed.common.job_params import SynthParams
from dpfed.common.jobs.contract import Ask, Budget
from dpfed.common.jobs.registry import job_kind
from dpfed.common.jobs.synth_pairs import PAIR_SCORES, PAIRS, PairInput
from dpfed.common.jobs.synth_rounds import LinksInput
from dpfed.common.secagg.policy import SecureAggregationPolicy
from dpfed.common.synth.link_release import (
    histogram_sizes,
    links_digest,
    proportions_from_histograms,
)
from dpfed.common.synth.pair_marginals import (
    PairGrid,
    PairTableAccumulator,
    dependence_scores,
)
from dpfed.common.transport.protocol import JobSpec
from dpfed.site_agent.handlers.secagg import SecureAggregationHandler, SiteIdentity
from tests.aggregator.hardening_harness import Harness, harness, start_agent

pytestmark = pytest.mark.timeout(180)

GROUPS = 4
SPLIT = {"links": [0.005, 0.25], "pca": [0.005, 0.25], "pair_scores": [0.5, 0.25],
         "pairs": [0.49, 0.25]}


async def _start_secure_sites(h: Harness, sites: list[str]) -> None:
    for site_id in sites:
        kit = h.fed.certs / "sites" / site_id
        handler = SecureAggregationHandler(
            SiteIdentity.load(kit / "ca.pem", kit / "site.pem", kit / "site.key"),
            SecureAggregationPolicy(min_participants=2, tolerated=1,
                                federation_list=kit / "revoked.toml"),
            allowed_kinds=("pca", "svt", "query", "synth"))
        agent, ledger, task = await start_agent(h.fed, site_id, handlers={"secagg": handler},
                                                extra_kinds=("synth", "secagg"))
        h.agents[site_id], h.ledgers[site_id], h.agent_tasks[site_id] = agent, ledger, task
    for site_id in sites:
        await h.wait_connected(site_id)


def _exact(h: Harness, site_id: str, schema: Schema, grid: PairGrid,
           pairs: list[tuple[int, int]], proportions: np.ndarray | None) -> np.ndarray:
    source = open_data_source(spec_from_path(h.fed.data_paths[site_id]), schema)
    acc = PairTableAccumulator(grid, pairs)
    for table, _report in source.iter_chunks():
        acc.add(table)
    if proportions is None:
        return acc.counts.astype(np.float64)
    return np.floor(dependence_scores(acc.counts, grid, pairs, proportions, acc.n_rows))


def test_secure_pair_rounds_decode_the_pooled_scores_and_tables(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with harness(tmp_path, honest=(), n_sites=3) as h:
            await _start_secure_sites(h, ["hospital-1", "hospital-2", "hospital-3"])
            schema = Schema.load(h.fed.schema_path)
            # the job's budget split gives the pair rounds epsilon 200 and 196
            params = SynthParams.parse({"aggregation": "secure", "n_bins": 16,
                                        "pair_groups": GROUPS, "split": SPLIT}, None)
            sizes = histogram_sizes(schema, params.n_bins)
            counts = np.random.default_rng(3).integers(5, 60, sum(sizes)).astype(np.float64)
            props = proportions_from_histograms(counts, schema, params.n_bins)
            digest = links_digest(schema, props, params.n_bins, params.continuous_link)
            job = Job(job_id="pairs-job", spec=JobSpec("synth", 400.0, 1e-5,
                                                       params.to_mapping()),
                      kind=job_kind("synth"), params=params,
                      federation=h.coordinator.jobs.federation,
                      registry=h.coordinator.registry, emit=lambda *_a: None)
            among = ["hospital-1", "hospital-2", "hospital-3"]
            grid = PairGrid.from_proportions(schema, props, params.n_bins, GROUPS)
            cands = grid.candidate_pairs()
            asked = PairInput(LinksInput(props, digest), grid, cands, [])

            first = await job.release(PAIR_SCORES, asked, among=among)
            scores = first.value
            out = first.secure
            assert out is not None
            assert scores.dtype == np.float64 and scores.shape == (len(cands),)
            assert out.plan.statistic == "scores" and out.plan.bound == 2.0
            assert sorted(out.plan.participants) == among
            pooled = sum(_exact(h, s, schema, grid, cands, props) for s in among)
            assert np.max(np.abs(scores - pooled)) <= 4.0  # epsilon 200: noise sd ~ 0.2

            edges = [(1, 0), (0, 2), (3, 2)]
            second = await job.release(PAIRS, asked.with_edges(edges), among=among[:2])
            tables = second.value.total
            out2 = second.secure
            assert out2 is not None
            assert tables.shape == (sum(grid.cells(e) for e in edges),)
            assert out2.plan.statistic == "counts"
            assert out2.plan.calibration.l2_sensitivity == pytest.approx(6.0 ** 0.5)
            pooled_tables = sum(_exact(h, s, schema, grid, edges, None) for s in among[:2])
            assert np.max(np.abs(tables - pooled_tables)) <= 4.0
            assert out2.n_rows_total == 2 * 300

            for site_id, ledger in h.ledgers.items():
                charged = [(e.task_id.split("/")[-1], e.mechanism) for e in ledger.events()
                           if e.epsilon > 0]
                expected = [("pair_scores-sum-1", "secure-skellam[n=3,t=1]")]
                if site_id != "hospital-3":
                    expected.append(("pairs-sum-1", "secure-skellam[n=2,t=1]"))
                assert charged == expected, (site_id, charged)
            meta = secure_record(first, second)["secure"]
            assert meta["rounds"]["pair_scores"]["releases"] == PAIR_SCORES.secure_releases
            assert meta["rounds"]["pairs"]["l2_sensitivity_integer"] == pytest.approx(6 ** 0.5)

    asyncio.run(scenario())


def test_pair_rounds_refuse_a_schema_without_candidates_and_an_empty_forest() -> None:
    from dpfed.common.errors import ValidationError

    wide = Schema.from_toml("\n".join(
        f'[[columns]]\nname = "{n}"\ntype = "nominal"\ncategories = '
        f'[{", ".join(repr(str(i)) for i in range(70))}]' for n in ("code", "code2")))
    params = SynthParams.parse({"aggregation": "secure"}, wide)
    props = proportions_from_histograms(np.full(140, 3.0), wide, params.n_bins)
    grid = PairGrid.from_proportions(wide, props, params.n_bins, GROUPS)
    asked = PairInput(LinksInput(props, "d"), grid, grid.candidate_pairs(), [])
    # refused before any site is asked: the secure sums cannot even be planned
    with pytest.raises(ValidationError, match="no candidate column pair"):
        PAIR_SCORES.encoding(Ask(params, wide, asked, Budget(1.0, 1e-6)))
    with pytest.raises(ValidationError, match="at least one edge"):
        PAIRS.encoding(Ask(params, wide, asked, Budget(1.0, 1e-6)))
