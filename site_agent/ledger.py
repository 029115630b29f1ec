"""The site's durable privacy ledger: check-and-charge, store the release, replay retries.

docs/privacy.md, invariant 4 ("Ledger first, durable, idempotent") lives here. Every value a site
sends is produced by :meth:`Ledger.charge_and_release`, which in **one** SQLite transaction

1. looks the task id up (a retry gets the stored bytes back and draws no fresh noise),
2. derives what the site has spent from the stored events and checks the request against the
   site's :class:`~dpfed.common.privacy.accounting.BudgetPolicy` (over budget: nothing is drawn),
3. calls the caller's ``release()`` (which draws the noise), and
4. inserts the event together with the released bytes and commits,

and only then hands the bytes back. So a value can leave the site only after its charge is on
disk, and a charge is on disk only together with the exact bytes it paid for. (Step 1 is also
tried once *before* the transaction, without the write lock: events are append-only, so a
committed row seen there is final, and a retry of a finished task then never waits behind
another task's ``release()``. Whether the row is absent is decided only under the lock.)

Storage
-------
One SQLite file with three tables (see ``_SCHEMA``):

``dpfed_ledger_schema``
    One row naming the application and the schema version, so that a file which is not a
    ledger, or was written by a newer dpfed, is refused instead of silently reinterpreted.
``ledger_events``
    One row per charged task (task id is the primary key, i.e. UNIQUE): job id, kind,
    mechanism, epsilon, delta, rho, sensitivity, noise scale, payload digest, the released
    bytes and their SHA-256, and the UTC time. There is **no running-total column**: totals
    are always derived from the events (as Google's ``dp_accounting`` and Opacus do, see
    ``docs/testing.md`` section 3), so the ledger cannot drift from its own
    history. Triggers make the table append-only.
``ledger_refusals``
    Tasks refused for the operator's information (over budget, or a task id reused for a
    different payload). A refusal charges nothing.

Connections and pragmas
-----------------------
Every connection the ledger opens (:meth:`Ledger._connect`) sets:

``PRAGMA busy_timeout``
    A writer that finds the write lock taken waits (up to ``busy_timeout_s``) instead of
    failing at once with "database is locked". ``release()`` runs while the lock is held, so
    the timeout must exceed the longest release of any process sharing the file.
``PRAGMA foreign_keys=ON``
    SQLite leaves foreign keys unenforced unless each connection asks; the schema has none
    today, but any added later is then enforced from the start.
``PRAGMA journal_mode=WAL``
    Write-ahead logging: readers (``dpfed-site ledger``, status queries) never block the
    writer and the writer never blocks them; a crash leaves either the whole transaction or
    none of it. The mode is persisted in the file; setting it again is a no-op.
``PRAGMA synchronous=FULL`` (reads back as 2)
    In WAL mode, FULL fsyncs the WAL on every commit. With NORMAL, a committed transaction
    "might roll back following a power loss or system crash" (sqlite.org/pragma.html) -- a
    charge we already acted on could vanish and its budget be spent twice. Unlike the journal
    mode, ``synchronous`` is per connection, so it is set (and verified) on every connection.

Why one connection per call (not one per thread)
------------------------------------------------
Each public method opens its own connection and closes it before returning. Nothing is
shared between threads (``sqlite3`` connections are not meant to be used from several threads
at once), no connection ever survives a ``fork()`` (SQLite forbids using a connection inherited
across fork), and there is no per-thread state to leak when handler threads come and go.
SQLite's own file locks then make the ledger safe across threads and processes alike. The
price: opening a connection and setting the pragmas takes about a millisecond, and when the
closing connection is the last one on the file SQLite checkpoints the WAL into the database
(one more fsync). On the development VM a charge took ~14 ms with another connection open and
~38 ms without; a replayed retry ~2 ms. That is nothing next to a DP task, and a site charges
a few tasks per job.

Why ``BEGIN IMMEDIATE``
-----------------------
Check-then-spend must be atomic across processes: two tasks that each fit the remaining budget
alone must not both pass the check. ``BEGIN IMMEDIATE`` takes the database's single write lock
*before* the spent total is read, so no other writer can commit between our check and our
insert. A plain (deferred) ``BEGIN`` would read first and try to take the lock at the insert;
in WAL mode SQLite cannot upgrade such a read transaction once another writer is active, so the
loser fails at once with "database is locked" (``SQLITE_BUSY``/``SQLITE_BUSY_SNAPSHOT``)
*without* waiting for the busy timeout -- a spurious error after its noise was already drawn.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

from dpfed.common.errors import (
    BudgetExceededError,
    ConfigError,
    DpfedError,
    IdempotencyConflictError,
    NotFoundError,
    ValidationError,
)
from dpfed.common.privacy.accounting import BudgetPolicy, BudgetStatus, PrivacyCost, StudyStatus
from dpfed.common.privacy.spent import Spent, event_loss
from dpfed.common.transport.protocol import RefusalCode
from dpfed.common.validation import check_nonnegative, check_positive

logger = logging.getLogger(__name__)

#: Name stored in the schema table; a file without it is not a dpfed ledger.
APPLICATION = "dpfed-ledger"
#: Version of the table layout this module writes and reads.
SCHEMA_VERSION = 1
#: Longest task id, job id, kind or mechanism name accepted.
MAX_ID_LENGTH = 200

REFUSAL_BUDGET = "budget_exceeded"
REFUSAL_CONFLICT = "idempotency_conflict"

_SCHEMA_TABLE = "dpfed_ledger_schema"
_EVENTS_TABLE = "ledger_events"
_REFUSALS_TABLE = "ledger_refusals"
_DIGEST_RE = re.compile(r"[0-9a-f]{32,128}")

# Column types are enforced with CHECK(typeof(...)) rather than STRICT tables, which would
# make the file unreadable by SQLite < 3.37 (still shipped by some long-term-support distros).
_SCHEMA: tuple[str, ...] = (
    f"""CREATE TABLE {_SCHEMA_TABLE} (
        id          INTEGER PRIMARY KEY CHECK (id = 1),
        application TEXT    NOT NULL,
        version     INTEGER NOT NULL,
        created_at  TEXT    NOT NULL
    )""",
    f"""CREATE TABLE {_EVENTS_TABLE} (
        task_id        TEXT    PRIMARY KEY NOT NULL
                               CHECK (length(task_id) BETWEEN 1 AND {MAX_ID_LENGTH}),
        seq            INTEGER NOT NULL UNIQUE CHECK (seq >= 1),
        job_id         TEXT    NOT NULL CHECK (length(job_id) >= 1),
        kind           TEXT    NOT NULL CHECK (length(kind) >= 1),
        mechanism      TEXT    NOT NULL CHECK (length(mechanism) >= 1),
        epsilon        REAL    NOT NULL CHECK (typeof(epsilon) = 'real' AND epsilon > 0),
        delta          REAL    NOT NULL CHECK (typeof(delta) = 'real' AND delta >= 0
                                               AND delta < 1),
        rho            REAL    NOT NULL CHECK (typeof(rho) = 'real' AND rho > 0),
        sensitivity    REAL    NOT NULL CHECK (typeof(sensitivity) = 'real'
                                               AND sensitivity >= 0),
        noise_scale    REAL    NOT NULL CHECK (typeof(noise_scale) = 'real'
                                               AND noise_scale >= 0),
        payload_digest TEXT    NOT NULL CHECK (length(payload_digest) BETWEEN 32 AND 128),
        result         BLOB    NOT NULL CHECK (typeof(result) = 'blob'),
        result_digest  TEXT    NOT NULL CHECK (length(result_digest) = 64),
        created_at     TEXT    NOT NULL
    )""",
    # A charge, once committed, is history: refuse UPDATE and DELETE inside SQLite itself.
    f"""CREATE TRIGGER ledger_events_no_update BEFORE UPDATE ON {_EVENTS_TABLE}
        BEGIN SELECT RAISE(ABORT, 'ledger events are append-only'); END""",
    f"""CREATE TRIGGER ledger_events_no_delete BEFORE DELETE ON {_EVENTS_TABLE}
        BEGIN SELECT RAISE(ABORT, 'ledger events are append-only'); END""",
    f"""CREATE TABLE {_REFUSALS_TABLE} (
        seq            INTEGER PRIMARY KEY AUTOINCREMENT,
        task_id        TEXT    NOT NULL,
        job_id         TEXT    NOT NULL,
        kind           TEXT    NOT NULL,
        mechanism      TEXT    NOT NULL,
        epsilon        REAL    NOT NULL,
        delta          REAL    NOT NULL,
        rho            REAL    NOT NULL,
        payload_digest TEXT    NOT NULL,
        reason         TEXT    NOT NULL
                               CHECK (reason IN ('{REFUSAL_BUDGET}', '{REFUSAL_CONFLICT}')),
        message        TEXT    NOT NULL,
        created_at     TEXT    NOT NULL
    )""",
)
_REQUIRED_TABLES = frozenset({_SCHEMA_TABLE, _EVENTS_TABLE, _REFUSALS_TABLE})

# Which analyst each charged task was attributed to (by the coordinator, from the analyst's
# certificate). A separate table, added to older files when they are opened, so the layout
# of ledger_events (and SCHEMA_VERSION) is unchanged; rows are written in the same
# transaction as their event and are append-only like it.
_ANALYSTS_TABLE = "ledger_task_analysts"
# The study each charged task was submitted under (``[studies.NAME]`` of site.toml), kept
# the same way.
_STUDIES_TABLE = "ledger_task_studies"


def _task_tag_schema(table: str, column: str) -> tuple[str, ...]:
    """Return the DDL of an append-only table tagging charged tasks with ``column``."""
    return (
        f"""CREATE TABLE IF NOT EXISTS {table} (
            task_id TEXT PRIMARY KEY NOT NULL REFERENCES {_EVENTS_TABLE}(task_id),
            {column} TEXT NOT NULL CHECK (length({column}) BETWEEN 1 AND {MAX_ID_LENGTH})
        )""",
        f"CREATE INDEX IF NOT EXISTS {table}_by_{column} ON {table}({column})",
        f"""CREATE TRIGGER IF NOT EXISTS {table}_no_update BEFORE UPDATE
            ON {table} BEGIN SELECT RAISE(ABORT, 'ledger events are append-only'); END""",
        f"""CREATE TRIGGER IF NOT EXISTS {table}_no_delete BEFORE DELETE
            ON {table} BEGIN SELECT RAISE(ABORT, 'ledger events are append-only'); END""",
    )


_TAG_SCHEMA = (*_task_tag_schema(_ANALYSTS_TABLE, "analyst"),
               *_task_tag_schema(_STUDIES_TABLE, "study"))

_EVENT_COLUMNS = ("seq, task_id, job_id, kind, mechanism, epsilon, delta, rho, sensitivity, "
                  "noise_scale, payload_digest, result_digest, length(result), created_at")
_REFUSAL_COLUMNS = ("seq, task_id, job_id, kind, mechanism, epsilon, delta, rho, "
                    "payload_digest, reason, message, created_at")


@dataclass(frozen=True)
class StudyBudget:
    """A study's budget at the site (``[studies.NAME]``): an epsilon cap and its last day.

    The study's jobs may spend until the end of ``expires`` (UTC); its cap composes the
    study's events under the site's accountant and delta, within the site's total.
    """

    epsilon: float
    expires: date

    def expired(self, today: date | None = None) -> bool:
        """Whether the study's last day has passed (UTC)."""
        return (today or datetime.now(UTC).date()) > self.expires


