"""``dpfed cancel`` and a client that dies, against real processes (issue 19).

Coordinator and three sites are real processes over mTLS; the analyst commands run as
``python -m dpfed.aggregator.cli`` processes. A job is held in its first round by a stopped
site (SIGSTOP), so that it is surely still running when it is cancelled or its client dies.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.common import exit_codes
from dpfed.common.errors import ValidationError
from dpfed.common.transport.certs import issue_certificate
from dpfed.common.transport.protocol import Refusal, Task
from dpfed.site_agent.handlers import DataAccess, Release, TaskHandler
from tests.aggregator.hardening_harness import start_agent
from tests.e2e.federations import (
    charged_events,
    roomy_settings,
    running,
    wait_until,
    with_keepalive,
)
from tests.e2e.rogue_coordinator import RogueCoordinator

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

DPFED = [sys.executable, "-m", "dpfed.aggregator.cli"]
#: The default pca job: a DP mean, a DP norm quantile, then the PCA round (three charges).
PCA = ["pca", "--k", "2", "--epsilon", "1", "--delta", "1e-5", "--min-sites", "3",
       "--deadline", "120"]


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(tmp_path / "fed", n_sites=3, rows=400, features=4,
                                        seed=8, min_sites=3, task_deadline_s=120,
                                        settings=roomy_settings())
    # A stopped site must stay connected for the whole test (not be dropped by keepalive).
    with_keepalive(federation, 300.0)
    yield from running(federation)


def conn(fed: LocalFederation, analyst: str = "analyst") -> list[str]:
    kit = fed.certs / "analysts" / analyst
    return ["--coordinator", fed.address, "--ca", str(kit / "ca.pem"), "--cert",
            str(kit / "analyst.pem"), "--key", str(kit / "analyst.key")]


def dpfed(fed: LocalFederation, *args: str, analyst: str = "analyst"
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DPFED, *args, *conn(fed, analyst)], capture_output=True, text=True,
                          timeout=120)


def held_job(fed: LocalFederation, tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    """Start ``dpfed pca`` with hospital-3 stopped; return the client and the job id once
    hospital-1 and hospital-2 have charged the first round."""
    fed.signal("hospital-3", signal.SIGSTOP)
    client = subprocess.Popen([*DPFED, *PCA, "--out", str(tmp_path / "pca.npz"), *conn(fed)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_until(lambda: all(len(charged_events(fed, s)) == 1
                           for s in ("hospital-1", "hospital-2")), 60, "the first round")
    jobs = json.loads(dpfed(fed, "jobs", "--json").stdout)
    return client, jobs[0]["job_id"]


def job_json(fed: LocalFederation, job_id: str) -> dict[str, object]:
    out = dpfed(fed, "job", job_id, "--json")
    return dict(json.loads(out.stdout))


def test_cancel_stops_a_job_its_sites_keep_their_charges_and_it_is_not_resumed(
        fed: LocalFederation, tmp_path: Path) -> None:
    client, job_id = held_job(fed, tmp_path)
    try:
        issue_certificate(fed.certs, role="analyst", name="mallory")
        other = dpfed(fed, "cancel", job_id, analyst="mallory")
        assert other.returncode != 0 and "no job with id" in other.stderr, other
        assert job_json(fed, job_id)["state"] == "running"

        t0 = time.monotonic()
        done = dpfed(fed, "cancel", job_id, "--reason", "wrong epsilon")
        took = time.monotonic() - t0
        assert done.returncode == exit_codes.OK, done.stderr
        assert f"job {job_id}: cancelled (cancelled by analyst/analyst: wrong epsilon)" in (
            done.stdout)
        out, _ = client.communicate(timeout=30)  # the submitting client learns it at once
        assert client.returncode == exit_codes.JOB_FAILED and "cancelled" in out, out
    finally:
        fed.signal("hospital-3", signal.SIGCONT)
        if client.poll() is None:
            client.kill()
            client.communicate(timeout=10)
    print(f"\n`dpfed cancel` answered in {took:.2f}s")
    info = job_json(fed, job_id)
    assert info["state"] == "cancelled" and info["error"] == (
        "cancelled by analyst/analyst: wrong epsilon")
    time.sleep(3.0)  # nothing more is dispatched: the mean round's charges stay, no more
    for site_id in ("hospital-1", "hospital-2"):
        assert len(charged_events(fed, site_id)) == 1
    assert len(charged_events(fed, "hospital-3")) <= 1  # it may still run the queued task

    fed.stop("coordinator")
    fed.start_coordinator(port=fed.port)
    fed.wait_for_sites()
    time.sleep(2.0)
    assert job_json(fed, job_id)["state"] == "cancelled"
    for site_id in ("hospital-1", "hospital-2"):
        assert len(charged_events(fed, site_id)) == 1
    again = dpfed(fed, "cancel", job_id)
    assert again.returncode == exit_codes.OK and "cancelled" in again.stdout


def test_a_job_outlives_its_dead_client_and_is_fetched_later(
        fed: LocalFederation, tmp_path: Path) -> None:
    client, job_id = held_job(fed, tmp_path)
    client.kill()
    client.communicate(timeout=10)
    fed.signal("hospital-3", signal.SIGCONT)
    watched = dpfed(fed, "job", job_id, "--watch")
    assert watched.returncode == exit_codes.OK, watched.stdout + watched.stderr
    assert job_json(fed, job_id)["state"] == "succeeded"
    fetched = dpfed(fed, "fetch", job_id, "--out", str(tmp_path / "later.npz"))
    assert fetched.returncode == exit_codes.OK, fetched.stderr
    assert (tmp_path / "later.npz").stat().st_size > 0


class SlowHandler(TaskHandler):
    """Keeps the site's task thread busy for a while, then refuses (charges nothing)."""

    kind = "slow"

    def prepare(self, task: Task, data: DataAccess) -> Release:
        time.sleep(2.0)
        raise ValidationError("slow task done")


async def test_a_site_refuses_a_cancelled_task_that_has_not_started(tmp_path: Path) -> None:
    fed = LocalFederation.create(tmp_path / "fed", n_sites=1, rows=200, features=4, seed=1,
                                 settings=roomy_settings())
    coordinator = RogueCoordinator(fed.certs)
    fed.port = await coordinator.start()
    agent, ledger, running_agent = await start_agent(fed, "hospital-1",
                                                     handlers={"slow": SlowHandler()},
                                                     extra_kinds=("slow",))
    try:
        await coordinator.wait_for("hospital-1")
        busy = asyncio.ensure_future(coordinator.ask("hospital-1", Task(
            "job-1/slow", "job-1", "slow", 0.0, 0.0)))
        await asyncio.sleep(0.3)  # the slow task holds the site's task thread
        queued = asyncio.ensure_future(coordinator.ask("hospital-1", Task(
            "job-2/pca", "job-2", "pca", 1.0, 1e-5, {"n_components": 1, "rank": 2})))
        await asyncio.sleep(0.3)
        coordinator.cancel("hospital-1", "job-2/pca")
        assert isinstance(await busy, Refusal)
        answer = await queued
        assert isinstance(answer, Refusal) and answer.code == "cancelled", answer
        assert ledger.events() == []
    finally:
        agent.stop()
        await coordinator.stop()
        await asyncio.wait_for(running_agent, 15)
        ledger.close()
