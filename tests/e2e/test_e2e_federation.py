"""End to end with real processes: coordinator and site agents over mTLS gRPC on loopback.

Processes are started the way users start them (``python -m dpfed.aggregator`` / ``python -m
site_agent`` = ``dpfed-aggregator`` / ``dpfed-site``), with certificates from
``dpfed.common.transport.certs``
and SQLite ledgers on disk; they are killed, stopped and restarted for real.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.aggregator.pca_result import PCAResult
from dpfed.aggregator.simulate import pooled_reference
from dpfed.common.data.schema import Schema
from dpfed.common.errors import JobFailedError
from dpfed.common.jobs.eligibility import gaussian_rounds_epsilon
from dpfed.common.pca.dppca import captured_energy, top_components
from dpfed.common.pca.features import feature_affine, max_feature_norm
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.transport.protocol import JobSpec
from tests.e2e.federations import (
    charged_events,
    killed_and_resumed,
    roomy_settings,
    running,
    wait_until,
    with_keepalive,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def ledger_events(fed: LocalFederation, site_id: str) -> int:
    return len(charged_events(fed, site_id))


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=1500, features=6, seed=11, min_sites=2,
        task_deadline_s=60, resume_wait_s=45,
        settings=roomy_settings())
    yield from running(federation)


@pytest.fixture
def seeded_fed(tmp_path: Path) -> Iterator[LocalFederation]:
    """``fed`` with seeded site noise: a test that bounds a noisy result passes or fails
    the same way every run (unseeded, the centred test's energy bound failed 1 run in 1,611)."""
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=1500, features=6, seed=11, min_sites=2,
        task_deadline_s=60, resume_wait_s=45,
        settings=roomy_settings(noise_seed=5))
    yield from running(federation)


@pytest.fixture
def deadline_only_fed(tmp_path: Path) -> Iterator[LocalFederation]:
    """``fed`` whose keepalive (120 s) cannot notice a hung site during a test: only a round's
    deadline can (with the default 10 s, a loaded machine let the keepalive mark a stopped
    site ``disconnected`` before its round's 3 s deadline had passed)."""
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=1500, features=6, seed=11, min_sites=2,
        task_deadline_s=60, resume_wait_s=45,
        settings=roomy_settings())
    with_keepalive(federation, 120)
    yield from running(federation)


def test_three_sites_pca_matches_nonprivate_at_large_epsilon(fed: LocalFederation,
                                                             tmp_path: Path) -> None:
    with fed.analyst() as coord:
        sites = coord.sites()
        assert [s.site_id for s in sites] == fed.site_ids
        assert all(s.connected for s in sites)
        # Sites connect before counting their rows and send the count right after.
        wait_until(lambda: all(s.row_count == 1500 for s in coord.sites()), 60, "row counts")
        # Today's one-round DPdisPCA (uncentred, worst-case bound); the centred default with
        # its three rounds: test_centred_auto_job_survives_a_coordinator_restart_between_rounds.
        result = coord.pca(3, epsilon=1000.0, delta=1e-5, centering="none", clip_norm="schema")
        job = coord.jobs(1)[0]
    assert job.state == "succeeded" and [s.status for s in job.sites] == ["ok"] * 3
    schema = Schema.load(fed.schema_path)
    pooled = pooled_reference(schema, list(fed.data_paths.values()), centred=False)
    reference, counts = pooled.matrix, pooled.counts
    assert counts == [1500] * 3
    exact = top_components(reference, 3)
    ratio = captured_energy(result.components_, reference) / captured_energy(exact, reference)
    assert ratio > 0.999
    # Subspace match: principal angles all small.
    cosines = np.linalg.svd(result.components_ @ exact.T, compute_uv=False)
    assert cosines.min() > 0.99
    # The saved file has what the issue lists, and loads back.
    path = result.save(tmp_path / "pca.npz")
    again = PCAResult.load(path)
    np.testing.assert_array_equal(again.components_, result.components_)
    meta = again.metadata
    assert meta["epsilon"] == 1000.0 and meta["calibration"] == "analytic"
    assert meta["n_components"] == 3 and meta["rank"] == 6
    assert [s["n_rows"] for s in meta["sites"]] == [1500] * 3
    assert again.feature_names_in_ == tuple(f"{n}" for n in schema.names)
    # Each site charged exactly once, and reports it.
    assert all(ledger_events(fed, s) == 1 for s in fed.site_ids)
    with fed.analyst() as coord:
        budgets = {site: b for site, _c, b in coord.budgets()}
    # the job's rounds composed tightly (the default pld ledger): at most the job's epsilon
    assert all(b is not None and b.accountant == "pld" and 0.0 < b.epsilon_spent <= 1000.0
               for b in budgets.values())


