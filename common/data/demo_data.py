"""Generated hospital-like demo data with a known latent factor structure.

``dpfed simulate``, the benchmarks and the tests need tables that look like hospital
extracts and that DP-PCA and the factor-model synthesizer can actually find structure in.
Every site draws its rows from one latent factor model (seed 000's model, used here as the
*truth*):

1. ``k`` factors (default ``min(8, n_features // 6)``, at least 1) with a decaying
   spectrum: factor ``j`` has variance ``FACTOR_DECAY ** j`` (1, 0.8, 0.64, ...).
2. Loadings ``Lambda`` (latent coordinates x k, orthogonal directions) shared by all sites;
   each latent coordinate has a communality ``h`` (the share of its unit variance explained
   by the factors) drawn in [0.75, 0.95], the rest is independent noise:
   ``z = w Lambda^T + e``.
3. Hospital heterogeneity: site ``s`` shifts the factor means by
   ``SITE_SHIFT x factor sd x N(0, 1)``; loadings are shared.
4. Links (as in seed 000's Alg. 2, run forwards): a continuous column is
   ``mean + sd x z`` rounded to the column's precision and clipped into its declared bounds
   (the bounds lie >= 3 sd away, so clipping is rare; columns of precision 0 are declared
   ``integer`` in the schema); an ordinal column thresholds its
   coordinate at fixed cut points; a nominal column with Q categories uses Q-1 coordinates
   (plus fixed offsets) and takes category 0 if all are <= 0, else 1 + argmax.

Data are reproducible from the seed and do not depend on how they are written: rows are
generated in blocks of :data:`GENERATION_BLOCK_ROWS`, block ``b`` of site ``s`` from its own
``SeedSequence(seed, spawn_key=(s + 1, b))``, so a 2M-row file can be written block by block
in bounded memory and still equal :func:`generate_demo`'s in-memory frames. A site's rows do
not depend on how many sites are generated either.

The demo data are synthetic; nothing in them comes from real patients.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from dpfed.common.data.schema import Column, ContinuousColumn, NominalColumn, OrdinalColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.validation import check_choice, check_int

#: Rows generated per random block (the unit of reproducibility, not of output).
GENERATION_BLOCK_ROWS = 65536
#: Ratio of successive factor variances.
FACTOR_DECAY = 0.8
#: Site-to-site spread of the factor means, in units of each factor's sd.
SITE_SHIFT = 0.3
DEMO_FORMATS: tuple[str, ...] = ("csv", "parquet")


@dataclass(frozen=True)
class _ContinuousSpec:
    name: str
    min: float
    max: float
    mean: float
    sd: float
    decimals: int


#: Physiological-looking columns first (name, bounds, typical mean/sd, precision).
VITALS: tuple[_ContinuousSpec, ...] = (
    _ContinuousSpec("age", 0, 110, 55, 18, 0),
    _ContinuousSpec("bmi", 10, 70, 27, 5, 1),
    _ContinuousSpec("systolic_bp", 60, 250, 128, 18, 0),
    _ContinuousSpec("diastolic_bp", 30, 150, 78, 11, 0),
    _ContinuousSpec("heart_rate", 20, 250, 80, 14, 0),
    _ContinuousSpec("respiratory_rate", 4, 60, 16, 3, 0),
    _ContinuousSpec("temperature", 30, 43, 37.0, 0.6, 1),
    _ContinuousSpec("spo2", 50, 100, 95.5, 1.4, 0),
    _ContinuousSpec("glucose", 20, 800, 110, 30, 0),
    _ContinuousSpec("creatinine", 0.1, 20, 1.1, 0.3, 2),
    _ContinuousSpec("hemoglobin", 3, 25, 13.5, 1.8, 1),
    _ContinuousSpec("wbc", 0, 100, 8.0, 2.5, 1),
    _ContinuousSpec("sodium", 100, 180, 139, 3.5, 0),
    _ContinuousSpec("potassium", 1.5, 10, 4.2, 0.5, 1),
)
#: Ordinal columns: (name, levels, cut points on the standardised latent coordinate).
ORDINALS: tuple[tuple[str, tuple[str, ...], tuple[float, ...]], ...] = (
    ("severity", ("mild", "moderate", "severe", "critical"), (-0.3, 0.8, 1.6)),
    ("triage_level", ("1", "2", "3", "4", "5"), (-1.3, -0.4, 0.4, 1.3)),
    ("frailty", ("fit", "vulnerable", "frail"), (0.0, 1.0)),
)
#: Nominal columns: (name, categories, offsets of the Q-1 probit coordinates).
NOMINALS: tuple[tuple[str, tuple[str, ...], tuple[float, ...]], ...] = (
    ("ward", ("general", "cardiology", "oncology", "surgery", "icu"), (-0.5, -0.6, -0.5, -1.2)),
    ("admission_type", ("elective", "emergency", "transfer"), (0.3, -1.0)),
    ("readmitted_30d", ("no", "yes"), (-0.8,)),
)


@dataclass(frozen=True)
class DemoModel:
    """The generative truth behind the demo data (public: nothing here is private).

    Attributes
    ----------
    schema : Schema
        The table's public schema.
    loadings : ndarray (q, k)
        ``Lambda``: latent coordinates by factors, shared by all sites.
    factor_sd : ndarray (k,)
        Standard deviation of each factor (decaying).
    noise_sd : ndarray (q,)
        Standard deviation of each latent coordinate's own noise, ``sqrt(1 - h)``.
    seed : int
        The seed everything derives from.
    """

    schema: Schema
    loadings: np.ndarray
    factor_sd: np.ndarray
    noise_sd: np.ndarray
    seed: int
    _continuous: tuple[_ContinuousSpec, ...]
    _ordinal_cuts: tuple[tuple[float, ...], ...]
    _nominal_offsets: tuple[tuple[float, ...], ...]

    @property
    def n_factors(self) -> int:
        """Number of factors k."""
        return int(self.factor_sd.shape[0])

    def site_shift(self, site: int) -> np.ndarray:
        """Factor means of site ``site`` (its own random stream; independent of other sites)."""
        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(site + 1,)))
        return SITE_SHIFT * self.factor_sd * rng.standard_normal(self.n_factors)

    def latent_block(self, site: int, block: int, n_rows: int) -> np.ndarray:
        """Standardised latent rows of one generation block, transposed: ``z^T`` (q x n).

        ``z = w Lambda^T + e`` with ``w ~ N(site_shift, diag(factor_sd^2))`` and
        ``e ~ N(0, diag(noise_sd^2))``; column-major per coordinate so each output column is
        a contiguous row of the result.
        """
        rng = np.random.default_rng(
            np.random.SeedSequence(self.seed, spawn_key=(site + 1, block)))
        w = rng.standard_normal((self.n_factors, n_rows))
        w *= self.factor_sd[:, None]
        w += self.site_shift(site)[:, None]
        z = rng.standard_normal((self.loadings.shape[0], n_rows))
        z *= self.noise_sd[:, None]
        z += self.loadings @ w
        return z

    def site_blocks(self, site: int, n_rows: int) -> Iterator[pa.Table]:
        """Yield site ``site``'s first ``n_rows`` rows as Arrow tables of at most one block."""
        check_int(site, "site", minimum=0)
        check_int(n_rows, "rows_per_site", minimum=1)
        for block in range(math.ceil(n_rows / GENERATION_BLOCK_ROWS)):
            rows = min(GENERATION_BLOCK_ROWS, n_rows - block * GENERATION_BLOCK_ROWS)
            yield self._to_table(self.latent_block(site, block, rows))

    def _to_table(self, z: np.ndarray) -> pa.Table:
        arrays: list[pa.Array] = []
        j = 0
        for spec in self._continuous:
            x = np.rint((spec.mean + spec.sd * z[j]) * 10.0 ** spec.decimals)
            x /= 10.0 ** spec.decimals
            x = np.clip(x, spec.min, spec.max)
            # Whole-unit columns (the schema's integer ones) are written as integers.
            arrays.append(pa.array(x.astype(np.int64) if spec.decimals == 0 else x))
            j += 1
        for cuts, col in zip(self._ordinal_cuts, self.schema.of_type("ordinal"), strict=True):
            assert isinstance(col, OrdinalColumn)
            codes = np.searchsorted(np.asarray(cuts), z[j]).astype(np.int32)
            arrays.append(_labels(codes, col.levels))
            j += 1
        for offsets, col in zip(self._nominal_offsets, self.schema.of_type("nominal"),
                                strict=True):
            assert isinstance(col, NominalColumn)
            u = z[j:j + len(offsets)] + np.asarray(offsets)[:, None]
            # Multinomial probit link (seed 000, Alg. 2): 0 if every coordinate <= 0.
            codes = np.where(u.max(axis=0) <= 0.0, 0, 1 + u.argmax(axis=0)).astype(np.int32)
            arrays.append(_labels(codes, col.categories))
            j += len(offsets)
        return pa.Table.from_arrays(arrays, names=list(self.schema.names))


