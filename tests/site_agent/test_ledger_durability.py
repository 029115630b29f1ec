"""Crash durability of the site ledger: kill -9 a real child process mid-task, then reopen.

reliability.md target 8 (and the restart half of target 9). A child process runs the
``loop`` mode of tests/site_agent/ledger_worker.py: it charges tasks one after another and reports
``ACK <task> <sha256 of result> <replayed>`` only after ``charge_and_release`` returned. The
parent SIGKILLs it at a random point and reopens the ledger. After every kill:

- ``PRAGMA integrity_check`` is ok, ``seq`` has no gaps, and every stored result matches its
  stored SHA-256 (no half-written row);
- every acknowledged task is present with the acknowledged digest (no acknowledged charge is
  lost, in this trial or any earlier one), and nothing committed earlier has disappeared;
- the trial's own events are a prefix of what it attempted: the acknowledged tasks plus at most
  the one in flight (committed, but killed before its ACK);
- the in-flight task is retried by the next trial's child: if its charge was committed, the
  retry replays the stored bytes (``replayed=1``, same digest, no new event); if not, it is
  charged fresh.

Kill points (in rotation): a random delay after the ledger is open; right after a ``RELEASE``
line (the child is inside ``release()``, sleeping or computing, holding the write lock); a few
milliseconds after an ``ACK`` (in the next task's check, release or commit); and a few
milliseconds after ``STARTING`` (while the ledger is opened, created or recovered).

Two kinds of child, both real processes killed with SIGKILL:

- ``python tests/site_agent/ledger_worker.py loop ...``, a fresh interpreter reporting on a flushed
  stdout (``DPFED_KILL_SUBPROCESS_TRIALS``, default 4 trials: each pays ~1 s of imports);
- a child forked by a multiprocessing ``forkserver`` that has preloaded the worker, reporting
  over a pipe (``DPFED_KILL_TRIALS``, default 40 trials). The forkserver process never opens
  the ledger, so each child starts with no SQLite state, exactly like a fresh interpreter.

Long run: ``DPFED_KILL_TRIALS=300 pytest tests/site_agent/test_ledger_durability.py -s`` (prints a
summary of where the kills landed). ``DPFED_KILL_SEED`` fixes the kill schedule.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.site_agent.ledger import Ledger
from tests.site_agent.ledger_worker import LOOP_COST, LOOP_POLICY, loop_child, payload_digest, spawn

FORKED_TRIALS = int(os.environ.get("DPFED_KILL_TRIALS", "40"))
SUBPROCESS_TRIALS = int(os.environ.get("DPFED_KILL_SUBPROCESS_TRIALS", "4"))
SEED = int(os.environ.get("DPFED_KILL_SEED", "20240531"))
STRATEGIES = ("random_delay", "in_release", "after_ack", "while_opening")


class Child(Protocol):
    """A running ``loop`` worker seen from the parent."""

    pid: int

    def next_line(self) -> str:
        """Block for the next complete line; raise AssertionError if the child ended."""

    def kill_and_collect(self) -> tuple[int, list[str]]:
        """SIGKILL the child; return its exit code and the complete lines it still sent."""


class SubprocessChild:
    """A fresh ``python tests/site_agent/ledger_worker.py loop`` process reporting on stdout."""

    def __init__(self, db: Path, prefix: str, seed: int, retry: str | None) -> None:
        self.proc = spawn("loop", db, prefix, str(seed), *(["--retry", retry] if retry else []))
        self.pid = self.proc.pid

    def next_line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.endswith("\n"), f"worker ended early: {self.proc.communicate()[1]}"
        return line[:-1]

    def kill_and_collect(self) -> tuple[int, list[str]]:
        os.kill(self.proc.pid, signal.SIGKILL)
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == -signal.SIGKILL, f"worker exited by itself: {err}"
        return self.proc.returncode, out.split("\n")[:-1]  # drop a line cut by the kill


class ForkedChild:
    """A child forked by the forkserver, reporting over a one-way pipe."""

    context: Any = None

    def __init__(self, db: Path, prefix: str, seed: int, retry: str | None) -> None:
        if ForkedChild.context is None:
            ForkedChild.context = multiprocessing.get_context("forkserver")
            ForkedChild.context.set_forkserver_preload(["tests.site_agent.ledger_worker"])
        reader, writer = ForkedChild.context.Pipe(duplex=False)
        self.reader: Connection = reader
        self.proc = ForkedChild.context.Process(
            target=loop_child, args=(str(db), prefix, seed, retry, writer), daemon=True)
        self.proc.start()
        writer.close()
        self.pid = int(self.proc.pid)

    def next_line(self) -> str:
        assert self.reader.poll(60), "worker sent nothing for 60 s"
        try:
            return self.reader.recv_bytes().decode()
        except EOFError:
            raise AssertionError(
                f"worker ended early with exit code {self.proc.exitcode}") from None

    def kill_and_collect(self) -> tuple[int, list[str]]:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.join(60)
        assert self.proc.exitcode == -signal.SIGKILL, f"worker exit code {self.proc.exitcode}"
        lines = []
        while self.reader.poll(0.05):
            try:
                lines.append(self.reader.recv_bytes().decode())
            except EOFError:
                break
        self.reader.close()
        self.proc.close()
        return -signal.SIGKILL, lines


def read_until(child: Child, lines: list[str], prefix: str, count: int) -> None:
    """Append the child's lines to ``lines`` until the count-th one starting with prefix."""
    seen = 0
    while seen < count:
        line = child.next_line()
        lines.append(line)
        seen += line.startswith(prefix)


