"""End to end with real processes: ``svt`` and ``query`` jobs over mTLS gRPC on loopback.

Coordinator and sites are separate processes started as users start them; the sites keep
their ledgers and SVT sessions in SQLite on disk; processes are killed and restarted for real.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.aggregator.query_results import QueryJobResult, SVTJobResult
from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.queries.query_language import compile_query_set
from dpfed.common.queries.svt_sessions import sessions_path
from dpfed.common.transport.protocol import JobSpec
from tests.e2e.federations import (
    charged_events,
    killed_and_resumed,
    roomy_settings,
    running,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

QUERIES = [{"per": "ward"}, {"name": "old", "where": {"column": "age", "op": ">=", "value": 70}},
           {"name": "severe_icu", "where": {"all": [{"column": "severity", "in": ["severe",
                                                                              "critical"]},
                                                    {"column": "ward", "in": ["icu"]}]}}]


def ledger_events(fed: LocalFederation, site_id: str) -> list[str]:
    return [e.task_id for e in charged_events(fed, site_id)]


def noisy_threshold(fed: LocalFederation, site_id: str, session: str) -> float:
    conn = sqlite3.connect(sessions_path(fed.ledger_path(site_id)))
    try:
        row = conn.execute("SELECT noisy_threshold FROM svt_sessions WHERE session_id = ?",
                           (session,)).fetchone()
    finally:
        conn.close()
    return float(row[0])


def true_counts(fed: LocalFederation, raw: object) -> dict[str, np.ndarray]:
    schema = Schema.load(fed.schema_path)
    q = compile_query_set(schema, raw)
    out = {}
    for s in fed.site_ids:
        src = open_data_source(spec_from_path(fed.data_paths[s]), schema)
        out[s] = q.counts(t for t, _ in src.iter_chunks())[0]
    return out


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=1500, features=8, seed=5, min_sites=3,
        task_deadline_s=60, resume_wait_s=45, mixed=True,
        settings=roomy_settings())
    yield from running(federation)



def test_svt_session_api_survives_site_restart(fed: LocalFederation) -> None:
    truth = true_counts(fed, QUERIES)
    with fed.analyst() as coord:
        opened = coord.svt(QUERIES, epsilon=2000.0, threshold=300.0, cutoff=3,
                           numeric_epsilon=1000.0)
        session = opened.session
        t = opened.table
        assert list(t.columns) == ["query", "sites_above", "sites_examined", "which_sites",
                                   "value_sum", "value_std_error"]
        # eps huge: the transcript is the truth (count >= 300), up to the cut-off.
        for i, s in enumerate(opened.metadata["site_ids"]):
            flags = opened.arrays["above"][i]
            examined = flags >= 0
            assert np.array_equal(flags[examined] == 1, truth[s][:len(flags)][examined] >= 300)
        # eps3 = 1000: the value sum is the sum of the true counts of the sites above.
        ids = opened.metadata["site_ids"]
        for q in range(len(t)):
            above_sites = [s for i, s in enumerate(ids) if opened.arrays["above"][i, q] == 1]
            if above_sites:
                assert t["value_sum"][q] == pytest.approx(
                    sum(truth[s][q] for s in above_sites), abs=0.5)
                assert t["value_std_error"][q] < 0.1
            else:
                assert np.isnan(t["value_sum"][q])
        charged = {s: ledger_events(fed, s) for s in fed.site_ids}
        assert all(len(v) == 1 for v in charged.values())
        before = {s: noisy_threshold(fed, s, session) for s in fed.site_ids}
        # Restart a site: the session keeps its threshold noise and its positives.
        fed.signal("hospital-2", signal.SIGKILL)
        fed.wait("hospital-2")
        fed.start_site("hospital-2")
        fed.wait_for_sites()
        nxt = coord.svt([{"name": "young", "where": {"column": "age", "op": "<", "value": 30}}],
                        session=session)
        assert nxt.metadata["action"] == "batch" and nxt.session == session
        after = {s: noisy_threshold(fed, s, session) for s in fed.site_ids}
        assert after == before
        assert {s: ledger_events(fed, s) for s in fed.site_ids} == charged  # no new charge
        sites = {r["site_id"]: r for r in nxt.metadata["sites"]}
        first = {r["site_id"]: r for r in opened.metadata["sites"]}
        for s in fed.site_ids:  # the cut-off count carried over the restart
            assert sites[s]["n_positives_total"] >= first[s]["n_positives_total"]
            assert sites[s]["n_examined_total"] >= first[s]["n_examined_total"]
        closed = coord.svt(session=session, close=True)
        assert all(r["closed"] for r in closed.metadata["sites"])
        with pytest.raises(Exception, match="closed"):
            coord.svt(QUERIES, session=session)
        with pytest.raises(ValidationError, match="unknown column"):
            coord.svt([{"name": "x", "where": {"column": "nope", "op": "<", "value": 1}}],
                      epsilon=1.0, threshold=5.0)
    assert {s: ledger_events(fed, s) for s in fed.site_ids} == charged


def test_query_api_and_cli(fed: LocalFederation, tmp_path: Path) -> None:
    with fed.analyst() as coord:
        res = coord.query(["ward", "severity"], epsilon=1e3, workload="marginals", k=2,
                          noise="laplace")
        with pytest.raises(ValidationError, match="delta must be 0"):
            coord.query("ward", epsilon=1.0, delta=1e-5, noise="laplace")
        with pytest.raises(ValidationError, match="at most 1,024"):
            coord.query("age", epsilon=1.0, bins={"age": 2000}, strategy="h2")
    assert isinstance(res, QueryJobResult)
    schema = Schema.load(fed.schema_path)
    hist = compile_query_set(schema, [{"cross": ["ward", "severity"]}])
    pooled = sum(true_counts(fed, [{"cross": ["ward", "severity"]}]).values())
    assert np.allclose(res.histogram["estimate"], pooled, atol=1.0)
    assert len(res.answers) == hist.n_queries
    kit = fed.certs / "analysts" / "analyst"
    conn = ["--coordinator", fed.address, "--ca", str(kit / "ca.pem"), "--cert",
            str(kit / "analyst.pem"), "--key", str(kit / "analyst.key")]
    dpfed = [sys.executable, "-m", "dpfed.aggregator.cli"]
    out = tmp_path / "q.npz"
    run = subprocess.run([*dpfed, "query", "--columns", "age", "--bins", "age=32",
                          "--workload", "all_range", "--epsilon", "1", "--out", str(out),
                          "--json", *conn], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert len(data["answers"]) == 32 * 33 // 2 and data["expected_rmse"] > 0
    rep = subprocess.run([*dpfed, "report", str(out), "--out", str(tmp_path / "q.html")],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert "data:image/png;base64" in (tmp_path / "q.html").read_text()
    qfile = tmp_path / "q.toml"
    qfile.write_text('[[queries]]\nper = "ward"\n\n[[queries]]\nname = "old"\n'
                     'where = { column = "age", op = ">=", value = 70 }\n')
    run = subprocess.run([*dpfed, "svt", "--queries", str(qfile), "--epsilon", "1",
                          "--threshold", "100", "--out", str(tmp_path / "s.csv"), *conn],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "continue with: dpfed svt --session" in run.stdout
    bad = subprocess.run([*dpfed, "svt", "--queries", str(qfile), "--epsilon", "1",
                          "--threshold", "100", "--cutoff", "0", *conn],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "cutoff" in bad.stderr


def test_coordinator_killed_mid_query_resumes_with_one_charge(fed: LocalFederation) -> None:
    fed.signal("hospital-3", signal.SIGSTOP)
    params = {"domain": {"columns": ["age"], "bins": {"age": 16}}, "workload": {
        "kind": "all_range"}, "strategy": "h2", "noise": "laplace"}
    final = killed_and_resumed(fed, JobSpec("query", 1.0, 0.0, params, min_sites=3),
                               lambda: _two_sites_charged(fed),
                               before_restart=lambda: fed.signal("hospital-3", signal.SIGCONT))
    with fed.analyst() as coord:
        result = QueryJobResult.from_bytes(coord.fetch_result(final.job_id))
    assert final.state == "succeeded", final.error
    assert [len(ledger_events(fed, s)) for s in fed.site_ids] == [1, 1, 1]
    assert result.strategy == "h2" and len(result.answers) == 16 * 17 // 2


def test_coordinator_killed_mid_svt_resumes_with_one_charge(fed: LocalFederation) -> None:
    fed.signal("hospital-3", signal.SIGSTOP)
    final = killed_and_resumed(
        fed, JobSpec("svt", 1.0, 0.0, {"queries": QUERIES, "threshold": 200.0, "cutoff": 2},
                     min_sites=3),
        lambda: _two_sites_charged(fed),
        before_restart=lambda: fed.signal("hospital-3", signal.SIGCONT))
    with fed.analyst() as coord:
        result = SVTJobResult.from_bytes(coord.fetch_result(final.job_id))
    assert final.state == "succeeded", final.error
    assert [len(ledger_events(fed, s)) for s in fed.site_ids] == [1, 1, 1]
    assert result.session == final.job_id and len(result.table) == 7


def _two_sites_charged(fed: LocalFederation) -> None:
    wait_until(lambda: len(ledger_events(fed, "hospital-1")) == 1 and
               len(ledger_events(fed, "hospital-2")) == 1, 60, "two sites to charge")


@pytest.mark.parametrize("job", ["svt", "query"])
def test_simulate_runs_the_query_jobs(job: str, tmp_path: Path) -> None:
    out = tmp_path / f"sim-{job}"
    run = subprocess.run([sys.executable, "-m", "dpfed.aggregator.cli", "simulate", "--job", job,
                          "--sites", "3", "--rows", "2000", "--epsilon", "2", "--seed", "3",
                          "--out", str(out)], capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64") >= 2
    if job == "svt":
        assert "precision" in run.stdout and (out / "svt-batch2.csv").exists()
        assert "spent epsilon 2 of" in run.stdout  # one charge per site: the session's
    else:
        assert "observed RMSE" in run.stdout and (out / "query-age-ranges.csv").exists()
