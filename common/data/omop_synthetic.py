"""A realistic synthetic OMOP CDM warehouse, for the demo (``dpfed simulate --omop``) and tests.

Nothing here is real: persons, visits and values come from a seeded generative model with the
shapes of real CDM tables -- many condition, measurement and drug rows per person with skewed
(negative binomial) counts, chronic conditions that drive labs and prescriptions, labs that are
simply never measured for many persons (a *missing* feature), repeated observation periods,
concept-valued observations (smoking status), and a case mix that differs between sites.

:func:`generate_cdm` returns the six tables (person, observation_period,
condition_occurrence, measurement, drug_exposure, observation) as Arrow tables with the CDM
v5.4 column names and types; :func:`write_duckdb` and :func:`write_postgres` load them into a
``cdm`` schema. :data:`DEMO_SCHEMA` is a federation schema whose ``[omop]`` table extracts one
row per person from them.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dpfed.common.data.omop_extraction import check_cdm_schema
from dpfed.common.validation import check_int

# Standard concept ids (OMOP vocabulary).
MALE, FEMALE = 8507, 8532
RACES = (8527, 8516, 8515, 0)  # White, Black or African American, Asian, unknown
T2D, HYPERTENSION, HYPERLIPIDEMIA, COPD, MI = 201826, 316866, 432867, 255573, 4329847
HBA1C, SYSTOLIC, BMI, CREATININE, LDL = 3004410, 3004249, 3038553, 3016723, 3028437
METFORMIN, LISINOPRIL, ATORVASTATIN = 1503297, 1308216, 1545958
SMOKING = 43054909  # tobacco smoking status
NEVER, FORMER, CURRENT = 45879404, 45883458, 45881517
EHR = 32817  # type concept: EHR
#: Background conditions: a pool of frequent concept ids, drawn with Zipf-like weights.
_BACKGROUND = (77670, 80180, 81151, 134057, 140673, 194133, 198803, 200219, 254761, 257012,
               260139, 312437, 313217, 317576, 318736, 372328, 378253, 381591, 433736, 436659,
               437663, 438409, 439777, 440383, 443392, 4112343, 4280726, 4329041, 4344040,
               40481087)
_END = dt.date(2024, 12, 31)
_EPOCH = dt.date(1970, 1, 1)

DEMO_SCHEMA = """name = "omop-demo"

[[columns]]
name = "age"
type = "continuous"
min = 18
max = 110
integer = true

[[columns]]
name = "gender"
type = "nominal"
categories = ["8507", "8532"]
other = true

[[columns]]
name = "race"
type = "nominal"
categories = ["8527", "8516", "8515"]
other = true

[[columns]]
name = "index_date"
type = "date"
min = 2010-01-01
max = 2024-12-31

[[columns]]
name = "observed_days"
type = "continuous"
min = 0
max = 6000
integer = true

[[columns]]
name = "type2_diabetes"
type = "nominal"
categories = [0, 1]

[[columns]]
name = "days_since_diabetes"
type = "continuous"
min = 0
max = 6000
integer = true
missing = "category"

[[columns]]
name = "hypertension"
type = "nominal"
categories = [0, 1]

[[columns]]
name = "chronic_diagnoses"
type = "continuous"
min = 0
max = 200
integer = true

[[columns]]
name = "hba1c"
type = "continuous"
min = 3
max = 15
missing = "category"

[[columns]]
name = "systolic_bp"
type = "continuous"
min = 70
max = 230
missing = "category"

[[columns]]
name = "bmi"
type = "continuous"
min = 12
max = 70
missing = "category"

[[columns]]
name = "creatinine"
type = "continuous"
min = 0.2
max = 15
missing = "category"

[[columns]]
name = "metformin"
type = "nominal"
categories = [0, 1]

[[columns]]
name = "statin_prescriptions"
type = "continuous"
min = 0
max = 100
integer = true

[[columns]]
name = "smoking"
type = "nominal"
categories = ["45879404", "45883458", "45881517"]
missing = "category"
other = true

[omop.columns.age]
table = "person"
field = "age"

[omop.columns.gender]
table = "person"
field = "gender"

[omop.columns.race]
table = "person"
field = "race"

[omop.columns.index_date]
table = "cohort"
field = "index_date"

[omop.columns.observed_days]
table = "observation_period"
field = "days_observed"

[omop.columns.type2_diabetes]
table = "condition_occurrence"
concept_ids = [201826]
value = "any"

[omop.columns.days_since_diabetes]
table = "condition_occurrence"
concept_ids = [201826]
value = "days_since_first"

