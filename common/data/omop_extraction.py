"""A feature extraction over an OMOP CDM warehouse, declared in the federation's schema.

The schema's ``[omop]`` table says how every column is computed from the CDM tables, one row
per person of a cohort; concept ids are named here, so every site extracts the same features::

    [omop]
    # One row per person: person_id and index_date. Default: everyone with an observation
    # period, at the end of their last one. {cdm} is each site's CDM schema.
    cohort = '''SELECT person_id, MAX(observation_period_end_date) AS index_date
                FROM {cdm}.observation_period GROUP BY person_id'''

    [omop.columns.age]
    table = "person"
    field = "age"                 # age | year_of_birth | gender | race | ethnicity

    [omop.columns.hba1c]
    table = "measurement"
    concept_ids = [3004410]
    value = "last"                # last | first | mean | min | max | count
    days_before = 365             # optional window: events in [index - 365 days, index]

Sources and values: ``cohort`` (``index_date``); ``person``; ``observation_period``
(``days_observed``: days from the start of the period holding the index date);
``condition_occurrence`` and ``drug_exposure`` (``any``, ``count``, ``days_since_first``,
``first_date``); ``measurement`` (``last``, ``first``, ``mean``, ``min``, ``max`` of
``value_as_number``, ``count``); ``observation`` (the measurement values, ``any``,
``last_concept`` = ``value_as_concept_id`` of the latest record). Events count up to the index
date. A person without a measurement has it *missing* (give the column a ``missing`` mode);
without a condition, ``any`` and ``count`` are 0. Concept-valued fields (gender, race, ...) are
the concept ids as text: a nominal column's categories are concept ids, ``other = true`` catches
the rest. :func:`extraction_query` writes one read-only ``WITH ... SELECT`` that PostgreSQL and
DuckDB both run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dpfed.common.errors import SchemaError

DEFAULT_COHORT = ("SELECT person_id, MAX(observation_period_end_date) AS index_date "
                  "FROM {cdm}.observation_period GROUP BY person_id")
#: Per source table: (concept column, date column, row id column) of the CDM (v5.4).
EVENT_TABLES: dict[str, tuple[str, str, str]] = {
    "condition_occurrence": ("condition_concept_id", "condition_start_date",
                             "condition_occurrence_id"),
    "drug_exposure": ("drug_concept_id", "drug_exposure_start_date", "drug_exposure_id"),
    "measurement": ("measurement_concept_id", "measurement_date", "measurement_id"),
    "observation": ("observation_concept_id", "observation_date", "observation_id"),
}
PERSON_FIELDS: dict[str, str] = {
    "age": "EXTRACT(YEAR FROM c.index_date) - p.year_of_birth",
    "year_of_birth": "p.year_of_birth",
    "gender": "CAST(p.gender_concept_id AS VARCHAR)",
    "race": "CAST(p.race_concept_id AS VARCHAR)",
    "ethnicity": "CAST(p.ethnicity_concept_id AS VARCHAR)",
}
_EVENT_VALUES = ("any", "count", "days_since_first", "first_date")
_NUMBER_VALUES = ("last", "first", "mean", "min", "max", "count")
VALUES: dict[str, tuple[str, ...]] = {
    "condition_occurrence": _EVENT_VALUES,
    "drug_exposure": _EVENT_VALUES,
    "measurement": _NUMBER_VALUES,
    "observation": (*_NUMBER_VALUES, "any", "last_concept"),
}
_KEYS = {"table", "field", "concept_ids", "value", "days_before"}
_SQL_AGGREGATES = {"mean": "AVG", "min": "MIN", "max": "MAX"}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class OmopFeature:
    """How one column is computed: a CDM source table and what to take from it."""

    table: str
    field: str | None = None
    concept_ids: tuple[int, ...] = ()
    value: str | None = None
    days_before: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return the feature as plain data (keys that are unset are left out)."""
        out: dict[str, Any] = {"table": self.table}
        if self.field is not None:
            out["field"] = self.field
        if self.concept_ids:
            out["concept_ids"] = list(self.concept_ids)
        if self.value is not None:
            out["value"] = self.value
        if self.days_before is not None:
            out["days_before"] = self.days_before
        return out


