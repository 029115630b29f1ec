"""``dpfed simulate --data ... --schema ...`` on sites with missing values, dates and ``other``.

Real processes over gRPC + mTLS: every site keeps every row (``missing = "category"``), the
DP-PCA result has the missing indicators as features, and the synthesis job on the same
tables generates missing values at the real rates and real dates in the date column.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dpfed.aggregator.pca_result import PCAResult

SCHEMA = """
[[columns]]
name = "age"
type = "continuous"
min = 18
max = 100
integer = true

[[columns]]
name = "creatinine"
type = "continuous"
min = 0
max = 15
missing = "category"

[[columns]]
name = "stage"
type = "ordinal"
levels = ["I", "II", "III"]
missing = "category"

[[columns]]
name = "ward"
type = "nominal"
categories = ["icu", "surgery", "general"]
missing = "category"
other = true

[[columns]]
name = "admitted"
type = "date"
min = 2015-01-01
max = 2024-12-31
missing = "category"
"""


def write_sites(tmp_path: Path, rows: int = 1500) -> list[Path]:
    rng = np.random.default_rng(11)
    paths = []
    for s in range(3):
        age = rng.integers(18, 100, rows)
        creatinine = np.round(0.6 + 0.01 * age + rng.gamma(2.0, 0.2, rows), 2).astype(object)
        creatinine[rng.random(rows) < 0.1 + 0.1 * s] = ""  # more missing at later sites
        stage = rng.choice(["I", "II", "III", ""], rows, p=[0.4, 0.3, 0.2, 0.1])
        ward = rng.choice(["icu", "surgery", "general", "cafeteria", ""], rows,
                          p=[0.3, 0.3, 0.3, 0.05, 0.05])
        day = pd.Timestamp("2015-01-01") + pd.to_timedelta(rng.integers(0, 3600, rows), "D")
        admitted = day.strftime("%Y-%m-%d").to_numpy().astype(object)
        admitted[rng.random(rows) < 0.05] = ""
        path = tmp_path / f"site_{s + 1}.csv"
        pd.DataFrame({"age": age, "creatinine": creatinine, "stage": stage, "ward": ward,
                      "admitted": admitted}).to_csv(path, index=False)
        paths.append(path)
    return paths


def simulate(tmp_path: Path, paths: list[Path], out: str, *extra: str
             ) -> subprocess.CompletedProcess[str]:
    (tmp_path / "schema.toml").write_text(SCHEMA)
    cmd = [sys.executable, "-m", "dpfed.aggregator.cli", "simulate", "--schema",
           str(tmp_path / "schema.toml"), "--seed", "3", "--out", str(tmp_path / out), *extra]
    for p in paths:
        cmd += ["--data", str(p)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=280)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_pca_keeps_every_row_and_has_missing_indicators(tmp_path: Path) -> None:
    paths = write_sites(tmp_path)
    run = simulate(tmp_path, paths, "pca", "--k", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 sites, 4500 rows" in run.stdout
    result = PCAResult.load(tmp_path / "pca" / "pca.npz")
    names = list(result.feature_names_in_)
    assert names == ["age", "creatinine", "creatinine (missing)", "stage", "stage (missing)",
                     "ward=icu", "ward=surgery", "ward=general", "ward=other", "admitted",
                     "admitted (missing)"]
    # The site logs say what the policy did, and that nothing was dropped.
    log = (tmp_path / "pca" / "logs" / "hospital-3.log").read_text()
    assert "read 1500 rows, kept 1500" in log and "as 'missing'" in log


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_synth_generates_missing_values_at_the_real_rates(tmp_path: Path) -> None:
    paths = write_sites(tmp_path, rows=800)
    run = simulate(tmp_path, paths, "synth", "--job", "synth", "--synth-rows", "10000",
                   "--epsilon", "8")
    assert run.returncode == 0, run.stdout + run.stderr
    synthetic = pd.read_parquet(tmp_path / "synth" / "synth.parquet")
    assert len(synthetic) == 10000 and list(synthetic.columns)[:2] == ["age", "creatinine"]
    # The new job has missing cells: every "category" column's missing rate comes back. At
    # epsilon 8 on 2400 rows the rates' noise is below 0.006 (sd; the 10 000 rows' sampling
    # about 0.004): 0.03 is more than 5 of those.
    real = pd.concat([pd.read_csv(p) for p in paths])
    for name in ("creatinine", "stage", "ward", "admitted"):
        assert abs(synthetic[name].isna().mean() - real[name].isna().mean()) <= 0.03, name
    assert synthetic["age"].isna().sum() == 0
    # The date column holds dates (date32), within the schema's bounds, nulls where missing.
    assert pq.read_schema(tmp_path / "synth" / "synth.parquet").field("admitted").type == (
        pa.date32())
    admitted = pd.to_datetime(synthetic["admitted"]).dropna()
    assert admitted.between("2015-01-01", "2024-12-31").all() and admitted.nunique() > 100
    assert re.search(r"admitted: missing real 0\.0\d+ / synthetic 0\.0\d+, p99 real / "
                     r"synthetic 202\d-\d\d-\d\d / 202\d-\d\d-\d\d \(released 202\d-",
                     run.stdout), run.stdout
    # Where the simulation and the sites compare with real rows, the missing rates show.
    assert "creatinine: missing real 0.2" in run.stdout
    assert "missing rate real / synthetic" in (tmp_path / "synth" / "report.html").read_text()
    site_reports = list((tmp_path / "synth" / "sites").glob("*/evaluations/*/*.html"))
    assert site_reports and "missing rate real / synthetic" in site_reports[0].read_text()