class LedgerCorruptionError(DpfedError):
    """A stored event no longer matches its own digest; the ledger file was damaged."""


@dataclass(frozen=True)
class LedgerEvent:
    """One charged task, as stored in the ledger.

    Attributes
    ----------
    seq : int
        Position in the ledger (1 = oldest).
    task_id, job_id, kind : str
        The task's idempotency key, its job, and the task type (``"pca"``, ``"svt"``, ...).
    mechanism : str
        Mechanism name from the charged :class:`~dpfed.common.privacy.accounting.PrivacyCost`.
    epsilon, delta, rho, sensitivity, noise_scale : float
        The charged cost and how the noise was calibrated.
    payload_digest : str
        Hex digest of the task payload, as given by the caller.
    result_digest : str
        SHA-256 (hex) of the released bytes.
    result_size : int
        Length of the released bytes.
    created_at : str
        UTC time of the charge, ISO-8601 with microseconds (``2026-05-09T07:35:25.123456+00:00``).
    """

    seq: int
    task_id: str
    job_id: str
    kind: str
    mechanism: str
    epsilon: float
    delta: float
    rho: float
    sensitivity: float
    noise_scale: float
    payload_digest: str
    result_digest: str
    result_size: int
    created_at: str

    @property
    def cost(self) -> PrivacyCost:
        """The charged cost as a :class:`~dpfed.common.privacy.accounting.PrivacyCost`."""
        return PrivacyCost(self.epsilon, self.delta, self.rho, self.mechanism,
                           self.sensitivity, self.noise_scale)


@dataclass(frozen=True)
class LedgerOutcome:
    """What :meth:`Ledger.charge_and_release` returns.

    Attributes
    ----------
    result : bytes
        The released bytes (fresh, or the stored bytes of an earlier identical task).
    replayed : bool
        True when the task id was already charged and the stored bytes were returned.
    event : LedgerEvent
        The ledger event the bytes belong to.
    """

    result: bytes = field(repr=False)
    replayed: bool
    event: LedgerEvent


