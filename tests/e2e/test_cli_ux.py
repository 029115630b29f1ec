"""The analyst and site command lines as users run them, against real processes.

One federation (coordinator + 2 sites over mTLS, JSON logs) serves the module; every command
runs as its own ``python -m`` process and is judged by its output and exit code.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.common import exit_codes
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.transport.certs import init_federation
from dpfed.site_agent.ledger import Ledger

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

DPFED = [sys.executable, "-m", "dpfed.aggregator.cli"]
SITE = [sys.executable, "-m", "dpfed.site_agent"]
BUDGET_EPSILON = 3.0

SITE_FIELDS = {"site_id", "connected", "row_count", "allowed_kinds", "max_epsilon_per_task",
               "software_version", "schema_digest", "first_seen", "last_seen", "budget",
               "secure_aggregation", "evaluation_summary"}
BUDGET_FIELDS = {"accountant", "epsilon_cap", "epsilon_spent", "epsilon_remaining",
                 "delta_cap", "delta_spent", "delta_remaining", "rho_spent", "events"}
JOB_FIELDS = {"job_id", "kind", "state", "epsilon", "delta", "params", "min_sites",
              "deadline_seconds", "requested_sites", "submitted_by", "created", "updated",
              "error", "sites_ok", "sites_total", "sites", "summary", "result_size", "study"}
JOB_SITE_FIELDS = {"site_id", "status", "reason", "row_count", "spend"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    root = tmp_path_factory.mktemp("cli-ux")
    federation = LocalFederation.create(
        root / "fed", n_sites=2, rows=800, features=5, seed=3, min_sites=2,
        task_deadline_s=60, settings=SiteSettings(budget_epsilon=BUDGET_EPSILON,
                                                  budget_delta=0.1, connect_timeout_s=30))
    federation.start_coordinator(extra=["--log-format", "json"])
    for site in federation.site_ids:
        federation.start_site(site, extra=["--log-format", "json"])
    try:
        federation.wait_for_sites()
        yield federation
    finally:
        federation.stop_all()


def conn(fed: LocalFederation) -> list[str]:
    kit = fed.certs / "analysts" / "analyst"
    return ["--coordinator", fed.address, "--ca", str(kit / "ca.pem"), "--cert",
            str(kit / "analyst.pem"), "--key", str(kit / "analyst.key")]


def dpfed(*args: str, env: dict[str, str] | None = None,
          timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DPFED, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def assert_clean(run: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in run.stderr + run.stdout, run.stderr


def test_pca_then_json_shapes_of_sites_budgets_jobs_job(fed: LocalFederation,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "pca.npz"
    run = dpfed("pca", "--k", "2", "--epsilon", "1", "--delta", "1e-5", "--out", str(out),
                *conn(fed))
    assert run.returncode == 0, run.stderr
    summary = run.stdout.strip().splitlines()[-1]
    ratios = summary.split("explained variance ratio:")[1].split(",")
    assert len(ratios) == 2 and all(0 <= float(r) <= 1 for r in ratios), summary

    sites = dpfed("sites", "--json", *conn(fed))
    assert sites.returncode == 0, sites.stderr
    data = json.loads(sites.stdout)
    assert [s["site_id"] for s in data] == ["hospital-1", "hospital-2"]
    for s in data:
        assert set(s) == SITE_FIELDS and set(s["budget"]) == BUDGET_FIELDS
        assert s["connected"] is True and s["row_count"] == 800
        assert s["budget"]["epsilon_cap"] == BUDGET_EPSILON

    budgets = json.loads(dpfed("budgets", "--json", *conn(fed)).stdout)
    assert [set(b) for b in budgets] == [{"site_id", "connected", "budget"}] * 2
    assert all(set(b["budget"]) == BUDGET_FIELDS for b in budgets)

    jobs = json.loads(dpfed("jobs", "--json", *conn(fed)).stdout)
    assert jobs and all(set(j) == JOB_FIELDS for j in jobs)
    newest = jobs[0]
    assert newest["state"] == "succeeded" and newest["params"]["n_components"] == 2
    job = dpfed("job", newest["job_id"], "--json", *conn(fed))
    assert job.returncode == 0
    one = json.loads(job.stdout)
    assert set(one) == JOB_FIELDS and one["sites_ok"] == one["sites_total"] == 2
    assert all(set(s) == JOB_SITE_FIELDS for s in one["sites"])
    # the rounds' own epsilons (GDP shares of the job's budget): together, tightly, epsilon 1
    assert one["sites"][0]["spend"]["epsilon"] >= 1.0 - 1e-9

    # JSON logs: one object per line, and the task's outcome at each end with its ids.
    task_id = f"{newest['job_id']}/pca"
    coordinator = [json.loads(line) for line in
                   (fed.logs / "coordinator.log").read_text().splitlines() if line.strip()]
    outcomes = {e["site"]: e["outcome"] for e in coordinator
                if e.get("task_id") == task_id and "outcome" in e}
    assert outcomes == {"hospital-1": "ok", "hospital-2": "ok"}
    assert any(e.get("job_id") == newest["job_id"] and e.get("outcome") == "succeeded"
               for e in coordinator)
    site_log = [json.loads(line) for line in
                (fed.logs / "hospital-1.log").read_text().splitlines() if line.strip()]
    charged = [e for e in site_log if e.get("task_id") == task_id]
    assert charged and charged[-1]["outcome"] == "charged"
    assert charged[-1]["site"] == "hospital-1" and charged[-1]["job_id"] == newest["job_id"]


def _job_count(fed: LocalFederation) -> int:
    return len(json.loads(dpfed("jobs", "--json", "--limit", "1000", *conn(fed)).stdout))


def test_an_unwritable_out_is_refused_before_the_job_is_submitted(fed: LocalFederation,
                                                                  tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a folder")
    before = _job_count(fed)
    spent = [s["budget"]["epsilon_spent"] for s in
             json.loads(dpfed("sites", "--json", *conn(fed)).stdout)]
    cases = [("pca", "--out", str(tmp_path / "notes.txt" / "pca.npz"), "is a file, not a folder"),
             ("pca", "--out", str(tmp_path), "is a folder"),
             ("pca", "--report", str(tmp_path / "notes.txt" / "r.html"), "is a file"),
             ("query", "--out", str(tmp_path / "notes.txt" / "q.csv"), "is a file"),
             ("svt", "--out", str(tmp_path), "is a folder"),
             ("synth", "--model", str(tmp_path), "is a folder"),
             ("fetch", "--out", str(tmp_path), "is a folder")]
    job_args = {"pca": ["--k", "1", "--epsilon", "0.1", "--delta", "1e-6", "--out",
                        str(tmp_path / "ok.npz")],
                "query": ["--columns", "age", "--bins", "age=8", "--epsilon", "0.1"],
                "svt": ["--queries", str(_write_queries(tmp_path)), "--epsilon", "0.1",
                        "--threshold", "10"],
                "synth": ["--epsilon", "0.1", "--delta", "1e-6", "--rows", "10"],
                "fetch": ["no-such-job"]}
    for command, flag, value, message in cases:
        run = dpfed(command, *job_args[command], flag, value, *conn(fed))
        assert run.returncode == exit_codes.CONFIG_ERROR, (command, flag, run.stderr)
        assert f"{flag} " in run.stderr and message in run.stderr, run.stderr
        assert_clean(run)
    assert _job_count(fed) == before
    assert [s["budget"]["epsilon_spent"] for s in
            json.loads(dpfed("sites", "--json", *conn(fed)).stdout)] == spent


def test_a_result_that_cannot_be_written_after_the_job_is_fetched_again(
        fed: LocalFederation, tmp_path: Path) -> None:
    # /dev/full passes every check (it exists and is writable) and fails the write: a full
    # disk after the job has run and spent.
    run = dpfed("pca", "--k", "1", "--epsilon", "0.1", "--delta", "1e-6", "--out", "/dev/full",
                *conn(fed))
    assert run.returncode == exit_codes.CONFIG_ERROR, run.stderr
    assert_clean(run)
    job_id = json.loads(dpfed("jobs", "--json", "--limit", "1", *conn(fed)).stdout)[0]["job_id"]
    assert (f"job {job_id} finished, but /dev/full could not be written (No space left on "
            f"device)") in run.stderr
    assert f"dpfed fetch {job_id} --out FILE.npz" in run.stderr
    fetched = dpfed("fetch", job_id, "--out", str(tmp_path / "pca.npz"), *conn(fed))
    assert fetched.returncode == 0, fetched.stderr
    from dpfed.aggregator.pca_result import PCAResult

    assert PCAResult.load(tmp_path / "pca.npz").metadata["job_id"] == job_id


def _write_queries(tmp_path: Path) -> Path:
    path = tmp_path / "queries.toml"
    path.write_text('[[queries]]\nname = "old"\nwhere = { column = "age", op = ">=", '
                    'value = 60 }\n')
    return path


def test_query_says_how_many_answers_it_showed_and_svt_close_does_not_say_continue(
        fed: LocalFederation, tmp_path: Path) -> None:
    run = dpfed("query", "--columns", "age", "--bins", "age=40", "--workload", "all_range",
                "--epsilon", "0.1", *conn(fed))
    assert run.returncode == 0, run.stderr
    job_id = json.loads(dpfed("jobs", "--json", "--limit", "1", *conn(fed)).stdout)[0]["job_id"]
    assert (f"showed the first 60 of 820 answers. All of them, at no further privacy cost: "
            f"dpfed fetch {job_id} --out query.npz") in run.stdout
    out = tmp_path / "q.csv"
    run = dpfed("query", "--columns", "age", "--bins", "age=4", "--epsilon", "0.1", "--out",
                str(out), *conn(fed))
    assert run.returncode == 0 and f"wrote {out} (all 4 answers)" in run.stdout
    assert "showed the first" not in run.stdout
    opened = dpfed("svt", "--queries", str(_write_queries(tmp_path)), "--epsilon", "0.1",
                   "--threshold", "10", *conn(fed))
    assert opened.returncode == 0 and "continue with: dpfed svt --session" in opened.stdout
    session = opened.stdout.split("session ", 1)[1].split()[0]
    closed = dpfed("svt", "--session", session, "--close", *conn(fed))
    assert closed.returncode == 0, closed.stderr
    assert "continue with" not in closed.stdout
    assert f"session {session} is closed: it takes no more batches" in closed.stdout


def test_jobs_prints_a_header_and_whole_errors(fed: LocalFederation) -> None:
    failed = dpfed("pca", "--k", "2", "--epsilon", "0.1", "--delta", "1e-6", "--min-sites", "5",
                   "--out", os.devnull, *conn(fed))
    assert failed.returncode == exit_codes.JOB_FAILED, failed.stderr
    assert "--min-sites 5" in failed.stderr and "min_sites" not in failed.stderr
    assert_clean(failed)
    jobs = dpfed("jobs", *conn(fed))
    lines = jobs.stdout.splitlines()
    assert lines[0].split() == ["job", "kind", "state", "epsilon", "sites", "ok", "created",
                                "error"]
    error = json.loads(dpfed("jobs", "--json", "--limit", "1", *conn(fed)).stdout)[0]["error"]
    assert len(error) > 60 and lines[1].endswith(error)


def test_job_refused_for_budget_at_every_site_exits_with_the_budget_code(
        fed: LocalFederation) -> None:
    codes = []
    # each job is epsilon 2 against the sites' 3; their tight ledgers compose the jobs'
    # Gaussian rounds below the sum, so a later job (the sixth at the latest) is refused
    for _ in range(6):
        run = dpfed("pca", "--k", "1", "--epsilon", "2", "--delta", "1e-6", "--out", os.devnull,
                    *conn(fed))
        assert_clean(run)
        codes.append(run.returncode)
        if run.returncode:
            break
    assert codes[-1] == exit_codes.BUDGET_EXCEEDED, (codes, run.stderr)
    assert "no privacy budget left" in run.stderr
    job_id = json.loads(dpfed("jobs", "--json", "--limit", "1", *conn(fed)).stdout)[0]["job_id"]
    assert dpfed("job", job_id, *conn(fed)).returncode == exit_codes.BUDGET_EXCEEDED


def test_flags_not_fields_in_validation_errors(fed: LocalFederation) -> None:
    run = dpfed("pca", "--k", "9", "--epsilon", "1", "--delta", "1e-5", "--out", os.devnull,
                *conn(fed))
    assert run.returncode == exit_codes.USAGE
    assert "--k must be <= 5, got 9" in run.stderr and "n_components" not in run.stderr
    run = dpfed("pca", "--k", "2", "--rank", "1", "--epsilon", "1", "--delta", "1e-5",
                "--out", os.devnull, *conn(fed))
    assert run.returncode == exit_codes.USAGE and "--rank must be >= 2" in run.stderr


def test_wait_sites_with_too_few_sites_has_its_own_code(fed: LocalFederation) -> None:
    run = dpfed("pca", "--k", "1", "--epsilon", "0.1", "--delta", "1e-6", "--wait-sites", "4",
                "--wait-timeout", "2", "--out", os.devnull, *conn(fed))
    assert run.returncode == exit_codes.SITES_NOT_CONNECTED, run.stderr
    assert "only 2 of 4 site(s) connected" in run.stderr
    assert "hospital-1, hospital-2" in run.stderr and "unavailable" not in run.stderr


def test_closed_pipe_exits_quietly(fed: LocalFederation) -> None:
    for args in (["jobs"], ["sites"], ["jobs", "--json"], ["budgets"], ["--help"]):
        proc = subprocess.Popen([*DPFED, *args, *conn(fed)] if args != ["--help"] else
                                [*DPFED, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # like `| head -0`: the reader is gone before anything is written
        err = proc.stderr.read()
        proc.stderr.close()
        code = proc.wait(60)
        assert "Traceback" not in err and "Broken pipe" not in err, (args, err)
        assert code in (exit_codes.PIPE_CLOSED, exit_codes.OK), (args, code)
    # Through a real shell pipe too.
    shell = subprocess.run(" ".join([*DPFED, "jobs", *conn(fed)]) + " | head -1",
                           shell=True, capture_output=True, text=True, timeout=60)
    assert shell.stdout.startswith("job ") and "Traceback" not in shell.stderr


def test_coordinator_address_needs_a_port(fed: LocalFederation) -> None:
    args = conn(fed)
    args[1] = "localhost"
    run = dpfed("sites", *args)
    assert run.returncode == exit_codes.USAGE
    assert "must be host:port" in run.stderr and "localhost:50051" in run.stderr
    env = {**os.environ, "DPFED_COORDINATOR": "localhost"}
    run = dpfed("sites", *args[2:], env=env)
    assert run.returncode == exit_codes.CONFIG_ERROR and "localhost:50051" in run.stderr
    site = subprocess.run([*SITE, "--config", str(fed.site_config("hospital-1")),
                           "--coordinator", "localhost"], capture_output=True, text=True,
                          timeout=60)
    assert site.returncode == exit_codes.USAGE and "localhost:50051" in site.stderr


def test_unreachable_coordinator_is_retried_then_code_6(tmp_path: Path,
                                                        fed: LocalFederation) -> None:
    args = conn(fed)
    args[1] = f"127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    run = dpfed("pca", "--k", "1", "--epsilon", "1", "--delta", "1e-5", "--wait-sites", "1",
                "--wait-timeout", "3", "--out", os.devnull, *args)
    assert run.returncode == exit_codes.COORDINATOR_UNREACHABLE, run.stderr
    assert time.monotonic() - t0 >= 3 and "kept trying for 3s" in run.stderr


def _site_config_copy(fed: LocalFederation, tmp_path: Path, **replace: str) -> Path:
    text = fed.site_config("hospital-1").read_text()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "site.toml"
    path.write_text(text)
    return path


def _tree_digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_site_check_reports_each_check_and_changes_nothing(fed: LocalFederation,
                                                           tmp_path: Path) -> None:
    new_ledger = tmp_path / "ledgers" / "new.sqlite"
    new_ledger.parent.mkdir()
    config = _site_config_copy(fed, tmp_path, **{
        '"127.0.0.1:1"': f'"{fed.address}"',
        json.dumps(str(fed.ledger_path("hospital-1").resolve())): json.dumps(str(new_ledger))})
    run = subprocess.run([*SITE, "check", "--config", str(config)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    for name in ("config", "certificate", "schema", "data", "ledger", "coordinator", "admission"):
        assert any(line.startswith(f"ok      {name}:") for line in lines), (name, run.stdout)
    assert "mutual TLS handshake ok" in run.stdout and "SERVING" in run.stdout
    assert lines[-1] == "all checks passed"
    assert not new_ledger.exists() and list(new_ledger.parent.iterdir()) == []

    # An existing ledger is read, not touched (no WAL switch, no new files).
    existing = tmp_path / "existing"
    existing.mkdir()
    with Ledger(existing / "ledger.sqlite", BudgetPolicy(5.0, 1e-3)):
        pass
    before = _tree_digest(existing)
    config.write_text(config.read_text().replace(json.dumps(str(new_ledger)),
                                                 json.dumps(str(existing / "ledger.sqlite"))))
    run = subprocess.run([*SITE, "check", "--config", str(config)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "0 event(s)" in run.stdout and "read-only" in run.stdout
    assert _tree_digest(existing) == before
    # The site did not appear as an extra connection at the coordinator.
    sites = json.loads(dpfed("sites", "--json", *conn(fed)).stdout)
    assert len(sites) == 2


def test_site_check_failures_name_the_check_and_exit_with_its_code(
        fed: LocalFederation, tmp_path: Path) -> None:
    down = fed.site_config("hospital-1")  # its address is 127.0.0.1:1: nothing listens
    run = subprocess.run([*SITE, "check", "--config", str(down), "--timeout", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == exit_codes.COORDINATOR_UNREACHABLE, run.stdout + run.stderr
    assert any(line.startswith("FAILED  coordinator:") for line in run.stdout.splitlines())
    assert "ok      data:" in run.stdout and run.stdout.splitlines()[-1] == "1 check(s) failed"

    # A kit from another federation: the certificate check fails, the coordinator is skipped.
    other = init_federation(tmp_path / "other", coordinator_hosts=["localhost"],
                            sites=["hospital-1"], analysts=[])
    kit = other.issued[-1].kit_dir
    wrong = _site_config_copy(fed, tmp_path, **{
        json.dumps(str((fed.certs / "sites" / "hospital-1" / "ca.pem").resolve())):
            json.dumps(str(fed.certs / "ca.pem")),
        json.dumps(str((fed.certs / "sites" / "hospital-1" / "site.pem").resolve())):
            json.dumps(str(kit / "site.pem")),
        json.dumps(str((fed.certs / "sites" / "hospital-1" / "site.key").resolve())):
            json.dumps(str(kit / "site.key"))})
    run = subprocess.run([*SITE, "check", "--config", str(wrong)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == exit_codes.CERTIFICATE_ERROR, run.stdout + run.stderr
    assert "FAILED  certificate:" in run.stdout and "skipped coordinator:" in run.stdout
    assert_clean(run)


def _check(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SITE, "check", "--config", str(config)], capture_output=True,
                          text=True, timeout=120)


def test_site_check_fails_when_no_row_survives_the_row_policy(fed: LocalFederation,
                                                              tmp_path: Path) -> None:
    data = tmp_path / "unusable.csv"
    header, *rows = fed.data_paths["hospital-1"].read_text().splitlines()
    # Every row has a value the schema cannot parse: on_invalid = "drop" drops them all.
    data.write_text("\n".join([header, *(",".join(["oops"] * len(header.split(",")))
                                          for _ in rows[:50])]) + "\n")
    config = _site_config_copy(fed, tmp_path, **{
        '"127.0.0.1:1"': f'"{fed.address}"',
        json.dumps(str(fed.data_paths["hospital-1"].resolve())): json.dumps(str(data))})
    run = _check(config)
    assert run.returncode == exit_codes.DATA_ERROR, run.stdout + run.stderr
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and failed[0].startswith("FAILED  data:"), run.stdout
    assert "no valid rows after the row policy" in failed[0] and "read 50 rows" in failed[0]
    assert_clean(run)


def test_site_check_fails_when_the_coordinator_would_refuse_the_schema(
        fed: LocalFederation, tmp_path: Path) -> None:
    schema = tmp_path / "schema.toml"
    text = fed.schema_path.read_text()
    schema.write_text(text.replace("max = ", "max = 9", 1))  # one bound differs
    # A ledger of its own: the refused agent below writes its "stopped" status beside its
    # ledger, which must not be the status file of hospital-1's running agent.
    config = _site_config_copy(fed, tmp_path, **{
        '"127.0.0.1:1"': f'"{fed.address}"',
        json.dumps(str(fed.schema_path.resolve())): json.dumps(str(schema)),
        json.dumps(str(fed.ledger_path("hospital-1").resolve())):
            json.dumps(str(tmp_path / "ledger.sqlite"))})
    run = _check(config)
    assert run.returncode == exit_codes.REJECTED_BY_COORDINATOR, run.stdout + run.stderr
    assert "ok      coordinator:" in run.stdout and "ok      data:" in run.stdout
    (failed,) = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert failed.startswith("FAILED  admission:") and "schema mismatch" in failed
    # The running agent with that schema is refused at once, with the same code.
    agent = subprocess.run([*SITE, "--config", str(config)], capture_output=True, text=True,
                           timeout=120)
    assert agent.returncode == exit_codes.REJECTED_BY_COORDINATOR
    assert len(json.loads(dpfed("sites", "--json", *conn(fed)).stdout)) == 2


def test_site_health_reads_the_running_agents_status(fed: LocalFederation) -> None:
    config = str(fed.site_config("hospital-1"))
    run = subprocess.run([*SITE, "health", "--config", config], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith(f"healthy: connected to {fed.address} as hospital-1")
    elsewhere = subprocess.run([*SITE, "health", "--config", config, "--ledger",
                                str(fed.root / "nowhere" / "ledger.sqlite")],
                               capture_output=True, text=True, timeout=60)
    assert elsewhere.returncode == exit_codes.COORDINATOR_UNREACHABLE
    assert elsewhere.stdout.startswith("unhealthy: no status file")


def test_wait_sites_retries_while_the_coordinator_starts(tmp_path: Path) -> None:
    federation = LocalFederation.create(
        tmp_path / "late", n_sites=1, rows=300, features=3, seed=5, min_sites=1,
        task_deadline_s=60, settings=SiteSettings(connect_timeout_s=60))
    port = free_port()
    kit = federation.certs / "analysts" / "analyst"
    analyst = subprocess.Popen(
        [*DPFED, "pca", "--k", "1", "--epsilon", "1", "--delta", "1e-5", "--wait-sites", "1",
         "--wait-timeout", "120", "--out", str(tmp_path / "late.npz"), "--coordinator",
         f"127.0.0.1:{port}", "--ca", str(kit / "ca.pem"), "--cert", str(kit / "analyst.pem"),
         "--key", str(kit / "analyst.key")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        time.sleep(4)  # several failed polls: nothing listens yet
        assert analyst.poll() is None, analyst.communicate()[0]
        federation.start_coordinator(port=port)
        federation.start_sites()
        out, _ = analyst.communicate(timeout=180)
        assert analyst.returncode == 0, out
        assert (tmp_path / "late.npz").exists()
    finally:
        if analyst.poll() is None:
            analyst.kill()
        federation.stop_all()
