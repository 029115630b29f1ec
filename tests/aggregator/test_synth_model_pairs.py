"""SynthModel with DP pair tables: with_pairs, persistence, streamed sampling, refusals.

The model comes from a small central fit and goes through the coordinator steps of the
``synth`` job's two pair rounds (noisy scores -> ``pair_forest``; noisy tables ->
``fit_pair_tables`` -> ``with_pairs``), on one site's releases.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import pytest

from dpfed.aggregator.result_file import decode_result, encode_result
from dpfed.aggregator.synth_model import SynthModel
from dpfed.common.data.encoding import EncodedTable
from dpfed.common.errors import ValidationError
from dpfed.common.synth import factor_model as fm
from dpfed.common.synth import pair_marginals as pm
from dpfed.common.synth.pipeline import pair_forest
from tests.aggregator.test_synth_model import build as build_reference
from tests.common.synth.test_pair_marginals import CAUSE, cause_frame, site_counts, tvd

BINS = 16


class Models(NamedTuple):
    plain: SynthModel  # the factor model alone
    paired: SynthModel  # the same model with the pair correction
    grid: pm.PairGrid
    edges: list[pm.Pair]
    joint: list[np.ndarray]


@pytest.fixture(scope="module")
def models() -> Models:
    real = cause_frame(8000, 11)
    rng = np.random.default_rng(12)
    synth = fm.FactorModelSynthesizer(CAUSE, epsilon=50.0, n_bins=BINS, pairs=0,
                                      rng=rng).fit(real)
    assert synth.proportions_ is not None
    plain = SynthModel.build(CAUSE, mode="generative", continuous_link="quantile",
                             n_bins=BINS, proportions=synth.proportions_,
                             factor_model=synth.model_,
                             dp_correlation=np.eye(synth.model_.dim), rng=rng,
                             latent_correlation=synth.latent_correlation_,
                             metadata={"job_id": "central"}, resolution=synth.resolution)
    # The two pair rounds of one site, then the coordinator's steps.
    grid = plain.pair_grid(pm.DEFAULT_GROUPS)
    cands = grid.candidate_pairs()
    counts, n = site_counts(grid, cands, real)
    scores = pm.dependence_scores(counts, grid, cands, plain.proportions, n)
    noisy_scores = pm.score_mechanism(len(cands), 5.0, 1e-7).release(scores, rng)
    edges = pair_forest(noisy_scores, grid, len(CAUSE.columns) - 1)
    tables, _ = site_counts(grid, edges, real)
    noisy = pm.pair_table_mechanism(len(edges), 20.0, 1e-7).release(tables, rng)
    joint = pm.fit_pair_tables(noisy, grid, edges, plain.proportions, n)
    return Models(plain, plain.with_pairs(grid, edges, joint, rng), grid, edges, joint)


def pair_tvds(m: Models, table: EncodedTable) -> list[float]:
    acc = pm.PairTableAccumulator(m.grid, m.edges)
    acc.add(table)
    return [tvd(t / table.n_rows, j) for t, j in zip(acc.tables(), m.joint, strict=True)]


def encoded_sample(model: SynthModel, rows: int, seed: int, **kwargs: int) -> EncodedTable:
    return EncodedTable.concatenate(list(model.iter_encoded(
        rows, rng=np.random.default_rng(seed), **kwargs)))


def test_with_pairs_fits_generated_rows_to_the_pair_tables(models: Models) -> None:
    m = models
    correction = m.paired.pair_correction
    assert correction is not None and correction.edges == m.edges
    assert m.paired.metadata == {**m.plain.metadata, "pair_groups": pm.DEFAULT_GROUPS}
    assert m.plain.pair_correction is None  # with_pairs returns a new model
    assert len(m.edges) == len(CAUSE.columns) - 1
    before = pair_tvds(m, encoded_sample(m.plain, 100_000, 1))
    after = pair_tvds(m, encoded_sample(m.paired, 100_000, 1))
    assert max(before) > 0.1 and max(after) < 0.02, (before, after)
    frame = m.paired.sample(2000, rng=np.random.default_rng(2))
    assert len(frame) == 2000 and list(frame.columns) == list(CAUSE.names)
    assert frame["year"].between(0, 10).all() and frame["futime"].between(0, 20).all()


def test_save_load_keeps_the_correction_and_the_samples(models: Models, tmp_path: Path) -> None:
    m = models
    loaded = SynthModel.load(m.paired.save(tmp_path / "paired.npz"))
    assert loaded.pair_correction is not None
    assert loaded.pair_correction.edges == m.edges
    assert loaded.metadata["pair_groups"] == pm.DEFAULT_GROUPS
    for name, value in m.paired.arrays().items():
        np.testing.assert_array_equal(loaded.arrays()[name], value)
    pd.testing.assert_frame_equal(m.paired.sample(3000, rng=np.random.default_rng(4)),
                                  loaded.sample(3000, rng=np.random.default_rng(4)))
    again = SynthModel.from_bytes(m.paired.to_bytes())
    pd.testing.assert_frame_equal(m.paired.sample(500, rng=np.random.default_rng(5)),
                                  again.sample(500, rng=np.random.default_rng(5)))
    # A model without pairs stays one (no pair arrays in its file).
    plain = SynthModel.load(m.plain.save(tmp_path / "plain.npz"))
    assert plain.pair_correction is None and "pair_edges" not in plain.arrays()


def test_chunked_sampling_does_not_depend_on_the_workers(models: Models) -> None:
    m = models
    one = encoded_sample(m.paired, 20_001, 6, chunk_rows=4096, workers=0)
    two = encoded_sample(m.paired, 20_001, 6, chunk_rows=4096, workers=2)
    assert one.n_rows == two.n_rows == 20_001
    for name in CAUSE.names:
        np.testing.assert_array_equal(one.columns[name], two.columns[name])
    # The correction is applied to every chunk (here: no cause of death for the living).
    alive = one.columns["death"] == 0
    assert float((one.columns["chapter"][alive] > 0).mean()) < 0.02


def test_row_aligned_models_refuse_pairs() -> None:
    aligned = build_reference("row_aligned")
    grid = aligned.pair_grid(pm.DEFAULT_GROUPS)
    sizes = grid.sizes
    table = np.full((sizes[0], sizes[1]), 1.0 / (sizes[0] * sizes[1]))
    with pytest.raises(ValidationError, match="generative"):
        aligned.with_pairs(grid, [(0, 1)], [table], np.random.default_rng(0))


def test_a_tampered_pair_correction_in_a_model_file_is_rejected(models: Models) -> None:
    m = models
    arrays, meta = decode_result(m.paired.to_bytes())

    def rejected(arrays_: dict[str, np.ndarray], meta_: dict[str, object], match: str) -> None:
        with pytest.raises(ValidationError, match=match):
            SynthModel.from_bytes(encode_result(arrays_, meta_))

    rejected(arrays, {k: v for k, v in meta.items() if k != "pair_groups"}, "pair_groups")
    rejected(arrays, {**meta, "pair_groups": "6"}, "pair_groups")
    rejected(arrays, {**meta, "pair_groups": 1}, "pair_groups")
    rejected(arrays, {**meta, "pair_groups": 2}, "cells")  # another grid: other table sizes
    move = arrays["pair_move"].copy()
    move[0] = 1.5
    rejected({**arrays, "pair_move": move}, meta, "out of range")
    move[0] = math.nan
    rejected({**arrays, "pair_move": move}, meta, "pair_move")
    rejected({**arrays, "pair_dest": arrays["pair_dest"][:-1]}, meta, "cells")
    edges = arrays["pair_edges"].copy()
    edges[0, 1] = len(CAUSE.columns)
    rejected({**arrays, "pair_edges": edges}, meta, "pair column")
    rejected({**arrays, "pair_edges": arrays["pair_edges"][::-1].copy()}, meta,
             "parents first|child of two")
