"""The fitted DP synthesis model an analyst keeps: sample any number of rows, save, load.

    from dpfed.aggregator.synth_model import SynthModel

    model = SynthModel.load("synth_model.npz")
    frame = model.sample(10_000)               # typed pandas DataFrame
    model.write("synth.parquet", rows=10_000_000)   # streamed, memory independent of rows

Everything in the model is a DP release or post-processing of one: the DP link proportions
(one block per column), the generative factor model fitted from the DP latent second moment,
the calibrated decoding proportions, and -- row-aligned mode only -- the sites' noisy factors.
Sampling is post-processing: it costs no privacy budget, however many rows are drawn.

The file is a result file (``dpfed.aggregator.result_file``): arrays plus JSON metadata,
readable with plain numpy (no pickle).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from dpfed.aggregator.result_file import decode_result, encode_result
from dpfed.common.data.dates import iso_text
from dpfed.common.data.encoding import EncodedTable, decode_dates, output_values
from dpfed.common.data.schema import ContinuousColumn, DateColumn, OrdinalColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.privacy.rng import resolve_rng
from dpfed.common.synth.column_cells import check_resolution
from dpfed.common.synth.generative import (
    CHUNK_ROWS,
    FactorModel,
    default_workers,
    in_order,
    iter_samples,
)
from dpfed.common.synth.link_release import links_from_proportions, split_proportions
from dpfed.common.synth.links import LatentLinks
from dpfed.common.synth.missing_cells import from_cells_table, synth_schema
from dpfed.common.synth.pair_marginals import Pair, PairCorrection, PairGrid
from dpfed.common.synth.pipeline import aligned_latent, calibrated_links, pair_correction
from dpfed.common.validation import check_int

log = logging.getLogger(__name__)

MODEL_FORMAT = "dpfed-synth-model/1"
OUTPUT_FORMATS: tuple[str, ...] = ("parquet", "csv")
#: Largest number of rows one call may draw.
MAX_ROWS = 10_000_000_000
#: Parquet writer options. The continuous columns are random doubles that no codec
#: compresses (lz4 makes the file larger and costs as much CPU as the copy; zstd saves ~8 % at
#: a third of the speed), so none is used; categorical columns are dictionary-encoded (Arrow
#: dictionaries with the schema's labels) and bit-packed, which is where the size goes down
#: (only they: a dictionary attempt on random doubles is wasted work). No column statistics
#: (a pass over every value); values handed to the encoders 64k at a time, not 1k (~10 %
#: less CPU per row).
PARQUET_OPTIONS: dict[str, Any] = {"compression": "none", "write_statistics": False,
                                   "write_batch_size": 65536}


def _public_rows(metadata: Mapping[str, Any] | None) -> int | None:
    """Return the public pooled row count a job's model was fitted from (None: not kept)."""
    n = (metadata or {}).get("n_rows_total")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def output_format(path: str | Path, fmt: str | None = None) -> str:
    """``fmt`` if given, else from the extension (.csv -> csv, anything else parquet)."""
    if fmt is not None:
        if fmt not in OUTPUT_FORMATS:
            raise ValidationError(f"--format must be one of {OUTPUT_FORMATS}, got {fmt!r}")
        return fmt
    return "csv" if str(path).lower().endswith(".csv") else "parquet"


def check_rows(rows: Any, flag: str = "--rows") -> int:
    """Validate a requested row count (1..MAX_ROWS), naming the flag."""
    if isinstance(rows, bool) or not isinstance(rows, int | np.integer):
        raise ValidationError(f"{flag} must be a whole number of rows, got {rows!r}")
    if not 1 <= int(rows) <= MAX_ROWS:
        raise ValidationError(f"{flag} must be between 1 and {MAX_ROWS:,}, got {rows}")
    return int(rows)


def arrow_dictionaries(schema: Schema) -> dict[str, pa.Array]:
    """Return the label array of every ordinal/nominal column (built once per output file)."""
    return {col.name: pa.array(list(col.levels if isinstance(col, OrdinalColumn)
                                    else col.categories), pa.string())
            for col in schema.columns if not isinstance(col, ContinuousColumn)}


