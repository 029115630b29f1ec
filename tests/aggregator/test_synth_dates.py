"""Date and datetime columns in the synthetic table: DataFrame, Parquet, CSV and the reports.

A model fitted on rows with a date column (missing values kept as a category) and an hourly
datetime column: every output holds dates within the schema's bounds at the column's
resolution, missing dates as NaT / null / an empty CSV field, the three outputs agree, and
the reports that show values show dates.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dpfed.aggregator.synth_model import SynthModel
from dpfed.aggregator.synth_report import synth_report
from dpfed.common.data.encoding import encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.evaluation.site_report import evaluate_at_site
from dpfed.common.synth.fidelity import column_fidelity
from tests.aggregator.test_synth_model import build

SCHEMA = Schema.from_toml("""
[[columns]]
name = "los"
type = "continuous"
min = 0
max = 60
[[columns]]
name = "admitted"
type = "date"
min = 2018-01-01
max = 2023-12-31
missing = "category"
[[columns]]
name = "seen"
type = "datetime"
min = 2020-01-01T00:00:00
max = 2020-03-01T00:00:00
resolution = "hour"
[[columns]]
name = "ward"
type = "nominal"
categories = ["icu", "general"]
""")
ADMITTED = (pd.Timestamp("2018-01-01"), pd.Timestamp("2023-12-31"))
SEEN = (pd.Timestamp("2020-01-01"), pd.Timestamp("2020-03-01"))
ROWS = 3000


def real_frame(seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    los = np.clip(rng.gamma(2.0, 4.0, ROWS), 0, 60)
    admitted = ADMITTED[0] + pd.to_timedelta(
        np.minimum(rng.integers(0, 2191, ROWS) + 30 * los.astype(int), 2190), "D")
    seen = SEEN[0] + pd.to_timedelta(rng.integers(0, 60 * 24 * 60, ROWS), "min")  # minutes
    frame = pd.DataFrame({"los": los, "admitted": admitted, "seen": seen,
                          "ward": rng.choice(["icu", "general"], ROWS)})
    frame.loc[rng.random(ROWS) < 0.2, "admitted"] = pd.NaT
    return frame


@pytest.fixture(scope="module")
def model() -> SynthModel:
    return build(schema=SCHEMA, frame=real_frame())


def check_dates(admitted: pd.Series, seen: pd.Series) -> None:
    """Dates within the bounds, whole days / hours, some admitted dates missing."""
    assert str(admitted.dtype).startswith("datetime64") and str(seen.dtype).startswith(
        "datetime64")
    present = admitted.dropna()
    assert 0.05 < admitted.isna().mean() < 0.4 and seen.notna().all()
    assert present.between(*ADMITTED).all() and seen.between(*SEEN).all()
    assert (present == present.dt.normalize()).all()
    assert (seen == seen.dt.floor("h")).all()
    assert present.nunique() > 100 and seen.nunique() > 100  # not collapsed to a few values


def test_sample_parquet_and_csv_hold_dates_within_bounds(model: SynthModel,
                                                         tmp_path: Path) -> None:
    frame = model.sample(4000, rng=np.random.default_rng(1))
    check_dates(frame["admitted"], frame["seen"])
    model.write(tmp_path / "s.parquet", 4000, rng=np.random.default_rng(1))
    table = pq.read_table(tmp_path / "s.parquet")
    assert table.schema.field("admitted").type == pa.date32()
    assert pa.types.is_timestamp(table.schema.field("seen").type)
    assert table.schema.field("seen").type.tz is None  # UTC, as the DataFrame holds it
    back = table.to_pandas()
    check_dates(pd.to_datetime(back["admitted"]), back["seen"])
    # The file holds the same rows as the DataFrame drawn with the same generator.
    pd.testing.assert_series_equal(pd.to_datetime(back["admitted"]).astype("datetime64[s]"),
                                   frame["admitted"].astype("datetime64[s]"))
    pd.testing.assert_series_equal(back["seen"].astype("datetime64[s]"),
                                   frame["seen"].astype("datetime64[s]"))
    model.write(tmp_path / "s.csv", 4000, rng=np.random.default_rng(1))
    text = pd.read_csv(tmp_path / "s.csv", dtype=str, keep_default_na=False)
    assert text["admitted"].str.fullmatch(r"\d{4}-\d{2}-\d{2}|").all()
    assert (text["admitted"] == "").mean() == pytest.approx(frame["admitted"].isna().mean())
    assert text["seen"].str.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}:00:00").all()
    assert (pd.to_datetime(text["seen"]) == frame["seen"]).all()


def test_reports_show_dates_and_compare_like_with_like(model: SynthModel,
                                                       tmp_path: Path) -> None:
    real, _ = encode_table(SCHEMA, real_frame())
    sample = model.sample(3000, rng=np.random.default_rng(2))
    # Like with like: the real rows' dates through a DataFrame encode to the same units.
    same = column_fidelity(SCHEMA, real, encode_table(SCHEMA, real.to_frame())[0])
    assert [f.tvd for f in same] == [0.0] * len(SCHEMA.columns)
    figures: dict[str, object] = {}
    html = synth_report(model, sample, real=real, figures=figures)
    row = re.findall(r"<tr><td>admitted</td>.*?</tr>", html, re.S)[-1]  # the real-rows table
    assert re.search(r"20(1[89]|2[0-3])-\d\d-\d\d / 20(1[89]|2[0-3])-\d\d-\d\d", row), row
    assert re.search(r"\d days / [\d.]+ days", row), row
    seen = figures["columns"]["seen"]  # type: ignore[index]
    assert re.fullmatch(r"2020-0[1-3]-\d\dT\d\d:00:00 / 2020-0[1-3]-\d\dT\d\d:00:00",
                        seen["p99_text"]), seen
    assert re.fullmatch(r"2020-0[1-3]-\d\dT\d\d:00:00 \[.*\]", seen["p99_band"]), seen
    path, _ = evaluate_at_site(SCHEMA, real.take(np.arange(2000)),
                               real.take(np.arange(2000, ROWS)), sample, site_id="h1",
                               out_dir=tmp_path)
    local = re.findall(r"<tr><td>seen</td>.*?</tr>", path.read_text(), re.S)[-1]
    assert re.search(r"2020-0[1-3]-\d\dT\d\d:00:00 / 2020-0", local), local
    assert re.search(r"\d hours / [\d.]+ hours", local), local
