"""The counting-query language: validation messages, exact satisfiability, counts vs pandas."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.demo_data import generate_demo
from dpfed.common.data.encoding import encode_table
from dpfed.common.errors import ValidationError
from dpfed.common.queries.query_language import (
    Predicate,
    compile_query_set,
    implies,
    load_query_file,
    parse_domain,
    satisfiable,
)

SCHEMA, FRAMES = generate_demo(1, 3000, 12, seed=3, mixed=True)


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    return FRAMES[0]


def test_schema_has_the_columns_the_tests_use() -> None:
    assert {"age", "ward", "severity"} <= set(SCHEMA.names)


@pytest.mark.parametrize(("entry", "match"), [
    ({"name": "a", "where": {"column": "nope", "op": "<", "value": 1}},
     r"query 'a': unknown column 'nope'; the schema's columns are \['age'"),
    ({"name": "b", "where": {"column": "ward", "in": ["zoo"]}},
     r"query 'b': column 'ward' \(nominal\) has no category 'zoo'; valid: \['general'"),
    ({"name": "c", "where": {"column": "ward", "op": "<", "value": "icu"}},
     "query 'c': column 'ward' is nominal"),
    ({"name": "d", "where": {"column": "age", "op": ">", "value": "old"}},
     "query 'd': column 'age' is continuous: compare it with a number"),
    ({"name": "e", "where": {"all": []}}, "query 'e': 'all' needs a non-empty list"),
    ({"name": "f", "where": {"all": [{"column": "age", "op": "<", "value": 10},
                                    {"column": "age", "op": ">", "value": 20}]}},
     "query 'f': the predicate is contradictory"),
    ({"name": "g", "where": {"column": "severity", "op": "~", "value": "mild"}},
     "op must be one of"),
    ({"name": "h", "where": {"column": "age", "between": [50, 10]}}, "low 50 above high 10"),
    ({"name": "i", "where": {"column": "severity", "in": []}}, "non-empty list"),
    ({"per": "age"}, "continuous column 'age' needs public bins"),
    ({"per": "age", "bins": [10, 20, 30]}, "must cover the schema's range"),
    ({"per": "age", "bins": [0, 50, 40, 110]}, "strictly increasing"),
    ({"cross": ["ward"]}, "'cross' takes a list of 2 or 3 column names"),
    ({"cross": ["ward", "ward"]}, "appears twice"),
    ({"per": "ward", "bins": 3}, "bins apply only to continuous columns"),
    ({"name": "j", "where": {"column": "age", "op": "<", "value": float("nan")}}, "finite"),
    ({"name": "k", "when": {}}, r"unknown key\(s\) \['when'\]"),
])
def test_errors_name_the_query_the_column_and_what_is_valid(entry: dict[str, Any],
                                                            match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        compile_query_set(SCHEMA, [entry])


def test_empty_and_oversized_sets_are_refused() -> None:
    with pytest.raises(ValidationError, match="empty"):
        compile_query_set(SCHEMA, [])
    with pytest.raises(ValidationError, match="more than 10 counts"):
        compile_query_set(SCHEMA, [{"per": "age", "bins": 20}], max_queries=10)
    with pytest.raises(ValidationError, match="unique"):
        compile_query_set(SCHEMA, [{"name": "x"}, {"name": "x"}])
    deep: dict[str, Any] = {"column": "age", "op": "<", "value": 1}
    for _ in range(20):
        deep = {"not": deep}
    with pytest.raises(ValidationError, match="too large"):
        compile_query_set(SCHEMA, [{"name": "deep", "where": deep}])


def _pandas_mask(df: pd.DataFrame, raw: dict[str, Any]) -> pd.Series:
    """Reference evaluation of the analyst format with pandas."""
    if "all" in raw:
        return np.logical_and.reduce([_pandas_mask(df, p) for p in raw["all"]])
    if "any" in raw:
        return np.logical_or.reduce([_pandas_mask(df, p) for p in raw["any"]])
    if "not" in raw:
        return ~_pandas_mask(df, raw["not"])
    col = SCHEMA.column(raw["column"])
    s = df[raw["column"]]
    if col.type == "continuous":
        x = pd.to_numeric(s).astype(float)
        if "between" in raw:
            return (x >= raw["between"][0]) & (x <= raw["between"][1])
        v = raw["value"]
    else:
        levels = list(col.levels if col.type == "ordinal" else col.categories)
        x = s.astype(str).map(levels.index)
        if "in" in raw:
            return x.isin([levels.index(v) for v in raw["in"]])
        if "between" in raw:
            return (x >= levels.index(raw["between"][0])) & (x <= levels.index(raw["between"][1]))
        v = levels.index(raw["value"])
    return {"<": x < v, "<=": x <= v, ">": x > v, ">=": x >= v, "==": x == v,
            "!=": x != v}[raw["op"]]


def test_counts_match_pandas_on_random_predicates(frame: pd.DataFrame) -> None:
    rng = np.random.default_rng(0)
    levels = list(SCHEMA.column("severity").levels)  # type: ignore[union-attr]
    cats = list(SCHEMA.column("ward").categories)  # type: ignore[union-attr]

    def atom() -> dict[str, Any]:
        kind = rng.integers(4)
        if kind == 0:
            return {"column": "age", "op": str(rng.choice(["<", "<=", ">", ">=", "!="])),
                    "value": float(rng.integers(20, 90))}
        if kind == 1:
            return {"column": "severity", "op": str(rng.choice(["<", ">=", "=="])),
                    "value": str(rng.choice(levels))}
        if kind == 2:
            return {"column": "ward", "in": [str(c) for c in rng.choice(cats, 2, False)]}
        lo = float(rng.integers(0, 50))
        return {"column": "bmi", "between": [lo + 10, lo + 30]}

    queries = []
    for i in range(40):
        parts = [atom() for _ in range(int(rng.integers(1, 4)))]
        op = str(rng.choice(["all", "any"]))
        where: dict[str, Any] = {op: parts}
        if rng.random() < 0.3:
            where = {"not": where}
        queries.append({"name": f"q{i}", "where": where})
    encoded, _ = encode_table(SCHEMA, frame)
    ok = []
    for q in queries:  # skip the (rare) contradictory draws, which are refused
        try:
            compile_query_set(SCHEMA, [q])
            ok.append(q)
        except ValidationError as exc:
            assert "contradictory" in str(exc)
    compiled = compile_query_set(SCHEMA, ok)
    counts, rows = compiled.counts([encoded])
    assert rows == len(frame)
    ref = encoded.to_frame()
    expected = [int(_pandas_mask(ref.astype({"severity": str, "ward": str}), q["where"]).sum())
                for q in ok]
    assert counts.tolist() == expected
    # Chunked evaluation equals one pass.
    halves = [encode_table(SCHEMA, frame.iloc[:1000])[0],
              encode_table(SCHEMA, frame.iloc[1000:])[0]]
    assert compiled.counts(halves)[0].tolist() == expected


def test_shorthands_are_histograms_and_roundtrip_canonically(frame: pd.DataFrame) -> None:
    encoded, _ = encode_table(SCHEMA, frame)
    raw = [{"per": "ward"}, {"per": "age", "bins": [0, 18, 65, 110]},
           {"cross": ["ward", "severity"], "where": {"column": "age", "op": ">=", "value": 60}},
           {"cross": ["ward", "severity", "age"], "bins": {"age": 3}}]
    q = compile_query_set(SCHEMA, raw)
    counts, _ = q.counts([encoded])
    df = encoded.to_frame()
    n_ward = len(SCHEMA.column("ward").categories)  # type: ignore[union-attr]
    assert counts[:n_ward].tolist() == df["ward"].value_counts(sort=False).tolist()
    age = df["age"].to_numpy()
    assert counts[n_ward:n_ward + 3].tolist() == [
        int(((age >= 0) & (age < 18)).sum()), int(((age >= 18) & (age < 65)).sum()),
        int(((age >= 65) & (age <= 110)).sum())]
    old = df[df["age"] >= 60]
    table = pd.crosstab(old["ward"], old["severity"], dropna=False)
    start = n_ward + 3
    n_sev = len(SCHEMA.column("severity").levels)  # type: ignore[union-attr]
    assert counts[start:start + n_ward * n_sev].tolist() == table.to_numpy().ravel().tolist()
    assert counts[start + n_ward * n_sev:].sum() == len(df)
    again = compile_query_set(SCHEMA, list(q.canonical), canonical=True)
    assert again.names == q.names and again.counts([encoded])[0].tolist() == counts.tolist()
    assert "per ward: ward=icu" in q.names


def test_canonical_form_rejects_hostile_values() -> None:
    for entry in ({"name": "x", "where": {"column": "ward", "in_codes": [99]}},
                  {"name": "x", "where": {"column": "age", "op": "<", "value": 1e400}},
                  {"name": "x", "where": {"column": "ward", "op": "<", "value": 1}},
                  {"name": "x", "domain": {"columns": ["age"], "bins": {"age": [5, 1]}}}):
        with pytest.raises(ValidationError):
            compile_query_set(SCHEMA, [entry], canonical=True)


def test_satisfiability_is_exact_on_the_grid() -> None:
    age_lt = Predicate("cmp", "age", "<", 30.0)
    age_ge = Predicate("cmp", "age", ">=", 30.0)
    assert satisfiable(SCHEMA, Predicate("all", children=(age_lt, age_ge))) is False
    assert satisfiable(SCHEMA, Predicate("any", children=(age_lt, age_ge))) is True
    # Outside the schema's bounds: age <= -1 has no schema-valid row.
    assert satisfiable(SCHEMA, Predicate("cmp", "age", "<=", -1.0)) is False
    assert satisfiable(SCHEMA, Predicate("cmp", "age", "<=", 0.0)) is True
    assert implies(SCHEMA, Predicate("cmp", "age", ">=", 80.0), age_ge)
    assert not implies(SCHEMA, age_ge, Predicate("cmp", "age", ">=", 80.0))


def test_one_directional_only_for_chains() -> None:
    chain = compile_query_set(SCHEMA, [
        {"name": f"age>={v}", "where": {"column": "age", "op": ">=", "value": v}}
        for v in (80, 60, 40)])
    assert chain.one_directional(SCHEMA)
    assert not compile_query_set(SCHEMA, [{"per": "ward"}]).one_directional(SCHEMA)
    # Brute force on a grid: no replacement x -> y moves two chained counts apart.
    ages = np.array([0.0, 39.0, 40.0, 59.0, 60.0, 79.0, 80.0, 110.0])
    member = np.array([[a >= v for v in (80, 60, 40)] for a in ages], dtype=int)
    for x, y in itertools.product(range(len(ages)), repeat=2):
        d = member[y] - member[x]
        assert not (d.max() > 0 and d.min() < 0)


def test_domains(tmp_path: Any) -> None:
    d = parse_domain(SCHEMA, ["ward", "age"], {"age": 4})
    assert d.shape == (5, 4) and d.n_cells == 20 and d.cell_names()[0].startswith("ward=general")
    with pytest.raises(ValidationError, match="at most 3 columns"):
        parse_domain(SCHEMA, ["ward", "severity", "age", "bmi"], {"age": 2, "bmi": 2})
    with pytest.raises(ValidationError, match="at most 100 are allowed"):
        parse_domain(SCHEMA, ["age"], {"age": 200}, max_cells=100)
    with pytest.raises(ValidationError, match="bins given for column"):
        parse_domain(SCHEMA, ["ward"], {"age": 3})
    f = tmp_path / "q.toml"
    f.write_text('[[queries]]\nper = "ward"\n')
    assert compile_query_set(SCHEMA, load_query_file(f)).n_queries == 5
    bad = tmp_path / "q.json"
    bad.write_text("{")
    with pytest.raises(ValidationError, match="not valid JSON"):
        load_query_file(bad)