def _labels(codes: np.ndarray, labels: tuple[str, ...]) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(codes), pa.array(list(labels), pa.string()))


def demo_model(n_features: int, *, seed: int, mixed: bool = False,
               n_factors: int | None = None) -> DemoModel:
    """Build the latent model and schema of a demo table with ``n_features`` columns.

    Parameters
    ----------
    n_features : int
        Number of columns (>= 1; >= 3 when ``mixed``). The first continuous columns are
        :data:`VITALS`, the rest ``lab_001``, ``lab_002``, ...
    seed : int
        Seed of everything (a non-negative integer).
    mixed : bool
        Also ordinal and nominal columns (about a fifth of the columns, at most six).
    n_factors : int, optional
        Number of factors k (at most the number of latent coordinates); default
        ``min(8, max(1, n_features // 6))``.
    """
    p = check_int(n_features, "n_features", minimum=3 if mixed else 1)
    seed = check_int(seed, "seed", minimum=0)
    n_categorical = min(len(ORDINALS) + len(NOMINALS), max(2, round(0.2 * p))) if mixed else 0
    n_ordinal = (n_categorical + 1) // 2
    ordinals = ORDINALS[:n_ordinal]
    nominals = NOMINALS[:n_categorical - n_ordinal]
    n_continuous = p - n_categorical

    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,)))
    continuous = list(VITALS[:n_continuous])
    for i in range(n_continuous - len(continuous)):
        # Generic labs: bounds [0, 100], means and spreads vary a little.
        mean = float(np.round(rng.uniform(35, 65), 1))
        sd = float(np.round(rng.uniform(8, 14), 1))
        continuous.append(_ContinuousSpec(f"lab_{i + 1:03d}", 0, 100, mean, sd, 2))
    # Columns recorded in whole units (age, blood pressure, ...) are declared integer.
    columns: list[Column] = [ContinuousColumn(c.name, c.min, c.max, integer=c.decimals == 0)
                             for c in continuous]
    columns += [OrdinalColumn(name, levels) for name, levels, _ in ordinals]
    columns += [NominalColumn(name, cats) for name, cats, _ in nominals]
    schema = Schema(tuple(columns), name=f"dpfed demo ({p} columns, seed {seed})")

    q = n_continuous + len(ordinals) + sum(len(off) for _, _, off in nominals)
    k = min(8, max(1, p // 6)) if n_factors is None else check_int(
        n_factors, "n_factors", minimum=1, maximum=q)
    factor_sd = FACTOR_DECAY ** (np.arange(k) / 2.0)
    # Orthonormal loading directions (Gaussian loadings would blur the weakest factors
    # into the noise through their uneven singular values), then per-row scaling so the
    # factors explain a share h of each coordinate's unit variance.
    loadings = np.linalg.qr(rng.standard_normal((q, k)))[0] * math.sqrt(q)
    communality = rng.uniform(0.75, 0.95, q)
    explained = (loadings ** 2) @ factor_sd ** 2
    loadings *= np.sqrt(communality / explained)[:, None]
    return DemoModel(schema, loadings, factor_sd, np.sqrt(1.0 - communality), seed,
                     tuple(continuous), tuple(cuts for _, _, cuts in ordinals),
                     tuple(off for _, _, off in nominals))


def _to_frame(table: pa.Table, schema: Schema) -> pd.DataFrame:
    """Arrow demo table -> DataFrame typed like ``EncodedTable.to_frame`` (categoricals)."""
    data: dict[str, Any] = {}
    for col in schema.columns:
        arr = table.column(col.name).combine_chunks()
        if isinstance(col, ContinuousColumn):
            data[col.name] = arr.to_numpy()
        else:
            labels = col.levels if isinstance(col, OrdinalColumn) else col.categories
            dtype = pd.CategoricalDtype(list(labels), ordered=isinstance(col, OrdinalColumn))
            data[col.name] = pd.Categorical.from_codes(
                arr.indices.to_numpy().astype(np.int64), dtype=dtype)
    return pd.DataFrame(data)


def generate_demo(n_sites: int, rows_per_site: int, n_features: int, *, seed: int,
                  mixed: bool = False,
                  n_factors: int | None = None) -> tuple[Schema, list[pd.DataFrame]]:
    """Generate every site's demo table in memory (see the module docstring for the model).

    Returns
    -------
    (Schema, list of pandas.DataFrame)
        The schema and one frame per site: float columns, and (ordered) categoricals for the
        ordinal and nominal columns.
    """
    sites = check_int(n_sites, "n_sites", minimum=1)
    model = demo_model(n_features, seed=seed, mixed=mixed, n_factors=n_factors)
    frames = []
    for s in range(sites):
        table = pa.concat_tables(list(model.site_blocks(s, rows_per_site)))
        frames.append(_to_frame(table, model.schema))
    return model.schema, frames


def write_demo(out_dir: str | Path, n_sites: int, rows_per_site: int, n_features: int, *,
               seed: int, mixed: bool = False, fmt: str = "csv",
               n_factors: int | None = None) -> tuple[Path, list[Path]]:
    """Write a schema and one data file per site, block by block (memory independent of rows).

    Files are ``schema.toml`` and ``site_01.csv`` (or ``.parquet``), ``site_02...`` in
    ``out_dir`` (created if needed). CSV is written with ``pyarrow.csv``; a Parquet file has
    one row group per generation block. The rows equal :func:`generate_demo`'s.

    Returns
    -------
    (schema path, [data file paths])
    """
    fmt = check_choice(fmt, "fmt", DEMO_FORMATS)
    sites = check_int(n_sites, "n_sites", minimum=1)
    model = demo_model(n_features, seed=seed, mixed=mixed, n_factors=n_factors)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValidationError(f"cannot create demo output directory {out}: {exc.strerror}") \
            from None
    schema_path = out / "schema.toml"
    schema_path.write_text(model.schema.to_toml(), encoding="utf-8")
    paths = []
    for s in range(sites):
        path = out / f"site_{s + 1:02d}.{fmt}"
        writer: Any = None
        try:
            for table in model.site_blocks(s, rows_per_site):
                if writer is None:
                    writer = (pcsv.CSVWriter(str(path), table.schema) if fmt == "csv"
                              else pq.ParquetWriter(str(path), table.schema))
                writer.write_table(table)
        finally:
            if writer is not None:
                writer.close()
        paths.append(path)
    return schema_path, paths
