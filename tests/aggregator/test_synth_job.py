"""The synth job's coordinator-side checks: bad input fails before any site is charged, the
DP evaluation summary's parameters, and what the report shows of rounds and summaries."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dpfed.aggregator.synth_report import synth_report
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.job_params import SynthParams
from dpfed.common.jobs.registry import job_kind
from tests.aggregator.test_synth_model import build
from tests.common.synth.test_link_release import SCHEMA

ONE_COLUMN = Schema.from_toml('[[columns]]\nname = "age"\ntype = "continuous"\nmin = 0\nmax = 1\n')


def validate(schema: Schema, epsilon: float, delta: float, **params: object) -> dict[str, object]:
    return job_kind("synth").canonical(params, epsilon, delta, schema)


@pytest.mark.parametrize("schema, epsilon, delta, params, match", [
    (ONE_COLUMN, 1.0, 1e-6, {}, "1 column.*synth needs at least 2"),
    (SCHEMA, 0.0, 1e-6, {}, "epsilon"),
    (SCHEMA, 1.0, 0.0, {}, "delta"),
    (SCHEMA, 1.0, 1e-6, {"summary_epsilon": 0.5, "summary_delta": 1e-6},
     "--evaluate-summary-epsilon needs --evaluate"),
    (SCHEMA, 1.0, 1e-6, {"evaluate_rows": 100, "summary_epsilon": 0.5, "summary_delta": 0.0},
     "--evaluate-summary-delta"),
    (SCHEMA, 1.0, 1e-6, {"evaluate_rows": 100, "summary_epsilon": -1, "summary_delta": 1e-6},
     "--evaluate-summary-epsilon"),
    (SCHEMA, 1.0, 1e-6, {"evaluate_rows": 100, "summary_delta": 1e-6},
     "--evaluate-summary-delta needs --evaluate-summary-epsilon"),
    (SCHEMA, 1.0, 1e-6, {"evaluate_rows": 10**6}, "evaluate_rows"),
])
def test_bad_input_is_refused_at_validation(schema: Schema, epsilon: float, delta: float,
                                            params: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        validate(schema, epsilon, delta, **params)


def test_summary_budget_is_part_of_the_canonical_parameters() -> None:
    out = validate(SCHEMA, 1.0, 1e-6, evaluate_rows=100, summary_epsilon=0.5,
                   summary_delta=1e-7)
    assert out["summary_epsilon"] == 0.5 and out["summary_delta"] == 1e-7
    again = SynthParams.parse(out, None)
    assert (again.summary_epsilon, again.evaluate_rows) == (0.5, 100)
    assert "summary_epsilon" not in validate(SCHEMA, 1.0, 1e-6, evaluate_rows=100)


#: A job's canonical parameters as a coordinator stored them before ``resolution`` and
#: ``pair_gate`` existed (ledgers and resumed jobs carry these bytes).
STORED = {"mode": "generative", "continuous_link": "quantile", "n_bins": 32,
          "info_threshold": 0.8, "calibration": "analytic", "pair_groups": 6,
          "split": {"links": [0.6, 0.4], "pca": [0.25, 0.3], "pair_scores": [0.03, 0.1],
                    "pairs": [0.12, 0.2]}}


def test_a_new_job_gets_the_fine_cells_and_the_pair_gate() -> None:
    out = validate(SCHEMA, 1.0, 1e-6)
    assert out["resolution"] == "fine" and out["pair_gate"] is True and out["heaps"] is True
    parsed = SynthParams.parse(out, SCHEMA)
    assert (parsed.resolution, parsed.pair_gate, parsed.heaps) == ("fine", True, True)
    assert parsed.to_mapping() == out  # what the sites parse is what was stored


def test_the_analyst_may_ask_for_the_former_layout_and_no_gate() -> None:
    out = validate(SCHEMA, 1.0, 1e-6, resolution="bins", pair_gate=False)
    assert "resolution" not in out and "pair_gate" not in out
    assert "heaps" not in out  # "bins" has no leaves to find heaps in
    assert "heaps" not in validate(SCHEMA, 1.0, 1e-6, heaps=False)


def test_without_pair_rounds_there_is_no_gate() -> None:
    out = validate(SCHEMA, 1.0, 1e-6, pairs=0)
    assert "pair_gate" not in out and out["resolution"] == "fine"


def test_a_stored_job_without_the_keys_parses_as_before_and_keeps_its_bytes() -> None:
    stored = SynthParams.parse(STORED, SCHEMA)
    assert (stored.resolution, stored.pair_gate, stored.heaps) == ("bins", False, False)
    fine = SynthParams.parse({**STORED, "resolution": "fine"}, SCHEMA)  # a fine job made before
    assert not fine.heaps and "heaps" not in fine.to_mapping()
    assert json.dumps(stored.to_mapping(), sort_keys=True) == json.dumps(STORED, sort_keys=True)


@pytest.mark.parametrize("params, match", [
    ({"resolution": "coarse"}, "--resolution"), ({"pair_gate": "yes"}, "pair_gate"),
    ({"pair_gate": 1}, "pair_gate"), ({"heaps": "yes"}, "heaps")])
def test_bad_resolution_or_gate_is_refused(params: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        validate(SCHEMA, 1.0, 1e-6, **params)


def test_report_shows_the_rounds_and_the_sites_dp_summaries() -> None:
    model = build()
    tvd = {c.name: 0.05 for c in SCHEMA.columns}
    summary = {"tvd": tvd, "near_train": 0.31, "near_holdout": 0.29, "n_train": 1200,
               "n_compared": 1200, "n_holdout": 300, "threshold": 0.2, "sigma_tvd": 0.004,
               "sigma_near_train": 0.004, "sigma_near_holdout": 0.016, "epsilon": 0.5,
               "delta": 1e-6}
    model.metadata.update({
        "rounds": {"links": ["h1", "h2", "h3"], "pca": ["h1", "h2"]},
        "evaluation": {"sample_rows": 500, "local_report_sites": ["h1", "h2"],
                       "summary_epsilon": 0.5, "summary_delta": 1e-6,
                       "summary_sites_asked": ["h1"], "summaries": {"h1": summary}}})
    html = synth_report(model, model.sample(500, rng=np.random.default_rng(1)))
    assert "Sites used by each round" in html and "h1, h2, h3" in html
    assert "Evaluation at the sites" in html and "0.310 (0.004)" in html
    assert html.count("data:image/png;base64,") == 3


# --------------------------------------------------------------------------- pair rounds


@pytest.mark.parametrize("params, match", [
    ({"pairs": -1}, "--pairs must be >= 0"),
    ({"pairs": 1.5}, "--pairs must be an integer"),
    ({"pairs": "all"}, "--pairs must be an integer"),
    ({"pair_groups": 1}, "--pair-groups must be >= 2"),
    ({"pair_groups": 65}, "--pair-groups must be <= 64"),
    ({"mode": "row_aligned", "pairs": 2}, "--pairs applies to --mode generative only"),
    ({"pairs": 0, "split": {"links": [0.7, 0.5], "pca": [0.2, 0.5], "pairs": [0.1, 0.0]}},
     "no pair rounds"),
    ({"pairs": 3, "split": {"links": [0.8, 0.5], "pca": [0.2, 0.5]}},
     "--pairs 0 skips the pair rounds"),
    ({"split": {"links": [0.7, 0.5], "pca": [0.2, 0.5], "pairs": [0.1, 0.0]}},
     "pair_scores.*positive share"),
    ({"split": {"links": [0.6, 0.4], "pca": [0.15, 0.3], "pair_scores": [0.05, 0.0],
                "pairs": [0.2, 0.3]}}, "pair_scores.*Gaussian"),
])
def test_bad_pair_parameters_are_refused_naming_the_flag(params: dict[str, object],
                                                         match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        validate(SCHEMA, 1.0, 1e-6, **params)


def test_plan_has_the_pair_rounds_by_default_and_the_old_split_without_them() -> None:
    four = SynthParams.parse(validate(SCHEMA, 2.0, 1e-5), None)
    assert four.rounds == ("links", "pca", "pair_scores", "pairs") and four.pairs is None
    assert four.max_pairs(len(SCHEMA.columns)) == len(SCHEMA.columns) - 1
    assert [(n, round(e, 9), round(d, 12)) for n, e, d in four.plan(2.0, 1e-5)] == [
        ("links", 1.2, 4e-6), ("pca", 0.5, 3e-6), ("pair_scores", 0.06, 1e-6),
        ("pairs", 0.24, 2e-6)]
    two = SynthParams.parse(validate(SCHEMA, 2.0, 1e-5, pairs=0), None)
    assert [n for n, _, _ in two.plan(2.0, 1e-5)] == ["links", "pca"]
    assert two.plan(2.0, 1e-5)[0][1] == pytest.approx(1.6)
    capped = SynthParams.parse(validate(SCHEMA, 2.0, 1e-5, pairs=99, pair_groups=4), None)
    assert capped.max_pairs(4) == 3 and capped.to_mapping()["pair_groups"] == 4
    custom = SynthParams.parse(validate(SCHEMA, 1.0, 1e-6, split={
        "links": [0.5, 0.25], "pca": [0.2, 0.25], "pair_scores": [0.1, 0.25],
        "pairs": [0.2, 0.25]}), None)
    assert {n: e for n, e, _ in custom.plan(1.0, 1e-6)}["pairs"] == pytest.approx(0.2)
    # Secure aggregation has them too (secure sums); row-aligned mode runs without them.
    secure = SynthParams.parse(validate(SCHEMA, 4.0, 1e-5, aggregation="secure"), None)
    assert secure.pair_rounds and secure.rounds == four.rounds
    p = SynthParams.parse(validate(SCHEMA, 4.0, 1e-5, mode="row_aligned"), None)
    assert not p.pair_rounds and p.max_pairs(4) == 0 and "pair_scores" not in p.rounds
    assert "pairs" not in p.to_mapping() and "pair_groups" not in p.to_mapping()


def test_a_two_round_split_without_pairs_is_the_job_before_the_pair_rounds() -> None:
    # The canonical parameters of a job made before the pair rounds (a resumed job, or a
    # caller keeping the former shares with ``split``) still mean the two-round job, and
    # map back to themselves (a resumed job re-sends identical tasks).
    old = {"mode": "generative", "continuous_link": "quantile", "n_bins": 32,
           "info_threshold": 0.8, "calibration": "analytic",
           "split": {"links": [0.8, 0.5], "pca": [0.2, 0.5]}}
    p = SynthParams.parse(old, None)
    assert p.rounds == ("links", "pca") and not p.pair_rounds and p.max_pairs(4) == 0
    assert p.to_mapping() == old
    # Submitted anew it gets the defaults of new jobs (the fine 1-way cells, missing cells,
    # heaps) and nothing else.
    assert validate(SCHEMA, 2.0, 1e-5, **old) == {**old, "resolution": "fine",
                                                  "missing_cells": True, "heaps": True}


@pytest.mark.parametrize("bad", [
    np.array([1.0, np.nan, 2.0]), np.array([1.0, 1e308, 2.0]), np.zeros(4), np.zeros((3, 1)),
    np.zeros(3, dtype=np.float32), [1.0, 2.0, 3.0], None])
def test_pair_vectors_from_sites_are_checked(bad: object) -> None:
    from dpfed.common.errors import ProtocolError
    from dpfed.common.jobs.synth_pairs import check_pooled as check_vector

    with pytest.raises(ProtocolError, match="finite float64 pair scores of shape"):
        check_vector(bad, 3, "pair scores")
    assert check_vector(np.array([1.0, -2.0, 3.0]), 3, "pair scores").shape == (3,)


def test_report_lists_the_chosen_pairs_with_heat_maps_and_their_budget() -> None:
    from dpfed.aggregator.jobs.synth import PairsFitted
    from dpfed.common.data.encoding import encode_table
    from dpfed.common.synth.pair_marginals import (
        PairTableAccumulator,
        choose_forest,
        dependence_scores,
        fit_pair_tables,
    )
    from tests.common.synth.test_link_release import skewed_frame

    model = build()
    grid = model.pair_grid(4)
    table, _ = encode_table(SCHEMA, skewed_frame(3000, 3))
    cands = grid.candidate_pairs()
    acc = PairTableAccumulator(grid, cands)
    acc.add(table)
    scores = dependence_scores(acc.counts, grid, cands, model.proportions, table.n_rows)
    edges = choose_forest(scores, cands, len(SCHEMA.columns), 2)
    tables_acc = PairTableAccumulator(grid, edges)
    tables_acc.add(table)
    joint = fit_pair_tables(tables_acc.counts.astype(float), grid, edges, model.proportions,
                            table.n_rows)
    rounds = PairsFitted(grid, cands, edges, joint, table.n_rows, 0.0)
    model = model.with_pairs(grid, edges, joint, np.random.default_rng(4))
    model.metadata.update(rounds.metadata(SCHEMA))
    model.metadata["plan"] += [{"round": "pair_scores", "epsilon": 0.05, "delta": 1e-7},
                               {"round": "pairs", "epsilon": 0.2, "delta": 2e-7}]
    model.metadata["sites"] = [{"site_id": "h1", "n_rows": 3000, "pairs_epsilon": 0.2,
                                "pairs_delta": 2e-7}]
    names = SCHEMA.names
    assert model.metadata["pair_edge_columns"] == [[names[a], names[b]] for a, b in edges]
    html = synth_report(model, model.sample(3000, rng=np.random.default_rng(2)))
    assert "Column pairs (DP 2-way marginals)" in html and "pairs_epsilon" in html
    assert f"{len(cands)} candidate column pair(s)" in html
    for a, b in edges:
        assert f"<tr><td>{names[a]}</td><td>{names[b]}</td>" in html
    assert html.count("data:image/png;base64,") == 3  # marginals, correlations, pairs
    # Without the fitted tables in the metadata the pairs are still listed, with no picture.
    del model.metadata["pair_tables"]
    html = synth_report(model, model.sample(1000, rng=np.random.default_rng(2)))
    assert "Column pairs" in html and html.count("data:image/png;base64,") == 2


def test_pair_rounds_are_skipped_without_a_candidate_pair() -> None:
    from dpfed.aggregator.jobs.synth import plan_pairs
    from dpfed.common.synth.link_release import histogram_sizes, proportions_from_histograms

    cats = ", ".join(f'"c{i}"' for i in range(70))
    wide = Schema.from_toml("".join(
        f'[[columns]]\nname = "{n}"\ntype = "nominal"\ncategories = [{cats}]\n'
        for n in ("a", "b")))
    props = proportions_from_histograms(np.ones(sum(histogram_sizes(wide, 8))), wide, 8)
    params = SynthParams.parse({"n_bins": 8}, wide)
    assert plan_pairs(wide, params, props) is None  # 70 x 70 cells > 4096
    small = SynthParams.parse({"n_bins": 8}, None)
    props = proportions_from_histograms(np.ones(sum(histogram_sizes(SCHEMA, 8))), SCHEMA, 8)
    planned = plan_pairs(SCHEMA, small, props)
    assert planned is not None and planned[2] == len(SCHEMA.columns) - 1
    assert len(planned[1]) == len(SCHEMA.columns) * (len(SCHEMA.columns) - 1) // 2
    off = SynthParams.parse({"n_bins": 8, "pairs": 0}, None)
    assert plan_pairs(SCHEMA, off, props) is None


def test_the_job_warns_when_its_pair_tables_would_be_mostly_noise() -> None:
    from dpfed.common.jobs.synth import pair_noise_note
    from dpfed.common.synth.pair_marginals import (
        expected_pair_table_error,
        pair_table_mechanism,
        typical_pair_cells,
    )

    params = SynthParams.parse(validate(SCHEMA, 1.0, 1e-6), None)
    # Small sites, site-level: the summed noise swamps the tables.
    note = pair_noise_note(SCHEMA, params, 1.0, 1e-6, [500] * 4)
    assert note is not None and "--pairs 0" in note and "--aggregation secure" in note
    # The figure is the closed form with the split's pairs budget and sqrt(S) sites' noise.
    k = params.max_pairs(len(SCHEMA.columns))
    cells = typical_pair_cells(SCHEMA, params.n_bins, params.pair_groups)
    eps, dlt = {n: (e, d) for n, e, d in params.plan(1.0, 1e-6)}["pairs"]
    err = expected_pair_table_error(cells, pair_table_mechanism(k, eps, dlt).sigma * 2.0, 2000)
    assert f"{err:.2f}" in note and err > 1.0
    # Large sites, or no pair rounds: no warning.
    assert pair_noise_note(SCHEMA, params, 1.0, 1e-6, [10**7] * 4) is None
    off = SynthParams.parse(validate(SCHEMA, 1.0, 1e-6, pairs=0), None)
    assert pair_noise_note(SCHEMA, off, 1.0, 1e-6, [500] * 4) is None
    # Secure aggregation adds the noise once: less error for the same rows.
    secure = SynthParams.parse(validate(SCHEMA, 1.0, 1e-6, aggregation="secure"), None)
    secure_note = pair_noise_note(SCHEMA, secure, 1.0, 1e-6, [500] * 4)
    assert secure_note is None or "--aggregation secure" not in secure_note
