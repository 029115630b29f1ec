"""A new job kind in one file gets both modes, ``--plan``, a report and resume for free.

The kind defined here -- ``count``, a DP count of every category of one column -- is a
params class, one round and a run: about 100 lines, no other file touched. Registered
through ``DPFED_JOB_KINDS`` (every program started with it loads this module), it runs over
real processes and mTLS: site level (each site's Gaussian counts, summed) and as a secure sum
(one Skellam draw on the pooled counts, the coordinator seeing only the total); ``dpfed run
count --plan`` lists the sites that would take part; ``dpfed run count --report`` writes the
generic report; a coordinator SIGKILLed after the sites paid resumes the job with one charge
per site. Its release is checked the way every release is: a replaced record moves the
counts by exactly the stated sensitivity, and a planted copy under-stating it is caught.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import pytest

from dpfed.aggregator.jobs.job import Job, JobOutput
from dpfed.aggregator.local_federation import LocalFederation
from dpfed.aggregator.result_file import decode_result
from dpfed.common.data.schema import NominalColumn, OrdinalColumn, Schema
from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.job_choices import AGGREGATIONS
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
from dpfed.common.jobs.params import Aggregation, Params, ParseContext, RoundShare, choice, param
from dpfed.common.jobs.release import job_params, noisy_release, planned_contribution
from dpfed.common.jobs.results import require_array
from dpfed.common.privacy.mechanisms import GaussianMechanism
from dpfed.common.transport.protocol import JobSpec, Task, TaskResult
from tests.e2e.federations import charged_events, killed_and_resumed, roomy_settings, wait_until

# --------------------------------------------------------------------------- the toy kind


def _categorical(value: Any, ctx: ParseContext) -> str:
    if ctx.schema is not None and (
            value not in ctx.schema.names
            or not isinstance(ctx.schema.column(value), NominalColumn | OrdinalColumn)):
        raise ValidationError(f"column must be a categorical column of the schema, got {value!r}")
    return str(value)


@dataclass(frozen=True)
class CountParams(Params):
    """A DP count of every category of one column."""

    kind: ClassVar[str] = "count"
    column: str = param(parse=_categorical, required="count needs a column", flag="--column")
    aggregation: str = param("site", parse=choice("aggregation", AGGREGATIONS))

    def aggregation_mode(self) -> Aggregation:
        return Aggregation(self.aggregation)

    def shares(self, epsilon: float, delta: float) -> list[RoundShare]:
        return [RoundShare("count", epsilon, delta)]


def _cells(schema: Schema, column: str) -> int:
    col = schema.column(column)
    return col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories  # type: ignore[union-attr]


def _counts(site: Site, column: str) -> tuple[np.ndarray, int]:
    size = _cells(site.data.schema, column)
    counts = np.zeros(size, dtype=np.int64)
    for table, _report in site.data.iter_chunks():
        counts += np.bincount(table.columns[column], minlength=size)[:size]
    return counts, int(counts.sum())


def count_mechanism(epsilon: float, delta: float) -> GaussianMechanism:
    """Replace-one moves one count down and another up: L2 sensitivity sqrt(2)."""
    return GaussianMechanism(epsilon, delta, math.sqrt(2.0))


class Count(SumRound[CountParams, None, np.ndarray]):
    """``count``: every category's count of the column (the ``counts`` statistic, C = 1)."""

    name = "count"
    task_kind = "count"
    source = "count"
    statistic = "counts"

    def prepare(self, task: Task, site: Site) -> Release:
        params = job_params(CountParams, task, site, ())
        counts, n_rows = _counts(site, params.column)
        mech = count_mechanism(task.epsilon, task.delta)
        return noisy_release(task, mech.cost(),
                             lambda rng: {"counts": mech.release(counts.astype(float), rng)},
                             {"n_rows": n_rows})

    def contribution(self, task: Task, site: Site, participants: list[str],
                     tolerated: int) -> Contribution:
        column = _categorical(task.params.get("column"), ParseContext(site.data.schema, {}, {}))
        return planned_contribution(
            task, participants, tolerated, statistic=self.statistic,
            dim=_cells(site.data.schema, column), row_norm=1.0,
            compute=lambda _plan, _rng: _counts(site, column))

    def request(self, ask: Ask[CountParams, None]) -> Request:
        return Request(ask.params.to_mapping())

    def check(self, result: TaskResult, ask: Ask[CountParams, None]) -> None:
        counts = require_array(result, "counts", (_cells(ask.schema, ask.params.column),))
        if float(np.abs(counts).max()) > 1e12:
            raise ProtocolError("counts out of any honest range")

    def pool(self, results: Mapping[str, TaskResult], ask: Ask[CountParams, None]
             ) -> np.ndarray:
        return np.asarray(np.sum([r.arrays["counts"] for r in results.values()], axis=0))

    def encoding(self, ask: Ask[CountParams, None]) -> SumEncoding:
        cells = _cells(ask.schema, ask.params.column)
        return SumEncoding(dim=cells, params={"source": self.source,
                                              "column": ask.params.column}, groups=(cells,))

    def pool_secure(self, summed: SecureSum, ask: Ask[CountParams, None]) -> np.ndarray:
        return summed.value