[omop.columns.hypertension]
table = "condition_occurrence"
concept_ids = [316866]
value = "any"

[omop.columns.chronic_diagnoses]
table = "condition_occurrence"
concept_ids = [201826, 316866, 432867, 255573, 4329847]
value = "count"

[omop.columns.hba1c]
table = "measurement"
concept_ids = [3004410]
value = "last"
days_before = 730

[omop.columns.systolic_bp]
table = "measurement"
concept_ids = [3004249]
value = "mean"
days_before = 365

[omop.columns.bmi]
table = "measurement"
concept_ids = [3038553]
value = "last"

[omop.columns.creatinine]
table = "measurement"
concept_ids = [3016723]
value = "max"
days_before = 365

[omop.columns.metformin]
table = "drug_exposure"
concept_ids = [1503297]
value = "any"

[omop.columns.statin_prescriptions]
table = "drug_exposure"
concept_ids = [1545958]
value = "count"

[omop.columns.smoking]
table = "observation"
concept_ids = [43054909]
value = "last_concept"
"""


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.asarray(1.0 / (1.0 + np.exp(-x)))


def _counts(rng: np.random.Generator, mean: np.ndarray | float, dispersion: float,
            n: int) -> np.ndarray:
    """Negative binomial counts (skewed: many persons with few rows, a few with very many)."""
    m = np.broadcast_to(np.asarray(mean, dtype=float), (n,))
    return rng.negative_binomial(dispersion, dispersion / (dispersion + m))


class _Rows:
    """Columns of one event table, appended person by person in vectorised blocks."""

    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray]] = {}

    def add(self, **columns: np.ndarray) -> None:
        for name, values in columns.items():
            self.parts.setdefault(name, []).append(np.asarray(values))

    def table(self, types: dict[str, pa.DataType]) -> pa.Table:
        arrays = {}
        for name, dtype in types.items():
            values = np.concatenate(self.parts[name]) if name in self.parts else np.array([])
            if pa.types.is_date(dtype):
                arrays[name] = pa.array(values.astype("datetime64[D]"), dtype)
            elif pa.types.is_floating(dtype):
                arrays[name] = pa.array(values.astype(float), dtype,
                                        from_pandas=True)  # NaN -> null
            else:
                arrays[name] = pa.array(values.astype(np.int64), dtype)
        return pa.table(arrays)


def _events(rng: np.random.Generator, person: np.ndarray, counts: np.ndarray,
            start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``counts[i]`` event dates per person, uniform within [start_i, end_i] (days)."""
    who = np.repeat(np.arange(len(person)), counts)
    span = (end - start)[who]
    day = start[who] + np.floor(rng.random(who.size) * (span + 1)).astype(np.int64)
    return person[who], day


