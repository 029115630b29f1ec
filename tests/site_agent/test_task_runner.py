"""The site's task runner: policy, replay, refusals -- and what a refusal may say."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.encoding import RowPolicy
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.transport.protocol import Refusal, Task
from dpfed.common.transport.wire import result_from_bytes
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner
from tests.support.schemas import AGE_BMI as SCHEMA


def make_runner(tmp_path: Path, rows: list[tuple[str, str]], *, on_invalid: str = "drop",
                budget: float = 5.0) -> TaskRunner:
    csv = tmp_path / "data.csv"
    pd.DataFrame(rows, columns=["age", "bmi"]).to_csv(csv, index=False)
    source = open_data_source(spec_from_path(csv, policy=RowPolicy(invalid=on_invalid)), SCHEMA)
    ledger = Ledger(tmp_path / "ledger.sqlite", BudgetPolicy(budget, 1e-4))
    return TaskRunner(source, ledger, ("pca",))


#: One uncentred round, schema bound (centred rounds: tests/site_agent/test_pca_rounds.py).
ONE_ROUND = {"n_components": 1, "rank": 2, "centering": "none", "clip_norm": "schema"}


def pca_task(task_id: str = "job-1/pca", epsilon: float = 1.0) -> Task:
    return Task(task_id, "job-1", "pca", epsilon, 1e-5, ONE_ROUND)


GOOD = [(str(20 + i % 60), str(15 + i % 40)) for i in range(300)]


def test_release_then_replay_without_recharge(tmp_path: Path) -> None:
    runner = make_runner(tmp_path, GOOD)
    first = runner.run(pca_task())
    assert isinstance(first, bytes)
    result = result_from_bytes(first)
    assert result.arrays["factor"].shape == (2, 2) and result.metadata["n_rows"] == 300
    assert runner.run(pca_task()) == first  # identical bytes, no fresh noise
    assert len(runner.ledger.events()) == 1
    other = Task("job-1/pca", "job-1", "pca", 2.0, 1e-5, ONE_ROUND)
    conflict = runner.run(other)
    assert isinstance(conflict, Refusal) and conflict.code == "conflict"
    assert len(runner.ledger.events()) == 1


def test_refusals_charge_nothing(tmp_path: Path) -> None:
    runner = make_runner(tmp_path, GOOD, budget=1.5)
    not_allowed = runner.run(Task("t1", "j", "svt", 1.0, 1e-5, {}))
    assert isinstance(not_allowed, Refusal) and not_allowed.code == "not_allowed"
    bad_params = runner.run(Task("t2", "j", "pca", 1.0, 1e-5, {"n_components": 7}))
    assert isinstance(bad_params, Refusal) and bad_params.code == "invalid"
    assert "n_components" in bad_params.reason  # about the task: fine to explain
    late = runner.run(pca_task("t3"), deadline_unix=1.0)
    assert isinstance(late, Refusal) and late.code == "deadline"
    over = runner.run(pca_task("t4", epsilon=2.0))
    assert isinstance(over, Refusal) and over.code == "budget_exceeded"
    assert runner.ledger.events() == []


def test_data_errors_do_not_leave_the_site(tmp_path: Path) -> None:
    rows = [*GOOD[:41], ("not-a-number", "20"), *GOOD[41:]]
    runner = make_runner(tmp_path, rows, on_invalid="error")
    refusal = runner.run(pca_task())
    assert isinstance(refusal, Refusal) and refusal.code == "invalid"
    assert "42" not in refusal.reason and "data row" not in refusal.reason
    assert "age" not in refusal.reason and "not-a-number" not in refusal.reason
    assert runner.ledger.events() == []


@pytest.mark.parametrize("rows", [[("x", "y")] * 3])
def test_no_valid_rows_is_refused_generically(tmp_path: Path, rows: list[tuple[str, str]]) -> None:
    runner = make_runner(tmp_path, rows)
    refusal = runner.run(pca_task())
    assert isinstance(refusal, Refusal) and refusal.code == "invalid"
    assert runner.ledger.events() == []