@dataclass(frozen=True)
class RefusalRecord:
    """A task the ledger refused (nothing was charged, drawn or released).

    Attributes
    ----------
    seq : int
        Position among refusals (1 = oldest).
    task_id, job_id, kind, mechanism : str
        The refused task.
    epsilon, delta, rho : float
        What it asked to spend.
    payload_digest : str
        Hex digest of its payload.
    reason : str
        ``"budget_exceeded"`` or ``"idempotency_conflict"``.
    message : str
        The error message the caller received.
    created_at : str
        UTC time, ISO-8601.
    """

    seq: int
    task_id: str
    job_id: str
    kind: str
    mechanism: str
    epsilon: float
    delta: float
    rho: float
    payload_digest: str
    reason: str
    message: str
    created_at: str

    @property
    def code(self) -> RefusalCode:
        """The refusal's code, as the site sent it to the coordinator."""
        return RefusalCode.of_ledger(self.reason)


@dataclass(frozen=True)
class _Request:
    """A validated charge request (internal)."""

    task_id: str
    job_id: str
    kind: str
    payload_digest: str
    cost: PrivacyCost


class Ledger:
    """A site's durable, idempotent privacy ledger in one SQLite file.

    Parameters
    ----------
    path : str or Path
        The ledger file. Created (with its tables) if absent or empty; its directory must exist
        and be writable (SQLite keeps ``-wal`` and ``-shm`` files beside it). Must be on a local
        filesystem: WAL mode needs shared memory, which network filesystems do not provide.
    policy : BudgetPolicy
        The site's budget and accountant. It is applied to the stored events at every check, so
        an operator may change it between restarts; past events are never rewritten.
    busy_timeout_s : float
        How long a writer waits for another writer's transaction (including that writer's
        ``release()``) before giving up with ``sqlite3.OperationalError``.
    analyst_budgets : mapping of str to float, optional
        Per-analyst epsilon caps (``[budget.analysts]`` of ``site.toml``): the tasks
        attributed to an analyst may together spend at most this much, composed with the
        policy's accountant at its delta, besides fitting the total. Checked in the same
        transaction as the total cap. Analysts without an entry are bound by the total only.
    studies : mapping of str to StudyBudget, optional
        The studies this site holds budgets for (``[studies.NAME]`` of ``site.toml``): a task
        submitted under a study is charged only while the study has not expired and its
        events fit its cap (checked in the same transaction as the total cap); a task under a
        study the site does not hold is refused.

    Raises
    ------
    ConfigError
        The path is not usable, is not an SQLite database, is an SQLite database that is not
        a dpfed ledger, was written by a newer schema version, or cannot be put in WAL mode.

    Notes
    -----
    Thread- and process-safe: see the module docstring for the connection-per-call choice and
    for why each pragma and ``BEGIN IMMEDIATE`` are used.
    """

    def __init__(self, path: str | Path, policy: BudgetPolicy, *,
                 busy_timeout_s: float = 120.0,
                 analyst_budgets: Mapping[str, float] | None = None,
                 studies: Mapping[str, StudyBudget] | None = None) -> None:
        if not isinstance(policy, BudgetPolicy):
            raise ValidationError(
                "policy must be a dpfed.common.privacy.accounting.BudgetPolicy, "
                f"got {type(policy).__name__}")
        if not isinstance(path, str | os.PathLike) or os.fspath(path) in ("", b""):
            raise ConfigError(f"ledger path must be a non-empty str or Path, got {path!r}")
        self._path = Path(os.fsdecode(path))
        self._policy = policy
        self._busy_timeout_s = check_positive(busy_timeout_s, "busy_timeout_s")
        self._analyst_policies = {
            _check_id(name, "analyst id"): BudgetPolicy(
                epsilon=min(check_positive(cap, f"analyst_budgets[{name!r}]"), policy.epsilon),
                delta=policy.delta, accountant=policy.accountant)
            for name, cap in (analyst_budgets or {}).items()}
        self._studies = {_check_id(name, "study"): budget
                         for name, budget in (studies or {}).items()}
        self._study_policies = {
            name: BudgetPolicy(epsilon=min(check_positive(b.epsilon, f"studies[{name!r}]"),
                                           policy.epsilon),
                               delta=policy.delta, accountant=policy.accountant)
            for name, b in self._studies.items()}
        self._closed = False
        # Composed events, extended incrementally (events are append-only): the key is the
        # seq and task id of the last event composed; None for the whole ledger, else an
        # analyst's share.
        self._composed: dict[str, tuple[int, str, Spent]] = {}
        self._composed_lock = threading.Lock()
        if self._path.is_dir():
            raise ConfigError(f"ledger path {self._path} is a directory, expected a file")
        if not self._path.parent.is_dir():
            raise ConfigError(
                f"ledger path {self._path}: directory {self._path.parent} does not exist")
        self._open_or_create()

    # ------------------------------------------------------------------ properties

    @property
    def path(self) -> Path:
        """The ledger file."""
        return self._path

    @property
    def policy(self) -> BudgetPolicy:
        """The budget policy checks are made against."""
        return self._policy

    # ------------------------------------------------------------------ connections

    def _raw_connect(self) -> sqlite3.Connection:
        """Open a connection with only the busy timeout set (no write happens here)."""
        try:
            # isolation_level=None: no implicit BEGIN; this module issues every BEGIN itself.
            conn = sqlite3.connect(str(self._path), timeout=self._busy_timeout_s,
                                   isolation_level=None)
        except sqlite3.Error as exc:
            raise ConfigError(f"ledger {self._path} cannot be opened: {exc}") from exc
        conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
        return conn

    def _configure(self, conn: sqlite3.Connection) -> None:
        """Set foreign_keys, WAL and synchronous=FULL on ``conn`` and verify them."""
        conn.execute("PRAGMA foreign_keys = ON")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise ConfigError(
                f"ledger {self._path} cannot use write-ahead logging (journal_mode is {mode!r}); "
                "put the ledger on a local filesystem, not in memory or on a network share")
        conn.execute("PRAGMA synchronous = FULL")
        level = conn.execute("PRAGMA synchronous").fetchone()[0]
        if level != 2:  # 2 == FULL; anything else would not fsync each commit
            raise ConfigError(f"ledger {self._path}: PRAGMA synchronous reads {level}, not 2")

    def _connect(self) -> sqlite3.Connection:
        """Open a fully configured connection (one per call; see the module docstring)."""
        conn = self._raw_connect()
        try:
            self._configure(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    @contextlib.contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        if self._closed:
            raise DpfedError(f"ledger {self._path} is closed")
        conn = self._connect()
        try:
            yield conn
        finally:
            _rollback_quietly(conn)  # an exception (e.g. from release()) undoes the charge
            conn.close()

    def connection(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """Return a configured connection to the file, closed (and rolled back) on exit.

        For tables kept in the ledger's file beside its own (the approval queue,
        :mod:`dpfed.site_agent.approvals`); the caller issues its own ``BEGIN``/``COMMIT``.
        """
        return self._connection()

    def connection_pragmas(self) -> dict[str, Any]:
        """Return the pragmas of a connection opened the way every ledger call opens one.

        For diagnostics and tests: ``{"journal_mode": "wal", "synchronous": 2,
        "foreign_keys": 1, "busy_timeout_ms": ...}``.
        """
        with self._connection() as conn:
            return {
                "journal_mode": str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower(),
                "synchronous": int(conn.execute("PRAGMA synchronous").fetchone()[0]),
                "foreign_keys": int(conn.execute("PRAGMA foreign_keys").fetchone()[0]),
                "busy_timeout_ms": int(conn.execute("PRAGMA busy_timeout").fetchone()[0]),
            }

    # ------------------------------------------------------------------ schema

    @staticmethod
    def _table_names(conn: sqlite3.Connection) -> set[str]:
        rows = conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        ).fetchall()
        return {str(r[0]) for r in rows}

    def _check_identity(self, conn: sqlite3.Connection, tables: set[str]) -> None:
        """Raise ConfigError unless ``tables`` (non-empty) are those of a readable ledger."""
        if _SCHEMA_TABLE not in tables:
            shown = ", ".join(sorted(tables)[:5])
            raise ConfigError(
                f"{self._path} is an SQLite database but not a dpfed ledger (it has tables "
                f"{shown} and no {_SCHEMA_TABLE}); refusing to use it as the privacy ledger")
        row = conn.execute(
            f"SELECT application, version FROM {_SCHEMA_TABLE} WHERE id = 1").fetchone()
        if row is None or row[0] != APPLICATION:
            raise ConfigError(f"{self._path} is not a dpfed ledger (its {_SCHEMA_TABLE} table "
                              f"does not name {APPLICATION!r})")
        version = row[1]
        if not isinstance(version, int) or version < 1:
            raise ConfigError(f"ledger {self._path} has an invalid schema version {version!r}")
        if version > SCHEMA_VERSION:
            raise ConfigError(
                f"ledger {self._path} has schema version {version}, newer than this dpfed "
                f"reads ({SCHEMA_VERSION}); upgrade dpfed instead of opening it with this one")
        missing = _REQUIRED_TABLES - tables
        if missing:
            raise ConfigError(f"ledger {self._path} is damaged: missing table(s) "
                              f"{', '.join(sorted(missing))}")

    def _open_or_create(self) -> None:
        """Verify the file is ours (or empty) before changing it; create the tables if absent."""
        conn = self._raw_connect()
        try:
            # Identify the file *before* switching it to WAL: a foreign database is left
            # untouched (setting journal_mode=WAL would rewrite its header).
            tables = self._table_names(conn)
            if tables:
                self._check_identity(conn, tables)
            self._configure(conn)
            # Creation is one transaction under the write lock, so processes opening a new
            # file at the same moment create it exactly once, and a crash mid-way leaves an
            # empty file (the DDL rolls back), never half a schema.
            conn.execute("BEGIN IMMEDIATE")
            tables = self._table_names(conn)
            if tables:
                self._check_identity(conn, tables)
            else:
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute(
                    f"INSERT INTO {_SCHEMA_TABLE} (id, application, version, created_at) "
                    "VALUES (1, ?, ?, ?)", (APPLICATION, SCHEMA_VERSION, _utc_now()))
                logger.info("[Ledger.open] created ledger %s (schema version %d)",
                            self._path, SCHEMA_VERSION)
            for statement in _TAG_SCHEMA:  # no-ops when the tables are already there
                conn.execute(statement)
            conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            raise ConfigError(
                f"ledger {self._path} cannot be used as an SQLite database: {exc}") from exc
        finally:
            _rollback_quietly(conn)
            conn.close()

    # ------------------------------------------------------------------ charging

    def charge_and_release(self, *, task_id: str, job_id: str, kind: str, payload_digest: str,
                           cost: PrivacyCost, release: Callable[[], bytes],
                           analyst: str = "", study: str = "",
                           deadline_unix: float | None = None) -> LedgerOutcome:
        """Charge ``cost`` for ``task_id`` and release its bytes, at most once per task id.

        Parameters
        ----------
        task_id : str
            Idempotency key chosen by the coordinator, reused on every retry of the task;
            1 to 200 printable characters.
        job_id, kind : str
            The job the task belongs to and its type; part of the task's identity.
        payload_digest : str
            Hex digest (32 to 128 lowercase hex characters, e.g. SHA-256) of the task payload.
            A retry must carry the same digest.
        cost : PrivacyCost
            What the release spends. ``epsilon`` and ``rho`` must be > 0 (a zero in either would
            make the release free under one of the two accountants); all fields finite.
        release : callable
            Draws the noise and returns the bytes to send. Called at most once, only after the
            budget check passed, while the ledger's write lock is held; it must not use this
            ledger itself (it would wait for its own lock).
        analyst : str
            The analyst the task is attributed to ("" when unknown). It is stored with the
            charge, and when ``analyst_budgets`` names it, the analyst's share is checked
            under the same write lock as the total (refused like an over-budget task).
        study : str
            The study the task was submitted under ("" = none): refused (as over budget)
            unless the site holds the study, it has not expired, and the cost fits its cap
            beside the study's earlier events; stored with the charge.
        deadline_unix : float, optional
            The task's deadline (seconds since the epoch). Checked inside the transaction,
            after the write lock is taken and again after ``release`` returned: a task whose
            deadline passed is never charged (the coordinator no longer waits for it), and
            drawn bytes that were not committed never leave the site. A replay of an already
            charged task is still answered (it costs nothing).

        Returns
        -------
        LedgerOutcome
            ``replayed=False`` with the fresh bytes, returned only after the charge and the
            bytes were committed together; or ``replayed=True`` with the stored bytes of an
            earlier identical task (``release`` not called, nothing charged).

        Raises
        ------
        ValidationError
            An argument is malformed (nothing is read or written).
        IdempotencyConflictError
            ``task_id`` was already charged for a different payload digest, job or kind.
            Nothing is charged; a refusal row is recorded.
        BudgetExceededError
            The cost does not fit the policy beside what was spent. ``release`` is not called
            (no noise is drawn); a refusal row is recorded, no event.
        LedgerCorruptionError
            The stored bytes of a replayed task no longer match their digest.
        TaskExpiredError
            ``deadline_unix`` passed before the charge could be committed; nothing charged.
        sqlite3.OperationalError
            The write lock stayed taken longer than ``busy_timeout_s``; nothing was charged.
        Exception
            Whatever ``release`` raised, after the transaction was rolled back (no charge).

        Privacy
        -------
        This is where invariants 2 and 4 of docs/privacy.md are enforced. Composition: the spent
        total is recomputed from every stored event at each check, under basic sequential
        composition (Dwork & Roth 2014, Thm. 3.16: epsilons and deltas add) or zCDP (Bun &
        Steinke 2016, Lemma 2.3: rhos add, converted to (epsilon, delta) only for the cap).
        A retry returns the identical stored bytes: releasing the same output again is
        post-processing and costs nothing, whereas redrawing noise would let a caller average
        fresh noise for free. A refused task draws nothing, so it reveals nothing about the
        data (only that the budget, which is public to the operator, ran out).
        """
        request = _validate_request(task_id, job_id, kind, payload_digest, cost)
        if analyst:
            _check_id(analyst, "analyst")
        if study:
            _check_id(study, "study")
        if not callable(release):
            raise ValidationError(f"release must be callable, got {type(release).__name__}")
        with self._connection() as conn:
            # Fast path for retries of finished tasks, without taking the write lock (events
            # are append-only, so a committed row seen here is final). This keeps a retry
            # from waiting behind another task's long release(); the authoritative look-up
            # is repeated under the lock below.
            stored = _select_event_with_result(conn, request.task_id)
            if stored is not None:
                return self._replay(conn, request, *stored)

            conn.execute("BEGIN IMMEDIATE")  # step 1: write lock before the check
            stored = _select_event_with_result(conn, request.task_id)
            if stored is not None:
                conn.execute("ROLLBACK")
                return self._replay(conn, request, *stored)

            _check_deadline(deadline_unix, request.task_id)
            spent = self._spent(conn)  # step 2: derived from events, under the lock
            n_events = spent.events
            try:
                self._policy.check(spent, request.cost)
                self._check_analyst_share(conn, analyst, request.cost)
                self._check_study(conn, study, request.cost)
            except BudgetExceededError as exc:
                conn.execute("ROLLBACK")  # nothing was drawn, nothing is charged
                self._record_refusal(conn, request, REFUSAL_BUDGET, str(exc))
                logger.warning("[Ledger.charge_and_release] refused task %s (job %s): %s",
                               request.task_id, request.job_id, exc)
                raise

            result = release()  # step 3: the noise is drawn only now
            if isinstance(result, bytearray | memoryview):
                result = bytes(result)
            if not isinstance(result, bytes):
                raise ValidationError(
                    f"release() must return bytes, got {type(result).__name__}")
            _check_deadline(deadline_unix, request.task_id)  # rolled back: nothing charged
            event = LedgerEvent(
                seq=_next_seq(conn), task_id=request.task_id, job_id=request.job_id,
                kind=request.kind, mechanism=request.cost.mechanism,
                epsilon=request.cost.epsilon, delta=request.cost.delta, rho=request.cost.rho,
                sensitivity=request.cost.sensitivity, noise_scale=request.cost.noise_scale,
                payload_digest=request.payload_digest,
                result_digest=hashlib.sha256(result).hexdigest(), result_size=len(result),
                created_at=_utc_now())
            conn.execute(  # step 4: charge and bytes in the same transaction
                f"INSERT INTO {_EVENTS_TABLE} (task_id, seq, job_id, kind, mechanism, epsilon, "
                "delta, rho, sensitivity, noise_scale, payload_digest, result, result_digest, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (event.task_id, event.seq, event.job_id, event.kind, event.mechanism,
                 event.epsilon, event.delta, event.rho, event.sensitivity, event.noise_scale,
                 event.payload_digest, result, event.result_digest, event.created_at))
            if analyst:
                conn.execute(f"INSERT INTO {_ANALYSTS_TABLE} (task_id, analyst) VALUES (?, ?)",
                             (event.task_id, analyst))
            if study:
                conn.execute(f"INSERT INTO {_STUDIES_TABLE} (task_id, study) VALUES (?, ?)",
                             (event.task_id, study))
            conn.execute("COMMIT")  # durable (WAL fsync) before the bytes are handed back
        logger.info("[Ledger.charge_and_release] charged task %s (job %s, %s, %s): epsilon "
                    "%.6g, delta %.3g, rho %.6g; %d events before it", event.task_id,
                    event.job_id, event.kind, event.mechanism, event.epsilon, event.delta,
                    event.rho, n_events)
        return LedgerOutcome(result, False, event)

    def _check_analyst_share(self, conn: sqlite3.Connection, analyst: str,
                             cost: PrivacyCost) -> None:
        """Raise BudgetExceededError if ``cost`` does not fit ``analyst``'s share."""
        policy = self._analyst_policies.get(analyst) if analyst else None
        if policy is None:
            return
        try:
            policy.check(self._spent(conn, analyst), cost)
        except BudgetExceededError as exc:
            raise BudgetExceededError(
                f"analyst {analyst!r} would exceed the share of this site's budget the site "
                f"grants them (epsilon {policy.epsilon:g} of {self._policy.epsilon:g}): "
                f"{exc}") from None

    def check_study(self, study: str) -> None:
        """Raise BudgetExceededError if ``study`` ("" = none) cannot be charged here today.

        The study must be one the site holds and must not have expired; its cap is checked
        with the charge (:meth:`charge_and_release`).
        """
        if not study:
            return
        budget = self._studies.get(study)
        if budget is None:
            held = ", ".join(sorted(self._studies)) or "none"
            raise BudgetExceededError(f"this site holds no budget for study {study!r} "
                                      f"(its studies: {held})")
        if budget.expired():
            raise BudgetExceededError(f"study {study!r} expired at this site on "
                                      f"{budget.expires.isoformat()}; nothing more is charged "
                                      "to it")

    def _check_study(self, conn: sqlite3.Connection, study: str, cost: PrivacyCost) -> None:
        """Raise BudgetExceededError if ``cost`` does not fit ``study`` (module docstring)."""
        if not study:
            return
        self.check_study(study)
        policy = self._study_policies[study]
        try:
            policy.check(self._spent(conn, study=study), cost)
        except BudgetExceededError as exc:
            raise BudgetExceededError(
                f"study {study!r} would exceed its budget at this site (epsilon "
                f"{policy.epsilon:g}, until {self._studies[study].expires.isoformat()}): "
                f"{exc}") from None

    def study_statuses(self, conn: sqlite3.Connection) -> tuple[StudyStatus, ...]:
        """Return every study's spent and remaining budget (read on ``conn``)."""
        return tuple(StudyStatus(name, self._studies[name].expires.isoformat(),
                                 policy.status(self._spent(conn, study=name)))
                     for name, policy in sorted(self._study_policies.items()))

    def studies(self) -> dict[str, str]:
        """Return the study of every charge made under one (task id -> study)."""
        with self._connection() as conn:
            rows = conn.execute(f"SELECT task_id, study FROM {_STUDIES_TABLE}").fetchall()
        return {str(task_id): str(study) for task_id, study in rows}

    def analyst_status(self, analyst: str) -> BudgetStatus | None:
        """Spent and remaining share of ``analyst`` (None if the site sets no share)."""
        policy = self._analyst_policies.get(analyst)
        if policy is None:
            return None
        with self._connection() as conn:
            return policy.status(self._spent(conn, analyst))

    def analyst_of(self, task_id: str) -> str:
        """Return the analyst a charged task was attributed to ("" if none)."""
        with self._connection() as conn:
            row = conn.execute(f"SELECT analyst FROM {_ANALYSTS_TABLE} WHERE task_id = ?",
                               (task_id,)).fetchone()
        return "" if row is None else str(row[0])

    def _replay(self, conn: sqlite3.Connection, request: _Request, event: LedgerEvent,
                result: bytes) -> LedgerOutcome:
        """Return the stored bytes of an already-charged task, or refuse a conflicting reuse."""
        if (event.payload_digest, event.job_id, event.kind) != (
                request.payload_digest, request.job_id, request.kind):
            message = (
                f"task_id {request.task_id!r} was already charged for a different task "
                f"(stored job {event.job_id!r}, kind {event.kind!r}, payload digest "
                f"{event.payload_digest[:16]}...; got job {request.job_id!r}, kind "
                f"{request.kind!r}, digest {request.payload_digest[:16]}...); a retry must "
                "resend the identical task, a new task needs a new task_id")
            self._record_refusal(conn, request, REFUSAL_CONFLICT, message)
            logger.warning("[Ledger.charge_and_release] %s", message)
            raise IdempotencyConflictError(message)
        if hashlib.sha256(result).hexdigest() != event.result_digest:
            raise LedgerCorruptionError(
                f"ledger {self._path}: stored result of task {event.task_id!r} does not match "
                "its SHA-256; the file was damaged, refusing to replay it")
        logger.info("[Ledger.charge_and_release] replayed task %s (job %s), no new charge",
                    event.task_id, event.job_id)
        return LedgerOutcome(result, True, event)

    def _record_refusal(self, conn: sqlite3.Connection, request: _Request, reason: str,
                        message: str) -> None:
        """Record a refusal in its own small transaction (never a charge).

        A failure to record it is logged, not raised: the caller must still see the refusal
        itself, and nothing was charged either way.
        """
        cost = request.cost
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                f"INSERT INTO {_REFUSALS_TABLE} (task_id, job_id, kind, mechanism, epsilon, "
                "delta, rho, payload_digest, reason, message, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (request.task_id, request.job_id, request.kind, cost.mechanism, cost.epsilon,
                 cost.delta, cost.rho, request.payload_digest, reason, message, _utc_now()))
            conn.execute("COMMIT")
        except sqlite3.Error:
            _rollback_quietly(conn)
            logger.exception("[Ledger.charge_and_release] could not record the refusal of "
                             "task %s", request.task_id)

    # ------------------------------------------------------------------ reading

    def events(self) -> list[LedgerEvent]:
        """Return every charged event, oldest first."""
        with self._connection() as conn:
            return _select_events(conn)

    def spent(self) -> PrivacyCost:
        """Return the basic-composition sums of all events (derived, never a stored total)."""
        return self.composed().basic

    def composed(self) -> Spent:
        """Return every event composed (each by its dominating pair; see ``Spent``)."""
        with self._connection() as conn:
            return self._spent(conn)

    def status(self) -> BudgetStatus:
        """Return spent and remaining budget under the policy's accountant (and per study)."""
        with self._connection() as conn:
            status = self._policy.status(self._spent(conn))
            if self._studies:
                status = replace(status, studies=self.study_statuses(conn))
            return status

    def _spent(self, conn: sqlite3.Connection, analyst: str = "", study: str = "") -> Spent:
        """Compose the stored events (all, ``analyst``'s or ``study``'s), extending a cache.

        Events are append-only (triggers refuse UPDATE and DELETE), so a composition of the
        events up to seq ``n`` stays valid while the event at ``n`` is the one it ended with;
        only later events are read and added. A ledger written by another process is seen
        the same way: the cache is a prefix of whatever is on disk.
        """
        scope = f"study:{study}" if study else analyst
        with self._composed_lock:
            cached = self._composed.get(scope)
        last_seq, last_task, spent = cached if cached is not None else (0, "", Spent())
        if last_seq:
            row = conn.execute(f"SELECT task_id FROM {_EVENTS_TABLE} WHERE seq = ?",
                               (last_seq,)).fetchone()
            if row is None or row[0] != last_task:  # not a prefix of this file: start over
                last_seq, last_task, spent = 0, "", Spent()
        rows = _event_cost_rows(conn, analyst, after_seq=last_seq, study=study)
        if not rows:
            return spent
        costs = [cost for _, _, cost in rows]
        spent = Spent.of(costs) if last_seq == 0 else _extend(spent, costs)
        with self._composed_lock:
            self._composed[scope] = (rows[-1][0], rows[-1][1], spent)
        return spent

    def lookup(self, task_id: str) -> LedgerEvent | None:
        """Return the event charged for ``task_id``, or None if it was never charged.

        No lock is taken: events are append-only, so a committed row seen here is final. The
        task runner uses this to answer a retried task from the ledger before recomputing
        anything; :meth:`charge_and_release` still makes the authoritative check.
        """
        tid = _check_id(task_id, "task_id")
        with self._connection() as conn:
            stored = _select_event_with_result(conn, tid)
        return None if stored is None else stored[0]

    def stored_result(self, task_id: str) -> bytes:
        """Return the released bytes of a charged task, verified against their digest.

        Raises
        ------
        NotFoundError
            The task id was never charged.
        LedgerCorruptionError
            The stored bytes no longer match the digest recorded with them.
        """
        tid = _check_id(task_id, "task_id")
        with self._connection() as conn:
            stored = _select_event_with_result(conn, tid)
        if stored is None:
            raise NotFoundError(f"task {tid!r} is not in the ledger")
        event, result = stored
        if hashlib.sha256(result).hexdigest() != event.result_digest:
            raise LedgerCorruptionError(
                f"stored result of task {tid!r} does not match its digest; the ledger file "
                f"{self._path} is damaged")
        return result

    def attributions(self) -> dict[str, str]:
        """Return the analyst of every attributed charge (task id -> analyst id)."""
        with self._connection() as conn:
            rows = conn.execute(f"SELECT task_id, analyst FROM {_ANALYSTS_TABLE}").fetchall()
        return {str(task_id): str(analyst) for task_id, analyst in rows}

    def refusals(self) -> list[RefusalRecord]:
        """Return the refused tasks, oldest first (none of them was charged)."""
        with self._connection() as conn:
            return _select_refusals(conn)

    def snapshot(self) -> tuple[list[LedgerEvent], list[RefusalRecord]]:
        """Return events and refusals read in one consistent read transaction."""
        with self._connection() as conn:
            conn.execute("BEGIN")  # a deferred read transaction: one WAL snapshot for both
            events = _select_events(conn)
            refusals = _select_refusals(conn)
            conn.execute("COMMIT")
        return events, refusals

    def integrity_ok(self) -> bool:
        """Return True when ``PRAGMA integrity_check`` reports exactly ``ok``."""
        with self._connection() as conn:
            rows = conn.execute("PRAGMA integrity_check").fetchall()
        return [tuple(r) for r in rows] == [("ok",)]

    def close(self) -> None:
        """Refuse further calls. No connection is held between calls, so nothing else to do."""
        self._closed = True

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({str(self._path)!r}, accountant={self._policy.accountant!r})"


