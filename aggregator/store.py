"""The coordinator's durable job store: jobs, their progress events, known sites, result files.

SQLite (WAL) for metadata and one ``.npz`` file per finished job, written atomically
(temporary file, fsync, rename). Everything survives a coordinator restart: jobs left
``pending`` or ``running`` are resumed with the same job id, so their task ids are the same and
sites replay the releases they already charged instead of spending again.

Durable and lazy writes: a job's creation, state changes and result are committed with
``synchronous=FULL`` (the WAL is fsynced before the call returns). Progress events, per-site
outcomes and site records -- most of the writes, one per site per round at the least -- are
committed with ``synchronous=NORMAL``: appended to the WAL without an fsync, so the next durable
commit's fsync makes them durable too (the WAL is one append-only file). A killed coordinator
loses none of them (the OS holds what was written); a power loss can lose only lazy writes made
after the last durable one, i.e. progress a resumed job recomputes -- never a job or its state.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sqlite3
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dpfed.common.errors import ConfigError, IdempotencyConflictError, NotFoundError
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.transport.protocol import (
    JobEvent,
    JobInfo,
    JobSpec,
    RefusalCode,
    SiteHello,
    SiteOutcome,
    SiteStatus,
)
from dpfed.common.validation import path_component

#: 2: request ids are unique per submitter (version 1 had one namespace for everybody).
SCHEMA_VERSION = 2

_JOBS_TABLE = """
CREATE TABLE IF NOT EXISTS {name} (
    job_id TEXT PRIMARY KEY,
    request_id TEXT,
    kind TEXT NOT NULL,
    spec_json TEXT NOT NULL,
    state TEXT NOT NULL,
    created TEXT NOT NULL,
    updated TEXT NOT NULL,
    error TEXT NOT NULL DEFAULT '',
    sites_json TEXT NOT NULL DEFAULT '[]',
    summary_json TEXT NOT NULL DEFAULT '{}',
    submitted_by TEXT NOT NULL DEFAULT '',
    result_file TEXT NOT NULL DEFAULT '',
    result_size INTEGER NOT NULL DEFAULT 0,
    UNIQUE (submitted_by, request_id)
);
"""

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
""" + _JOBS_TABLE.replace("{name}", "jobs") + """
CREATE TABLE IF NOT EXISTS job_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    time TEXT NOT NULL,
    stage TEXT NOT NULL,
    message TEXT NOT NULL,
    progress REAL NOT NULL,
    state TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS job_events_by_job ON job_events(job_id, seq);
CREATE TABLE IF NOT EXISTS sites (
    site_id TEXT PRIMARY KEY,
    first_seen TEXT NOT NULL,
    last_seen TEXT NOT NULL,
    hello_json TEXT NOT NULL
);
"""


def utc_now() -> str:
    """Return the current UTC time, ISO-8601 with milliseconds."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def new_job_id() -> str:
    """Return a sortable, unguessable job id, e.g. ``20261122T101500-3fa9c2``."""
    return f"{datetime.now(UTC):%Y%m%dT%H%M%S}-{secrets.token_hex(3)}"


def _finite_only(value: Any) -> Any:
    """Replace NaN/Infinity (stored by an older version) by None, so every reader survives."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_only(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_only(v) for v in value]
    return value


def _cost_dict(cost: PrivacyCost | None) -> dict[str, Any] | None:
    return None if cost is None else asdict(cost)


def _outcomes_to_json(sites: tuple[SiteOutcome, ...]) -> str:
    return json.dumps([{**asdict(s), "spend": _cost_dict(s.spend)} for s in sites])


def _outcomes_from_json(text: str) -> tuple[SiteOutcome, ...]:
    out = []
    for d in json.loads(text):
        spend = PrivacyCost(**d["spend"]) if d.get("spend") else None
        reason = d.get("reason", "")
        code, left_out = ((d["code"], d.get("left_out", False)) if "code" in d
                          else _legacy_code(d["status"], reason))
        out.append(SiteOutcome(d["site_id"], SiteStatus(d["status"]), reason, spend,
                               int(d.get("row_count", 0)),
                               RefusalCode(code) if code else None, bool(left_out)))
    return tuple(out)


def _legacy_code(status: str, reason: str) -> tuple[str | None, bool]:
    """Return the code and left-out mark of an outcome stored before outcomes carried them.

    Such a refusal's reason was ``"<code>: <text>"``, and a site left out before the first
    round for its budget said ``"budget_exceeded: the job needs ..."``.
    """
    if status != SiteStatus.REFUSED:
        return None, False
    code, _sep, text = reason.partition(": ")
    if code not in set(RefusalCode):
        return None, False
    return code, code == RefusalCode.BUDGET_EXCEEDED and text.split(" ", 2)[:2] == ["the",
                                                                                   "job"]