def test_cli_commands_against_a_running_federation(fed: LocalFederation, tmp_path: Path) -> None:
    kit = fed.certs / "analysts" / "analyst"
    conn = ["--coordinator", fed.address, "--ca", str(kit / "ca.pem"), "--cert",
            str(kit / "analyst.pem"), "--key", str(kit / "analyst.key")]
    dpfed = [sys.executable, "-m", "dpfed.aggregator.cli"]
    out = tmp_path / "cli-pca.npz"
    report = tmp_path / "cli-report.html"
    run = subprocess.run([*dpfed, "pca", "--k", "2", "--epsilon", "2", "--delta", "1e-5",
                          "--out", str(out), "--report", str(report), *conn],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "site hospital-1: result received" in run.stdout and out.exists()
    assert f"wrote {report}" in run.stdout
    assert report.read_text().count("data:image/png;base64,") == 3
    sites = subprocess.run([*dpfed, "sites", *conn], capture_output=True, text=True, timeout=60)
    assert sites.returncode == 0 and sites.stdout.count("connected") == 3
    jobs = subprocess.run([*dpfed, "jobs", *conn], capture_output=True, text=True, timeout=60)
    job_id = jobs.stdout.splitlines()[1].split()[0]  # under the header line
    job = subprocess.run([*dpfed, "job", job_id, *conn], capture_output=True, text=True,
                         timeout=60)
    assert "succeeded" in job.stdout and "site hospital-2: ok" in job.stdout
    ledger = subprocess.run([sys.executable, "-m", "dpfed.site_agent", "ledger", "--config",
                             str(fed.site_config("hospital-1"))], capture_output=True, text=True,
                            timeout=60)
    assert ledger.returncode == 0 and job_id in ledger.stdout
    missing = subprocess.run([*dpfed, "sites"], capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin"})
    assert missing.returncode == 3 and "--coordinator" in missing.stderr


def test_killed_site_and_quorum(fed: LocalFederation) -> None:
    fed.signal("hospital-3", signal.SIGKILL)
    fed.wait("hospital-3")
    with fed.analyst() as coord:
        wait_until(lambda: len(coord.sites()) == 2, 30, "the coordinator to drop hospital-3")
        with pytest.raises(JobFailedError, match=r"2 eligible site\(s\).*min_sites=3"):
            coord.pca(2, epsilon=1.0, delta=1e-5, min_sites=3)
        result = coord.pca(2, epsilon=1.0, delta=1e-5, min_sites=2)
        assert [s["site_id"] for s in result.metadata["sites"]] == ["hospital-1", "hospital-2"]
        offline = {s.site_id: s.connected for s in coord.sites(include_disconnected=True)}
    assert offline == {"hospital-1": True, "hospital-2": True, "hospital-3": False}
    assert ledger_events(fed, "hospital-3") == 0
    assert ledger_events(fed, "hospital-1") == 3  # norms, mean, pca


def test_unresponsive_site_times_out_and_job_proceeds(deadline_only_fed: LocalFederation) -> None:
    fed = deadline_only_fed
    fed.signal("hospital-2", signal.SIGSTOP)
    try:
        with fed.analyst() as coord:
            t0 = time.monotonic()
            job = coord.submit(JobSpec("pca", 1.0, 1e-5, {"n_components": 2}, min_sites=2,
                                       deadline_seconds=3.0))
            elapsed = time.monotonic() - t0
    finally:
        fed.signal("hospital-2", signal.SIGCONT)
    outcomes = {s.site_id: s.status for s in job.sites}
    assert job.state == "succeeded"
    assert outcomes == {"hospital-1": "ok", "hospital-2": "timeout", "hospital-3": "ok"}
    assert elapsed < 3.0 + 2.0 + 5.0  # deadline + grace + slack, never "wait forever"


def test_coordinator_restart_sites_reconnect(fed: LocalFederation) -> None:
    with fed.analyst() as coord:
        first = coord.pca(2, epsilon=1.0, delta=1e-5)
    port = fed.port
    fed.signal("coordinator", signal.SIGTERM)
    assert fed.wait("coordinator", 30) == 0
    fed.start_coordinator(port=port)
    fed.wait_for_sites(timeout=60)  # no manual step at the sites
    with fed.analyst() as coord:
        jobs = coord.jobs()
        assert jobs[0].job_id == first.metadata["job_id"]  # the store survived
        second = coord.pca(2, epsilon=1.0, delta=1e-5)
    assert second.metadata["job_id"] != first.metadata["job_id"]
    assert all(ledger_events(fed, s) == 6 for s in fed.site_ids)  # 2 jobs x 3 rounds
    for s in fed.site_ids:
        fed.check_alive(s)


def test_coordinator_crash_mid_job_resumes_without_double_charge(fed: LocalFederation) -> None:
    fed.signal("hospital-3", signal.SIGSTOP)
    port = fed.port
    outcome: dict[str, object] = {}

    def submit() -> None:
        try:
            with fed.analyst() as coord:
                outcome["job"] = coord.submit(JobSpec("pca", 1.0, 1e-5, {"n_components": 2},
                                                      min_sites=3))
        except Exception as exc:  # noqa: BLE001 -- the stream dies with the coordinator
            outcome["error"] = exc

    t = threading.Thread(target=submit, daemon=True)
    t.start()
    wait_until(lambda: ledger_events(fed, "hospital-1") == 1 and
                ledger_events(fed, "hospital-2") == 1, 60, "two sites to charge")
    fed.signal("coordinator", signal.SIGKILL)
    fed.wait("coordinator")
    t.join(30)
    fed.signal("hospital-3", signal.SIGCONT)
    fed.start_coordinator(port=port)
    with fed.analyst() as coord:
        job_id = coord.jobs(1)[0].job_id
        final = coord.watch(job_id)
    assert final.state == "succeeded", final.error
    assert [s.status for s in final.sites] == ["ok"] * 3
    # Same task ids after the restart: the two sites replayed their stored release of the
    # first round instead of paying again; then the other two once each.
    assert [ledger_events(fed, s) for s in fed.site_ids] == [3, 3, 3]


def ledger_task_ids(fed: LocalFederation, site_id: str) -> list[str]:
    return sorted(e.task_id for e in charged_events(fed, site_id))


def test_centred_auto_job_survives_a_coordinator_restart_between_rounds(
        seeded_fed: LocalFederation) -> None:
    """The default job (DP mean, DP clip radius, PCA): killed after round 1, resumed.

    Every site is charged exactly once per round; the resumed job re-sends byte-identical
    tasks (a different payload under the same task id would be refused as a conflict). The
    noise is seeded (each site's stream keyed on its release count, which the restart does
    not change: replays draw nothing), so the accuracy bounds below are deterministic.
    """
    fed = seeded_fed
    fed.signal("hospital-3", signal.SIGSTOP)  # holds the job in round 1 (min_sites=3)

    def round_one_done() -> None:  # the kill comes between round 1 and the end of round 2
        wait_until(lambda: ledger_events(fed, "hospital-1") == 1 and
                   ledger_events(fed, "hospital-2") == 1, 60, "two sites to pay for round 1")
        fed.signal("hospital-3", signal.SIGCONT)
        wait_until(lambda: ledger_events(fed, "hospital-3") >= 1, 60, "round 1 to complete")

    final = killed_and_resumed(
        fed, JobSpec("pca", 2.0, 1e-5, {"n_components": 2}, min_sites=3), round_one_done)
    job_id = final.job_id
    with fed.analyst() as coord:
        result = coord.pca_result(final)
    assert final.state == "succeeded", final.error
    assert [s.status for s in final.sites] == ["ok"] * 3
    for s in fed.site_ids:
        assert ledger_task_ids(fed, s) == sorted(f"{job_id}/{r}" for r in ("mean", "norms",
                                                                           "pca"))
    meta = result.metadata
    assert meta["centering"] == "mean" and meta["clip_norm_requested"] == "auto"
    assert [r["round"] for r in meta["rounds"]] == ["norms", "mean", "pca"]
    assert meta["composition"] == "gdp"  # pld ledgers: the rounds cost the job's (eps, delta)
    pairs = [(r["epsilon"], r["delta"]) for r in meta["rounds"]]
    assert gaussian_rounds_epsilon(pairs) == pytest.approx(2.0, rel=1e-6)
    assert [o.spend.epsilon for o in final.sites if o.spend] == [
        pytest.approx(sum(e for e, _ in pairs))] * 3  # each round's own epsilon, added
    assert [s["epsilon"] for s in meta["sites"]] == [pytest.approx(2.0, rel=1e-6)] * 3
    # The DP mean is close to the real pooled mean and the components to pooled PCA.
    schema = Schema.load(fed.schema_path)
    pooled = pooled_reference(schema, list(fed.data_paths.values()), centred=True)
    exact = top_components(pooled.matrix, 2)
    ratio = (captured_energy(result.components_, pooled.matrix)
             / captured_energy(exact, pooled.matrix))
    assert ratio > 0.9
    frames = [pd.read_csv(p) for p in fed.data_paths.values()]
    raw_mean = pd.concat(frames)[list(schema.names)].mean().to_numpy()
    _offset, scale = feature_affine(schema)
    # noise sd of the DP mean in the scaled space: sigma(mean round, 2) sqrt(3 sites) c / N,
    # at most with c = B (the clip radius lies on the grid below the box bound)
    mean_round = next(r for r in meta["rounds"] if r["round"] == "mean")
    sd = (gaussian_sigma(mean_round["epsilon"], mean_round["delta"], 2.0) * np.sqrt(3)
          * max_feature_norm(schema) / 4500)
    assert np.all(np.abs(result.mean_ - raw_mean) < 5 * sd * scale)


def test_over_budget_job_is_refused_and_nothing_is_charged(fed: LocalFederation) -> None:
    with fed.analyst() as coord, pytest.raises(JobFailedError, match="budget_exceeded"):
        coord.pca(2, epsilon=2e4, delta=1e-5)
    assert all(ledger_events(fed, s) == 0 for s in fed.site_ids)


def test_binaries_exit_with_clear_codes(tmp_path: Path) -> None:
    fed = LocalFederation.create(tmp_path / "f", n_sites=1, rows=50, features=3, seed=1,
                                 settings=SiteSettings(connect_timeout_s=2))
    site = [sys.executable, "-m", "dpfed.site_agent",
            "--config", str(fed.site_config("hospital-1"))]

    def run(args: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, capture_output=True, text=True, timeout=90)

    # Coordinator unreachable (nothing listens on port 1): exit 6 after connect_timeout_s.
    r = run([*site, "--coordinator", "127.0.0.1:1"])
    assert r.returncode == 6, r.stderr
    assert "could not connect to the coordinator" in r.stderr
    # Missing data file: exit 4, naming the path.
    r = run([*site, "--data", str(tmp_path / "missing.csv")])
    assert r.returncode == 4 and "missing.csv" in r.stderr
    # Unreadable certificate: exit 5, naming the file.
    cfg = fed.site_config("hospital-1")
    text = cfg.read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("site.pem", "nope.pem"))
    r = run([sys.executable, "-m", "dpfed.site_agent", "--config", str(bad)])
    assert r.returncode == 5 and "nope.pem" in r.stderr
    # Bad config: exit 3, naming the key.
    bad.write_text(text.replace("[budget]\nepsilon", "[budget]\nepsilonn"))
    r = run([sys.executable, "-m", "dpfed.site_agent", "--config", str(bad)])
    assert r.returncode == 3 and "budget" in r.stderr
    agg = run([sys.executable, "-m", "dpfed.aggregator", "--config", str(tmp_path / "none.toml")])
    assert agg.returncode == 3 and "config file not found" in agg.stderr


def test_site_with_another_schema_is_rejected(fed: LocalFederation, tmp_path: Path) -> None:
    other = tmp_path / "other_schema.toml"
    schema = Schema.load(fed.schema_path)
    other.write_text(schema.to_toml().replace("max = ", "max = 1", 1))
    cfg = fed.site_config("hospital-1")
    alt = tmp_path / "alt_site.toml"
    alt.write_text(cfg.read_text().replace(str(fed.schema_path.resolve()), str(other.resolve())))
    r = subprocess.run([sys.executable, "-m", "dpfed.site_agent", "--config", str(alt),
                        "--coordinator", fed.address, "--ledger", str(tmp_path / "alt.sqlite")],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 7, r.stderr
    assert "schema mismatch" in r.stderr


@pytest.mark.timeout(600)
def test_p2000_travels_in_chunks(tmp_path: Path) -> None:
    """p = 2000 with R = 400: each P_s is 6.4 MB, above gRPC's 4 MiB default message size."""
    fed = LocalFederation.create(tmp_path / "wide", n_sites=2, rows=400, features=2000, seed=5,
                                 fmt="parquet", settings=SiteSettings(connect_timeout_s=60))
    fed.start_coordinator()
    fed.start_sites()
    try:
        fed.wait_for_sites()
        with fed.analyst(timeout=120) as coord:
            result = coord.pca(200, epsilon=1.0, delta=1e-5)
        assert result.components_.shape == (200, 2000)
        np.testing.assert_allclose(result.components_ @ result.components_.T, np.eye(200),
                                   atol=1e-8)
    finally:
        fed.stop_all()
