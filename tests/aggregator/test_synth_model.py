"""SynthModel: typed samples, chunked Parquet/CSV output, file round trip, bad input."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dpfed.aggregator.synth_cli import write_progress
from dpfed.aggregator.synth_model import SynthModel, check_rows
from dpfed.aggregator.synth_report import synth_report
from dpfed.common.data.encoding import encode_table
from dpfed.common.data.schema import ContinuousColumn, NominalColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.pca import dppca
from dpfed.common.synth.generative import fit_factor_model
from dpfed.common.synth.link_release import (
    LinkHistogramAccumulator,
    links_from_proportions,
    proportions_from_histograms,
    split_proportions,
)
from dpfed.common.synth.links import clip_to_unit_ball, default_clip_norm
from dpfed.common.synth.missing_cells import cells_schema, to_cells_table
from tests.common.synth.test_link_release import SCHEMA, skewed_frame

BINS = 16


def build(mode: str = "generative", seed: int = 0, schema: Schema = SCHEMA,
          frame: pd.DataFrame | None = None) -> SynthModel:
    """A model fitted to ``frame`` (default: 5000 skewed rows of the fixture ``SCHEMA``).

    One noisy PCA release, exact link histograms: enough to exercise sampling and outputs.
    """
    rows, _ = encode_table(schema, skewed_frame(5000, seed) if frame is None else frame)
    cells = cells_schema(schema)  # a missing cell per missing = "category" column
    table = to_cells_table(rows, cells)
    acc = LinkHistogramAccumulator(cells, BINS)
    acc.add(table)
    props = proportions_from_histograms(acc.counts.astype(float), cells, BINS)
    links = links_from_proportions(cells, props, BINS)
    rng = np.random.default_rng(seed)
    clip = default_clip_norm(links.dim)
    unit, _ = clip_to_unit_ball(links.to_latent(table, rng), clip)
    g = dppca.GramAccumulator(links.dim)
    g.add(unit)
    rel = dppca.site_release(g.gram(), table.n_rows, epsilon=5.0, delta=1e-6,
                             rank=links.dim, rng=rng)
    est = dppca.combine([rel.factor], links.dim)
    fm, corr = fit_factor_model(est, links, clip_norm=clip, rng=rng,
                                correct_correlation=mode == "generative")
    factors = None
    if mode == "row_aligned":
        factors = unit @ fm.loadings + rng.laplace(0, 0.1, (table.n_rows, fm.rank))
    return SynthModel.build(schema, mode=mode, continuous_link="quantile", n_bins=BINS,
                            proportions=props, factor_model=fm, dp_correlation=np.eye(links.dim),
                            rng=rng, latent_correlation=corr, factors=factors,
                            metadata={"job_id": "test", "plan": [
                                {"round": "links", "epsilon": 0.4, "delta": 5e-7}]},
                            missing_cells=cells is not schema)


def test_sample_is_typed_and_within_bounds() -> None:
    frame = build().sample(3000, rng=np.random.default_rng(1))
    assert len(frame) == 3000 and list(frame.columns) == list(SCHEMA.names)
    for col in SCHEMA.columns:
        if isinstance(col, ContinuousColumn):
            assert frame[col.name].dtype == np.float64
            assert frame[col.name].between(col.min, col.max).all()
        else:
            dtype = frame[col.name].dtype
            assert isinstance(dtype, pd.CategoricalDtype)
            assert dtype.ordered == (col.type == "ordinal")


def test_ordinal_and_quantile_columns_decode_with_their_released_proportions() -> None:
    # The generative latent is exactly N(0, covariance) with unit variances: its normal
    # thresholds at the released cumulative proportions decode to the release exactly, with
    # no simulated rows (whose sampling error a calibration on them would carry).
    model = build()
    cells = model.cells_schema
    released = split_proportions(model.proportions, cells, BINS, model.resolution)
    decoded = split_proportions(model.decode_proportions, cells, BINS, model.resolution)
    for col in cells.columns:
        if not isinstance(col, NominalColumn):
            np.testing.assert_allclose(decoded[col.name], released[col.name], rtol=0,
                                       atol=1e-12, err_msg=col.name)


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_write_streams_in_chunks(tmp_path: Path, suffix: str) -> None:
    model = build()
    out = tmp_path / f"synth.{suffix}"
    assert model.write(out, 25_001, chunk_rows=4096, rng=np.random.default_rng(2)) == 25_001
    back = pq.read_table(out).to_pandas() if suffix == "parquet" else pd.read_csv(out)
    assert len(back) == 25_001 and list(back.columns) == list(SCHEMA.names)
    if suffix == "parquet":
        assert pq.ParquetFile(out).metadata.num_row_groups >= 6  # written chunk by chunk
    assert not (tmp_path / f"synth.{suffix}.partial").exists()


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    model = build()
    loaded = SynthModel.load(model.save(tmp_path / "m.npz"))
    np.testing.assert_array_equal(loaded.decode_proportions, model.decode_proportions)
    a = model.sample(500, rng=np.random.default_rng(3))
    b = loaded.sample(500, rng=np.random.default_rng(3))
    pd.testing.assert_frame_equal(a, b)
    with pytest.raises(ValidationError, match="does not exist"):
        SynthModel.load(tmp_path / "nope.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a model")
    with pytest.raises(ValidationError):
        SynthModel.load(tmp_path / "junk.npz")


def test_rows_validation_names_the_flag() -> None:
    for bad in (0, -1, 10**11, 2.5, True):
        with pytest.raises(ValidationError, match="--rows"):
            check_rows(bad)
    model = build("row_aligned")
    assert model.n_rows_fixed == 5000 and len(model.sample()) == 5000
    with pytest.raises(ValidationError, match="--rows"):
        model.sample(10)
    with pytest.raises(ValidationError, match="--rows"):
        build().sample(None)


def test_report_has_marginals_heatmaps_and_budget() -> None:
    model = build()
    html = synth_report(model, model.sample(2000, rng=np.random.default_rng(4)))
    assert html.count("data:image/png;base64,") == 2
    assert "Privacy budget" in html and "TVD(DP marginal, synthetic)" in html


def test_a_tampered_model_file_is_rejected(tmp_path: Path) -> None:
    model = build()
    arrays, meta = model.arrays(), model.file_metadata()
    arrays["loadings"] = arrays["loadings"][:-1]
    with pytest.raises(ValidationError):
        SynthModel.from_result(arrays, meta)
    with pytest.raises(ValidationError, match="format"):
        SynthModel.from_result(model.arrays(), {**meta, "format": "other"})


def test_schema_of_the_fixture_has_every_column_type() -> None:
    assert {c.type for c in Schema.from_toml(SCHEMA.to_toml()).columns} == {
        "continuous", "ordinal", "nominal"}


def test_parallel_write_equals_one_thread_and_reports_progress(tmp_path: Path) -> None:
    model = build()
    seen: list[tuple[int, int]] = []
    model.write(tmp_path / "one.parquet", 20_000, chunk_rows=3000, workers=0,
                rng=np.random.default_rng(7))
    model.write(tmp_path / "two.parquet", 20_000, chunk_rows=3000, workers=2,
                rng=np.random.default_rng(7), progress=lambda w, t: seen.append((w, t)))
    one, two = pq.read_table(tmp_path / "one.parquet"), pq.read_table(tmp_path / "two.parquet")
    assert one.equals(two)
    assert seen == [(min(3000 * (i + 1), 20_000), 20_000) for i in range(7)]
    meta = pq.ParquetFile(tmp_path / "two.parquet").metadata
    assert meta.num_row_groups == 7 and meta.num_rows == 20_000
    for col in SCHEMA.columns:  # floats; categoricals dictionary-encoded with the labels
        field = one.schema.field(col.name)
        if isinstance(col, ContinuousColumn):
            assert field.type == pa.float64()
        else:
            assert pa.types.is_dictionary(field.type)
            labels = col.levels if col.type == "ordinal" else col.categories
            assert one.column(col.name).chunk(0).dictionary.to_pylist() == list(labels)


def test_row_aligned_write_reports_its_fixed_row_count(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    model = build("row_aligned")
    assert model.write(tmp_path / "r.csv", chunk_rows=2000,
                       progress=lambda w, t: seen.append((w, t))) == 5000
    assert seen == [(2000, 5000), (4000, 5000), (5000, 5000)]
    assert len(pd.read_csv(tmp_path / "r.csv")) == 5000


def test_cli_progress_lines_for_long_writes(capsys: pytest.CaptureFixture[str]) -> None:
    report = write_progress("out.parquet", every=0.0)
    report(250, 1000)
    report(1000, 1000)  # the end is announced by the caller ("wrote ...")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("writing out.parquet: 250 / 1,000 rows (25%)")
    quiet = write_progress("out.parquet")  # a write shorter than 2 s prints nothing
    quiet(500, 1000)
    assert capsys.readouterr().err == ""


def test_write_memory_does_not_grow_with_the_row_count(tmp_path: Path) -> None:
    model = build()
    peaks = []
    for rows in (4 * 8192, 24 * 8192):
        tracemalloc.start()
        model.write(tmp_path / f"m{rows}.parquet", rows, chunk_rows=8192, workers=1,
                    rng=np.random.default_rng(8))
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    # At most workers + 2 chunks exist at a time, whatever the row count (a chunk of 8192
    # rows is ~0.4 MB here; holding all 24 chunks would be ~10 MB).
    assert peaks[1] < 1.5 * peaks[0] + 2**20, peaks


def test_repr_is_one_short_line() -> None:
    for mode in ("generative", "row_aligned"):
        model = build(mode)
        text = repr(model)
        assert "\n" not in text and len(text) < 200, text
        assert text.startswith("SynthModel(") and f"mode={mode!r}" in text
        assert f"columns={len(model.schema.columns)}" in text
        assert ("rows=" in text) == (mode == "row_aligned")
