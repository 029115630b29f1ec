"""The "fine" 1-way release: public cells, the multi-scale estimate, decoding, the model file.

Layers: exact properties of the cells (every value in one leaf, leaves decode inside
themselves, whole numbers round trip); noise-free estimates that must return the truth;
seeded statistical checks of the estimate under noise, each run against a broken copy (the
projection onto the simplex that the "bins" layout uses, or no shape test) that must fail the
same check; end to end, a column with point masses and a long tail synthesized at a generous
epsilon must match its released marginal at the evaluation's resolution.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dpfed.aggregator.synth_model import SynthModel
from dpfed.common.data.encoding import encode_table
from dpfed.common.data.schema import ContinuousColumn, NominalColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.job_params import SynthParams
from dpfed.common.synth import marginal_estimate as me
from dpfed.common.synth.column_cells import (
    column_cells,
    release_counts,
    schema_cells,
    sub_bins,
)
from dpfed.common.synth.factor_model import FactorModelSynthesizer
from dpfed.common.synth.link_release import (
    LinkHistogramAccumulator,
    histogram_sizes,
    link_sizes,
    project_counts,
    proportions_from_histograms,
    split_proportions,
)
from dpfed.common.synth.quantile_link import QuantileLink, bin_codes, point_values, roundest

COUNT = ContinuousColumn("visits", 0.0, 100.0, integer=True)       # whole-number cells
LONG = ContinuousColumn("days", 0.0, 400.0, integer=True)          # bins of whole numbers
LAB = ContinuousColumn("lab", 0.0, 50.0)                           # bins of sub-cells
SCHEMA = Schema((COUNT, LONG, LAB, NominalColumn("sex", ("f", "m"))))
BINS = 32


# --------------------------------------------------------------------------- cells


@pytest.mark.parametrize("column", [COUNT, LONG, LAB])
def test_every_value_falls_in_one_leaf_and_decodes_inside_it(column: ContinuousColumn) -> None:
    cells = column_cells(column, BINS, 16, "fine")
    rng = np.random.default_rng(1)
    v = np.concatenate([rng.uniform(column.min, column.max, 5000),
                        [column.min, column.max, column.min - 7, column.max + 1e9]])
    if column.integer:
        v = np.rint(v)
    leaf = cells.codes(v)
    assert leaf.min() >= 0 and leaf.max() < cells.n_leaves
    clipped = np.clip(v, column.min, column.max)
    assert np.all(cells.lo[leaf] <= clipped) and np.all(clipped <= cells.hi[leaf] + 1e-9)
    back = cells.values(leaf, rng.random(leaf.size))
    assert np.all(cells.lo[leaf] <= back) and np.all(back <= cells.hi[leaf])
    assert np.all(np.diff(cells.coarse) >= 0) and cells.coarse[-1] == cells.n_coarse - 1
    if column.integer:
        assert np.all(back == np.rint(back))


def test_whole_numbers_round_trip_and_bounds_are_point_cells() -> None:
    count = column_cells(COUNT, BINS, 16, "fine")
    assert count.kind == "whole" and count.n_leaves == 101 and not count.has_fine
    k = np.arange(101.0)
    np.testing.assert_array_equal(count.values(count.codes(k), np.full(101, 0.7)), k)
    long = column_cells(LONG, BINS, 16, "fine")  # 401 whole numbers: bins of whole numbers
    assert long.kind == "fine" and long.has_fine and long.n_coarse == BINS + 2
    k = np.arange(401.0)
    np.testing.assert_array_equal(long.values(long.codes(k), np.full(401, 0.3)), k)
    lab = column_cells(LAB, BINS, 16, "fine")
    assert lab.lo[0] == lab.hi[0] == 0.0 and lab.lo[-1] == lab.hi[-1] == 50.0
    assert lab.codes(np.array([0.0, 1e-12, 50.0]))[[0, 2]].tolist() == [0, lab.n_leaves - 1]
    assert lab.codes(np.array([1e-12]))[0] == 1  # just inside: the first bin's first leaf


def test_bins_layout_is_the_legacy_equal_width_bins() -> None:
    cells = column_cells(LAB, BINS, 16, "bins")
    v = np.random.default_rng(2).uniform(-5, 55, 1000)
    np.testing.assert_array_equal(cells.codes(v), bin_codes(LAB, v, BINS))
    assert histogram_sizes(SCHEMA, BINS) == (BINS, BINS, BINS, 2)
    assert link_sizes(SCHEMA, BINS, "fine") == tuple(
        c.n_leaves for c in schema_cells(SCHEMA, BINS, "fine").values()) + (2,)


def test_leaves_per_bin_shrink_with_the_schema_width() -> None:
    many = Schema(tuple(ContinuousColumn(f"c{i}", 0.0, 1.0) for i in range(400)))
    assert sub_bins(SCHEMA, BINS) == 64
    assert sub_bins(many, BINS) == 8  # 400 x 32 x 8 leaves stay near the leaf budget
    assert sum(link_sizes(many, BINS, "fine")) <= 2 * (1 << 17)


def test_release_counts_are_the_coarse_sums_then_the_inner_leaves() -> None:
    cells = column_cells(LAB, BINS, 16, "fine")
    leaves = np.arange(cells.n_leaves, dtype=float)
    block = release_counts(cells, leaves)
    assert block.shape == (cells.release_size,)
    np.testing.assert_allclose(block[:cells.n_coarse],
                               np.bincount(cells.coarse, weights=leaves))
    np.testing.assert_allclose(block[cells.n_coarse:], leaves[1:-1])


# --------------------------------------------------------------------------- estimate


def zero_inflated(n: int, seed: int) -> np.ndarray:
    """A count column: 60 % zeros, a geometric body, a few values at the ceiling."""
    rng = np.random.default_rng(seed)
    v = np.where(rng.random(n) < 0.6, 0.0, 1.0 + rng.geometric(0.25, n))
    v[rng.random(n) < 0.02] = 400.0
    return np.clip(v, 0, 400)


def release_block(cells: object, values: np.ndarray, sd: float, seed: int) -> np.ndarray:
    leaves = np.bincount(cells.codes(values), minlength=cells.n_leaves)  # type: ignore[attr-defined]
    exact = release_counts(cells, leaves)  # type: ignore[arg-type]
    return np.asarray(exact + np.random.default_rng(seed).normal(0.0, sd, exact.shape))


def test_a_noise_free_release_is_estimated_exactly() -> None:
    cells = column_cells(LONG, BINS, 16, "fine")
    v = zero_inflated(5000, 3)
    block = release_block(cells, v, 0.0, 0)
    truth = np.bincount(cells.codes(v), minlength=cells.n_leaves).astype(float)
    got = me.column_masses(cells, block, np.full(block.shape, 1e-9), len(v))
    np.testing.assert_allclose(got, truth, atol=1e-6)


def tail_mass(masses: np.ndarray, cells: object, above: float) -> float:
    return float(masses[cells.lo > above].sum() / masses.sum())  # type: ignore[attr-defined]


def test_empty_tails_stay_empty_where_the_projection_keeps_noise() -> None:
    # The tail beyond 40 holds 2 % at the ceiling and nothing else; 34 coarse cells and
    # hundreds of leaves of noise around it.
    cells = column_cells(LONG, BINS, 16, "fine")
    v = zero_inflated(5000, 4)
    real_tail = float(np.mean((v > 40) & (v < 400)))
    sd = 12.0
    mine, projected = [], []
    for seed in range(20):
        block = release_block(cells, v, sd, seed)
        est = me.column_masses(cells, block, np.full(block.shape, sd), len(v))
        mine.append(tail_mass(est, cells, 40) - tail_mass(est, cells, 399))
        # Broken copy: the coarse cells projected onto the simplex (the "bins" estimate).
        coarse = project_counts(block[:cells.n_coarse], len(v))
        inner = np.repeat(coarse[1:-1] / np.bincount(cells.coarse)[1:-1],
                          np.bincount(cells.coarse)[1:-1])
        flat = np.concatenate([[coarse[0]], inner, [coarse[-1]]])
        projected.append(tail_mass(flat, cells, 40) - tail_mass(flat, cells, 399))
    assert real_tail < 1e-3
    assert np.mean(mine) < 0.005          # a few noise draws' worth (measured 0.0035)
    # the projection keeps noise in every empty bin (measured 0.0081): more than twice
    assert np.mean(projected) > 2.0 * np.mean(mine)


def test_a_flat_column_as_noisy_as_it_is_full_stays_flat() -> None:
    # 40 whole numbers of about 70 rows each, noise of 60 per cell: an estimate that empties
    # every half that looks empty collects the rows on noise peaks.
    age = ContinuousColumn("age", 25.0, 64.0, integer=True)
    cells = column_cells(age, BINS, 16, "fine")
    v = np.random.default_rng(8).integers(25, 65, 2800).astype(float)
    truth = np.bincount(cells.codes(v), minlength=cells.n_leaves) / len(v)
    sd = 60.0

    def error(snr: float, empty_tau: float) -> float:
        old = me.SPARSE_SNR, me.EMPTY_TAU
        me.SPARSE_SNR, me.EMPTY_TAU = snr, empty_tau
        try:
            out = []
            for seed in range(12):
                block = release_block(cells, v, sd, seed)
                est = me.column_masses(cells, block, np.full(block.shape, sd), len(v))
                out.append(0.5 * float(np.abs(est / len(v) - truth).sum()))
            return float(np.mean(out))
        finally:
            me.SPARSE_SNR, me.EMPTY_TAU = old

    flat = error(me.SPARSE_SNR, me.EMPTY_TAU)
    assert flat < 0.15          # measured 0.10 (the flat prior alone: 0.08)
    # Broken copy: a half is emptied whenever its sum is within 3 deviations of 0.
    assert error(0.0, 3.0) > 2.0 * flat  # measured 0.58


def test_point_masses_inside_a_bin_are_resolved_and_smooth_bins_keep_their_shape() -> None:
    cells = column_cells(LAB, BINS, 16, "fine")
    rng = np.random.default_rng(5)
    v = np.concatenate([rng.uniform(10.0, 40.0, 20_000), np.full(3000, 25.0)])
    truth = np.bincount(cells.codes(v), minlength=cells.n_leaves).astype(float)
    heap = cells.codes(np.array([25.0]))[0]
    smooth = (cells.lo >= 11.0) & (cells.hi <= 39.0) & (cells.coarse != cells.coarse[heap])
    sd = 20.0  # per leaf: more than the ~65 rows' own sampling spread (8)

    def errors(shape_tau: float) -> tuple[float, float]:
        old = me.SHAPE_TAU
        me.SHAPE_TAU = shape_tau
        try:
            heap_err, smooth_err = [], []
            for seed in range(8):
                block = release_block(cells, v, sd, seed)
                est = me.column_masses(cells, block, np.full(block.shape, sd), len(v))
                heap_err.append(abs(est[heap] - truth[heap]) / truth[heap])
                smooth_err.append(float(np.abs(est[smooth] - truth[smooth]).mean()))
            return float(np.mean(heap_err)), float(np.mean(smooth_err))
        finally:
            me.SHAPE_TAU = old

    heap_err, smooth_err = errors(me.SHAPE_TAU)
    assert heap_err < 0.05  # the heap's leaf is found (3 000 rows in one leaf of 64)
    # Broken copy: no shape test -- every split follows the noisy leaves.
    _, noisy_err = errors(0.0)
    assert smooth_err < 0.6 * noisy_err


def test_heaps_keep_their_rows_and_smooth_bins_are_left_as_they_were() -> None:
    # A smooth reading (about 8 rows per leaf) heaped on six round values (120 rows each):
    # a heap is 6 noise deviations, found bottom-up; top-down, half a bin's summed noise
    # (20 sqrt(8)) hides most of it.
    cells = column_cells(LAB, BINS, 16, "fine")
    rng = np.random.default_rng(5)
    points = np.array([12.0, 15.0, 20.0, 25.0, 30.0, 35.0])
    v = np.concatenate([rng.uniform(10.0, 40.0, 4000), np.repeat(points, 120)])
    truth = np.bincount(cells.codes(v), minlength=cells.n_leaves).astype(float)
    heaps = cells.codes(points)
    smooth = (cells.lo >= 11.0) & (cells.hi <= 39.0) & ~np.isin(cells.coarse,
                                                                cells.coarse[heaps])
    sd = 20.0

    def errors(with_heaps: bool) -> tuple[float, float]:
        heap_err, smooth_err = [], []
        for seed in range(8):
            block = release_block(cells, v, sd, seed)
            est = me.column_masses(cells, block, np.full(block.shape, sd), len(v),
                                   heaps=with_heaps)
            assert est.min() >= 0.0 and est.sum() == pytest.approx(len(v))
            heap_err.append(float(np.mean(np.abs(est[heaps] - truth[heaps]) / truth[heaps])))
            smooth_err.append(float(np.abs(est[smooth] - truth[smooth]).mean()))
        return float(np.mean(heap_err)), float(np.mean(smooth_err))

    heap_err, smooth_err = errors(True)
    assert heap_err < 0.2  # measured 0.11
    # Broken copy (the estimate of jobs made before): heaps split top-down, measured 0.39.
    old_heap_err, old_smooth_err = errors(False)
    assert old_heap_err > 2.0 * heap_err
    assert smooth_err <= 1.05 * old_smooth_err  # no heap invented in a smooth bin


@pytest.mark.parametrize("heaps", [False, True])
def test_the_estimate_is_non_negative_and_sums_to_n_for_any_noisy_block(heaps: bool) -> None:
    cells = column_cells(LAB, BINS, 16, "fine")
    rng = np.random.default_rng(6)
    for _ in range(20):
        block = rng.normal(0, 50, cells.release_size) * rng.choice([0, 1, 1e3], cells.release_size)
        sd = np.abs(rng.normal(5, 3, cells.release_size)) + 1e-3
        est = me.column_masses(cells, block, sd, 1234.0, heaps=heaps)
        assert np.all(est >= 0) and est.sum() == pytest.approx(1234.0)


def test_fine_proportions_need_the_noise_level() -> None:
    acc = LinkHistogramAccumulator(SCHEMA, BINS, "fine")
    with pytest.raises(ValidationError, match="noise_sd"):
        proportions_from_histograms(acc.counts.astype(float), SCHEMA, BINS, n_rows=10,
                                    resolution="fine")


# --------------------------------------------------------------------------- decoding


def test_roundest_prefers_round_numbers() -> None:
    assert roundest(1.992, 2.006) == 2.0
    assert roundest(2.4976, 2.5122) == 2.5
    assert roundest(123.4, 131.2) == 130.0
    assert roundest(-0.3, 0.2) == 0.0
    lo, hi = 6.9004, 6.915
    assert lo <= roundest(lo, hi) < hi


def test_a_heap_decodes_to_its_round_number_and_smooth_cells_spread() -> None:
    cells = column_cells(LAB, BINS, 16, "fine")
    p = np.full(cells.n_leaves, 1.0)
    p[[0, -1]] = 1e-6
    heap = cells.codes(np.array([25.0]))[0]
    p[heap] = 40.0
    p /= p.sum()
    points = point_values(cells, p)
    assert points[heap] == 25.0 and np.isnan(np.delete(points, heap)).all()
    link = QuantileLink(LAB, proportions=p, cells=cells)
    z = np.random.default_rng(7).standard_normal((200_000, 1))
    y = link.inverse(z)
    share = np.mean(y == 25.0)
    assert share == pytest.approx(p[heap], abs=0.005)
    assert np.unique(y).size > 10_000  # the rest is continuous


def test_fine_sample_matches_its_released_marginal_at_a_generous_epsilon() -> None:
    # A count with 60 % zeros, a body and a ceiling; a lab value heaped on 2.5 steps.
    rng = np.random.default_rng(8)
    n = 20_000
    frame = pd.DataFrame({"visits": np.clip(zero_inflated(n, 9), 0, 100),
                          "days": zero_inflated(n, 10),
                          "lab": np.where(rng.random(n) < 0.5, 2.5 * rng.integers(2, 12, n),
                                          rng.uniform(0, 50, n)),
                          "sex": rng.choice(["f", "m"], n)})
    synth = FactorModelSynthesizer(SCHEMA, epsilon=50.0, delta=1e-6, n_bins=BINS, pairs=0,
                                   rng=np.random.default_rng(11)).fit(frame)
    out = synth.sample(n)
    for name in ("visits", "days"):
        real = frame[name].value_counts(normalize=True)
        fake = out[name].value_counts(normalize=True)
        cells = real.index.union(fake.index)
        tvd = 0.5 * float(np.abs(real.reindex(cells, fill_value=0)
                                 - fake.reindex(cells, fill_value=0)).sum())
        assert tvd < 0.03, name  # at whole-number resolution
    heaped = frame["lab"].isin(2.5 * np.arange(2, 12)).mean()
    assert out["lab"].isin(2.5 * np.arange(2, 12)).mean() == pytest.approx(heaped, abs=0.03)
    # The "bins" layout spreads the zeros over its first bin (the failure).
    old = FactorModelSynthesizer(SCHEMA, epsilon=50.0, delta=1e-6, n_bins=BINS, pairs=0,
                                 resolution="bins", rng=np.random.default_rng(11)).fit(frame)
    zeros = float(old.sample(n)["visits"].eq(0).mean())
    assert abs(zeros - float(frame["visits"].eq(0).mean())) > 0.2


def _sick_counts(n: int, seed: int) -> pd.DataFrame:
    """Zero-inflated visits and a chronic-condition count, both raised by sickness."""
    rng = np.random.default_rng(seed)
    sick = rng.random(n) < 0.4
    chronic = np.clip(rng.poisson(np.where(sick, 3.0, 0.7)), 0, 10).astype(float)
    visits = np.where(rng.random(n) < np.where(sick, 0.3, 0.7), 0.0,
                      1.0 + rng.geometric(0.15, n))
    return pd.DataFrame({"visits": np.clip(visits, 0, 100), "chronic": chronic,
                         "lab": np.clip(rng.normal(np.where(sick, 30, 20), 6), 0, 50),
                         "sex": rng.choice(["f", "m"], n)})


def test_zero_inflated_counts_are_sampled_exactly_from_their_released_marginal() -> None:
    # The job's steps on one table (links, factor model, calibration, pair rounds and the pair
    # correction) at epsilon 1000: the synthetic count columns must be their released pmf,
    # up to the sampling error of the rows drawn. Tolerance: twice the expected TVD of a
    # multinomial sample of as many rows from the pmf itself, 0.5 sum sqrt(2 p (1-p) / (pi n))
    # (0.0015 and 0.0010 here). Calibrating the decoding thresholds on 50 000 simulated rows
    # and fitting the pair correction's moves on their unraked tables gave 4-6 times that.
    schema = Schema((COUNT, ContinuousColumn("chronic", 0.0, 10.0, integer=True), LAB,
                     NominalColumn("sex", ("f", "m"))))
    synth = FactorModelSynthesizer(schema, epsilon=1000.0, delta=1e-6,
                                   rng=np.random.default_rng(40)).fit(_sick_counts(3000, 30))
    assert synth.pair_edges_  # the pair correction runs
    n = 1_000_000
    out = encode_table(schema, synth.sample(n))[0]
    blocks = split_proportions(synth.proportions_, schema, synth.n_bins, "fine")
    cells = schema_cells(schema, synth.n_bins, "fine")
    for name in ("visits", "chronic"):
        p = blocks[name]
        q = np.bincount(cells[name].codes(out.columns[name]), minlength=p.size) / n
        sampling = 0.5 * float(np.sqrt(2.0 * p * (1.0 - p) / (np.pi * n)).sum())
        assert 0.5 * float(np.abs(q - p).sum()) < 2.0 * sampling, name


# --------------------------------------------------------------------------- job and file


def test_the_parameter_is_bins_for_stored_jobs_and_fine_for_new_ones() -> None:
    stored = SynthParams.parse({}, None)
    assert stored.resolution == "bins" and "resolution" not in stored.to_mapping()
    new = SynthParams.parse(SynthParams.submitted({}), None)
    assert new.resolution == "fine" and new.to_mapping()["resolution"] == "fine"
    with pytest.raises(ValidationError, match="--resolution"):
        SynthParams.parse({"resolution": "coarse"}, None)


def test_a_fine_model_file_round_trips_and_a_legacy_one_is_bins(tmp_path: object) -> None:
    rng = np.random.default_rng(12)
    frame = pd.DataFrame({"visits": np.clip(zero_inflated(3000, 13), 0, 100),
                          "days": zero_inflated(3000, 14), "lab": rng.uniform(0, 50, 3000),
                          "sex": rng.choice(["f", "m"], 3000)})
    synth = FactorModelSynthesizer(SCHEMA, epsilon=5.0, n_bins=BINS, pairs=0,
                                   rng=rng).fit(frame)
    assert synth.proportions_ is not None
    model = SynthModel.build(SCHEMA, mode="generative", continuous_link="quantile",
                             n_bins=BINS, proportions=synth.proportions_,
                             factor_model=synth.model_, dp_correlation=np.eye(synth.model_.dim),
                             rng=rng, resolution="fine")
    again = SynthModel.from_bytes(model.to_bytes())
    assert again.resolution == "fine"
    a = again.sample(500, rng=np.random.default_rng(1))
    b = model.sample(500, rng=np.random.default_rng(1))
    pd.testing.assert_frame_equal(a, b)
    arrays, meta = model.arrays(), model.file_metadata()
    meta.pop("resolution")
    with pytest.raises(ValidationError):  # a fine model read as "bins" has the wrong blocks
        SynthModel.from_result(arrays, meta)
    assert split_proportions(again.proportions, SCHEMA, BINS, "fine")["visits"].size == 101
    assert encode_table(SCHEMA, a)[0].n_rows == 500