def _spec_to_json(spec: JobSpec) -> str:
    stored = {"kind": spec.kind, "epsilon": spec.epsilon, "delta": spec.delta,
              "params": dict(spec.params), "min_sites": spec.min_sites,
              "deadline_seconds": spec.deadline_seconds, "sites": list(spec.sites)}
    if spec.study:  # absent for a job without one: stored specs stay as they were
        stored["study"] = spec.study
    return json.dumps(stored)


def _spec_from_json(text: str) -> JobSpec:
    d = json.loads(text)
    return JobSpec(d["kind"], d["epsilon"], d["delta"], d["params"], d["min_sites"],
                   d["deadline_seconds"], tuple(d["sites"]), d.get("study", ""))


class JobStore:
    """Persistent jobs, events, sites and results under one directory.

    Thread-safe: one connection guarded by a lock (the coordinator's writes are small and
    infrequent; SQLite's own locking guards against a second process on the same store).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.results_dir = self.directory / "results"
        try:
            self.results_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the job store at {self.directory}: {exc}") from None
        self.path = self.directory / "jobs.sqlite"
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=30000")
            self._db.executescript(_DDL)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"{self.path} is not a dpfed job store: {exc}") from None
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)",
                             (str(SCHEMA_VERSION),))
        elif int(row[0]) > SCHEMA_VERSION:
            raise ConfigError(f"{self.path} was written by a newer dpfed (store schema {row[0]}); "
                              "upgrade this coordinator")
        elif int(row[0]) == 1:
            self._migrate_v1()

    def _migrate_v1(self) -> None:
        """Scope request ids to their submitter: rebuild ``jobs`` with the new constraint."""
        with self._tx() as db:
            db.execute(_JOBS_TABLE.replace("{name}", "jobs_v2"))
            db.execute("INSERT INTO jobs_v2 SELECT * FROM jobs")
            db.execute("DROP TABLE jobs")
            db.execute("ALTER TABLE jobs_v2 RENAME TO jobs")
            db.execute("UPDATE meta SET value=? WHERE key='schema_version'",
                       (str(SCHEMA_VERSION),))

    @contextmanager
    def _tx(self, *, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One transaction; ``durable=False`` commits without an fsync (module docstring)."""
        with self._lock:
            if not durable:
                self._db.execute("PRAGMA synchronous=NORMAL")  # per connection, between txs
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            finally:
                if not durable:
                    self._db.execute("PRAGMA synchronous=FULL")

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ jobs
    def create_job(self, spec: JobSpec, *, submitted_by: str,
                   request_id: str = "") -> tuple[JobInfo, bool]:
        """Create a pending job; return (job, created).

        A ``request_id`` this submitter already used returns its job; request ids of
        different submitters never meet (another analyst's id starts a job of its own).
        """
        now = utc_now()
        with self._tx() as db:
            row = None
            if request_id:
                row = db.execute("SELECT job_id FROM jobs WHERE request_id=? AND submitted_by=?",
                                 (request_id, submitted_by)).fetchone()
            if row is not None:
                job_id, created = row[0], False
                stored = db.execute("SELECT spec_json FROM jobs WHERE job_id=?",
                                    (job_id,)).fetchone()[0]
                if json.loads(stored) != json.loads(_spec_to_json(spec)):
                    raise IdempotencyConflictError(
                        f"request_id {request_id!r} was already used for job {job_id} with a "
                        "different job spec; resubmit the same spec to follow that job, or use "
                        "a new request_id for a new job")
            else:
                job_id, created = new_job_id(), True
                db.execute(
                    "INSERT INTO jobs (job_id, request_id, kind, spec_json, state, created, "
                    "updated, submitted_by) VALUES (?, ?, ?, ?, 'pending', ?, ?, ?)",
                    (job_id, request_id or None, spec.kind, _spec_to_json(spec), now, now,
                     submitted_by))
        return self.get_job(job_id), created

    def _row_to_job(self, row: sqlite3.Row | tuple[Any, ...]) -> JobInfo:
        (job_id, _req, _kind, spec_json, state, created, updated, error, sites_json, summary_json,
         submitted_by, _file, size) = row
        return JobInfo(job_id, _spec_from_json(spec_json), state, created, updated, error,
                       _outcomes_from_json(sites_json), _finite_only(json.loads(summary_json)),
                       submitted_by, int(size))

    def get_job(self, job_id: str) -> JobInfo:
        """Return a job (NotFoundError if unknown)."""
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no job with id {job_id!r}")
        return self._row_to_job(row)

    def list_jobs(self, limit: int = 50, *,
                  submitted_by: Collection[str] | None = None) -> list[JobInfo]:
        """Most recent jobs first (only those of the given submitters, unless None)."""
        where, args = "", []
        if submitted_by is not None:
            owners = sorted(set(submitted_by))
            if not owners:
                return []
            where = f"WHERE submitted_by IN ({', '.join('?' * len(owners))}) "
            args = owners
        with self._lock:
            rows = self._db.execute(f"SELECT * FROM jobs {where}ORDER BY created DESC, job_id "
                                    "DESC LIMIT ?", (*args, max(1, limit))).fetchall()
        return [self._row_to_job(r) for r in rows]

    def job_counts(self) -> list[tuple[str, str, int]]:
        """(kind, state, number of jobs) for every kind and state in the store."""
        with self._lock:
            rows = self._db.execute("SELECT kind, state, COUNT(*) FROM jobs "
                                    "GROUP BY kind, state ORDER BY kind, state").fetchall()
        return [(str(k), str(s), int(n)) for k, s, n in rows]

    def unfinished_jobs(self) -> list[JobInfo]:
        """Jobs that were pending or running when the coordinator stopped (oldest first)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs WHERE state IN ('pending', 'running') "
                                    "ORDER BY created").fetchall()
        return [self._row_to_job(r) for r in rows]

    def update_job(self, job_id: str, *, state: str | None = None, error: str | None = None,
                   sites: tuple[SiteOutcome, ...] | None = None,
                   summary: dict[str, Any] | None = None) -> JobInfo:
        """Update a job's fields and its ``updated`` time.

        Durable, except an update of the per-site outcomes alone (lazy: progress).
        """
        lazy = state is None and error is None and summary is None and sites is not None
        sets, args = ["updated=?"], [utc_now()]
        if state is not None:
            sets.append("state=?")
            args.append(state)
        if error is not None:
            sets.append("error=?")
            args.append(error)
        if sites is not None:
            sets.append("sites_json=?")
            args.append(_outcomes_to_json(sites))
        if summary is not None:
            sets.append("summary_json=?")
            args.append(json.dumps(summary, allow_nan=False))  # never store NaN/Infinity
        with self._tx(durable=not lazy) as db:
            cur = db.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE job_id=?", (*args, job_id))
            if cur.rowcount == 0:
                raise NotFoundError(f"no job with id {job_id!r}")
        return self.get_job(job_id)

    def add_event(self, event: JobEvent) -> None:
        """Append a progress event (lazy: committed without an fsync)."""
        with self._tx(durable=False) as db:
            db.execute("INSERT INTO job_events (job_id, time, stage, message, progress, state) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (event.job_id, event.time, event.stage,
                                                    event.message, event.progress, event.state))

    def events(self, job_id: str) -> list[JobEvent]:
        """Return a job's events, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT job_id, time, stage, message, progress, state FROM "
                                    "job_events WHERE job_id=? ORDER BY seq", (job_id,)).fetchall()
        return [JobEvent(*r) for r in rows]

    # ------------------------------------------------------------------ results
    def save_result(self, job_id: str, data: bytes) -> Path:
        """Write a job's result file atomically and record it."""
        final = self.results_dir / f"{path_component(job_id)}.npz"
        tmp = final.with_suffix(".npz.tmp")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        dir_fd = os.open(self.results_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        with self._tx() as db:
            db.execute("UPDATE jobs SET result_file=?, result_size=? WHERE job_id=?",
                       (final.name, len(data), job_id))
        return final

    def result_path(self, job_id: str) -> Path:
        """Return the result file of a finished job (NotFoundError when there is none)."""
        with self._lock:
            row = self._db.execute("SELECT result_file, state FROM jobs WHERE job_id=?",
                                   (job_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no job with id {job_id!r}")
        if not row[0]:
            raise NotFoundError(f"job {job_id} has no result (state: {row[1]})")
        return self.results_dir / str(row[0])

    # ------------------------------------------------------------------ sites
    def record_site(self, site_id: str, hello: SiteHello) -> None:
        """Remember a site's latest Hello (so budgets stay visible while it is offline).

        Lazy (no fsync): the site says it again when it next connects.
        """
        now = utc_now()
        budget = None if hello.budget is None else asdict(hello.budget)
        data = json.dumps({**asdict(hello), "budget": budget})
        with self._tx(durable=False) as db:
            db.execute("INSERT INTO sites VALUES (?, ?, ?, ?) ON CONFLICT(site_id) DO UPDATE SET "
                       "last_seen=excluded.last_seen, hello_json=excluded.hello_json",
                       (site_id, now, now, data))

    def known_sites(self) -> list[tuple[str, str, str, SiteHello]]:
        """(site_id, first_seen, last_seen, last Hello) of every site ever seen."""
        from dpfed.common.privacy.accounting import BudgetStatus

        with self._lock:
            rows = self._db.execute("SELECT site_id, first_seen, last_seen, hello_json FROM sites "
                                    "ORDER BY site_id").fetchall()
        out = []
        for site_id, first, last, text in rows:
            d = json.loads(text)
            budget = BudgetStatus(**d["budget"]) if d.get("budget") else None
            hello = SiteHello(d["software_version"], d["protocol_version"], d["schema_digest"],
                              d["row_count"], tuple(d["allowed_kinds"]), d["max_epsilon_per_task"],
                              budget, str(d.get("secure_policy", "")))
            out.append((site_id, first, last, hello))
        return out
