"""``dpfed simulate --omop``: generated CDM warehouses in PostgreSQL and DuckDB."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dpfed.aggregator.local_postgres import start
from dpfed.aggregator.pca_result import PCAResult


def simulate(out: Path, *extra: str, rows: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dpfed.aggregator.cli", "simulate", "--omop",
                           *(["--rows", "1500"] if rows else []), "--seed", "2", "--out",
                           str(out), *extra], capture_output=True, text=True, timeout=400)


@pytest.mark.e2e
@pytest.mark.timeout(450)
@pytest.mark.parametrize("job", ["pca", "synth"])
def test_simulate_omop_runs_the_job_on_three_warehouses(tmp_path: Path, job: str) -> None:
    server, why = start()  # the CI machine has PostgreSQL: the first warehouse must use it
    if server is None:
        pytest.skip(f"no PostgreSQL server could start: {why}")
    server.stop()
    run = simulate(tmp_path / "out", "--job", job,
                   *(["--synth-rows", "3000"] if job == "synth" else []))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "hospital-1: synthetic CDM of 1500 persons in PostgreSQL" in out
    assert "hospital-2: synthetic CDM of 1500 persons in DuckDB" in out
    assert "hospital-3: synthetic CDM of 1500 persons in DuckDB" in out
    run_dir = tmp_path / "out" / "run"
    log = (run_dir / "logs" / "hospital-1.log").read_text()
    assert "OMOP extraction (hospital-1.omop.toml) from postgres query" in log
    assert "kept 1500" in log and "as 'missing'" in log
    if job == "pca":
        result = PCAResult.load(run_dir / "pca.npz")
        assert "hba1c (missing)" in result.feature_names_in_
        assert "3 sites, 4500 rows" in out
    else:
        synthetic = pd.read_parquet(run_dir / "synth.parquet")
        assert len(synthetic) == 3000 and "hba1c" in synthetic.columns


def test_omop_refuses_data_and_other_jobs(tmp_path: Path) -> None:
    for extra, match in ((["--job", "svt"], "--omop does not apply to --job svt"),
                         (["--data", "x.csv", "--schema", "s.toml"], "drop --data")):
        run = simulate(tmp_path / "o", *extra, rows=False)
        assert run.returncode != 0 and match in run.stderr, run.stderr
        assert not (tmp_path / "o").exists()
