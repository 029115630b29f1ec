"""Schemas the tests share (one definition each)."""

from __future__ import annotations

from dpfed.common.data.schema import Schema


def columns(*specs: str) -> Schema:
    """A schema from ``[[columns]]`` bodies, e.g. ``'name = "a"\\ntype = "continuous"...'``."""
    return Schema.from_toml("\n".join(f"[[columns]]\n{spec}" for spec in specs))


AGE = 'name = "age"\ntype = "continuous"\nmin = 0\nmax = 100'
BMI = 'name = "bmi"\ntype = "continuous"\nmin = 10\nmax = 60'
WARD = 'name = "ward"\ntype = "nominal"\ncategories = ["general", "icu", "surgery"]'
SEVERITY = 'name = "severity"\ntype = "ordinal"\nlevels = ["mild", "moderate", "severe"]'

#: age (continuous) and ward (3 categories): SVT and query tests.
AGE_WARD = columns(AGE, WARD)
#: age and ward, and severity (3 levels): the matrix mechanism's searches.
AGE_WARD_SEVERITY = columns(AGE, WARD, SEVERITY)
#: Two continuous columns: runner and secure-aggregation tests.
AGE_BMI = columns(AGE, BMI)
#: Two continuous columns and an ordinal one (the sensitivity searches).
CONT_ORD = columns('name = "a"\ntype = "continuous"\nmin = -10\nmax = 10',
                   'name = "b"\ntype = "continuous"\nmin = 0\nmax = 4',
                   'name = "lvl"\ntype = "ordinal"\nlevels = ["x", "y", "z"]')
#: CONT_ORD and a nominal column of 3 categories: every column type.
MIXED = columns('name = "a"\ntype = "continuous"\nmin = -10\nmax = 10',
                'name = "b"\ntype = "continuous"\nmin = 0\nmax = 4',
                'name = "lvl"\ntype = "ordinal"\nlevels = ["x", "y", "z"]',
                'name = "cat"\ntype = "nominal"\ncategories = ["p", "q", "r"]')
#: Two continuous columns, an ordinal one of 4 levels and a nominal one: synthesis tests.
SYNTH = columns(AGE, 'name = "lab"\ntype = "continuous"\nmin = -5\nmax = 5',
                'name = "stage"\ntype = "ordinal"\nlevels = ["I", "II", "III", "IV"]',
                'name = "ward"\ntype = "nominal"\ncategories = ["a", "b", "c"]')


def continuous(n: int) -> Schema:
    """``n`` continuous columns ``c0 .. c{n-1}`` in [0, 1]."""
    return columns(*(f'name = "c{i}"\ntype = "continuous"\nmin = 0\nmax = 1' for i in range(n)))


def row_policy_schema(date_missing: str) -> Schema:
    """A schema each row-policy outcome can reach: a bounded column, a column with missing
    values kept, a nominal with ``other``, and a date whose ``missing`` mode the caller picks."""
    return columns('name = "a"\ntype = "continuous"\nmin = -5\nmax = 5',
                   'name = "b"\ntype = "continuous"\nmin = 0\nmax = 1\nmissing = "category"',
                   'name = "w"\ntype = "nominal"\ncategories = ["x", "y"]\n'
                   'missing = "category"\nother = true',
                   'name = "d"\ntype = "date"\nmin = 2020-01-01\nmax = 2020-12-31\n'
                   f'missing = "{date_missing}"')
