"""Every limit a site advertises is checked against every round before the first charge.

Real processes over mTLS. ``dpfed pca --epsilon 3`` against sites whose policy caps a task
at epsilon 2 (its pca round asks more): the job is refused before anything is
charged anywhere, naming the cap -- where it used to charge the first two rounds at every
site and fail on the third. One capped site among uncapped ones is left out, charged
nothing, and the job runs with the others. ``--plan`` lists only the sites that would take
part and names the others with their reason.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.common import exit_codes
from dpfed.common.transport.protocol import JobSpec, RefusalCode, SiteStatus
from tests.e2e.federations import charged_events, roomy_settings, running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _cli(fed: LocalFederation, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    kit = fed.certs / "analysts" / "analyst"
    conn = ["--coordinator", fed.address, "--ca", str(kit / "ca.pem"), "--cert",
            str(kit / "analyst.pem"), "--key", str(kit / "analyst.key")]
    return subprocess.run([sys.executable, "-m", "dpfed.aggregator.cli", *args, *conn],
                          capture_output=True, text=True, timeout=180, cwd=cwd)


def test_a_job_no_site_can_finish_is_refused_before_any_charge(tmp_path: Path) -> None:
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=800, features=5, seed=2, min_sites=2,
        task_deadline_s=60, settings=roomy_settings(max_epsilon_per_task=2.0))
    for fed in running(federation):
        run = _cli(fed, "pca", "--k", "2", "--epsilon", "3", "--delta", "1e-5", "--out",
                   "pca.npz", cwd=tmp_path)
        assert run.returncode == exit_codes.BUDGET_EXCEEDED, run.stderr
        assert "allows at most 2 per task" in run.stderr and "Traceback" not in run.stderr
        assert not (tmp_path / "pca.npz").exists()
        for site_id in fed.site_ids:
            assert charged_events(fed, site_id) == []
        with fed.analyst() as coord:
            (job,) = coord.jobs(1)
        assert job.state == "failed" and "nothing was charged" in job.error
        assert all(s.status == SiteStatus.REFUSED and s.left_out
                   and s.code is RefusalCode.BUDGET_EXCEEDED for s in job.sites)
        # what --plan says of the same job: nobody would take part
        plan = _cli(fed, "pca", "--k", "2", "--epsilon", "3", "--delta", "1e-5", "--plan",
                    cwd=tmp_path)
        assert plan.returncode == 0, plan.stderr
        assert not [x for x in plan.stdout.splitlines() if x.startswith("hospital")]
        assert plan.stdout.count("not taking part: hospital-") == 3
        # within the cap the same sites run it
        ok = _cli(fed, "pca", "--k", "2", "--epsilon", "2", "--delta", "1e-5", "--out",
                  "pca.npz", cwd=tmp_path)
        assert ok.returncode == 0, ok.stderr


def test_a_site_that_would_refuse_a_later_round_is_left_out_and_charged_nothing(
        tmp_path: Path) -> None:
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=800, features=5, seed=3, min_sites=2,
        task_deadline_s=60, mixed=True, settings=roomy_settings(allowed_jobs=("pca", "synth")))
    federation.write_site_config("hospital-3", roomy_settings(allowed_jobs=("pca", "synth"),
                                                              max_epsilon_per_task=2.0))
    federation.write_site_config("hospital-2", roomy_settings(allowed_jobs=("pca",)))
    for fed in running(federation):
        with fed.analyst() as coord:
            job = coord.submit(JobSpec("pca", 3.0, 1e-5, {"n_components": 2}, min_sites=2))
        assert job.state == "succeeded", job.error
        outcome = {s.site_id: s for s in job.sites}
        capped = outcome["hospital-3"]
        assert capped.status == SiteStatus.REFUSED and capped.left_out
        assert "round 'pca' asks epsilon=2.8" in capped.reason  # its share of the GDP mu^2
        assert charged_events(fed, "hospital-3") == []
        assert [e.task_id.split("/")[-1] for e in charged_events(fed, "hospital-1")] == [
            "norms", "mean", "pca"]  # the clip radius first
        # --plan states the split the coordinator settles on (from the schema and the rows)
        plan = _cli(fed, "pca", "--k", "2", "--epsilon", "3", "--delta", "1e-5", "--plan",
                    cwd=tmp_path)
        assert plan.returncode == 0, plan.stderr
        assert "budget split: shares of mu^2 (GDP): norms 0." in plan.stdout, plan.stdout
        assert "a pld ledger is charged exactly epsilon 3 at delta 1e-05" in plan.stdout
        # two sites taking part, each tolerating t=1: secure mode is no better here
        assert "with 2 site(s), t=1: secure / site-level = 1.01. WARNING" in plan.stdout
        # synth --plan lists only the sites whose policy runs synth (issue: it listed all)
        plan = _cli(fed, "synth", "--epsilon", "1", "--delta", "1e-5", "--plan",
                    cwd=tmp_path)
        assert plan.returncode == 0, plan.stderr
        listed = {x.split()[0] for x in plan.stdout.splitlines() if x.startswith("hospital")}
        assert listed == {"hospital-1", "hospital-3"}, plan.stdout
        assert "not taking part: hospital-2 -- not_allowed: the site's policy does not " \
               "allow 'synth' jobs" in plan.stdout
