"""The site ledger with the tight (pld) accountant, on real SQLite files.

A ledger written under ``basic`` (and rows as an older dpfed wrote them) converts forward: its
history is kept, every event is charged by its dominating pair where its description allows
and by its own (epsilon, delta) where it does not; the check runs in the charge's transaction
with the tight figure; the incremental composition agrees with a fresh one; the operator's
listing shows the tight figure and what each event was charged as.
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from dpfed.common.errors import BudgetExceededError
from dpfed.common.privacy.accounting import BudgetPolicy, PrivacyCost
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.privacy.spent import Spent
from dpfed.site_agent.ledger import Ledger, format_ledger, ledger_as_json, read_status_readonly


def gaussian(eps: float, delta: float, sens: float = 1.0) -> PrivacyCost:
    return PrivacyCost.gaussian(eps, delta, sigma=gaussian_sigma(eps, delta, sens),
                                sensitivity=sens)


def charge(ledger: Ledger, task: str, cost: PrivacyCost) -> None:
    ledger.charge_and_release(task_id=task, job_id="job", kind="pca",
                              payload_digest=hashlib.sha256(task.encode()).hexdigest(),
                              cost=cost, release=lambda: b"bytes")


def test_the_tight_ledger_admits_what_its_rounds_really_cost(tmp_path: Path) -> None:
    # PCA-like jobs: three Gaussian rounds at 10/10/80 % of (1, 1e-6) each. Basic composition
    # charges 1.0 per job; their exact composition is 0.80.
    rounds = [gaussian(0.1, 1e-7), gaussian(0.1, 1e-7), gaussian(0.8, 8e-7)]
    basic = Ledger(tmp_path / "basic.sqlite", BudgetPolicy(3.0, 1e-5, accountant="basic"))
    tight = Ledger(tmp_path / "tight.sqlite", BudgetPolicy(3.0, 1e-5))
    assert tight.policy.accountant == "pld"  # the default
    jobs = {"basic": 0, "pld": 0}
    for job in range(20):
        for ledger, name in ((basic, "basic"), (tight, "pld")):
            try:
                for i, cost in enumerate(rounds):
                    charge(ledger, f"{job}-{i}", cost)
                jobs[name] += 1
            except BudgetExceededError:
                pass
    assert jobs["basic"] == 3
    assert jobs["pld"] >= 10  # the Gaussian rounds compose to about sqrt(jobs) * 0.8
    status = tight.status()
    assert status.accountant == "pld" and status.epsilon_spent <= 3.0
    # the refusal was decided by the tight figure, in the charge's transaction: nothing
    # charged past it
    assert Spent.of(e.cost for e in tight.events()).epsilon(1e-5) <= 3.0 * (1 + 1e-12)


def test_a_basic_ledger_converts_forward_and_keeps_its_history(tmp_path: Path) -> None:
    path = tmp_path / "site.sqlite"
    with Ledger(path, BudgetPolicy(10.0, 1e-4, accountant="basic")) as old:
        for i in range(5):
            charge(old, f"g{i}", gaussian(0.5, 1e-6))
        charge(old, "svt", PrivacyCost.pure(0.4, mechanism="svt", sensitivity=1.0,
                                            noise_scale=10.0))
        before = old.events()
    # rows as an earlier dpfed wrote them: no noise scale, or a mechanism name it no longer uses
    conn = sqlite3.connect(path)
    with conn:
        for seq, (name, scale) in enumerate([("gaussian", 0.0), ("composed", 0.0)], start=7):
            conn.execute(
                "INSERT INTO ledger_events (task_id, seq, job_id, kind, mechanism, epsilon, "
                "delta, rho, sensitivity, noise_scale, payload_digest, result, result_digest, "
                "created_at) VALUES (?, ?, 'old', 'pca', ?, 0.5, 1e-6, 0.02, 1.0, ?, ?, ?, ?, "
                "'2025-01-01T00:00:00+00:00')",
                (f"old{seq}", seq, name, scale, "0" * 64, b"x", hashlib.sha256(b"x").hexdigest()))
    conn.close()
    with Ledger(path, BudgetPolicy(10.0, 1e-4)) as new:
        events = new.events()
        assert [e.task_id for e in events[:6]] == [e.task_id for e in before]
        spent = new.composed()
        assert spent.events == 8 and spent.fallbacks == 2  # the two old rows: by (eps, delta)
        status = new.status()
        assert status.epsilon_spent < spent.epsilon_sum  # 3.9 summed
        assert status.epsilon_spent >= 0.5 * 2 * 0.99  # the fallbacks are never charged less
        text = format_ledger(new)
        assert "Tight composition at delta 0.0001" in text and "charged as" in text
        assert "approximate" in text and "gaussian" in text and "pure" in text
        data = ledger_as_json(new)
        assert data["totals"]["fallback_events"] == 2
        assert data["status"]["epsilon_spent"] == pytest.approx(status.epsilon_spent)
    readonly = read_status_readonly(path, BudgetPolicy(10.0, 1e-4))
    assert readonly is not None and readonly.epsilon_spent == pytest.approx(status.epsilon_spent)


def test_the_incremental_composition_matches_a_fresh_one(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    ledger = Ledger(path, BudgetPolicy(50.0, 1e-5))
    costs = [gaussian(0.3, 1e-7), PrivacyCost.pure(0.2, mechanism="laplace", sensitivity=2.0,
                                                   noise_scale=10.0),
             PrivacyCost.pure(0.1, mechanism="svt", sensitivity=1.0, noise_scale=20.0)]
    for i in range(12):
        charge(ledger, f"t{i}", costs[i % 3])
        warm = ledger.status().epsilon_spent
        fresh = Ledger(path, BudgetPolicy(50.0, 1e-5)).status().epsilon_spent  # cold cache
        assert warm == pytest.approx(fresh, abs=1e-3)
    # another process (here: another Ledger on the same file) charging in between is seen
    other = Ledger(path, BudgetPolicy(50.0, 1e-5))
    charge(other, "elsewhere", gaussian(2.0, 1e-6))
    assert ledger.composed().events == 13
