"""A ledger export from a real federation job verifies; one flipped byte or one removed event
does not.

A coordinator and three sites as real processes over mTLS run two jobs (a centred DP-PCA of
three rounds, and a one-round one); a site's ledger is exported with the real command while
its agent keeps running, and checked with ``dpfed audit verify`` against the federation CA.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.common import exit_codes
from dpfed.common.transport.certs import init_federation
from tests.e2e.federations import charged_events, roomy_settings, running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

DPFED = [sys.executable, "-m", "dpfed.aggregator.cli"]
SITE = [sys.executable, "-m", "dpfed.site_agent"]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        tmp_path_factory.mktemp("audit") / "fed", n_sites=3, rows=1200, features=5, seed=3,
        min_sites=3, task_deadline_s=60, settings=roomy_settings())
    yield from running(federation)


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120, check=False)


def test_an_export_of_a_real_run_verifies_and_tampering_fails(fed: LocalFederation,
                                                              tmp_path: Path) -> None:
    with fed.analyst() as coord:
        coord.pca(2, epsilon=1.0, delta=1e-5)
        coord.pca(2, epsilon=0.5, delta=1e-5, centering="none", clip_norm="schema")
        jobs = {j.job_id for j in coord.jobs(2)}
    export = tmp_path / "hospital-2.jsonl"
    made = _run(*SITE, "ledger", "export", "--config", str(fed.site_config("hospital-2")),
                "--out", str(export))
    assert made.returncode == 0, made.stderr
    assert "wrote 4 ledger event(s) of site hospital-2" in made.stdout

    ca = str(fed.certs / "ca.pem")
    ok = _run(*DPFED, "audit", "verify", str(export), "--ca", ca)
    assert ok.returncode == exit_codes.OK, ok.stderr
    assert "VERIFIED" in ok.stdout and "4 ledger event(s) of 2 job(s)" in ok.stdout
    # What the site's (tight, pld) accountant says two jobs of ε 1 and 0.5 cost together.
    spent = re.search(r"spent +epsilon ([0-9.e+-]+) of", ok.stdout)
    assert spent is not None and 0 < float(spent.group(1)) <= 1.5, ok.stdout

    # The records are the ledger's events, attributed to the analyst who submitted the jobs.
    records = [json.loads(x) for x in export.read_text().splitlines()[1:-2]]
    events = charged_events(fed, "hospital-2")
    assert [r["task_id"] for r in records] == [e.task_id for e in events]
    assert {r["job_id"] for r in records} == jobs
    assert {r["analyst"] for r in records} == {"analyst"} and {r["study"] for r in records} == {""}
    assert [r["release_digest"] for r in records] == [e.result_digest for e in events]
    # each round's own epsilon; together they compose (tightly) to what the trailer says
    assert sum(r["epsilon"] for r in records) >= float(spent.group(1))

    data = export.read_bytes()
    flipped = bytearray(data)
    middle = data.index(b'"epsilon":', data.index(b'"type":"charge"')) + len(b'"epsilon":')
    flipped[middle] ^= 0x01  # one digit of the first charge's epsilon
    (tmp_path / "flipped.jsonl").write_bytes(bytes(flipped))
    bad = _run(*DPFED, "audit", "verify", str(tmp_path / "flipped.jsonl"), "--ca", ca)
    assert bad.returncode == exit_codes.VERIFICATION_FAILED, bad.stdout
    assert "does not chain to line 2" in bad.stderr or "not valid JSON" in bad.stderr

    lines = data.split(b"\n")
    del lines[2]  # the second ledger event
    (tmp_path / "removed.jsonl").write_bytes(b"\n".join(lines))
    bad = _run(*DPFED, "audit", "verify", str(tmp_path / "removed.jsonl"), "--ca", ca)
    assert bad.returncode == exit_codes.VERIFICATION_FAILED
    assert "line 3 does not chain to line 2" in bad.stderr

    # The right export checked against another federation's CA: the certificate is refused.
    other = init_federation(tmp_path / "other", coordinator_hosts=["localhost"],
                            sites=["hospital-2"], analysts=[])
    bad = _run(*DPFED, "audit", "verify", str(export), "--ca", str(other.ca_cert_path))
    assert bad.returncode == exit_codes.VERIFICATION_FAILED
    assert "not issued by the CA" in bad.stderr
    assert hashlib.sha256(export.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
