"""Approval at the site, with real processes: a manual-approval site holds a job's task, and
nothing is computed or charged until its data steward runs ``dpfed-site approve``; ``deny``
refuses with nothing charged; a restart of the site keeps the queue.

A coordinator and two sites over mTLS; hospital-2's ``site.toml`` says
``[policy] approval = "manual"``. The steward's commands run as real ``dpfed-site``
subprocesses against the running agent's ledger file, and the analyst looks at the job with
the real ``dpfed job``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.common import exit_codes
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.transport.protocol import JobInfo, JobSpec, JobState, RefusalCode, SiteStatus
from dpfed.site_agent.approvals import ApprovalQueue
from dpfed.site_agent.ledger import Ledger
from tests.e2e.federations import charged_events, roomy_settings, running, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

DPFED = [sys.executable, "-m", "dpfed.aggregator.cli"]
SITE = [sys.executable, "-m", "dpfed.site_agent"]
HELD = "hospital-2"
#: A one-round PCA (no DP centring: one task per site).
ONE_ROUND = {"n_components": 2, "calibration": "analytic", "centering": "none",
             "clip_norm": "schema"}


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        tmp_path_factory.mktemp("approval") / "fed", n_sites=2, rows=600, features=4, seed=5,
        min_sites=2, task_deadline_s=300, settings=roomy_settings())
    config = federation.site_config(HELD)
    config.write_text(config.read_text().replace("[policy]\n",
                                                 "[policy]\napproval = \"manual\"\n"))
    yield from running(federation)


def steward(fed: LocalFederation, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SITE, *args, "--config", str(fed.site_config(HELD))],
                          capture_output=True, text=True, timeout=120, check=False)


def dpfed_job(fed: LocalFederation, job_id: str) -> subprocess.CompletedProcess[str]:
    kit = fed.certs / "analysts" / "analyst"
    return subprocess.run([*DPFED, "job", job_id, "--coordinator", fed.address, "--ca",
                           str(kit / "ca.pem"), "--cert", str(kit / "analyst.pem"), "--key",
                           str(kit / "analyst.key")],
                          capture_output=True, text=True, timeout=120, check=False)


def pending(fed: LocalFederation) -> list[dict[str, object]]:
    listed = steward(fed, "approvals", "--json")
    assert listed.returncode == exit_codes.OK, listed.stderr
    return list(json.loads(listed.stdout))


def submitted(fed: LocalFederation, spec: JobSpec) -> tuple[threading.Thread, list[JobInfo]]:
    """Submit ``spec`` on a thread (the client follows the job until it ends)."""
    out: list[JobInfo] = []

    def run() -> None:
        with fed.analyst(timeout=300) as coord:
            out.append(coord.submit(spec))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def newest_job(fed: LocalFederation) -> str:
    with fed.analyst() as coord:
        return coord.jobs(1)[0].job_id


def job_events(fed: LocalFederation, site_id: str, job_id: str) -> int:
    return sum(1 for e in charged_events(fed, site_id) if e.job_id == job_id)


def test_a_held_job_runs_only_after_approve_and_the_queue_survives_a_restart(
        fed: LocalFederation) -> None:
    thread, out = submitted(fed, JobSpec("pca", 1.0, 1e-5, ONE_ROUND))
    wait_until(lambda: len(pending(fed)) == 1, 60, "the approval request")
    job_id = newest_job(fed)
    [request] = pending(fed)
    assert request["job_id"] == job_id and request["analyst"] == "analyst"
    assert request["kind"] == "pca" and request["epsilon"] == 1.0
    assert '"n_components": 2' in str(request["params"])
    text = steward(fed, "approvals")
    assert f"request {request['id']}: PENDING" in text.stdout and "analyst   analyst" in (
        text.stdout)

    # The analyst sees the job waiting for that site; the site has charged nothing.
    wait_until(lambda: "waiting for approval at hospital-2" in dpfed_job(fed, job_id).stdout,
               30, "dpfed job to show the wait")
    shown = dpfed_job(fed, job_id).stdout
    assert "running" in shown and f"site {HELD}: awaiting_approval" in shown, shown
    assert job_events(fed, HELD, job_id) == 0
    assert job_events(fed, "hospital-1", job_id) == 1  # the auto site answered at once

    # A restart of the held site keeps the queue: the same request, still pending, no charge.
    fed.stop(HELD)
    fed.start_site(HELD)
    fed.wait_for_sites()
    assert [r["id"] for r in pending(fed)] == [request["id"]]
    assert job_events(fed, HELD, job_id) == 0 and thread.is_alive()

    approved = steward(fed, "approve", str(request["id"]))
    assert approved.returncode == exit_codes.OK, approved.stderr
    assert f"request {request['id']} approved: job {job_id}" in approved.stdout
    thread.join(120)
    [job] = out
    assert job.state == JobState.SUCCEEDED, job.error
    assert {s.site_id: s.status for s in job.sites} == {"hospital-1": SiteStatus.OK,
                                                         HELD: SiteStatus.OK}
    # Charged exactly once, for the job's one task, however often the task was resent.
    assert job_events(fed, HELD, job_id) == 1
    assert pending(fed) == []
    again = steward(fed, "approve", str(request["id"]))
    assert again.returncode == exit_codes.USAGE and "a decision is final" in again.stderr


def test_deny_refuses_the_job_with_nothing_charged(fed: LocalFederation) -> None:
    before = len(charged_events(fed, HELD))
    thread, out = submitted(fed, JobSpec("pca", 0.5, 1e-5, ONE_ROUND, min_sites=1))
    wait_until(lambda: len(pending(fed)) == 1, 60, "the approval request")
    [request] = pending(fed)
    denied = steward(fed, "deny", str(request["id"]), "--reason", "not in the approved protocol")
    assert denied.returncode == exit_codes.OK, denied.stderr
    thread.join(120)
    [job] = out
    # The quorum of one is met by hospital-1; hospital-2 refused with the new code.
    assert job.state == JobState.SUCCEEDED, job.error
    held = next(s for s in job.sites if s.site_id == HELD)
    assert held.status == SiteStatus.REFUSED and held.code == RefusalCode.DENIED
    assert "not in the approved protocol" in held.reason
    assert len(charged_events(fed, HELD)) == before
    with Ledger(fed.ledger_path(HELD), BudgetPolicy(1e6, 0.5)) as ledger:
        decided = ApprovalQueue(ledger).get(int(str(request["id"])))
    assert decided.decision == "denied" and decided.reason == "not in the approved protocol"


def test_an_unknown_request_and_a_bad_policy_value_are_clear_errors(
        fed: LocalFederation, tmp_path: Path) -> None:
    missing = steward(fed, "approve", "999")
    assert missing.returncode == exit_codes.USAGE
    assert "no approval request 999" in missing.stderr and "Traceback" not in missing.stderr
    bad = tmp_path / "site.toml"
    bad.write_text(fed.site_config(HELD).read_text().replace(
        "approval = \"manual\"", "approval = \"sometimes\""))
    run = subprocess.run([*SITE, "approvals", "--config", str(bad)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == exit_codes.CONFIG_ERROR
    assert "policy.approval must be one of auto, manual, got 'sometimes'" in run.stderr
