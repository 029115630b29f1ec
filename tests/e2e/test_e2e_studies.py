"""Studies with real processes: jobs submitted with ``dpfed --study NAME`` spend from the
study's cap at every site; a job that would exceed the cap and every job under an expired
study are refused with nothing charged; ``dpfed budgets --study`` shows spent and left per
site; the signed export names each charge's study.

A coordinator and two sites over mTLS, each site.toml holding ``[studies.trial]`` (epsilon
1.5, expiring in 2099) and ``[studies.closed]`` (expired in 2020), under the basic accountant
so the arithmetic is exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.common import exit_codes
from tests.e2e.federations import charged_events, roomy_settings, running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

DPFED = [sys.executable, "-m", "dpfed.aggregator.cli"]
SITE = [sys.executable, "-m", "dpfed.site_agent"]
SITES = ("hospital-1", "hospital-2")
STUDIES = ("\n[studies.trial]\nepsilon = 1.5\nexpires = 2099-12-31\n"
           "\n[studies.closed]\nepsilon = 5.0\nexpires = 2020-01-01\n")


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        tmp_path_factory.mktemp("studies") / "fed", n_sites=2, rows=600, features=4, seed=7,
        min_sites=2, task_deadline_s=120, settings=roomy_settings(budget_epsilon=10.0,
                                                                 accountant="basic"))
    for site_id in SITES:
        config = federation.site_config(site_id)
        config.write_text(config.read_text() + STUDIES)
    yield from running(federation)


def dpfed(fed: LocalFederation, *args: str) -> subprocess.CompletedProcess[str]:
    kit = fed.certs / "analysts" / "analyst"
    return subprocess.run([*DPFED, *args, "--coordinator", fed.address, "--ca",
                           str(kit / "ca.pem"), "--cert", str(kit / "analyst.pem"), "--key",
                           str(kit / "analyst.key")],
                          capture_output=True, text=True, timeout=120, check=False)


def pca(fed: LocalFederation, epsilon: float, *study: str) -> subprocess.CompletedProcess[str]:
    return dpfed(fed, "pca", "--k", "1", "--epsilon", str(epsilon), "--delta", "1e-6",
                 "--centering", "none", "--clip-norm", "schema", "--out", os.devnull, *study)


def spent(fed: LocalFederation) -> dict[str, float]:
    return {s: sum(e.epsilon for e in charged_events(fed, s)) for s in SITES}


def test_a_study_caps_its_jobs_and_an_expired_study_refuses_everything(
        fed: LocalFederation, tmp_path: Path) -> None:
    first = pca(fed, 1.0, "--study", "trial")
    assert first.returncode == exit_codes.OK, first.stderr
    assert spent(fed) == {"hospital-1": 1.0, "hospital-2": 1.0}

    shown = dpfed(fed, "budgets", "--study", "trial")
    assert shown.returncode == exit_codes.OK, shown.stderr
    assert "study trial:" in shown.stdout
    for site_id in SITES:
        line = next(x for x in shown.stdout.splitlines() if x.startswith(site_id))
        assert line.split()[2:6] == ["1", "0.5", "1.5", "2099-12-31"], shown.stdout
    as_json = json.loads(dpfed(fed, "budgets", "--study", "trial", "--json").stdout)
    assert {r["site_id"]: r["budget"]["epsilon_remaining"] for r in as_json} == {
        "hospital-1": 0.5, "hospital-2": 0.5}

    # 1.0 more does not fit the study's 0.5 left: both sites refuse, nothing is charged.
    over = pca(fed, 1.0, "--study", "trial")
    assert over.returncode == exit_codes.BUDGET_EXCEEDED, (over.stdout, over.stderr)
    assert "study 'trial' would exceed its budget" in over.stderr + over.stdout
    assert spent(fed) == {"hospital-1": 1.0, "hospital-2": 1.0}

    # The expired study refuses even a tiny job, before anything is charged.
    closed = pca(fed, 0.01, "--study", "closed")
    assert closed.returncode == exit_codes.BUDGET_EXCEEDED, (closed.stdout, closed.stderr)
    assert "study 'closed' expired" in closed.stderr + closed.stdout
    unknown = pca(fed, 0.01, "--study", "nosuch")
    assert unknown.returncode == exit_codes.JOB_FAILED
    assert "no budget for study 'nosuch'" in unknown.stderr + unknown.stdout
    assert spent(fed) == {"hospital-1": 1.0, "hospital-2": 1.0}

    # Outside any study the site's total still has room.
    assert pca(fed, 1.0).returncode == exit_codes.OK
    assert spent(fed) == {"hospital-1": 2.0, "hospital-2": 2.0}

    # The signed export names the study of each charge.
    export = tmp_path / "h1.jsonl"
    made = subprocess.run([*SITE, "ledger", "export", "--config",
                           str(fed.site_config("hospital-1")), "--out", str(export)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert made.returncode == exit_codes.OK, made.stderr
    records = [json.loads(x) for x in export.read_text().splitlines()[1:-2]]
    assert [r["study"] for r in records] == ["trial", ""]
    verified = subprocess.run([*DPFED, "audit", "verify", str(export), "--ca",
                               str(fed.certs / "ca.pem")],
                              capture_output=True, text=True, timeout=120, check=False)
    assert verified.returncode == exit_codes.OK, verified.stderr