def arrow_table(table: EncodedTable,
                dictionaries: Mapping[str, pa.Array] | None = None) -> pa.Table:
    """Typed Arrow table: floats (int64 for integer columns), dictionary-encoded labels, dates.

    The arrays wrap the decoded numpy buffers without a copy; ``dictionaries`` (from
    :func:`arrow_dictionaries`) saves rebuilding the labels for every chunk. Date columns
    are date32, datetime columns timestamp[s] (UTC, no time zone), decoded by
    :func:`dpfed.common.data.encoding.decode_dates` (within the bounds, NaT as null).
    """
    labels = arrow_dictionaries(table.schema) if dictionaries is None else dictionaries
    arrays = []
    for col in table.schema.columns:
        values = table.columns[col.name]
        mask = table.missing.get(col.name)  # missing values: nulls
        if isinstance(col, DateColumn):
            arrays.append(pa.array(decode_dates(col, values, mask)))  # NaT: null
        elif isinstance(col, ContinuousColumn):
            arrays.append(_with_nulls(pa.array(output_values(col, values)), mask))
        else:
            arrays.append(pa.DictionaryArray.from_arrays(
                _with_nulls(pa.array(np.asarray(values, dtype=np.int32)), mask),
                labels[col.name], ordered=isinstance(col, OrdinalColumn)))
    return pa.Table.from_arrays(arrays, names=list(table.schema.names))


def csv_table(table: pa.Table) -> pa.Table:
    """``table`` as CSV files hold it: datetimes as ISO 8601 text (:func:`iso_text`)."""
    for i, column in enumerate(table.schema):
        if pa.types.is_timestamp(column.type):
            table = table.set_column(i, column.name, iso_text(table.column(i)))
    return table


def _with_nulls(array: pa.Array, mask: np.ndarray | None) -> pa.Array:
    """``array`` (fixed width, no nulls) with nulls where ``mask`` is set, its data not copied."""
    if mask is None or not mask.any():
        return array
    validity = pa.py_buffer(np.packbits(~mask, bitorder="little"))
    return pa.Array.from_buffers(array.type, len(array), [validity, array.buffers()[1]],
                                 int(np.count_nonzero(mask)))