@dataclass(frozen=True)
class OmopExtraction:
    """The ``[omop]`` table of a schema: a cohort and one feature per column."""

    cohort: str
    features: tuple[tuple[str, OmopFeature], ...]

    def to_dict(self) -> dict[str, Any]:
        """Return the extraction as plain data (the inverse of :func:`parse_extraction`)."""
        out: dict[str, Any] = {"columns": {name: f.to_dict() for name, f in self.features}}
        if self.cohort != DEFAULT_COHORT:
            out["cohort"] = self.cohort
        return out


def parse_extraction(raw: Any, columns: dict[str, str], source: str) -> OmopExtraction:
    """Validate the ``[omop]`` table against the schema's columns (name -> type).

    Raises
    ------
    SchemaError
        Naming ``omop.columns.<name>`` and the key, for any unknown table, field, value or
        key, a column without a feature or a feature without a column.
    """
    where = f"{source}: [omop]"
    if not isinstance(raw, dict):
        raise SchemaError(f"{where} must be a table")
    unknown = set(raw) - {"cohort", "columns"}
    if unknown:
        raise SchemaError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: cohort, columns")
    cohort = raw.get("cohort", DEFAULT_COHORT)
    if not isinstance(cohort, str) or not re.match(r"\s*(SELECT|WITH)\b", cohort, re.I):
        raise SchemaError(f"{where}: 'cohort' must be one SELECT or WITH statement returning "
                          "person_id and index_date")
    table = raw.get("columns")
    if not isinstance(table, dict) or not table:
        raise SchemaError(f"{where}: needs [omop.columns.<name>] for every schema column")
    missing = [n for n in columns if n not in table]
    extra = sorted(set(table) - set(columns))
    if missing or extra:
        raise SchemaError(f"{where}: every schema column needs exactly one feature; without "
                          f"one: {missing}; not schema columns: {extra}")
    features = tuple((name, _parse_feature(table[name], columns[name],
                                           f"{source}: [omop.columns.{name}]"))
                     for name in columns)
    return OmopExtraction(cohort, features)


def _parse_feature(raw: Any, ctype: str, where: str) -> OmopFeature:
    if not isinstance(raw, dict):
        raise SchemaError(f"{where} must be a table")
    unknown = set(raw) - _KEYS
    if unknown:
        raise SchemaError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_KEYS)}")
    table = raw.get("table")
    known = ("cohort", "person", "observation_period", *EVENT_TABLES)
    if table not in known:
        raise SchemaError(f"{where}: 'table' must be one of {', '.join(known)}, got {table!r}")
    fields = {"cohort": ("index_date",), "person": tuple(PERSON_FIELDS),
              "observation_period": ("days_observed",)}
    if table in fields:
        field = raw.get("field")
        if field not in fields[table]:
            raise SchemaError(f"{where}: 'field' of {table} must be one of "
                              f"{', '.join(fields[table])}, got {field!r}")
        if set(raw) - {"table", "field"}:
            raise SchemaError(f"{where}: a {table} feature takes only 'field'")
        _check_type(where, ctype, field in ("index_date",), field in ("gender", "race",
                                                                     "ethnicity"))
        return OmopFeature(table, field=field)
    ids = raw.get("concept_ids")
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise SchemaError(f"{where}: 'concept_ids' must be a non-empty list of concept ids "
                          f"(integers), got {ids!r}")
    value = raw.get("value")
    if value not in VALUES[table]:
        raise SchemaError(f"{where}: 'value' of {table} must be one of "
                          f"{', '.join(VALUES[table])}, got {value!r}")
    days = raw.get("days_before")
    if days is not None and (isinstance(days, bool) or not isinstance(days, int) or days < 0):
        raise SchemaError(f"{where}: 'days_before' must be a whole number of days >= 0, "
                          f"got {days!r}")
    if "field" in raw:
        raise SchemaError(f"{where}: 'field' applies to person, observation_period and cohort")
    _check_type(where, ctype, value == "first_date", value == "last_concept")
    return OmopFeature(table, concept_ids=tuple(ids), value=value, days_before=days)