def generate_cdm(n_persons: int, *, seed: int, site: int = 0) -> dict[str, pa.Table]:
    """Return the six CDM tables of one synthetic site (``site`` shifts its case mix)."""
    n = check_int(n_persons, "n_persons", minimum=1)
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(site,)))
    person_id = np.arange(1, n + 1, dtype=np.int64) + 1_000_000 * site
    shift = 0.25 * site  # later sites: sicker patients
    year_of_birth = np.clip(np.round(rng.normal(1958 - 4 * site, 16, n)), 1915, 2005)
    gender = np.where(rng.random(n) < 0.48, MALE, FEMALE)
    race = rng.choice(RACES, n, p=[0.7, 0.15, 0.08, 0.07])
    risk = rng.normal(shift, 1.0, n)
    end_day = (_END - _EPOCH).days
    start = rng.integers((dt.date(2010, 1, 1) - _EPOCH).days, end_day - 365, n)
    end = np.minimum(start + np.round(rng.exponential(5 * 365, n)).astype(np.int64) + 90,
                     end_day)
    age = 2017 - year_of_birth
    people = pa.table({
        "person_id": pa.array(person_id), "gender_concept_id": pa.array(gender),
        "year_of_birth": pa.array(year_of_birth.astype(np.int64)),
        "month_of_birth": pa.array(rng.integers(1, 13, n)),
        "day_of_birth": pa.array(rng.integers(1, 29, n)),
        "race_concept_id": pa.array(race), "ethnicity_concept_id": pa.array(np.zeros(n, int)),
        "gender_source_value": pa.array(np.where(gender == MALE, "M", "F")),
    })
    # Observation periods: one per person, a second (after a gap) for some.
    periods = _Rows()
    second = rng.random(n) < 0.15
    gap_start = np.minimum(end + rng.integers(30, 400, n), end_day)
    periods.add(person_id=person_id, observation_period_start_date=start,
                observation_period_end_date=end)
    periods.add(person_id=person_id[second], observation_period_start_date=gap_start[second],
                observation_period_end_date=np.minimum(gap_start[second] + 365, end_day))
    last_end = np.where(second, np.minimum(gap_start + 365, end_day), end)
    chronic = {
        T2D: rng.random(n) < _sigmoid(-2.2 + 0.045 * (age - 55) + 0.8 * risk),
        HYPERTENSION: rng.random(n) < _sigmoid(-1.0 + 0.05 * (age - 55) + 0.5 * risk),
        HYPERLIPIDEMIA: rng.random(n) < _sigmoid(-1.2 + 0.03 * (age - 55) + 0.4 * risk),
        COPD: rng.random(n) < _sigmoid(-3.0 + 0.03 * (age - 55) + 0.3 * risk),
        MI: rng.random(n) < _sigmoid(-4.0 + 0.05 * (age - 55) + 0.6 * risk),
    }
    conditions = _Rows()
    for concept, has in chronic.items():
        k = np.where(has, 1 + _counts(rng, 4.0, 1.5, n), 0)
        who, day = _events(rng, person_id, k, start, last_end)
        conditions.add(person_id=who, condition_concept_id=np.full(who.size, concept),
                       condition_start_date=day)
    weights = 1.0 / np.arange(1, len(_BACKGROUND) + 1)
    k = _counts(rng, 6.0 + 2.0 * np.clip(risk, 0, None), 0.8, n)
    who, day = _events(rng, person_id, k, start, last_end)
    conditions.add(person_id=who, condition_start_date=day,
                   condition_concept_id=rng.choice(_BACKGROUND, who.size,
                                                   p=weights / weights.sum()))
    # Visits with labs: each lab measured at a visit with its own probability, so some persons
    # never have one (missing), and the sick are measured more often.
    visits = 1 + _counts(rng, 4.0 + 3.0 * chronic[T2D] + 2.0 * chronic[HYPERTENSION], 1.0, n)
    vperson, vday = _events(rng, np.arange(n), visits, start, last_end)
    measurements = _Rows()
    def lab_values(concept: int, i: np.ndarray) -> np.ndarray:
        """Values of one lab for the persons ``i`` (one per measurement)."""
        if concept == HBA1C:
            return np.asarray(rng.normal(5.4 + 2.2 * chronic[T2D][i] + 0.3 * risk[i], 0.6))
        if concept == SYSTOLIC:
            mean = 118 + 16 * chronic[HYPERTENSION][i] + 0.35 * (age[i] - 55)
            return np.asarray(rng.normal(mean, 13))
        if concept == BMI:
            return np.asarray(rng.normal(27.5 + 1.8 * risk[i], 4.5))
        if concept == CREATININE:
            return np.asarray(np.exp(rng.normal(np.log(0.9) + 0.004 * (age[i] - 55), 0.3)))
        return np.asarray(rng.normal(105 + 30 * chronic[HYPERLIPIDEMIA][i], 25))

    labs = {  # probability of the lab at a visit
        HBA1C: np.where(chronic[T2D][vperson], 0.85, 0.05),
        SYSTOLIC: np.full(vperson.size, 0.7),
        BMI: np.full(vperson.size, 0.35),
        CREATININE: np.full(vperson.size, 0.25),
        LDL: np.where(chronic[HYPERLIPIDEMIA][vperson], 0.5, 0.15),
    }
    for concept, prob in labs.items():
        taken = rng.random(vperson.size) < prob
        i = vperson[taken]
        v = lab_values(concept, i)
        v[rng.random(i.size) < 0.02] = np.nan  # recorded without a value
        measurements.add(person_id=person_id[i], measurement_concept_id=np.full(i.size, concept),
                         measurement_date=vday[taken], value_as_number=np.round(v, 2))
    drugs = _Rows()
    for concept, has, p_treated in ((METFORMIN, chronic[T2D], 0.75),
                                    (LISINOPRIL, chronic[HYPERTENSION], 0.6),
                                    (ATORVASTATIN, chronic[HYPERLIPIDEMIA], 0.65)):
        treated = has & (rng.random(n) < p_treated)
        k = np.where(treated, 1 + _counts(rng, 5.0, 1.2, n), 0)
        who, day = _events(rng, person_id, k, start, last_end)
        drugs.add(person_id=who, drug_concept_id=np.full(who.size, concept),
                  drug_exposure_start_date=day, days_supply=rng.choice([30, 60, 90], who.size))
    observations = _Rows()
    k = np.where(rng.random(n) < 0.7, 1 + _counts(rng, 1.0, 1.0, n), 0)
    who, day = _events(rng, np.arange(n), k, start, last_end)
    status = rng.choice([NEVER, FORMER, CURRENT], who.size,
                        p=[0.55, 0.27, 0.18]) if who.size else np.array([], int)
    observations.add(person_id=person_id[who], observation_concept_id=np.full(who.size, SMOKING),
                     observation_date=day, value_as_concept_id=status,
                     value_as_number=np.full(who.size, np.nan))
    return {
        "person": people,
        "observation_period": _with_ids(periods.table({
            "person_id": pa.int64(), "observation_period_start_date": pa.date32(),
            "observation_period_end_date": pa.date32()}), "observation_period_id", site,
            type_column="period_type_concept_id"),
        "condition_occurrence": _with_ids(conditions.table({
            "person_id": pa.int64(), "condition_concept_id": pa.int64(),
            "condition_start_date": pa.date32()}), "condition_occurrence_id", site,
            type_column="condition_type_concept_id"),
        "measurement": _with_ids(measurements.table({
            "person_id": pa.int64(), "measurement_concept_id": pa.int64(),
            "measurement_date": pa.date32(), "value_as_number": pa.float64()}),
            "measurement_id", site, type_column="measurement_type_concept_id"),
        "drug_exposure": _with_ids(drugs.table({
            "person_id": pa.int64(), "drug_concept_id": pa.int64(),
            "drug_exposure_start_date": pa.date32(), "days_supply": pa.int64()}),
            "drug_exposure_id", site, type_column="drug_type_concept_id"),
        "observation": _with_ids(observations.table({
            "person_id": pa.int64(), "observation_concept_id": pa.int64(),
            "observation_date": pa.date32(), "value_as_number": pa.float64(),
            "value_as_concept_id": pa.int64()}), "observation_id", site,
            type_column="observation_type_concept_id"),
    }