# ---------------------------------------------------------------------- helpers


class TaskExpiredError(DpfedError):
    """A task's deadline passed before it was charged; nothing was charged or released."""


def _check_deadline(deadline_unix: float | None, task_id: str) -> None:
    if deadline_unix is not None and time.time() > deadline_unix:
        raise TaskExpiredError(f"task {task_id!r}: its deadline passed "
                               f"{time.time() - deadline_unix:.3f}s ago; not charged")


def _rollback_quietly(conn: sqlite3.Connection) -> None:
    """Roll back an open transaction; a failing rollback must not hide the original error."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            # Closing the connection rolls the transaction back anyway.
            logger.exception("[Ledger] rollback failed; the connection is closed instead")


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _check_id(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise ValidationError(f"{name} must be a str, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_ID_LENGTH or not value.isprintable():
        raise ValidationError(
            f"{name} must be 1 to {MAX_ID_LENGTH} printable characters, got "
            f"{value[:40]!r}{'...' if len(value) > 40 else ''} ({len(value)} characters)")
    return value


def _check_digest(value: object, name: str) -> str:
    if not isinstance(value, str) or _DIGEST_RE.fullmatch(value) is None:
        shown = value[:20] + "..." if isinstance(value, str) and len(value) > 20 else value
        raise ValidationError(
            f"{name} must be a hex digest of 32 to 128 lowercase hex characters (e.g. "
            f"hashlib.sha256(payload).hexdigest()), got {shown!r}")
    return value


def _validate_request(task_id: object, job_id: object, kind: object, payload_digest: object,
                      cost: object) -> _Request:
    """Check every argument before the ledger is touched."""
    if not isinstance(cost, PrivacyCost):
        raise ValidationError(
            "cost must be a dpfed.common.privacy.accounting.PrivacyCost, "
            f"got {type(cost).__name__}")
    # PrivacyCost already rejects negative or non-finite epsilon/delta/rho; the ledger also
    # needs the descriptive fields finite and both epsilon and rho strictly positive.
    for name in ("epsilon", "delta", "rho", "sensitivity", "noise_scale"):
        check_nonnegative(getattr(cost, name), f"cost.{name}")
    for name in ("epsilon", "rho"):
        if not getattr(cost, name) > 0:
            raise ValidationError(
                f"cost.{name} must be > 0 for a charged release (0 would make it free under "
                f"the {'basic' if name == 'epsilon' else 'zcdp'} accountant), got "
                f"{getattr(cost, name)!r}")
    _check_id(cost.mechanism, "cost.mechanism")
    return _Request(_check_id(task_id, "task_id"), _check_id(job_id, "job_id"),
                    _check_id(kind, "kind"), _check_digest(payload_digest, "payload_digest"),
                    cost)


def _event_from_row(row: tuple[Any, ...]) -> LedgerEvent:
    return LedgerEvent(int(row[0]), row[1], row[2], row[3], row[4], float(row[5]),
                       float(row[6]), float(row[7]), float(row[8]), float(row[9]), row[10],
                       row[11], int(row[12]), row[13])


def _select_event_with_result(conn: sqlite3.Connection,
                              task_id: str) -> tuple[LedgerEvent, bytes] | None:
    row = conn.execute(f"SELECT {_EVENT_COLUMNS}, result FROM {_EVENTS_TABLE} "
                       "WHERE task_id = ?", (task_id,)).fetchone()
    if row is None:
        return None
    return _event_from_row(row[:-1]), bytes(row[-1])


def _select_events(conn: sqlite3.Connection) -> list[LedgerEvent]:
    rows = conn.execute(f"SELECT {_EVENT_COLUMNS} FROM {_EVENTS_TABLE} ORDER BY seq").fetchall()
    return [_event_from_row(r) for r in rows]


def _select_refusals(conn: sqlite3.Connection) -> list[RefusalRecord]:
    rows = conn.execute(
        f"SELECT {_REFUSAL_COLUMNS} FROM {_REFUSALS_TABLE} ORDER BY seq").fetchall()
    return [RefusalRecord(int(r[0]), r[1], r[2], r[3], r[4], float(r[5]), float(r[6]),
                          float(r[7]), r[8], r[9], r[10], r[11]) for r in rows]


def _event_cost_rows(conn: sqlite3.Connection, analyst: str = "", *, after_seq: int = 0,
                     study: str = "") -> list[tuple[int, str, PrivacyCost]]:
    """``(seq, task id, cost)`` of the events after ``after_seq`` (a study's or analyst's)."""
    columns = ("e.seq, e.task_id, e.epsilon, e.delta, e.rho, e.mechanism, e.sensitivity, "
               "e.noise_scale")
    if study:
        rows = conn.execute(
            f"SELECT {columns} FROM {_EVENTS_TABLE} e JOIN {_STUDIES_TABLE} s "
            "ON s.task_id = e.task_id WHERE s.study = ? AND e.seq > ? ORDER BY e.seq",
            (study, after_seq)).fetchall()
    elif analyst:
        rows = conn.execute(
            f"SELECT {columns} FROM {_EVENTS_TABLE} e JOIN {_ANALYSTS_TABLE} a "
            "ON a.task_id = e.task_id WHERE a.analyst = ? AND e.seq > ? ORDER BY e.seq",
            (analyst, after_seq)).fetchall()
    else:
        rows = conn.execute(f"SELECT {columns} FROM {_EVENTS_TABLE} e WHERE e.seq > ? "
                            "ORDER BY e.seq", (after_seq,)).fetchall()
    return [(int(r[0]), str(r[1]), PrivacyCost(float(r[2]), float(r[3]), float(r[4]), str(r[5]),
                                               float(r[6]), float(r[7]))) for r in rows]


def _extend(spent: Spent, costs: list[PrivacyCost]) -> Spent:
    for cost in costs:
        spent = spent.add(cost)
    return spent


def _next_seq(conn: sqlite3.Connection) -> int:
    row = conn.execute(f"SELECT COALESCE(MAX(seq), 0) + 1 FROM {_EVENTS_TABLE}").fetchone()
    return int(row[0])


# ---------------------------------------------------------------------- operator views


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def format_ledger(ledger: Ledger) -> str:
    """Return the ledger as a readable table with totals and remaining budget.

    One line per event (time, task id, job id, kind, mechanism, epsilon, delta, rho, noise
    scale, and the pair the tight accountant charges it as), then the composed totals, the
    spent and remaining budget under the policy's accountant (with the tight figure beside
    the others), and the number of refused tasks. Used by ``dpfed-site ledger``.
    """
    events, refusals = ledger.snapshot()
    policy = ledger.policy
    spent = Spent.of(e.cost for e in events)
    status = policy.status(spent)
    header = ("seq", "time (UTC)", "task id", "job id", "kind", "mechanism", "epsilon",
              "delta", "rho", "noise scale", "charged as")
    rows = [(str(e.seq), e.created_at[:19].replace("T", " "), e.task_id, e.job_id, e.kind,
             e.mechanism, _fmt(e.epsilon), _fmt(e.delta), _fmt(e.rho), _fmt(e.noise_scale),
             event_loss(e.cost).method)
            for e in events]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = {0, 6, 7, 8, 9}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    cap = f"epsilon {_fmt(policy.epsilon)}, delta {_fmt(policy.delta)}"
    if policy.max_epsilon_per_task is not None:
        cap += f", max epsilon per task {_fmt(policy.max_epsilon_per_task)}"
    out = [f"Privacy ledger {ledger.path}", f"Policy: {policy.accountant} accountant, cap {cap}",
           ""]
    if rows:
        out += [line(header), line(tuple("-" * w for w in widths))]
        out += [line(r) for r in rows]
    else:
        out.append("(no events)")
    out.append("")
    out.append(f"Total over {len(events)} events: epsilon {_fmt(spent.epsilon_sum)}, "
               f"delta {_fmt(spent.delta_sum)}, rho {_fmt(spent.rho_sum)}")
    if events:
        tight = spent.epsilon(policy.delta)
        note = (f" (the discretised pairs may overstate it by up to "
                f"{_fmt(spent.discretisation_error)})" if spent.loss is not None else "")
        out.append(f"Tight composition at delta {_fmt(policy.delta)}: epsilon {_fmt(tight)}"
                   f"{note}; {spent.fallbacks} event(s) charged by their (epsilon, delta) "
                   "alone")
    if policy.accountant == "pld":
        out.append(f"Spent (tight composition at delta {_fmt(policy.delta)}): "
                   f"epsilon {_fmt(status.epsilon_spent)}")
        out.append(f"Remaining: epsilon {_fmt(status.epsilon_remaining)} of "
                   f"{_fmt(status.epsilon_cap)}")
    elif policy.accountant == "zcdp":
        out.append(f"Spent (zCDP, rho {_fmt(status.rho_spent)} at delta {_fmt(policy.delta)}): "
                   f"epsilon {_fmt(status.epsilon_spent)}")
        out.append(f"Remaining: epsilon {_fmt(status.epsilon_remaining)} of "
                   f"{_fmt(status.epsilon_cap)}")
    else:
        out.append(f"Spent (basic composition): epsilon {_fmt(status.epsilon_spent)}, "
                   f"delta {_fmt(status.delta_spent)}")
        out.append(f"Remaining: epsilon {_fmt(status.epsilon_remaining)} of "
                   f"{_fmt(status.epsilon_cap)}, delta {_fmt(status.delta_remaining)} of "
                   f"{_fmt(status.delta_cap)}")
    for study in ledger.status().studies:
        out.append(f"Study {study.name} (until {study.expires}): epsilon "
                   f"{_fmt(study.status.epsilon_spent)} spent, "
                   f"{_fmt(study.status.epsilon_remaining)} of {_fmt(study.status.epsilon_cap)} "
                   f"left, {study.status.events} release(s)")
    out.append(f"Refused tasks (not charged): {len(refusals)}")
    return "\n".join(out) + "\n"


def ledger_as_json(ledger: Ledger) -> dict[str, Any]:
    """Return the ledger as a JSON-serialisable dict (for ``dpfed-site ledger --json``).

    Keys: ``path``, ``schema_version``, ``policy``, ``events`` (without the released bytes:
    their SHA-256 and size instead), ``totals`` (composed sums), ``status`` (spent and
    remaining under the accountant) and ``refusals``. All numbers are finite.
    """
    events, refusals = ledger.snapshot()
    policy = ledger.policy
    spent = Spent.of(e.cost for e in events)
    status = policy.status(spent)
    return {
        "path": str(ledger.path),
        "schema_version": SCHEMA_VERSION,
        "policy": {"accountant": policy.accountant, "epsilon": policy.epsilon,
                   "delta": policy.delta, "max_epsilon_per_task": policy.max_epsilon_per_task},
        "events": [
            {"seq": e.seq, "created_at": e.created_at, "task_id": e.task_id, "job_id": e.job_id,
             "kind": e.kind, "mechanism": e.mechanism, "epsilon": e.epsilon, "delta": e.delta,
             "rho": e.rho, "sensitivity": e.sensitivity, "noise_scale": e.noise_scale,
             "charged_as": event_loss(e.cost).method, "payload_digest": e.payload_digest,
             "result_digest": e.result_digest, "result_size": e.result_size}
            for e in events],
        "totals": {"events": len(events), "epsilon": spent.epsilon_sum,
                   "delta": spent.delta_sum, "rho": spent.rho_sum,
                   "tight_epsilon": spent.epsilon(policy.delta),
                   "discretisation_error": spent.discretisation_error,
                   "fallback_events": spent.fallbacks},
        "status": {"accountant": status.accountant, "epsilon_cap": status.epsilon_cap,
                   "delta_cap": status.delta_cap, "epsilon_spent": status.epsilon_spent,
                   "delta_spent": status.delta_spent, "rho_spent": status.rho_spent,
                   "epsilon_remaining": status.epsilon_remaining,
                   "delta_remaining": status.delta_remaining},
        "refusals": [
            {"seq": r.seq, "created_at": r.created_at, "task_id": r.task_id, "job_id": r.job_id,
             "kind": r.kind, "mechanism": r.mechanism, "epsilon": r.epsilon, "delta": r.delta,
             "rho": r.rho, "payload_digest": r.payload_digest, "reason": r.reason,
             "message": r.message}
            for r in refusals],
    }


def read_status_readonly(path: str | Path, policy: BudgetPolicy) -> BudgetStatus | None:
    """Return a ledger's budget status without creating, migrating or writing anything.

    For ``dpfed-site check``: the file is opened read-only (SQLite ``mode=ro``, and
    ``immutable=1`` when no write-ahead log is pending), so a missing ledger stays missing and
    an existing one is not switched to WAL, written, or given -wal/-shm files.

    Returns
    -------
    BudgetStatus or None
        None when the file does not exist yet (the agent creates it on its first run).

    Raises
    ------
    ConfigError
        The path is a directory, is not an SQLite database, or is not a dpfed ledger.
    """
    p = Path(os.fsdecode(path))
    if p.is_dir():
        raise ConfigError(f"ledger path {p} is a directory, expected a file")
    if not p.exists():
        return None
    # With no -wal file every commit is in the main file, and ``immutable=1`` reads it without
    # creating the -wal/-shm files a WAL database otherwise gets even from a read-only
    # connection. With a -wal file (the agent is running, or stopped uncleanly), read through
    # it with mode=ro so no committed charge is missed.
    wal = p.with_name(p.name + "-wal")
    flags = "mode=ro" if wal.exists() else "mode=ro&immutable=1"
    try:
        conn = sqlite3.connect(f"{p.resolve().as_uri()}?{flags}", uri=True,
                               isolation_level=None)
    except sqlite3.Error as exc:
        raise ConfigError(f"ledger {p} cannot be opened read-only: {exc}") from None
    try:
        tables = Ledger._table_names(conn)
        if not tables:
            return policy.status(Spent())
        if _SCHEMA_TABLE not in tables or _EVENTS_TABLE not in tables:
            raise ConfigError(f"{p} is an SQLite database but not a dpfed ledger")
        spent = Spent.of(cost for _, _, cost in _event_cost_rows(conn))
    except sqlite3.Error as exc:
        raise ConfigError(f"ledger {p} cannot be read: {exc}") from None
    finally:
        conn.close()
    return policy.status(spent)
