"""Tests of the site's privacy ledger (dpfed.site_agent.ledger).

Targets from docs/testing.md: 6 (accounting; refused requests draw no noise),
7 (budget never exceeded under concurrency, threads and processes), 8 (synchronous reads 2
on every connection) and 9 (idempotent spend: one debit, byte-identical replays, conflicting
reuse refused, replay after restart). Crash durability (kill -9) is in
test_ledger_durability.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dpfed.common.errors import (
    BudgetExceededError,
    ConfigError,
    DpfedError,
    IdempotencyConflictError,
    ValidationError,
)
from dpfed.common.privacy.accounting import BudgetPolicy, PrivacyCost, zcdp_to_epsilon
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.transport.protocol import RefusalCode
from dpfed.site_agent import ledger as ledger_module
from dpfed.site_agent.ledger import (
    SCHEMA_VERSION,
    Ledger,
    LedgerCorruptionError,
    format_ledger,
    ledger_as_json,
)
from tests.site_agent.ledger_worker import spawn

CAP = 1.0
SLACK = 1e-12  # BudgetPolicy.check allows this relative slack at the cap


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Recorder:
    """A release() that records how often it ran and returns fresh random bytes each time."""

    def __init__(self, payload: bytes | None = None) -> None:
        self.calls = 0
        self.payload = payload
        self._lock = threading.Lock()

    def __call__(self) -> bytes:
        with self._lock:
            self.calls += 1
        return self.payload if self.payload is not None else random.randbytes(32)


def charge(ledger: Ledger, task_id: str, cost: PrivacyCost | float = 0.1, *,
           release: Callable[[], bytes] | None = None, job_id: str = "job-1",
           kind: str = "pca", payload: str | None = None) -> ledger_module.LedgerOutcome:
    c = PrivacyCost.pure(cost) if isinstance(cost, float) else cost
    return ledger.charge_and_release(
        task_id=task_id, job_id=job_id, kind=kind,
        payload_digest=digest(payload if payload is not None else task_id), cost=c,
        release=release if release is not None else Recorder())


def raw_rows(path: Path, sql: str) -> list[tuple[Any, ...]]:
    """Read the file with a plain sqlite3 connection, independent of the Ledger code."""
    conn = sqlite3.connect(str(path))
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "ledger.sqlite"


@pytest.fixture
def ledger(db: Path) -> Ledger:
    return Ledger(db, BudgetPolicy(CAP, 1e-5, accountant="basic"))


# ---------------------------------------------------------------------- charging and replay


def test_first_charge_stores_the_released_bytes_with_the_event(ledger: Ledger, db: Path) -> None:
    cost = PrivacyCost.gaussian(0.5, 1e-6, sigma=4.0, sensitivity=1.0)
    out = charge(ledger, "task-1", cost, release=Recorder(b"noisy result"))
    assert out.result == b"noisy result" and not out.replayed
    event = out.event
    assert (event.seq, event.task_id, event.job_id, event.kind) == (1, "task-1", "job-1", "pca")
    assert (event.mechanism, event.epsilon, event.delta, event.rho) == (
        "gaussian", 0.5, 1e-6, cost.rho)
    assert (event.sensitivity, event.noise_scale) == (1.0, 4.0)
    assert event.result_digest == hashlib.sha256(b"noisy result").hexdigest()
    assert event.created_at.endswith("+00:00")
    assert ledger.events() == [event]
    assert raw_rows(db, "SELECT task_id, result, result_digest FROM ledger_events") == [
        ("task-1", b"noisy result", event.result_digest)]
    assert ledger.spent().epsilon == 0.5


def test_sequential_retries_return_identical_bytes_and_charge_once(ledger: Ledger) -> None:
    release = Recorder()
    first = charge(ledger, "task-1", 0.25, release=release)
    for _ in range(1000):
        again = charge(ledger, "task-1", 0.25, release=release)
        assert again.replayed and again.result == first.result
        assert again.event == first.event
    assert release.calls == 1
    assert len(ledger.events()) == 1
    assert ledger.spent().epsilon == 0.25


def test_concurrent_thread_retries_charge_once(ledger: Ledger) -> None:
    release = Recorder()
    barrier = threading.Barrier(50)
    outcomes: list[ledger_module.LedgerOutcome] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            for _ in range(4):
                outcomes.append(charge(ledger, "task-1", 0.25, release=release))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(outcomes) == 200
    assert release.calls == 1
    assert sum(not o.replayed for o in outcomes) == 1
    assert len({o.result for o in outcomes}) == 1
    assert len(ledger.events()) == 1


def test_concurrent_process_retries_charge_once(db: Path) -> None:
    # Four processes (plus this one) race on one task id of a file none of them has created.
    procs = [spawn("same", db, "task-1", "10") for _ in range(4)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "READY\n", p.stderr
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    lines = [line.split() for out, _ in outs for line in out.splitlines()]
    results = [(d, int(r)) for tag, d, r in (x for x in lines if x[0] == "OUT")]
    releases = sum(int(x[1]) for x in lines if x[0] == "RELEASES")
    assert len(results) == 40
    assert releases == 1
    assert sum(1 for _, replayed in results if not replayed) == 1
    ledger = Ledger(db, BudgetPolicy(CAP, 1e-5, accountant="basic"))
    events = ledger.events()
    assert len(events) == 1
    assert {d for d, _ in results} == {events[0].result_digest}


def test_same_task_id_with_a_different_payload_is_refused(ledger: Ledger) -> None:
    first = charge(ledger, "task-1", 0.25, payload="payload A")
    release = Recorder()
    with pytest.raises(IdempotencyConflictError, match="task-1"):
        charge(ledger, "task-1", 0.25, payload="payload B", release=release)
    with pytest.raises(IdempotencyConflictError):
        charge(ledger, "task-1", 0.25, payload="payload A", job_id="job-2", release=release)
    with pytest.raises(IdempotencyConflictError):
        charge(ledger, "task-1", 0.25, payload="payload A", kind="svt", release=release)
    assert release.calls == 0
    assert ledger.events() == [first.event]
    assert ledger.spent().epsilon == 0.25
    refusals = ledger.refusals()
    assert [r.reason for r in refusals] == ["idempotency_conflict"] * 3
    assert {r.code for r in refusals} == {RefusalCode.CONFLICT}  # the wire's code
    assert refusals[0].payload_digest == digest("payload B")
    # The original payload still replays.
    assert charge(ledger, "task-1", 0.25, payload="payload A").result == first.result


def test_over_budget_draws_no_noise_and_leaves_no_event(ledger: Ledger, db: Path) -> None:
    charge(ledger, "task-1", 0.8)
    release = Recorder()
    with pytest.raises(BudgetExceededError, match="epsilon budget exceeded"):
        charge(ledger, "task-2", 0.3, release=release)
    assert release.calls == 0  # no noise was drawn
    assert [e.task_id for e in ledger.events()] == ["task-1"]
    assert raw_rows(db, "SELECT count(*) FROM ledger_events WHERE task_id = 'task-2'") == [(0,)]
    (refusal,) = ledger.refusals()
    assert (refusal.task_id, refusal.reason, refusal.epsilon) == (
        "task-2", "budget_exceeded", 0.3)
    assert "exceeded" in refusal.message
    # Retrying the refused task is refused again (and recorded again), still without noise.
    with pytest.raises(BudgetExceededError):
        charge(ledger, "task-2", 0.3, release=release)
    assert release.calls == 0 and len(ledger.refusals()) == 2


def test_delta_cap_is_enforced(ledger: Ledger) -> None:
    gaussian = PrivacyCost.gaussian(0.1, 6e-6, sigma=30.0, sensitivity=1.0)
    charge(ledger, "task-1", gaussian)
    release = Recorder()
    with pytest.raises(BudgetExceededError, match="delta budget exceeded"):
        charge(ledger, "task-2", gaussian, release=release)
    assert release.calls == 0 and len(ledger.events()) == 1


def test_spending_exactly_the_cap_is_allowed(ledger: Ledger) -> None:
    for i in range(4):
        charge(ledger, f"task-{i}", 0.25)
    assert ledger.status().epsilon_remaining == 0.0
    with pytest.raises(BudgetExceededError):
        charge(ledger, "task-4", 1e-6)


def test_max_epsilon_per_task_is_enforced(db: Path) -> None:
    ledger = Ledger(db, BudgetPolicy(5.0, 1e-5, accountant="basic", max_epsilon_per_task=0.5))
    release = Recorder()
    with pytest.raises(BudgetExceededError, match="max_epsilon_per_task"):
        charge(ledger, "task-1", 0.6, release=release)
    assert release.calls == 0 and ledger.events() == []
    assert ledger.refusals()[0].reason == "budget_exceeded"
    assert not charge(ledger, "task-2", 0.5).replayed


def test_a_failing_release_rolls_back_the_charge(ledger: Ledger) -> None:
    def boom() -> bytes:
        raise RuntimeError("solver diverged")

    with pytest.raises(RuntimeError, match="solver diverged"):
        charge(ledger, "task-1", 0.5, release=boom)
    assert ledger.events() == [] and ledger.spent().epsilon == 0.0
    assert ledger.refusals() == []  # a failure is not a refusal
    with pytest.raises(ValidationError, match="must return bytes"):
        charge(ledger, "task-1", 0.5, release=lambda: "not bytes")  # type: ignore[arg-type,return-value]
    assert ledger.events() == []
    # The task can be retried and is then charged once, fresh.
    out = charge(ledger, "task-1", 0.5, release=Recorder(b"ok"))
    assert not out.replayed and out.result == b"ok"
    assert ledger.spent().epsilon == 0.5


# ---------------------------------------------------------------------- accounting


def test_zcdp_total_rho_equals_the_sum_of_event_rhos(db: Path) -> None:
    policy = BudgetPolicy(50.0, 1e-6, accountant="zcdp")
    ledger = Ledger(db, policy)
    rnd = random.Random(7)
    costs = []
    for i in range(80):
        if rnd.random() < 0.5:
            cost = PrivacyCost.gaussian(rnd.uniform(0.01, 0.5), 1e-8,
                                        sigma=rnd.uniform(1.0, 40.0),
                                        sensitivity=rnd.uniform(0.1, 2.0))
        else:
            cost = PrivacyCost.pure(rnd.uniform(0.001, 0.2))
        costs.append(cost)
        charge(ledger, f"task-{i}", cost)
    expected_rho = math.fsum(c.rho for c in costs)
    assert abs(ledger.spent().rho - expected_rho) <= 1e-12
    assert abs(sum(e.rho for e in ledger.events()) - expected_rho) <= 1e-12
    status = ledger.status()
    assert status.events == 80
    assert status.epsilon_spent == pytest.approx(zcdp_to_epsilon(expected_rho, 1e-6), rel=1e-9)


def test_zcdp_accountant_admits_what_basic_composition_would_refuse(tmp_path: Path) -> None:
    # 40 Gaussian releases at epsilon 0.25 each: basic composition spends 10 > cap 5, while
    # their summed rho converts to about 1.5 at delta 1e-6.
    epsilon, delta = 0.25, 1e-9
    gaussian = PrivacyCost.gaussian(epsilon, delta, sigma=gaussian_sigma(epsilon, delta),
                                    sensitivity=1.0)
    basic = Ledger(tmp_path / "basic.sqlite", BudgetPolicy(5.0, 1e-6, accountant="basic"))
    zcdp = Ledger(tmp_path / "zcdp.sqlite", BudgetPolicy(5.0, 1e-6, accountant="zcdp"))
    refused_basic = 0
    for i in range(40):
        try:
            charge(basic, f"t{i}", gaussian)
        except BudgetExceededError:
            refused_basic += 1
        charge(zcdp, f"t{i}", gaussian)
    assert refused_basic == 20
    assert zcdp.status().epsilon_spent < 2.0
    # ... and the zcdp ledger still refuses once the converted epsilon would pass the cap.
    with pytest.raises(BudgetExceededError, match="zCDP budget exceeded"):
        charge(zcdp, "big", PrivacyCost.pure(3.0))


def assert_never_exceeded(ledger: Ledger, charged: set[str], refused: dict[str, float],
                          cap: float) -> None:
    """The concurrency invariants of reliability.md target 7."""
    events = ledger.events()
    committed = math.fsum(e.epsilon for e in events)
    assert committed <= cap * (1 + SLACK), f"spent {committed} > cap {cap}"
    assert {e.task_id for e in events} == charged  # every charge has its event ...
    assert not charged & set(refused)  # ... and no refused request left one
    # No spurious refusal either: spent only grows, so each refused request must still not fit.
    assert all(committed + eps > cap * (1 + SLACK) for eps in refused.values())


def test_concurrent_spends_from_threads_and_processes_never_exceed_the_cap(db: Path) -> None:
    cap = 3.0
    procs = [spawn("spend", db, f"p{k}", "12", str(100 + k), "--epsilon", str(cap))
             for k in range(4)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "READY\n", p.stderr
    ledger = Ledger(db, BudgetPolicy(cap, 1e-5, accountant="basic"))
    charged: set[str] = set()
    refused: dict[str, float] = {}
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def thread_worker(k: int) -> None:
        rnd = random.Random(k)
        barrier.wait()
        for i in range(6):
            task_id, eps = f"th{k}-{i}", rnd.uniform(0.05, 0.25)
            try:
                charge(ledger, task_id, eps)
            except BudgetExceededError:
                with lock:
                    refused[task_id] = eps
            else:
                with lock:
                    charged.add(task_id)

    threads = [threading.Thread(target=thread_worker, args=(k,)) for k in range(8)]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        for line in out.splitlines():  # READY was read above
            tag, task_id, eps = line.split()
            if tag == "CHARGED":
                charged.add(task_id)
            else:
                refused[task_id] = float(eps)
    assert len(charged) + len(refused) == 4 * 12 + 8 * 6
    assert charged and refused
    print(f"charged {len(charged)} (processes {sum(t.startswith('p') for t in charged)}), "
          f"refused {len(refused)}, spent {ledger.spent().epsilon!r} of cap {cap}")
    assert_never_exceeded(ledger, charged, refused, cap)
    assert {r.task_id for r in ledger.refusals()} == set(refused)


class CheckOutsideTheLockLedger(Ledger):
    """A deliberately broken copy: checks the budget *before* taking the write lock."""

    def __init__(self, path: Path, policy: BudgetPolicy, gate: threading.Barrier) -> None:
        super().__init__(path, BudgetPolicy(1e9, 0.5))  # the inner check never refuses
        self.real_policy = policy
        self.gate = gate

    def charge_and_release(self, **kwargs: Any) -> ledger_module.LedgerOutcome:
        self.real_policy.check(self.composed(), kwargs["cost"])  # check ...
        self.gate.wait()  # ... another request checks too ...
        return super().charge_and_release(**kwargs)  # ... then both spend


@pytest.mark.parametrize("broken", [False, True])
def test_the_cap_check_catches_a_ledger_that_checks_outside_the_lock(
        tmp_path: Path, broken: bool) -> None:
    policy = BudgetPolicy(CAP, 1e-5, accountant="basic")
    gate = threading.Barrier(2)
    ledger = (CheckOutsideTheLockLedger(tmp_path / "l.sqlite", policy, gate) if broken
              else Ledger(tmp_path / "l.sqlite", policy))
    charged: set[str] = set()
    refused: dict[str, float] = {}

    def request(task_id: str) -> None:
        if not broken:
            gate.wait()
        try:
            charge(ledger, task_id, 0.6)
            charged.add(task_id)
        except BudgetExceededError:
            refused[task_id] = 0.6

    threads = [threading.Thread(target=request, args=(f"t{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if broken:
        with pytest.raises(AssertionError, match="> cap"):
            assert_never_exceeded(ledger, charged, refused, CAP)
    else:
        assert len(charged) == 1 and len(refused) == 1
        assert_never_exceeded(ledger, charged, refused, CAP)


# ---------------------------------------------------------------------- storage


def test_every_connection_is_wal_and_synchronous_full(
        ledger: Ledger, db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, int, int]] = []
    original = Ledger._connect

    def spy(self: Ledger) -> sqlite3.Connection:
        conn = original(self)
        seen.append((conn.execute("PRAGMA journal_mode").fetchone()[0],
                     conn.execute("PRAGMA synchronous").fetchone()[0],
                     conn.execute("PRAGMA foreign_keys").fetchone()[0]))
        return conn

    monkeypatch.setattr(Ledger, "_connect", spy)
    charge(ledger, "task-1", 0.1)
    charge(ledger, "task-1", 0.1)
    with pytest.raises(BudgetExceededError):
        charge(ledger, "task-2", 5.0)
    ledger.events()
    ledger.spent()
    ledger.status()
    ledger.refusals()
    ledger.integrity_ok()
    format_ledger(ledger)
    assert len(seen) >= 9
    assert set(seen) == {("wal", 2, 1)}
    pragmas = ledger.connection_pragmas()
    assert pragmas == {"journal_mode": "wal", "synchronous": 2, "foreign_keys": 1,
                       "busy_timeout_ms": 120_000}
    # The journal mode is persisted in the file itself.
    assert raw_rows(db, "PRAGMA journal_mode") == [("wal",)]


def test_reopening_keeps_events_and_replays_after_restart(db: Path) -> None:
    policy = BudgetPolicy(CAP, 1e-5, accountant="basic")
    with Ledger(db, policy) as first:
        outs = [charge(first, f"task-{i}", 0.2) for i in range(3)]
    second = Ledger(db, policy)
    assert second.events() == [o.event for o in outs]
    release = Recorder()
    again = charge(second, "task-1", 0.2, release=release)
    assert again.replayed and again.result == outs[1].result and release.calls == 0
    assert second.spent().epsilon == pytest.approx(0.6)
    with pytest.raises(BudgetExceededError):  # the budget spent before the restart counts
        charge(second, "task-9", 0.5)
    assert second.integrity_ok()


def test_concurrent_first_open_creates_the_schema_once(db: Path) -> None:
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            barrier.wait()
            Ledger(db, BudgetPolicy(CAP, 1e-5, accountant="basic"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert raw_rows(db, "SELECT application, version FROM dpfed_ledger_schema") == [
        ("dpfed-ledger", SCHEMA_VERSION)]


def test_a_foreign_sqlite_file_is_refused_and_left_untouched(db: Path) -> None:
    conn = sqlite3.connect(str(db))
    conn.execute("CREATE TABLE patients (id INTEGER, diagnosis TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(ConfigError, match="not a dpfed ledger.*patients"):
        Ledger(db, BudgetPolicy(CAP, 1e-5, accountant="basic"))
    assert raw_rows(db, "PRAGMA journal_mode") == [("delete",)]  # not switched to WAL
    assert raw_rows(db, "SELECT name FROM sqlite_master") == [("patients",)]


def test_a_file_that_is_not_sqlite_is_refused(db: Path) -> None:
    db.write_text("site_id = 'hospital-a'\n" * 100)
    with pytest.raises(ConfigError, match="cannot be used as an SQLite database"):
        Ledger(db, BudgetPolicy(CAP, 1e-5, accountant="basic"))


@pytest.mark.parametrize(("sql", "message"), [
    ("UPDATE dpfed_ledger_schema SET version = 2", "newer than this dpfed reads"),
    ("UPDATE dpfed_ledger_schema SET application = 'other'", "not a dpfed ledger"),
    ("DROP TABLE ledger_refusals", "damaged"),
])
def test_newer_or_damaged_ledgers_are_refused(db: Path, sql: str, message: str) -> None:
    Ledger(db, BudgetPolicy(CAP, 1e-5, accountant="basic"))
    conn = sqlite3.connect(str(db))
    conn.execute(sql)
    conn.commit()
    conn.close()
    with pytest.raises(ConfigError, match=message):
        Ledger(db, BudgetPolicy(CAP, 1e-5, accountant="basic"))


def test_unusable_paths_are_config_errors(tmp_path: Path) -> None:
    policy = BudgetPolicy(CAP, 1e-5, accountant="basic")
    with pytest.raises(ConfigError, match="is a directory"):
        Ledger(tmp_path, policy)
    with pytest.raises(ConfigError, match="does not exist"):
        Ledger(tmp_path / "missing" / "ledger.sqlite", policy)
    with pytest.raises(ConfigError, match="write-ahead logging"):
        Ledger(":memory:", policy)
    with pytest.raises(ValidationError, match="BudgetPolicy"):
        Ledger(tmp_path / "l.sqlite", {"epsilon": 1.0})  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="busy_timeout_s"):
        Ledger(tmp_path / "l.sqlite", policy, busy_timeout_s=0.0)


def test_events_are_append_only_in_the_file(ledger: Ledger, db: Path) -> None:
    charge(ledger, "task-1", 0.5)
    conn = sqlite3.connect(str(db))
    try:
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("UPDATE ledger_events SET epsilon = 0.001")
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("DELETE FROM ledger_events")
    finally:
        conn.close()
    assert ledger.spent().epsilon == 0.5


def test_a_damaged_stored_result_is_not_replayed(ledger: Ledger, db: Path) -> None:
    charge(ledger, "task-1", 0.5, release=Recorder(b"original"))
    conn = sqlite3.connect(str(db))
    conn.execute("DROP TRIGGER ledger_events_no_update")
    conn.execute("UPDATE ledger_events SET result = x'00'")
    conn.commit()
    conn.close()
    with pytest.raises(LedgerCorruptionError, match="does not match"):
        charge(ledger, "task-1", 0.5)


def test_a_closed_ledger_refuses_calls(ledger: Ledger) -> None:
    ledger.close()
    with pytest.raises(DpfedError, match="closed"):
        charge(ledger, "task-1", 0.1)
    with pytest.raises(DpfedError, match="closed"):
        ledger.events()


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(("field", "value", "message"), [
    ("task_id", "", "task_id must be 1 to 200"),
    ("task_id", "x" * 201, "task_id must be 1 to 200"),
    ("task_id", "line\nbreak", "printable"),
    ("task_id", 17, "task_id must be a str"),
    ("job_id", "", "job_id must be 1 to 200"),
    ("kind", None, "kind must be a str"),
    ("payload_digest", "not-hex" * 8, "payload_digest must be a hex digest"),
    ("payload_digest", "AB" * 32, "lowercase"),
    ("payload_digest", "ab" * 8, "32 to 128"),
    ("cost", PrivacyCost(0.0, 0.0, 0.0), "cost.epsilon must be > 0"),
    ("cost", PrivacyCost(1.0, 0.0, 0.0), "cost.rho must be > 0"),
    ("cost", PrivacyCost(1.0, 0.0, 0.5, "laplace", math.nan, 1.0), "cost.sensitivity"),
    ("cost", PrivacyCost(1.0, 0.0, 0.5, "laplace", 1.0, math.inf), "cost.noise_scale"),
    ("cost", PrivacyCost(1.0, 0.0, 0.5, ""), "cost.mechanism"),
    ("cost", 0.5, "PrivacyCost"),
    ("release", b"bytes, not a callable", "release must be callable"),
])
def test_malformed_requests_are_refused_before_touching_the_ledger(
        ledger: Ledger, db: Path, field: str, value: Any, message: str) -> None:
    release = Recorder()
    kwargs: dict[str, Any] = {"task_id": "task-1", "job_id": "job-1", "kind": "pca",
                              "payload_digest": digest("task-1"),
                              "cost": PrivacyCost.pure(0.1), "release": release}
    kwargs[field] = value
    with pytest.raises(ValidationError, match=message):
        ledger.charge_and_release(**kwargs)
    assert release.calls == 0
    assert ledger.events() == [] and ledger.refusals() == []


def test_task_ids_of_200_characters_are_accepted(ledger: Ledger) -> None:
    assert charge(ledger, "t" * 200, 0.1).event.task_id == "t" * 200


# ---------------------------------------------------------------------- operator views


def test_format_ledger_lists_events_and_totals(ledger: Ledger) -> None:
    assert "(no events)" in format_ledger(ledger)
    charge(ledger, "pca-site-a-1", PrivacyCost.gaussian(0.5, 2e-6, sigma=3.5, sensitivity=1.0),
           job_id="job-pca-7")
    charge(ledger, "svt-site-a-2", 0.25, kind="svt", job_id="job-svt-8")
    with pytest.raises(BudgetExceededError):
        charge(ledger, "svt-site-a-3", 0.5, kind="svt")
    text = format_ledger(ledger)
    lines = text.splitlines()
    assert "basic accountant, cap epsilon 1, delta 1e-05" in text
    header = next(line for line in lines if line.startswith("seq"))
    for column in ("time (UTC)", "task id", "job id", "kind", "mechanism", "epsilon", "delta",
                   "rho", "noise scale"):
        assert column in header
    row = next(line for line in lines if "pca-site-a-1" in line)
    for cell in ("job-pca-7", "pca", "gaussian", "0.5", "2e-06", "3.5"):
        assert cell in row.split()
    assert "Total over 2 events: epsilon 0.75, delta 2e-06" in text
    assert "Remaining: epsilon 0.25 of 1, delta 8e-06 of 1e-05" in text
    assert "Refused tasks (not charged): 1" in text


def test_format_ledger_reports_zcdp_spend(db: Path) -> None:
    ledger = Ledger(db, BudgetPolicy(2.0, 1e-6, accountant="zcdp"))
    cost = PrivacyCost.gaussian(0.5, 1e-7, sigma=5.0, sensitivity=1.0)
    charge(ledger, "task-1", cost)
    text = format_ledger(ledger)
    eps = zcdp_to_epsilon(cost.rho, 1e-6)
    assert f"Spent (zCDP, rho {cost.rho:.6g} at delta 1e-06): epsilon {eps:.6g}" in text
    assert f"Remaining: epsilon {2.0 - eps:.6g} of 2" in text


def test_ledger_as_json_is_serialisable_and_consistent(ledger: Ledger) -> None:
    out = charge(ledger, "task-1", 0.25, release=Recorder(b"secret-ish bytes"))
    with pytest.raises(BudgetExceededError):
        charge(ledger, "task-2", 0.9)
    data = json.loads(json.dumps(ledger_as_json(ledger), allow_nan=False))
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["policy"] == {"accountant": "basic", "epsilon": 1.0, "delta": 1e-5,
                              "max_epsilon_per_task": None}
    (event,) = data["events"]
    assert event["task_id"] == "task-1" and event["result_digest"] == out.event.result_digest
    assert event["result_size"] == len(b"secret-ish bytes")
    assert "result" not in event  # the listing never carries the released bytes
    totals = dict(data["totals"])
    tight = totals.pop("tight_epsilon")
    assert totals == {"events": 1, "epsilon": 0.25, "delta": 0.0,
                      "rho": PrivacyCost.pure(0.25).rho, "fallback_events": 0,
                      "discretisation_error": 2.0 ** -14}
    assert 0.25 - 1e-4 < tight <= 0.25  # randomized response at 0.25, read at delta 1e-5
    assert event["charged_as"] == "pure"
    assert data["status"]["epsilon_remaining"] == 0.75
    assert [r["task_id"] for r in data["refusals"]] == ["task-2"]
