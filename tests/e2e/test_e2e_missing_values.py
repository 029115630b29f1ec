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


def printed_table(stdout: str, title_start: str) -> tuple[str, list[list[str]]]:
    """Return a table ``dpfed simulate --job profile`` printed: its title and its rows."""
    block = next(b for b in stdout.split("\n\n") if b.strip().startswith(title_start))
    title, *lines = block.strip().splitlines()
    return title, [re.split(r"\s{2,}", line.strip()) for line in lines]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_profile_sets_every_dp_figure_beside_the_truth(tmp_path: Path) -> None:
    paths = write_sites(tmp_path, rows=1500)
    run = simulate(tmp_path, paths, "profile", "--job", "profile", "--epsilon", "8",
                   "--delta", "1e-5")
    assert run.returncode == 0, run.stdout + run.stderr
    real = [pd.read_csv(p, keep_default_na=False, dtype=str) for p in paths]
    pooled = pd.concat(real)
    # Per site, the true policy counts are the exact ones of the real rows.
    title, rows = printed_table(run.stdout, "What each site's row policy did")
    sd = float(re.search(r"noise sd ([0-9.e+-]+) each", title).group(1))  # type: ignore[union-attr]
    assert rows[0] == ["count", "hospital-1 DP", "hospital-1 true", "hospital-2 DP",
                       "hospital-2 true", "hospital-3 DP", "hospital-3 true"]
    counts = {r[0]: [float(v) for v in r[1:]] for r in rows[1:]}
    for s, frame in enumerate(real):
        true_counts = {"dropped: missing": 0, "dropped: invalid": 0,
                       "dropped: out of range": 0, "age: missing": 0,
                       **{f"{c}: missing": int((frame[c] == "").sum())
                          for c in ("creatinine", "stage", "ward", "admitted")},
                       "ward: other": int((frame["ward"] == "cafeteria").sum())}
        assert {k: v[2 * s + 1] for k, v in counts.items()} == true_counts
        for name, value in true_counts.items():  # the DP count: the truth plus N(0, sd^2)
            assert abs(counts[name][2 * s] - value) <= 5 * sd, (name, s)
    # The pooled missing rates: 3 sites' noise over the 4500 rows read (no row dropped), so
    # the DP rate's sd is sqrt(3) sd / 4500 (~0.001); 5 of those, plus the print's rounding.
    _title, rows = printed_table(run.stdout, "Missing rate per column")
    assert rows[0] == ["column", "missing rate", "true"]
    for name, dp, true in rows[1:]:
        assert float(true.rstrip("%")) / 100 == pytest.approx((pooled[name] == "").mean(),
                                                              abs=5e-5), name
        assert abs(float(dp.rstrip("%")) - float(true.rstrip("%"))) / 100 <= (
            5 * np.sqrt(3) * sd / 4500 + 1e-4), name
    # The means of the observed values, dates as dates: within 5 printed sd of the truth
    # (plus 1 for the integer columns, whose DP and true means are both rounded).
    _title, rows = printed_table(run.stdout, "DP mean of the observed values")
    assert rows[0] == ["column", "impute", "mean", "noise sd", "true impute", "true mean"]
    means = {r[0]: r[1:] for r in rows[1:]}
    assert list(means) == ["age", "creatinine", "admitted"]
    for name, (_impute, dp, mean_sd, _true_impute, true) in means.items():
        slack = 0.0 if name == "creatinine" else 1.0
        assert abs(float(dp) - float(true)) <= 5 * float(mean_sd) + slack, name
    observed = pd.to_numeric(pooled["creatinine"].replace("", np.nan)).dropna()
    assert float(means["creatinine"][4]) == pytest.approx(observed.mean(), rel=1e-5)
    assert float(means["age"][4]) == round(pd.to_numeric(pooled["age"]).mean())
    days = pd.to_datetime(pooled["admitted"].replace("", None)).dropna()
    true_day = pd.Timestamp(means["admitted"][3])
    assert abs(true_day - days.mean()) <= pd.Timedelta(days=1)
    assert re.fullmatch(r"20[12]\d-\d\d-\d\d", means["admitted"][0])  # the DP impute: a date
    report = (tmp_path / "profile" / "report.html").read_text()
    assert "hospital-1 true" in report and "true impute" in report and "Budgets" in report
    assert (tmp_path / "profile" / "profile.npz").exists()