def _check_type(where: str, ctype: str, is_date: bool, is_concept: bool) -> None:
    if is_date and ctype not in ("date", "datetime"):
        raise SchemaError(f"{where}: gives a date; the column must be of type date, not {ctype}")
    if not is_date and ctype in ("date", "datetime"):
        raise SchemaError(f"{where}: gives no date; a {ctype} column needs field = "
                          "\"index_date\" or value = \"first_date\"")
    if is_concept and ctype != "nominal":
        raise SchemaError(f"{where}: gives concept ids; the column must be nominal (its "
                          f"categories concept ids), not {ctype}")


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def check_cdm_schema(name: Any) -> str:
    """Validate a site's CDM schema name (a plain identifier, substituted into the SQL)."""
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise SchemaError(f"cdm_schema must be a plain identifier (letters, digits, "
                          f"underscore), got {name!r}")
    return name


def extraction_query(extraction: OmopExtraction, cdm_schema: str) -> str:
    """Return the read-only query: one row per cohort person, one column per feature."""
    cdm = check_cdm_schema(cdm_schema)
    ctes = [f"cohort AS (SELECT person_id, MIN(index_date) AS index_date FROM "
            f"({extraction.cohort.strip().rstrip(';').replace('{cdm}', cdm)}) AS q "
            "GROUP BY person_id)"]
    joins = [f"JOIN {cdm}.person p ON p.person_id = c.person_id"]
    selects: list[str] = []
    if any(f.table == "observation_period" for _, f in extraction.features):
        ctes.append(
            f"op AS (SELECT c.person_id, MIN(o.observation_period_start_date) AS start_date "
            f"FROM cohort c JOIN {cdm}.observation_period o ON o.person_id = c.person_id "
            "AND o.observation_period_start_date <= c.index_date "
            "AND o.observation_period_end_date >= c.index_date GROUP BY c.person_id)")
        joins.append("LEFT JOIN op ON op.person_id = c.person_id")
    for k, (name, f) in enumerate(extraction.features):
        if f.table == "cohort":
            expr = "c.index_date"
        elif f.table == "person":
            expr = PERSON_FIELDS[str(f.field)]
        elif f.table == "observation_period":
            expr = "c.index_date - op.start_date"
        else:
            alias = f"f{k}"
            ctes.append(f"{alias} AS ({_event_cte(f, cdm)})")
            joins.append(f"LEFT JOIN {alias} ON {alias}.person_id = c.person_id")
            expr = _event_value(f, alias)
        selects.append(f"{expr} AS {_quote(name)}")
    return ("WITH " + ",\n".join(ctes) + "\nSELECT " + ",\n  ".join(selects)
            + "\nFROM cohort c\n" + "\n".join(joins) + "\nORDER BY c.person_id")


def _event_cte(f: OmopFeature, cdm: str) -> str:
    concept, date, row_id = EVENT_TABLES[f.table]
    ids = ", ".join(str(i) for i in f.concept_ids)
    where = f"e.{concept} IN ({ids}) AND e.{date} <= c.index_date"
    if f.days_before is not None:
        where += f" AND e.{date} >= c.index_date - {int(f.days_before)}"
    source = f"FROM cohort c JOIN {cdm}.{f.table} e ON e.person_id = c.person_id WHERE {where}"
    if f.value in ("last", "first", "last_concept"):
        column = "value_as_concept_id" if f.value == "last_concept" else "value_as_number"
        order = "ASC" if f.value == "first" else "DESC"
        return (f"SELECT person_id, v FROM (SELECT e.person_id, e.{column} AS v, ROW_NUMBER() "
                f"OVER (PARTITION BY e.person_id ORDER BY e.{date} {order}, e.{row_id} "
                f"{order}) AS rn {source} AND e.{column} IS NOT NULL) AS r WHERE rn = 1")
    if f.value in _SQL_AGGREGATES:
        return (f"SELECT e.person_id, {_SQL_AGGREGATES[f.value]}(e.value_as_number) AS v "
                f"{source} GROUP BY e.person_id")
    if f.value in ("days_since_first", "first_date"):
        return f"SELECT e.person_id, MIN(e.{date}) AS v {source} GROUP BY e.person_id"
    return f"SELECT e.person_id, COUNT(*) AS v {source} GROUP BY e.person_id"


def _event_value(f: OmopFeature, alias: str) -> str:
    if f.value == "any":
        return f"CASE WHEN {alias}.person_id IS NULL THEN 0 ELSE 1 END"
    if f.value == "count":
        return f"COALESCE({alias}.v, 0)"
    if f.value == "days_since_first":
        return f"c.index_date - {alias}.v"
    if f.value == "last_concept":
        return f"CAST({alias}.v AS VARCHAR)"
    return f"{alias}.v"