def _with_ids(table: pa.Table, id_column: str, site: int, *, type_column: str) -> pa.Table:
    ids = pa.array(np.arange(1, table.num_rows + 1, dtype=np.int64) + 10**9 * site)
    table = table.add_column(0, id_column, ids)
    return table.append_column(type_column, pa.array(np.full(table.num_rows, EHR)))


_SQL_TYPES = {pa.int64(): "BIGINT", pa.date32(): "DATE", pa.float64(): "DOUBLE PRECISION",
              pa.string(): "VARCHAR"}


def write_duckdb(tables: dict[str, pa.Table], path: Path, cdm_schema: str = "cdm") -> Path:
    """Load the tables into a new DuckDB file under ``cdm_schema``; return its path."""
    import duckdb

    cdm = check_cdm_schema(cdm_schema)
    path = Path(path)
    path.unlink(missing_ok=True)
    with duckdb.connect(":memory:") as conn:
        # Attached under a fixed name: a file's own catalog name (its stem) may equal cdm.
        quoted = str(path.resolve()).replace("'", "''")
        conn.execute(f"ATTACH '{quoted}' AS target")
        conn.execute("USE target")
        conn.execute(f"CREATE SCHEMA {cdm}")
        for name, table in tables.items():
            conn.register("incoming", table)
            conn.execute(f"CREATE TABLE {cdm}.{name} AS SELECT * FROM incoming")
            conn.unregister("incoming")
    return path


def write_postgres(tables: dict[str, pa.Table], admin_conninfo: str, *, reader: str,
                   cdm_schema: str = "cdm") -> None:
    """Create ``cdm_schema`` with the tables (COPY) and let the role ``reader`` SELECT them."""
    import psycopg
    from psycopg import sql

    cdm = check_cdm_schema(cdm_schema)
    with psycopg.connect(admin_conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(cdm)))
        for name, table in tables.items():
            target = sql.Identifier(cdm, name)
            columns = sql.SQL(", ").join(
                sql.SQL("{} {}").format(sql.Identifier(f.name), sql.SQL(_SQL_TYPES[f.type]))
                for f in table.schema)
            conn.execute(sql.SQL("CREATE TABLE {} ({})").format(target, columns))
            names = sql.SQL(", ").join(sql.Identifier(c) for c in table.column_names)
            with conn.cursor() as cur, cur.copy(sql.SQL("COPY {} ({}) FROM STDIN").format(
                    target, names)) as copy:
                for row in zip(*(_python(table.column(i)) for i in range(table.num_columns)),
                               strict=True):
                    copy.write_row(row)
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
            sql.Identifier(cdm), sql.Identifier(reader)))
        conn.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(
            sql.Identifier(cdm), sql.Identifier(reader)))


def _python(column: Any) -> list[Any]:
    return list(column.to_pylist())
