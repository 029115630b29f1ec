"""docs/operations.md "Deploying by hand", step by step, with real processes.

The commands are the documented ones (the test checks each appears in the page), run in a
temporary directory; only the coordinator's port is a free one instead of 50051, since the
test machine is shared.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dpfed.aggregator.pca_result import PCAResult
from tests.e2e.federations import stop_processes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operations.md"
BIN = Path(sys.executable).parent


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_hand_deployment_as_documented(tmp_path: Path) -> None:
    doc = section(DOC.read_text(), "Deploying by hand")
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "REPO": str(ROOT)}
    setup = [
        "dpfed certs init --out certs --coordinator-host localhost --sites hospital-a,hospital-b "
        "--analysts alice",
        'cp "$REPO/deploy/examples/aggregator.toml" aggregator.toml',
        'cp "$REPO/deploy/examples/site.toml" site-a.toml',
        "sed 's/hospital-a/hospital-b/g; s/site_01/site_02/g' site-a.toml > site-b.toml",
    ]
    for command in setup:
        assert command in doc, command
    assert "dpfed demo-data --out data --sites 2 --rows 20000" in doc
    work = tmp_path / "federation-demo"
    work.mkdir()
    for command in [*setup[:1], "dpfed demo-data --out data --sites 2 --rows 2000",
                    *setup[1:]]:
        subprocess.run(command, shell=True, cwd=work, env=env, check=True,
                       capture_output=True, timeout=120)

    port = free_port()
    for name in ("site-a.toml", "site-b.toml"):
        path = work / name
        path.write_text(path.read_text().replace("localhost:50051", f"localhost:{port}"))
    procs: list[subprocess.Popen[bytes]] = []

    def start(argv: str, log: str) -> subprocess.Popen[bytes]:
        with open(work / log, "wb") as fh:
            proc = subprocess.Popen(argv, shell=True, cwd=work, env=env, stdout=fh,
                                    stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    try:
        assert "dpfed-aggregator --config aggregator.toml" in doc
        start(f"exec dpfed-aggregator --config aggregator.toml --listen 127.0.0.1:{port}",
              "coordinator.log")
        deadline = time.monotonic() + 60
        while True:  # terminal 2's first step, repeated until the coordinator is up
            check = subprocess.run("dpfed-site check --config site-a.toml --timeout 2",
                                   shell=True, cwd=work, env=env, capture_output=True,
                                   text=True, timeout=60)
            if check.returncode == 0 or time.monotonic() > deadline:
                break
            assert procs[0].poll() is None, (work / "coordinator.log").read_text()
            time.sleep(0.5)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "dpfed-site check --config site-a.toml" in doc
        for name in ("config", "certificate", "schema", "data", "ledger", "coordinator"):
            assert f"ok      {name}:" in check.stdout and f"ok      {name}:" in doc
        assert not (work / "ledger-hospital-a.sqlite").exists()

        assert "dpfed-site --config site-a.toml &" in doc
        start("exec dpfed-site --config site-a.toml", "site-a.log")
        # site-b.toml says format = "text"; the flag overrides it.
        start("exec dpfed-site --config site-b.toml --log-format json", "site-b.log")

        analyst = {**env, "DPFED_COORDINATOR": f"localhost:{port}",
                   "DPFED_CA": "certs/analysts/alice/ca.pem",
                   "DPFED_CERT": "certs/analysts/alice/analyst.pem",
                   "DPFED_KEY": "certs/analysts/alice/analyst.key"}
        for key in ("DPFED_CA", "DPFED_CERT", "DPFED_KEY"):
            assert f"{key}={analyst[key]}" in doc
        pca = "dpfed pca --k 3 --epsilon 1 --delta 1e-6 --wait-sites 2 --out pca.npz"
        assert pca in doc
        run = subprocess.run(pca + " --wait-timeout 120", shell=True, cwd=work, env=analyst,
                             capture_output=True, text=True, timeout=200)
        assert run.returncode == 0, run.stdout + run.stderr
        result = PCAResult.load(work / "pca.npz")
        assert result.components_.shape == (3, 20)
        np.testing.assert_allclose(result.components_ @ result.components_.T, np.eye(3),
                                   atol=1e-9)
        budgets = subprocess.run("dpfed budgets --json", shell=True, cwd=work, env=analyst,
                                 capture_output=True, text=True, timeout=60)
        spent = {b["site_id"]: b["budget"]["epsilon_spent"] for b in json.loads(budgets.stdout)}
        # the job's three Gaussian rounds composed tightly at the site's delta cap (pld)
        assert set(spent) == {"hospital-a", "hospital-b"}
        assert all(0.5 < v < 1.0 for v in spent.values()), spent
        ledger = subprocess.run("dpfed-site ledger --config site-a.toml", shell=True, cwd=work,
                                env=env, capture_output=True, text=True, timeout=60)
        jobs = subprocess.run("dpfed jobs --json", shell=True, cwd=work, env=analyst,
                              capture_output=True, text=True, timeout=60)
        job_id = json.loads(jobs.stdout)[0]["job_id"]
        assert ledger.returncode == 0 and f"{job_id}/pca" in ledger.stdout
        events = [json.loads(line) for line in (work / "site-b.log").read_text().splitlines()]
        assert any(e.get("outcome") == "charged" and e.get("site") == "hospital-b"
                   for e in events)
    finally:
        stop_processes(procs)
    assert "Ctrl-C" in doc
