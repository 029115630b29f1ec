"""The job store's durable and lazy commits (aggregator/store.py).

A job's creation, state changes and result are committed with synchronous=FULL (fsynced before
the call returns); progress events, per-site outcomes and site records with NORMAL (they ride on
the next fsync). What each write ran under is read from SQLite's own statement trace; a killed
process keeps every lazy write (real process, SIGKILL).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpfed.aggregator.store import JobStore, utc_now
from dpfed.common.errors import NotFoundError
from dpfed.common.transport.protocol import (
    PROTOCOL_VERSION,
    JobEvent,
    JobSpec,
    JobState,
    SiteHello,
    SiteOutcome,
    SiteStatus,
)

SPEC = JobSpec("pca", 1.0, 1e-5, {"n_components": 1}, min_sites=1)


def writes_by_level(statements: list[str]) -> list[tuple[str, str]]:
    """(first words of each INSERT/UPDATE, the synchronous level set when it ran)."""
    level, out = "FULL", []
    for statement in statements:
        words = " ".join(statement.split()).upper()
        if words.startswith("PRAGMA SYNCHRONOUS="):
            level = words.partition("=")[2]
        elif words.startswith(("INSERT", "UPDATE")):
            out.append((" ".join(words.split()[:3]), level))
    return out


def traced(store: JobStore) -> list[str]:
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)  # noqa: SLF001 -- SQLite's own trace
    return statements


def event(job_id: str, i: int) -> JobEvent:
    return JobEvent(job_id, utc_now(), "round", f"event {i}", i / 10, JobState.RUNNING)


def test_jobs_and_states_are_durable_progress_is_lazy(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    statements = traced(store)
    job, _ = store.create_job(SPEC, submitted_by="analyst/a")
    store.update_job(job.job_id, state=JobState.RUNNING)
    store.add_event(event(job.job_id, 1))
    store.update_job(job.job_id, sites=(SiteOutcome("hospital-1", SiteStatus.OK, ""),))
    store.record_site("hospital-1", SiteHello("hospital-1", PROTOCOL_VERSION, "d", 10,
                                              ("pca",), None, None))
    store.save_result(job.job_id, b"result")
    store.update_job(job.job_id, state=JobState.SUCCEEDED,
                     sites=(SiteOutcome("hospital-1", SiteStatus.OK, ""),))
    assert writes_by_level(statements) == [
        ("INSERT INTO JOBS", "FULL"),
        ("UPDATE JOBS SET", "FULL"),          # running
        ("INSERT INTO JOB_EVENTS", "NORMAL"),
        ("UPDATE JOBS SET", "NORMAL"),        # the per-site outcomes alone
        ("INSERT INTO SITES", "NORMAL"),
        ("UPDATE JOBS SET", "FULL"),          # the result file
        ("UPDATE JOBS SET", "FULL"),          # succeeded, with its outcomes
    ]
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # noqa: SLF001
    store.close()


def test_a_failed_lazy_write_leaves_the_connection_durable(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    with pytest.raises(NotFoundError):
        store.update_job("no-such-job", sites=(SiteOutcome("h", SiteStatus.OK, ""),))
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # noqa: SLF001
    job, _ = store.create_job(SPEC, submitted_by="analyst/a")
    statements = traced(store)
    store.update_job(job.job_id, state=JobState.FAILED, error="x")
    assert writes_by_level(statements) == [("UPDATE JOBS SET", "FULL")]
    store.close()


def test_a_killed_coordinator_keeps_every_lazy_write(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, signal
        from dpfed.aggregator.store import JobStore
        from tests.aggregator.test_job_store_writes import SPEC, event
        store = JobStore({str(tmp_path)!r})
        job, _ = store.create_job(SPEC, submitted_by="analyst/a")
        for i in range(50):
            store.add_event(event(job.job_id, i))
        print(job.job_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[2])
    assert proc.returncode == -9, proc.stderr
    store = JobStore(tmp_path)
    events = store.events(proc.stdout.split()[0])
    assert [e.message for e in events] == [f"event {i}" for i in range(50)]
    store.close()
