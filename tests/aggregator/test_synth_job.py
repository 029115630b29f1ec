"""The synth job's coordinator-side checks: bad input fails before any site is charged, the
DP evaluation summary's parameters, and what the report shows of rounds and summaries."""

from __future__ import annotations

import numpy as np
import pytest

from dpfed.aggregator.federation import Federation
from dpfed.aggregator.jobs.synth import SynthJob
from dpfed.aggregator.synth_report import synth_report
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.job_params import SynthParams
from dpfed.common.transport.protocol import JobSpec
from tests.aggregator.test_synth_model import build
from tests.common.synth.test_link_release import SCHEMA

ONE_COLUMN = Schema.from_toml('[[columns]]\nname = "age"\ntype = "continuous"\nmin = 0\nmax = 1\n')


def validate(schema: Schema, epsilon: float, delta: float, **params: object) -> dict[str, object]:
    return SynthJob().validate(JobSpec("synth", epsilon, delta, params), Federation(schema))


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
    again = SynthParams.from_mapping(out, latent_dim=50)
    assert (again.summary_epsilon, again.evaluate_rows) == (0.5, 100)
    assert "summary_epsilon" not in validate(SCHEMA, 1.0, 1e-6, evaluate_rows=100)


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