COUNT = Count()


async def run(job: Job[CountParams]) -> JobOutput:
    """One release; the counts are the result."""
    counts = await job.release(COUNT, None)
    meta = {"kind": "count", "job_id": job.job_id, "epsilon": job.spec.epsilon,
            "delta": job.spec.delta, "column": job.params.column,
            "aggregation": job.params.aggregation, "n_rows_total": counts.n_rows_total,
            "sites": [{"site_id": s, "n_rows": n} for s, n in counts.rows.items()]}
    return JobOutput({"counts": counts.value}, meta, {"sites": len(counts.rows)})


KIND: JobKind[CountParams] = JobKind(name="count", params=CountParams, rounds=(COUNT,),
                                     run=run, summary="DP counts of one column's categories")

# --------------------------------------------------------------------------- its tests

HERE = "tests.e2e.test_job_kind_contract"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalFederation]:
    monkeypatch.setenv("DPFED_JOB_KINDS", HERE)  # every process started from here loads it
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=1200, features=6, seed=9, min_sites=2,
        task_deadline_s=60, resume_wait_s=30, mixed=True,
        settings=roomy_settings(allowed_jobs=("count",)))
    federation.write_site_config("hospital-3", roomy_settings(allowed_jobs=("pca",)))
    federation.start_coordinator()
    federation.start_sites()
    try:
        federation.wait_for_sites()
        yield federation
    finally:
        federation.stop_all()


def _truth(fed: LocalFederation, sites: list[str]) -> np.ndarray:
    schema = Schema.load(fed.schema_path)
    col = schema.column("ward")
    assert isinstance(col, NominalColumn)
    frames = [pd.read_csv(fed.data_paths[s]) for s in sites]
    return np.array([sum(int((f["ward"] == c).sum()) for f in frames)
                     for c in col.categories], dtype=float)


