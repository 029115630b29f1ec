"""Schema parsing, validation messages, and table encoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from dpfed.common.data.encoding import RowPolicy, encode_table
from dpfed.common.data.schema import ContinuousColumn, NominalColumn, OrdinalColumn, Schema
from dpfed.common.errors import DataError, SchemaError

DROP = RowPolicy(missing="drop")

MIXED = """
name = "demo"
[[columns]]
name = "age"
type = "continuous"
min = 0
max = 110

[[columns]]
name = "severity"
type = "ordinal"
levels = ["mild", "moderate", "severe"]

[[columns]]
name = "ward"
type = "nominal"
categories = ["cardiology", "oncology", "surgery"]

[[columns]]
name = "stage"
type = "ordinal"
levels = [1, 2, 3, 4]
"""


def test_parse_mixed_schema_and_round_trip(tmp_path: Path) -> None:
    s = Schema.from_toml(MIXED)
    assert s.names == ("age", "severity", "ward", "stage")
    assert isinstance(s.columns[0], ContinuousColumn) and s.columns[0].half_range == 55
    assert isinstance(s.columns[1], OrdinalColumn) and s.columns[1].n_levels == 3
    assert isinstance(s.columns[2], NominalColumn)
    assert s.column("stage").levels == ("1", "2", "3", "4")  # type: ignore[union-attr]
    path = tmp_path / "schema.toml"
    path.write_text(s.to_toml())
    again = Schema.load(path)
    assert again == s and again.digest() == s.digest()
    assert Schema.from_toml(MIXED.replace("110", "111")).digest() != s.digest()


@pytest.mark.parametrize("text, match", [
    ("", "at least one"),
    ("[[columns]]\nname='x'\ntype='continuous'\nmin=0", r"columns\[0\] \('x'\): continuous "
     r"columns need 'max'"),
    ("[[columns]]\nname='x'\ntype='continuous'\nmin=5\nmax=1", "'min' must be < 'max', got min=5"),
    ("[[columns]]\nname='x'\ntype='continuous'\nmin=0\nmax=nan", "finite number"),
    ("[[columns]]\nname='x'\ntype='text'", "'type' must be one of continuous, ordinal, nominal"),
    ("[[columns]]\nname='x'\ntype='ordinal'\nlevels=['a']", "at least 2"),
    ("[[columns]]\nname='x'\ntype='nominal'\ncategories=['a','a']", "duplicates"),
    ("[[columns]]\nname='x'\ntype='continuous'\nmin=0\nmax=1\nmean=3",
     r"unknown key\(s\) \['mean'\]"),
    ("[[columns]]\nname='x'\ntype='continuous'\nmin=0\nmax=1\n[[columns]]\nname='x'\n"
     "type='continuous'\nmin=0\nmax=1", "unique"),
    ("colums = 1", "unknown top-level"),
    ("[[columns]]\nname='x'\ntype='continuous'\nmin=0\nmax=1\ninteger='yes'",
     "'integer' must be true or false, got 'yes'"),
    ("[[columns]]\nname='x'\ntype='continuous'\nmin=0.5\nmax=10\ninteger=true",
     "integer column needs whole-number 'min' and 'max', got min=0.5"),
    ("[[columns]\n", "not valid TOML"),
])
def test_schema_errors_name_the_problem(text: str, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        Schema.from_toml(text)


def test_integer_flag_round_trips_and_leaves_other_digests_alone(tmp_path: Path) -> None:
    plain = Schema.from_toml(MIXED)
    flagged = Schema.from_toml(MIXED.replace("max = 110\n", "max = 110\ninteger = true\n"))
    age = flagged.column("age")
    assert isinstance(age, ContinuousColumn) and age.integer
    assert not plain.column("age").integer  # type: ignore[union-attr]
    # Written only when set: a schema without it keeps the digest it had before the flag.
    assert "integer" not in plain.to_toml() and "integer = true" in flagged.to_toml()
    assert Schema.from_toml(flagged.to_toml()) == flagged
    assert flagged.digest() != plain.digest()
    assert plain.digest() == Schema.from_toml(MIXED.replace("max = 110\n",
                                                            "max = 110\ninteger = false\n")
                                              ).digest()
    with pytest.raises(SchemaError, match="whole-number bounds"):
        ContinuousColumn("x", 0.0, 2.5, integer=True)


def test_missing_schema_file(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="schema file not found"):
        Schema.load(tmp_path / "nope.toml")


def test_encoding_policies_count_and_never_leak_values() -> None:
    s = Schema.from_toml(MIXED)
    df = pd.DataFrame({
        "age": [10, 200, None, "secret-value", 50, -3],
        "severity": ["mild", "severe", "mild", "moderate", "unknown", "moderate"],
        "ward": ["oncology", "surgery", "cardiology", "oncology", "surgery", "surgery"],
        "stage": [1, 2, 3, 4, 2, 2.0],
    })
    enc, report = encode_table(s, df, policy=DROP)
    assert enc.n_rows == 3 and report.rows_read == 6
    assert report.dropped_missing == 1 and report.dropped_invalid == 2
    assert report.values_clipped == 2
    np.testing.assert_array_equal(enc.columns["age"], [10, 110, 0])
    np.testing.assert_array_equal(enc.columns["stage"], [0, 1, 1])
    frame = enc.to_frame()
    assert list(frame["severity"]) == ["mild", "severe", "moderate"]
    assert frame["severity"].cat.ordered and not frame["ward"].cat.ordered
    with pytest.raises(DataError) as info:
        encode_table(s, df, policy=RowPolicy(missing="drop", invalid="error"), source="site.csv")
    assert "site.csv: data row 4 has invalid values" in str(info.value)
    assert "secret-value" not in str(info.value)
    with pytest.raises(DataError, match="out of range"):
        encode_table(s, df.iloc[[0, 1]], policy=RowPolicy(out_of_range="error"))
    dropped, rep = encode_table(s, df, policy=RowPolicy(missing="drop", out_of_range="drop"))
    assert dropped.n_rows == 1 and rep.dropped_out_of_range == 2


def test_encoding_arrow_text_and_missing_column() -> None:
    s = Schema.from_toml(MIXED)
    t = pa.table({"age": ["1.5", " 2 ", "NA", "1e1"], "severity": ["mild"] * 4,
                  "ward": ["surgery"] * 4, "stage": ["1", "2", "3", "4"]})
    enc, rep = encode_table(s, t, policy=DROP)
    np.testing.assert_array_equal(enc.columns["age"], [1.5, 2.0, 10.0])
    assert rep.dropped_missing == 1
    with pytest.raises(DataError, match=r"missing column\(s\) \['ward'\]"):
        encode_table(s, t.drop_columns(["ward"]))