def stored_events(db: Path) -> list[tuple[int, str, bytes, str, str]]:
    """All events, read with a plain sqlite3 connection (independent of the Ledger code)."""
    conn = sqlite3.connect(str(db))
    try:
        return conn.execute("SELECT seq, task_id, result, result_digest, payload_digest "
                            "FROM ledger_events ORDER BY seq").fetchall()
    finally:
        conn.close()


def kill_campaign(db: Path, trials: int, start: Callable[..., Child], seed: int) -> Counter[str]:
    """Run ``trials`` kill -9 trials against one ledger file, checking it after each."""
    rnd = random.Random(seed)
    stats: Counter[str] = Counter()
    committed: dict[str, str] = {}  # task id -> result digest, as of the last check
    acknowledged: dict[str, str] = {}
    pending: str | None = None  # the task in flight at the last kill; retried next trial

    for trial in range(trials):
        strategy = STRATEGIES[trial % len(STRATEGIES)]
        pending_was_committed = pending is not None and pending in committed
        child = start(db, f"t{trial}", rnd.randrange(2**31), pending)
        lines: list[str] = []
        try:
            if strategy == "while_opening":
                read_until(child, lines, "STARTING", 1)
                time.sleep(rnd.uniform(0.0, 0.005))
            else:
                read_until(child, lines, "READY", 1)
                if strategy == "random_delay":
                    time.sleep(rnd.uniform(0.0, 0.2))
                elif strategy == "in_release":
                    read_until(child, lines, "RELEASE ", rnd.randint(1, 6))
                else:
                    read_until(child, lines, "ACK ", rnd.randint(1, 6))
                    time.sleep(rnd.uniform(0.0, 0.003))
        finally:
            _, rest = child.kill_and_collect()
        lines += rest
        stats[f"kills {strategy}"] += 1
        stats["kills before the ledger was open"] += "READY" not in lines

        acks = [line.split()[1:] for line in lines if line.startswith("ACK ")]
        released = {line.split()[1] for line in lines if line.startswith("RELEASE ")}

        # Restart: opening the ledger recovers the WAL; the file must be whole.
        ledger = Ledger(db, LOOP_POLICY)
        assert ledger.integrity_ok()
        rows = stored_events(db)
        assert [r[0] for r in rows] == list(range(1, len(rows) + 1))  # no gap, no torn row
        for _, task_id, result, result_digest, digest_of_payload in rows:
            assert hashlib.sha256(result).hexdigest() == result_digest, task_id
            assert digest_of_payload == payload_digest(task_id)
        now = {r[1]: r[3] for r in rows}

        # Nothing committed earlier disappeared, acknowledged or not.
        assert all(now.get(t) == d for t, d in committed.items())
        for task_id, result_digest, _ in acks:
            acknowledged[task_id] = result_digest
        # No acknowledged charge is lost (from this trial or any earlier one).
        missing = [t for t, d in acknowledged.items() if now.get(t) != d]
        assert not missing, f"acknowledged but not in the ledger: {missing}"

        # The retry of the previous in-flight task: replayed iff its charge had been committed.
        retry_ack = [a for a in acks if a[0] == pending]
        if retry_ack:
            assert retry_ack[0][2] == str(int(pending_was_committed))
            stats["retries that replayed the stored bytes" if pending_was_committed
                  else "retries charged fresh"] += 1

        # This trial's own tasks: a prefix of what it attempted.
        own = sorted((t for t in now if t.startswith(f"t{trial}-")),
                     key=lambda t: int(t.split("-")[1]))
        n_acked = sum(1 for a in acks if a[0].startswith(f"t{trial}-"))
        assert own == [f"t{trial}-{i}" for i in range(len(own))]
        assert len(own) in (n_acked, n_acked + 1)
        assert set(now) - set(committed) <= set(own) | {pending}

        # Where did the kill land? Pick the task to retry next time.
        in_flight = pending if pending is not None and not retry_ack else f"t{trial}-{n_acked}"
        if in_flight in now and in_flight not in acknowledged:
            stats["in flight: committed, killed before its ACK"] += 1
        elif in_flight in released:
            stats["in flight: killed in release() or commit, rolled back"] += 1
        else:
            stats["killed outside a task"] += 1
        pending = None if in_flight in acknowledged else in_flight
        committed = now

    # Finally, every committed task replays its stored bytes without drawing anything.
    ledger = Ledger(db, LOOP_POLICY)

    def must_not_run() -> bytes:
        raise AssertionError("release() ran for a task that was already charged")

    for task_id, result_digest in committed.items():
        outcome = ledger.charge_and_release(
            task_id=task_id, job_id="job-" + task_id.split("-")[0], kind="test",
            payload_digest=payload_digest(task_id), cost=PrivacyCost.pure(LOOP_COST),
            release=must_not_run)
        assert outcome.replayed
        assert hashlib.sha256(outcome.result).hexdigest() == result_digest
    assert ledger.status().events == len(committed)
    stats["events"] = len(committed)
    stats["acknowledged charges"] = len(acknowledged)
    return stats


def report(name: str, trials: int, stats: Counter[str]) -> None:
    print(f"\n{name}: {trials} kill -9 trials; "
          + "; ".join(f"{k}: {v}" for k, v in sorted(stats.items())))


def test_kill_9_of_forked_children_never_loses_an_acknowledged_charge(tmp_path: Path) -> None:
    stats = kill_campaign(tmp_path / "ledger.sqlite", FORKED_TRIALS, ForkedChild, SEED)
    report("forked children", FORKED_TRIALS, stats)


def test_kill_9_of_fresh_interpreters_never_loses_an_acknowledged_charge(
        tmp_path: Path) -> None:
    stats = kill_campaign(tmp_path / "ledger.sqlite", SUBPROCESS_TRIALS, SubprocessChild,
                          SEED + 1)
    report("fresh interpreters", SUBPROCESS_TRIALS, stats)
