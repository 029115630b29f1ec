"""``read_status_readonly`` (used by ``dpfed-site check``): reads, never creates or writes."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from dpfed.common.errors import ConfigError
from dpfed.common.privacy.accounting import BudgetPolicy, PrivacyCost
from dpfed.site_agent.ledger import Ledger, read_status_readonly

POLICY = BudgetPolicy(10.0, 1e-3, accountant="basic")


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def charge(ledger: Ledger, task_id: str, epsilon: float) -> None:
    ledger.charge_and_release(task_id=task_id, job_id="j", kind="pca",
                              payload_digest=hashlib.sha256(task_id.encode()).hexdigest(),
                              cost=PrivacyCost(epsilon, 1e-6, 0.01), release=lambda: b"bytes")


def test_missing_ledger_stays_missing(tmp_path: Path) -> None:
    assert read_status_readonly(tmp_path / "ledger.sqlite", POLICY) is None
    assert list(tmp_path.iterdir()) == []


def test_closed_ledger_is_read_without_any_new_file(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger(path, POLICY) as ledger:
        charge(ledger, "t1", 1.5)
    before = files(tmp_path)
    status = read_status_readonly(path, POLICY)
    assert status is not None and status.events == 1 and status.epsilon_spent == 1.5
    assert files(tmp_path) == before


def test_running_agents_uncheckpointed_charges_are_seen(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path, POLICY)
    agent = sqlite3.connect(path)  # an open connection keeps the write-ahead log alive
    agent.execute("PRAGMA wal_autocheckpoint = 0")
    agent.execute("SELECT count(*) FROM sqlite_master").fetchone()
    try:
        charge(ledger, "t1", 1.0)
        charge(ledger, "t2", 2.0)
        assert (tmp_path / "ledger.sqlite-wal").stat().st_size > 0
        status = read_status_readonly(path, POLICY)
        assert status is not None and status.events == 2 and status.epsilon_spent == 3.0
    finally:
        agent.close()


def test_foreign_database_and_directory_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE patients (id INTEGER)")
    before = other.read_bytes()
    with pytest.raises(ConfigError, match="not a dpfed ledger"):
        read_status_readonly(other, POLICY)
    assert other.read_bytes() == before
    with pytest.raises(ConfigError, match="is a directory"):
        read_status_readonly(tmp_path, POLICY)
