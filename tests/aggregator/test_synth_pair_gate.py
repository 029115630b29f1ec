"""The pair gate in the synth job's run, over a real federation (coordinator on loopback, three
real site agents over mTLS with SQLite ledgers): when no pair's noisy score clears the noise
its table would carry, the ``pairs`` round is never sent and no site is charged for it; when
pairs clear it, the round runs and every site is charged once for it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from dpfed.aggregator.jobs import synth as synth_job
from dpfed.aggregator.jobs.job import Job
from dpfed.common.job_params import SynthParams
from dpfed.common.jobs.registry import job_kind
from dpfed.common.transport.protocol import JobSpec
from tests.aggregator.hardening_harness import harness

pytestmark = pytest.mark.timeout(240)

SITES = ("hospital-1", "hospital-2", "hospital-3")


def _run_job(tmp_path: Path, split: dict[str, list[float]], epsilon: float
             ) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Run a site-level synth job with the gate; its model metadata and every site's charges."""
    async def scenario() -> tuple[dict[str, Any], dict[str, list[str]]]:
        async with harness(tmp_path, honest=SITES, n_sites=3, extra_kinds=("synth",)) as h:
            kind = job_kind("synth")
            raw = kind.canonical({"n_bins": 8, "split": split}, epsilon, 1e-5,
                                 h.coordinator.jobs.federation.schema)
            params = SynthParams.parse(raw, h.coordinator.jobs.federation.schema)
            assert params.pair_gate and params.resolution == "fine"  # a new job's defaults
            job = Job(job_id="gate-job", spec=JobSpec("synth", epsilon, 1e-5, raw), kind=kind,
                      params=params, federation=h.coordinator.jobs.federation,
                      registry=h.coordinator.registry, emit=lambda *_a: None)
            out = await synth_job.run(job)
            charged = {s: [e.task_id.split("/")[-1] for e in ledger.events() if e.epsilon > 0]
                       for s, ledger in h.ledgers.items()}
            return dict(out.metadata), charged

    return asyncio.run(scenario())


def test_no_pair_clears_the_gate_so_the_pairs_round_is_skipped_uncharged(tmp_path: Path
                                                                         ) -> None:
    # epsilon 0.002 on the pairs round: a table's noise (thousands of counts per cell) is far
    # above any score 900 rows can have (at most 2 N), so no pair passes
    split = {"links": [0.5, 0.4], "pca": [0.3, 0.3], "pair_scores": [0.1999, 0.1],
             "pairs": [0.0001, 0.2]}
    meta, charged = _run_job(tmp_path, split, 20.0)
    assert meta["pair_edges"] == []
    assert "pairs" not in meta["rounds"] and "pair_scores" in meta["rounds"]
    for site, tasks in charged.items():
        assert not any(t.startswith("pairs") for t in tasks), (site, tasks)
        assert any(t.startswith("pair_scores") for t in tasks), (site, tasks)


def test_pairs_that_clear_the_gate_are_measured_and_charged(tmp_path: Path) -> None:
    split = {"links": [0.25, 0.25], "pca": [0.25, 0.25], "pair_scores": [0.25, 0.25],
             "pairs": [0.25, 0.25]}
    meta, charged = _run_job(tmp_path, split, 200.0)
    assert len(meta["pair_edges"]) >= 1
    assert sorted(meta["rounds"]["pairs"]) == list(SITES)
    for site, tasks in charged.items():
        assert sum(t.startswith("pairs") for t in tasks) == 1, (site, tasks)


def test_the_plan_says_the_gated_pairs_round_may_cost_nothing() -> None:
    from tests.support.schemas import AGE_WARD

    kind = job_kind("synth")
    gated = SynthParams.parse(kind.canonical({}, 1.0, 1e-5, AGE_WARD), AGE_WARD)
    assert gated.pair_gate
    note = gated.plan_note(1.0, 1e-5)
    pairs = {n: e for n, e, _ in gated.plan(1.0, 1e-5)}["pairs"]
    assert f"epsilon {pairs:.4g}" in note and "skipped and charged nothing" in note
    ungated = SynthParams.parse({**gated.to_mapping(), "pair_gate": False}, AGE_WARD)
    assert ungated.plan_note(1.0, 1e-5) == ""