def _cli(fed: LocalFederation, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    kit = fed.certs / "analysts" / "analyst"
    conn = ["--coordinator", fed.address, "--ca", str(kit / "ca.pem"), "--cert",
            str(kit / "analyst.pem"), "--key", str(kit / "analyst.key")]
    return subprocess.run([sys.executable, "-m", "dpfed.aggregator.cli", *args, *conn],
                          capture_output=True, text=True, timeout=180, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_one_file_kind_runs_in_both_modes_plans_reports_and_resumes(
        fed: LocalFederation, tmp_path: Path) -> None:
    two = ["hospital-1", "hospital-2"]
    truth = _truth(fed, two)
    with fed.analyst() as coord:
        site_level = coord.submit(JobSpec("count", 5.0, 1e-5, {"column": "ward"}))
        secure = coord.submit(JobSpec("count", 5.0, 1e-5, {"column": "ward",
                                                           "aggregation": "secure"}))
        for job in (site_level, secure):
            assert job.state == "succeeded", job.error
        arrays, meta = decode_result(coord.fetch_result(site_level.job_id))
        secure_arrays, secure_meta = decode_result(coord.fetch_result(secure.job_id))
    sigma = count_mechanism(5.0, 1e-5).sigma
    assert np.max(np.abs(arrays["counts"] - truth)) < 6 * sigma * math.sqrt(2)
    assert meta["n_rows_total"] == 2400 and secure_meta["n_rows_total"] == 2400
    # two sites, one tolerated colluder: the honest survivor alone carries the central noise,
    # so the pooled secure sum holds twice the variance (plus the Skellam rounding)
    assert np.max(np.abs(secure_arrays["counts"] - truth)) < 6 * sigma * math.sqrt(2)
    # hospital-3's policy has no count jobs: it was left out of both, charged nothing
    assert charged_events(fed, "hospital-3") == []
    for s in two:
        mechanisms = [e.mechanism for e in charged_events(fed, s)]
        assert mechanisms == ["gaussian", "secure-skellam[n=2,t=1]"], mechanisms
    # --plan: the sites that would take part, and hospital-3 named apart
    plan = _cli(fed, "run", "count", "--column", "ward", "--epsilon", "1", "--delta", "1e-5",
                "--plan", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert [x.split()[:3] for x in plan.stdout.splitlines() if x.startswith("hospital")] == [
        ["hospital-1", "count", "1"], ["hospital-2", "count", "1"]]
    assert "not taking part: hospital-3" in plan.stdout
    # the generic command writes the result and its (generic) report
    out = _cli(fed, "run", "count", "--column", "ward", "--aggregation", "secure",
               "--epsilon", "1", "--delta", "1e-5", "--out", "count.npz", "--report",
               "count.html", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    html = (tmp_path / "count.html").read_text()
    assert "dpfed count result" in html and "counts" in html and "ward" in html
    # resume: the coordinator dies once both sites paid; the resumed job replays their
    # answers (one charge each) and finishes
    before = {s: len(charged_events(fed, s)) for s in two}
    final = killed_and_resumed(
        fed, JobSpec("count", 2.0, 1e-5, {"column": "ward"}),
        lambda: wait_until(lambda: all(len(charged_events(fed, s)) == before[s] + 1
                                       for s in two), 60, "both sites to pay"))
    assert final.state == "succeeded", final.error
    assert all(len(charged_events(fed, s)) == before[s] + 1 for s in two)


def test_its_release_moves_by_the_stated_sensitivity_and_a_planted_copy_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.records import random_rows
    from tests.support.schemas import AGE_WARD
    from tests.support.tables import FrameData, ZeroNoise, cost_of, produced

    def released(frame: pd.DataFrame) -> tuple[np.ndarray, float]:
        task = Task("j/count", "j", "count", 1.0, 1e-5, {"column": "ward",
                                                          "aggregation": "site"})
        r = COUNT.prepare(task, Site(FrameData(AGE_WARD, frame)))
        return produced(r, ZeroNoise()).arrays["counts"], cost_of(r).sensitivity

    base = random_rows(AGE_WARD, 30, 0)
    worst, stated = 0.0, 0.0
    col = AGE_WARD.column("ward")
    assert isinstance(col, NominalColumn)
    for a in col.categories:
        for b in col.categories:
            ta, tb = base.copy(), base.copy()
            ta.loc[0, "ward"], tb.loc[0, "ward"] = a, b
            (ca, stated), (cb, _) = released(ta), released(tb)
            worst = max(worst, float(np.linalg.norm(ca - cb)))
    assert worst == pytest.approx(stated) == pytest.approx(math.sqrt(2))
    monkeypatch.setattr(sys.modules[__name__], "count_mechanism",
                        lambda e, d: GaussianMechanism(e, d, 1.0))  # planted: half the bound
    assert worst > released(base)[1] * 1.3
