"""Comparing a synthetic table with real rows (simulation and site reports only)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dpfed.aggregator.report import Report
from dpfed.aggregator.synth_model import SynthModel
from dpfed.aggregator.synth_report import add_real_rows_section, synth_report
from dpfed.common.data.encoding import encode_table
from dpfed.common.data.schema import ContinuousColumn, NominalColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.synth.column_cells import column_cells
from dpfed.common.synth.factor_model import FactorModelSynthesizer
from dpfed.common.synth.fidelity import column_fidelity, quantile_cuts, released_quantile_band

SCHEMA = Schema((ContinuousColumn("visits", 0.0, 60.0, integer=True),
                 ContinuousColumn("lab", 0.0, 200.0), NominalColumn("sex", ("f", "m"))))


def frame(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(n)
    return pd.DataFrame({"visits": np.where(rng.random(n) < 0.6, 0, rng.geometric(0.3, n)),
                         "lab": np.clip(100 + 15 * z, 0, 200),
                         "sex": np.where(z + rng.standard_normal(n) > 0, "m", "f")})


def test_quantile_cuts_sit_between_distinct_values() -> None:
    v = np.array([0] * 60 + [1] * 20 + [2] * 10 + [5] * 10, dtype=float)
    cuts = quantile_cuts(v, 20)
    np.testing.assert_allclose(cuts, [0.5, 1.5, 3.5])
    assert quantile_cuts(np.ones(10)).size == 0


def test_point_masses_and_tails_are_compared() -> None:
    real = encode_table(SCHEMA, frame(5000, 1))[0]
    same = encode_table(SCHEMA, frame(5000, 2))[0]
    smeared = frame(5000, 3)
    smeared["visits"] = np.where(smeared["visits"] == 0, np.random.default_rng(4).integers(
        0, 4, 5000), smeared["visits"])  # the zeros spread over 0..3, as one wide bin would
    fid = {f.column: f for f in column_fidelity(SCHEMA, real, same)}
    bad = {f.column: f for f in column_fidelity(SCHEMA, real, encode_table(SCHEMA,
                                                                           smeared)[0])}
    assert fid["visits"].tvd < 0.03 and bad["visits"].tvd > 0.3
    assert fid["visits"].mode is not None and fid["visits"].mode[0] == 0.0
    assert bad["visits"].mode is not None and bad["visits"].mode[2] < 0.3
    assert fid["lab"].real_tail is not None and fid["lab"].synthetic_tail is not None
    assert fid["lab"].real_tail[2] == pytest.approx(fid["lab"].synthetic_tail[2], rel=0.03)
    assert fid["sex"].real_tail is None and fid["sex"].tvd < 0.03
    with pytest.raises(ValidationError):
        column_fidelity(SCHEMA, encode_table(SCHEMA, frame(1, 5))[0], same)


def test_the_quantile_band_covers_the_noise_of_the_release() -> None:
    cells = column_cells(SCHEMA.columns[1], 32, 16, "fine")
    v = frame(20_000, 6)["lab"].to_numpy()
    p = np.bincount(cells.codes(v), minlength=cells.n_leaves) + 1e-9
    sd = np.full(cells.n_coarse, 30.0)
    low, mid, high = released_quantile_band(cells, p / p.sum(), sd, 20_000, 0.99)
    assert low <= np.quantile(v, 0.99) <= high and low < mid < high
    narrow = released_quantile_band(cells, p / p.sum(), sd / 100, 20_000, 0.99)
    assert narrow[2] - narrow[0] <= high - low


def test_the_simulation_report_compares_with_the_real_rows() -> None:
    rows = frame(6000, 7)
    synth = FactorModelSynthesizer(SCHEMA, epsilon=5.0, n_bins=32, pairs=0,
                                   rng=np.random.default_rng(8)).fit(rows)
    assert synth.proportions_ is not None
    model = SynthModel.build(SCHEMA, mode="generative", continuous_link="quantile", n_bins=32,
                             proportions=synth.proportions_, factor_model=synth.model_,
                             dp_correlation=np.eye(synth.model_.dim),
                             rng=np.random.default_rng(9), resolution="fine",
                             metadata={"plan": [{"round": "links", "epsilon": 4.0,
                                                 "delta": 5e-7}],
                                       "rounds": {"links": ["central"]}, "n_rows_total": 6000})
    sample = model.sample(6000, rng=np.random.default_rng(10))
    real = encode_table(SCHEMA, rows)[0]
    figures = add_real_rows_section(Report("t"), model, real, encode_table(SCHEMA, sample)[0])
    assert figures["columns"]["visits"]["tvd"] < 0.05
    assert figures["correlation_error"] < 0.1
    assert "[" in figures["columns"]["lab"]["p99_band"]
    html = synth_report(model, sample, real=real)
    assert "against the real rows" in html and "released p99" in html
    assert "against the real rows" not in synth_report(model, sample)  # never without them
