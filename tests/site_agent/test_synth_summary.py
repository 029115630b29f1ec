"""The DP evaluation summary (kind ``synth_eval_dp``): sensitivity search, noise, ledger.

The sensitivity search goes through the real site code path
(:func:`exact_summary`, bound to a site directory with its holdout secret):
one row -- held out, or a training row -- is replaced by every extreme schema-valid record
(every continuous column at min/mid/max, levels and categories), against several synthetic
samples (random, copies of real rows, the extreme records themselves); the scaled summary
vector must move by at most its stated L2 sensitivity ``sqrt(d + 1)``. A broken copy that
standardises distances by the rows' own statistics (so one row moves every other row's
indicator) must be caught. The noise is checked against the calibration stated in the
docstring, and against a broken copy calibrated for the wrong sensitivity.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.encoding import EncodedTable, encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.evaluation import dp_summary
from dpfed.common.evaluation.dp_summary import (
    ExactSummary,
    release_summary,
    summary_cost,
    summary_sensitivity,
)
from dpfed.common.evaluation.holdout import holdout_positions, job_key
from dpfed.common.evaluation.site_holdout import KEY_FILE, site_secret
from dpfed.common.jobs.contract import Site
from dpfed.common.jobs.synth_evaluation import exact_summary
from dpfed.common.pca.features import UnitBallMap
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.transport.protocol import Refusal, Task
from dpfed.common.transport.wire import result_from_bytes
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner
from tests.site_agent.test_synth_handler import (
    N_BINS,
    SCHEMA,
    TableAccess,
    base_frame,
    eval_arrays,
    extreme_records,
)
from tests.site_agent.test_synth_holdout import replaced

N = 40
D = len(SCHEMA.columns)


def arrays_of(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    table, _ = encode_table(SCHEMA, frame)
    return {f"col:{k}": v for k, v in table.columns.items()}


def summary_task(arrays: dict[str, np.ndarray], epsilon: float = 1.0, delta: float = 1e-6,
                 schema_digest: str | None = None) -> Task:
    return Task("j/evaluate_summary", "j", "synth_eval_dp", epsilon, delta,
                {"schema_digest": schema_digest or SCHEMA.digest(), "n_bins": N_BINS}, arrays)


def samples() -> list[dict[str, np.ndarray]]:
    base = base_frame(N)
    return [eval_arrays(60),                                        # an unrelated sample
            arrays_of(base.iloc[:30].reset_index(drop=True)),       # copies of real rows
            arrays_of(pd.DataFrame(extreme_records()))]             # the extreme records


def search(tmp_path: Path) -> tuple[float, float]:
    """Return the worst L2 move of the scaled vector: (held-out row replaced, training row)."""
    (tmp_path / KEY_FILE).write_bytes(bytes([2]) * 32)  # a fixed secret: a reproducible split
    ledger = tmp_path / "ledger.sqlite"
    base = base_frame(N)
    held = holdout_positions(job_key(site_secret(tmp_path), "j"), N)
    trained = [p for p in range(N) if p not in set(held.tolist())][:1]
    worst = {True: 0.0, False: 0.0}
    for arrays in samples():
        task = summary_task(arrays)
        for position in (int(held[0]), *trained):
            z = [exact_summary(task, Site(TableAccess(replaced(base, position, x)), ledger)).scaled
                 for x in extreme_records()]
            move = max(float(np.linalg.norm(a - b)) for a, b in itertools.combinations(z, 2))
            key = position in set(held.tolist())
            worst[key] = max(worst[key], move)
    return worst[True], worst[False]


def test_summary_sensitivity_search_stays_within_the_stated_bound(tmp_path: Path) -> None:
    stated = summary_sensitivity(D)
    assert stated == pytest.approx(math.sqrt(D + 1))
    held, trained = search(tmp_path)
    assert 0 < held <= 1.0 + 1e-12  # only near_holdout moves
    assert trained <= stated + 1e-12
    # Non-trivial: the search moves the TVD counts and the near count together (1.76 of
    # 2.24; full tightness needs every column's count to sit on the right side of n_t q).
    assert trained >= 0.75 * stated


def test_summary_search_catches_data_dependent_distances(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Broken copy: distances standardised by the rows' own statistics (as the local report
    # does) -- one replaced row then moves every other row's indicator.
    def standardised(schema: Schema, table: EncodedTable) -> np.ndarray:
        x = UnitBallMap(schema).scaled(table)
        return np.ascontiguousarray((x - x.mean(axis=0)) / (x.std(axis=0) + 1e-9))

    monkeypatch.setattr(dp_summary, "summary_features", standardised)
    held, trained = search(tmp_path)
    assert max(held, trained) > summary_sensitivity(D) * 1.05


def fixed_exact() -> ExactSummary:
    return ExactSummary(np.array([3.0, 5.0, 1.0, 2.0, 10.0, 4.0]), n_train=160, n_compared=160,
                        n_holdout=40, threshold=0.3)


def noise_ratio(draws: int = 4000) -> float:
    """Empirical noise sd of the scaled vector over the sigma the docstring states."""
    rng = np.random.default_rng(11)
    exact = fixed_exact()
    out = np.array([np.concatenate(list(release_summary(exact, epsilon=1.0, delta=1e-6,
                                                        rng=rng)[0].values())) * exact.divisors
                    for _ in range(draws)])
    stated = gaussian_sigma(1.0, 1e-6, math.sqrt(D + 1))
    return float((out - exact.scaled).std(axis=0).mean() / stated)


def test_summary_noise_matches_the_stated_calibration() -> None:
    assert noise_ratio() == pytest.approx(1.0, abs=0.04)
    arrays, meta = release_summary(fixed_exact(), epsilon=1.0, delta=1e-6,
                                   rng=np.random.default_rng(1))
    sigma = gaussian_sigma(1.0, 1e-6, math.sqrt(D + 1))
    assert meta["sigma_tvd"] == pytest.approx(sigma / 160)
    assert meta["sigma_near_holdout"] == pytest.approx(sigma / 40)
    assert arrays["tvd"].shape == (D,) and arrays["near"].shape == (2,)
    cost = summary_cost(D, 1.0, 1e-6)
    assert (cost.epsilon, cost.delta) == (1.0, 1e-6)
    assert cost.sensitivity == pytest.approx(math.sqrt(D + 1))


def test_noise_check_catches_a_wrong_sensitivity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp_summary, "summary_sensitivity", lambda n_columns: 1.0)
    assert noise_ratio(1000) < 0.6


def make_runner(tmp_path: Path, kinds: tuple[str, ...] = ("synth_eval_dp",)) -> TaskRunner:
    tmp_path.mkdir(parents=True, exist_ok=True)
    csv = tmp_path / "data.csv"
    base_frame(200).to_csv(csv, index=False)
    return TaskRunner(open_data_source(spec_from_path(csv), SCHEMA),
                      Ledger(tmp_path / "ledger.sqlite", BudgetPolicy(10.0, 1e-3)), kinds)


def test_summary_is_charged_before_it_leaves_and_replays(tmp_path: Path) -> None:
    runner = make_runner(tmp_path)
    task = summary_task(eval_arrays(), epsilon=0.5, delta=1e-6)
    out = runner.run(task)
    assert isinstance(out, bytes)
    result = result_from_bytes(out)
    assert result.arrays["tvd"].shape == (D,) and result.arrays["near"].shape == (2,)
    assert result.metadata["n_train"] == 160 and result.metadata["n_holdout"] == 40
    events = runner.ledger.events()
    assert len(events) == 1 and events[0].epsilon == 0.5
    assert runner.run(task) == out and len(runner.ledger.events()) == 1  # replayed


def test_bad_summary_tasks_are_refused_before_any_charge(tmp_path: Path) -> None:
    runner = make_runner(tmp_path)
    bad = [summary_task(eval_arrays(), schema_digest="0" * 64),
           summary_task(eval_arrays(), epsilon=0.0),
           summary_task(eval_arrays(), delta=0.0),
           summary_task({**eval_arrays(), "col:age": np.full(40, np.nan)}),
           Task("j/s", "j", "synth_eval_dp", 1.0, 1e-6, {"schema_digest": SCHEMA.digest(),
                                                          "n_bins": 10**6}, eval_arrays())]
    for task in bad:
        answer = runner.run(task)
        assert isinstance(answer, Refusal) and answer.code == "invalid", answer
    assert runner.ledger.events() == []
    # A site whose policy does not allow summaries never runs one.
    other = make_runner(tmp_path / "other", kinds=("synth_eval",))
    answer = other.run(summary_task(eval_arrays()))
    assert isinstance(answer, Refusal) and answer.code == "not_allowed"