@dataclass(frozen=True)
class SynthModel:
    """A fitted DP synthesis model (see the module docstring).

    Attributes
    ----------
    schema : Schema
    mode : {"generative", "row_aligned"}
    continuous_link : {"quantile", "identity"}
    n_bins : int
    proportions : ndarray
        The released DP proportions, one block per column (the DP marginals), on the
        columns' link cells (:mod:`dpfed.common.synth.column_cells`).
    decode_proportions : ndarray
        The calibrated proportions the decoding links use (post-processing).
    factor_model : FactorModel
        Loadings, eigenvalues, residual and the link-unit multiplier.
    dp_correlation : ndarray (p, p)
        Correlation of the DP latent second moment (before the correction).
    latent_correlation : ndarray (p, p) or None
        The corrected latent correlation (generative mode).
    factors : ndarray (N, r) or None
        Row-aligned mode: the sites' noisy factors, in site order.
    metadata : dict
        Job id, budget plan, sites, etc.
    pair_correction : PairCorrection or None
        Generative mode with DP pair tables: the correction applied to every generated
        chunk (:mod:`dpfed.common.synth.pair_marginals`); its grid's ``max_groups`` is
        stored as ``pair_groups`` in the metadata.
    resolution : {"fine", "bins"}
        The continuous columns' cells (the job's ``resolution``; model files written before
        it existed are "bins").
    missing_cells : bool
        The cells follow :attr:`cells_schema`: every ``missing = "category"`` column has a
        missing cell and the synthetic rows have missing values (the job's
        ``missing_cells``; model files written before it existed: False).
    """

    schema: Schema
    mode: str
    continuous_link: str
    n_bins: int
    proportions: np.ndarray
    decode_proportions: np.ndarray
    factor_model: FactorModel
    dp_correlation: np.ndarray
    latent_correlation: np.ndarray | None = None
    factors: np.ndarray | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    pair_correction: PairCorrection | None = None
    resolution: str = "bins"
    missing_cells: bool = False
    _decode: list[LatentLinks] = field(default_factory=list, init=False, repr=False,
                                       compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, schema: Schema, *, mode: str, continuous_link: str, n_bins: int,
              proportions: np.ndarray, factor_model: FactorModel, dp_correlation: np.ndarray,
              rng: np.random.Generator, latent_correlation: np.ndarray | None = None,
              factors: np.ndarray | None = None,
              metadata: Mapping[str, Any] | None = None,
              resolution: str = "bins", missing_cells: bool = False) -> SynthModel:
        """Assemble a model and run the final per-column calibration (post-processing).

        :func:`dpfed.common.synth.pipeline.calibrated_links`: generative mode calibrates on
        simulated latent rows, row-aligned mode on the reconstructed latent rows themselves.
        """
        cells = synth_schema(schema, missing_cells)
        links = links_from_proportions(cells, proportions, n_bins, continuous_link,
                                       resolution)
        _, calibrated = calibrated_links(links, factor_model, rng, factors,
                                         n_rows=_public_rows(metadata))
        blocks = split_proportions(proportions, cells, n_bins, resolution)
        decode = np.concatenate([blocks[c.name] if p is None else p
                                 for c, p in zip(cells.columns, calibrated, strict=True)])
        return cls(schema, mode, continuous_link, n_bins, np.asarray(proportions),
                   decode, factor_model, dp_correlation, latent_correlation, factors,
                   dict(metadata or {}), None, check_resolution(resolution),
                   bool(missing_cells))

    @property
    def cells_schema(self) -> Schema:
        """Return the schema the model's cells and links follow.

        A missing cell per ``missing = "category"`` column when :attr:`missing_cells`.
        """
        return synth_schema(self.schema, self.missing_cells)

    def pair_grid(self, max_groups: int) -> PairGrid:
        """Return the pair tables' cells for this model's DP proportions (post-processing)."""
        return PairGrid.from_proportions(self.cells_schema, self.proportions, self.n_bins,
                                         max_groups, self.resolution)

    def with_pairs(self, grid: PairGrid, edges: Sequence[Pair], tables: Sequence[np.ndarray],
                   rng: np.random.Generator, *, noise_sd: float = 0.0) -> SynthModel:
        """Return this generative model fitted to DP pair tables (post-processing).

        ``edges`` are (parent, child) in application order and ``tables`` their joint
        proportions (:func:`dpfed.common.synth.pair_marginals.fit_pair_tables`). The
        correction is built on rows drawn from this model
        (:func:`~dpfed.common.synth.generative.calibration_rows` of them); ``noise_sd`` is the
        tables' public noise per cell in proportions (see
        :meth:`~dpfed.common.synth.pair_marginals.PairCorrection.fit`).
        """
        if self.factors is not None:
            raise ValidationError("pair tables apply to generative models only")
        correction = pair_correction(grid, edges, tables, self.factor_model,
                                     self.decode_links, self.proportions, rng,
                                     noise_sd=noise_sd, n_rows=_public_rows(self.metadata))
        metadata = {**self.metadata, "pair_groups": grid.max_groups}
        return replace(self, metadata=metadata, pair_correction=correction)

    @staticmethod
    def _aligned_latent(factors: np.ndarray, fm: FactorModel) -> np.ndarray:
        return aligned_latent(factors, fm)

    def __repr__(self) -> str:
        # One line: the arrays (thousands of lines printed whole) stay out of it.
        pairs = 0 if self.pair_correction is None else len(self.pair_correction.edges)
        rows = "" if self.factors is None else f", rows={self.factors.shape[0]}"
        return (f"SynthModel(job_id={self.metadata.get('job_id', '')!r}, mode={self.mode!r}, "
                f"columns={len(self.schema.columns)}, "
                f"latent_dim={self.dp_correlation.shape[0]}, rank={self.factor_model.rank}, "
                f"pairs={pairs}{rows})")

    # ------------------------------------------------------------------ links
    @property
    def links(self) -> LatentLinks:
        """The links fitted from the DP proportions."""
        return links_from_proportions(self.cells_schema, self.proportions, self.n_bins,
                                      self.continuous_link, self.resolution)

    @property
    def decode_links(self) -> LatentLinks:
        """The calibrated links used to decode synthetic latent rows (built once per model)."""
        if not self._decode:
            self._decode.append(links_from_proportions(
                self.cells_schema, self.decode_proportions, self.n_bins, self.continuous_link,
                self.resolution))
        return self._decode[0]

    @property
    def n_rows_fixed(self) -> int | None:
        """Row-aligned models release exactly one row per real row; None for generative."""
        return None if self.factors is None else int(self.factors.shape[0])

    # ------------------------------------------------------------------ sampling
    def iter_encoded(self, rows: int | None = None, *, rng: np.random.Generator | None = None,
                     chunk_rows: int = CHUNK_ROWS,
                     workers: int | None = None) -> Iterator[EncodedTable]:
        """Synthetic rows of :attr:`schema` in chunks (memory independent of ``rows``).

        Missing values are marked (:attr:`EncodedTable.missing`); see :meth:`_iter_cells`.
        """
        for chunk in self._iter_cells(rows, rng=rng, chunk_rows=chunk_rows, workers=workers):
            yield from_cells_table(chunk, self.schema)

    def _iter_cells(self, rows: int | None, *, rng: np.random.Generator | None,
                    chunk_rows: int, workers: int | None) -> Iterator[EncodedTable]:
        """Synthetic rows of :attr:`cells_schema` in chunks (memory independent of ``rows``).

        Chunks are drawn and decoded on ``workers`` background threads (default: one per CPU
        but one, at most 4; 0: in the calling thread) while the caller uses the previous
        ones (see :func:`dpfed.common.synth.generative.iter_samples`); the rows depend on
        ``rng`` and ``chunk_rows`` only.
        """
        decode = self.decode_links
        threads = default_workers() if workers is None else check_int(workers, "workers",
                                                                      minimum=0)
        if self.factors is not None:
            factors = self.factors
            n = factors.shape[0]
            if rows is not None and rows != n:
                raise ValidationError(
                    f"--rows: a row-aligned model releases exactly one noisy row per real row "
                    f"({n}); omit --rows or pass {n}")
            fm = self.factor_model
            yield from in_order(lambda start: decode.from_latent(self._aligned_latent(
                factors[start:start + chunk_rows], fm)), range(0, n, chunk_rows), threads)
            return
        if rows is None:
            raise ValidationError("--rows is required for a generative model")
        n = check_rows(rows)
        correction = self.pair_correction
        yield from iter_samples(self.factor_model, decode, n, resolve_rng(rng), chunk_rows,
                                workers=threads,
                                correct=None if correction is None else partial(
                                    correction.apply, in_place=True))

    def sample(self, rows: int | None = None, *,
               rng: np.random.Generator | None = None) -> pd.DataFrame:
        """Return a typed DataFrame (floats within bounds, categoricals with the schema labels)."""
        parts = list(self.iter_encoded(rows, rng=rng))
        if not parts:
            empty = {c.name: np.zeros(0, dtype=np.float64 if isinstance(c, ContinuousColumn)
                                      else np.int32) for c in self.schema.columns}
            return EncodedTable(self.schema, empty, 0).to_frame()
        return EncodedTable.concatenate(parts).to_frame()

    def write(self, path: str | Path, rows: int | None = None, *, fmt: str | None = None,
              rng: np.random.Generator | None = None, chunk_rows: int = CHUNK_ROWS,
              workers: int | None = None,
              progress: Callable[[int, int], None] | None = None) -> int:
        """Stream synthetic rows to Parquet or CSV, chunk by chunk; return the row count.

        Memory does not depend on ``rows``: at most ``workers + 2`` chunks of ``chunk_rows``
        rows exist at a time (drawn on ``workers`` background threads while this thread
        writes; pyarrow writes without the GIL). Every chunk is one Parquet row group.
        ``progress(written, total)`` is called after every chunk. The file appears under its
        name only when complete (written to ``<name>.partial`` first).
        """
        out = Path(path)
        kind = output_format(out, fmt)
        out.parent.mkdir(parents=True, exist_ok=True)
        total = self.n_rows_fixed if rows is None and self.factors is not None else rows
        tmp = out.with_name(out.name + ".partial")
        written = 0
        writer: pq.ParquetWriter | pcsv.CSVWriter | None = None
        labels = arrow_dictionaries(self.schema)
        try:
            for chunk in self.iter_encoded(rows, rng=rng, chunk_rows=chunk_rows,
                                           workers=workers):
                table = arrow_table(chunk, labels)
                if kind == "csv":
                    table = csv_table(table)
                if writer is None:
                    writer = (pq.ParquetWriter(tmp, table.schema, use_dictionary=list(labels),
                                               **PARQUET_OPTIONS)
                              if kind == "parquet" else pcsv.CSVWriter(tmp, table.schema))
                writer.write_table(table)
                written += chunk.n_rows
                if progress is not None:
                    progress(written, int(total or written))
        finally:
            if writer is not None:
                writer.close()
        if writer is None:
            raise ValidationError("--rows: nothing to write")
        tmp.replace(out)
        log.info("[SynthModel.write] %d rows -> %s (%s)", written, out, kind)
        return written

    # ------------------------------------------------------------------ files
    def arrays(self) -> dict[str, np.ndarray]:
        """Return the model's arrays as stored in the result file."""
        fm = self.factor_model
        out = {"proportions": self.proportions, "decode_proportions": self.decode_proportions,
               "loadings": fm.loadings, "eigenvalues": fm.eigenvalues,
               "multiplier": fm.multiplier, "dp_correlation": self.dp_correlation}
        if self.latent_correlation is not None:
            out["latent_correlation"] = self.latent_correlation
        if self.factors is not None:
            out["factors"] = self.factors
        if self.pair_correction is not None:
            out.update(self.pair_correction.arrays())
        return out

    def file_metadata(self) -> dict[str, Any]:
        """Return the model's JSON metadata as stored in the result file."""
        out = {**self.metadata, "format": MODEL_FORMAT, "mode": self.mode,
               "continuous_link": self.continuous_link, "n_bins": self.n_bins,
               "residual": self.factor_model.residual, "schema_toml": self.schema.to_toml()}
        if self.resolution != "bins":  # absent: files written before the key existed
            out["resolution"] = self.resolution
        if self.missing_cells:  # absent: files written before the key existed
            out["missing_cells"] = True
        return out

    def to_bytes(self) -> bytes:
        """Serialize (a result file)."""
        return encode_result(self.arrays(), self.file_metadata())

    def save(self, path: str | Path) -> Path:
        """Write the model file (``.npz``)."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(self.to_bytes())
        return out

    @classmethod
    def from_result(cls, arrays: Mapping[str, np.ndarray],
                    metadata: Mapping[str, Any]) -> SynthModel:
        """Rebuild from a result file's arrays and metadata (validated)."""
        if metadata.get("format") != MODEL_FORMAT:
            raise ValidationError(f"not a dpfed synthesis model (format "
                                  f"{metadata.get('format')!r}, expected {MODEL_FORMAT!r})")
        try:
            schema = Schema.from_toml(str(metadata["schema_toml"]), "model metadata")
            fm = FactorModel(np.asarray(arrays["loadings"], dtype=np.float64),
                             np.asarray(arrays["eigenvalues"], dtype=np.float64),
                             float(metadata["residual"]),
                             np.asarray(arrays["multiplier"], dtype=np.float64))
            model = cls(schema, str(metadata["mode"]), str(metadata["continuous_link"]),
                        int(metadata["n_bins"]), np.asarray(arrays["proportions"]),
                        np.asarray(arrays["decode_proportions"]), fm,
                        np.asarray(arrays["dp_correlation"]),
                        arrays.get("latent_correlation"), arrays.get("factors"),
                        {k: v for k, v in metadata.items()
                         if k not in ("format", "mode", "continuous_link", "n_bins",
                                      "residual", "schema_toml", "resolution",
                                      "missing_cells")},
                        None, check_resolution(metadata.get("resolution", "bins")),
                        metadata.get("missing_cells", False) is True)
        except KeyError as exc:
            raise ValidationError(f"model file lacks {exc}") from None
        if "pair_edges" in arrays:
            groups = metadata.get("pair_groups")
            if not isinstance(groups, int):
                raise ValidationError("model file has pair tables but no integer pair_groups")
            grid = model.pair_grid(groups)
            model = replace(model, pair_correction=PairCorrection.from_arrays(
                grid, dict(arrays), model.proportions))
        model.decode_links  # noqa: B018 -- validates every block (raises ValidationError)
        if fm.dim != model.links.dim:
            raise ValidationError(f"model loadings have {fm.dim} rows; the schema's latent "
                                  f"dimension is {model.links.dim}")
        return model

    @classmethod
    def from_bytes(cls, data: bytes) -> SynthModel:
        """Load from bytes (a fetched job result)."""
        return cls.from_result(*decode_result(data))

    @classmethod
    def load(cls, path: str | Path) -> SynthModel:
        """Load a model file written by :meth:`save` or ``dpfed synth``."""
        p = Path(path)
        if not p.is_file():
            raise ValidationError(f"model file {p} does not exist")
        return cls.from_result(*decode_result(str(p)))
