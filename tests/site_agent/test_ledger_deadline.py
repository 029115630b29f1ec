"""The ledger never charges a task whose deadline has passed (issue 7, §2), on a real SQLite
ledger: the deadline is checked under the write lock and again after the noise was drawn."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from dpfed.common.privacy.accounting import BudgetPolicy, PrivacyCost
from dpfed.site_agent.ledger import Ledger, TaskExpiredError

COST = PrivacyCost(1.0, 1e-6, 0.1, "gaussian", 1.0, 2.0)
DIGEST = hashlib.sha256(b"task").hexdigest()


def charge(ledger: Ledger, task_id: str, deadline: float | None, release=lambda: b"bytes"):  # type: ignore[no-untyped-def]
    return ledger.charge_and_release(task_id=task_id, job_id="job", kind="pca",
                                     payload_digest=DIGEST, cost=COST, release=release,
                                     deadline_unix=deadline)


def test_an_expired_task_is_not_charged_and_draws_nothing(tmp_path: Path) -> None:
    calls: list[int] = []
    with Ledger(tmp_path / "l.sqlite", BudgetPolicy(10.0, 1e-3)) as ledger:
        with pytest.raises(TaskExpiredError, match="deadline passed"):
            charge(ledger, "job/a", time.time() - 0.01, lambda: calls.append(1) or b"x")
        assert ledger.events() == [] and calls == []


def test_a_deadline_passing_while_the_noise_is_drawn_rolls_the_charge_back(
        tmp_path: Path) -> None:
    def slow_release() -> bytes:
        time.sleep(0.3)
        return b"drawn but never released"

    with Ledger(tmp_path / "l.sqlite", BudgetPolicy(10.0, 1e-3)) as ledger:
        with pytest.raises(TaskExpiredError):
            charge(ledger, "job/b", time.time() + 0.1, slow_release)
        assert ledger.events() == [] and ledger.spent().epsilon == 0.0
        # A live task is charged as before, and its replay is answered even after the deadline.
        first = charge(ledger, "job/c", time.time() + 30)
        again = charge(ledger, "job/c", time.time() - 5)
    assert not first.replayed and again.replayed and again.result == first.result
