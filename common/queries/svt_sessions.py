"""Durable SVT session state at a site: the secret noisy threshold, positives so far, batches.

An SVT session (``dpfed svt``) spans several tasks: it opens with a charged task and continues
with batches that cost nothing more (Alg. 1 pays for the whole stream up front). Its state must
survive a site restart -- a redrawn threshold noise or a reset cut-off would make the stream
two releases paid as one -- and a retried batch must return the same transcript. This store
keeps it in an SQLite file beside the ledger (``<ledger stem>.svt-sessions.sqlite``) with the
ledger's discipline: WAL, ``synchronous=FULL``, one ``BEGIN IMMEDIATE`` transaction that reads
the state, draws the noise and commits the new state together with the released bytes.

A separate file rather than tables in the ledger: the opening batch runs inside the ledger's
release callback, while the ledger holds its own write lock, so a write to the same file would
wait for itself. Ordering makes the split safe: the session row is committed before the
ledger's charge; if the site dies in between, the retried opening task finds the session and
reuses its threshold noise (nothing left the site before the charge), and a continuation is
refused unless the ledger holds the opening charge.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dpfed.common.errors import ConfigError, IdempotencyConflictError, ValidationError
from dpfed.common.queries.svt_stream import SessionState

log = logging.getLogger(__name__)

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS svt_sessions (
        session_id      TEXT PRIMARY KEY NOT NULL CHECK (length(session_id) BETWEEN 1 AND 200),
        open_task_id    TEXT NOT NULL,
        params          TEXT NOT NULL,
        noisy_threshold REAL NOT NULL,
        n_examined      INTEGER NOT NULL CHECK (n_examined >= 0),
        n_positives     INTEGER NOT NULL CHECK (n_positives >= 0),
        closed          INTEGER NOT NULL DEFAULT 0,
        created_at      TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS svt_batches (
        task_id        TEXT PRIMARY KEY NOT NULL,
        session_id     TEXT NOT NULL REFERENCES svt_sessions(session_id),
        seq            INTEGER NOT NULL,
        payload_digest TEXT NOT NULL,
        queries        TEXT NOT NULL,
        result         BLOB NOT NULL,
        created_at     TEXT NOT NULL,
        UNIQUE (session_id, seq)
    )""",
    """CREATE TRIGGER IF NOT EXISTS svt_batches_no_update BEFORE UPDATE ON svt_batches
        BEGIN SELECT RAISE(ABORT, 'svt batches are append-only'); END""",
)


@dataclass(frozen=True)
class StoredSession:
    """One session as stored (``state.noisy_threshold`` is secret: never log or send it)."""

    session_id: str
    open_task_id: str
    params: dict[str, Any]
    state: SessionState
    closed: bool

    def __repr__(self) -> str:
        return (f"StoredSession({self.session_id!r}, examined={self.state.n_examined}, "
                f"positives={self.state.n_positives}, closed={self.closed})")


def sessions_path(ledger_path: Path) -> Path:
    """Where a site's SVT sessions live, beside its ledger."""
    return ledger_path.with_name(ledger_path.stem + ".svt-sessions.sqlite")


class SVTSessionStore:
    """The site's SVT sessions in one SQLite file (see the module docstring)."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 120.0) -> None:
        self.path = Path(path)
        self._timeout = busy_timeout_s
        self._lock = threading.Lock()
        if not self.path.parent.is_dir():
            raise ConfigError(f"SVT session store {self.path}: directory does not exist")
        # One connection per store (tasks run one at a time on the agent's worker thread; the
        # lock serialises any other caller). Every write is its own BEGIN IMMEDIATE
        # transaction, so other processes opening the file see only committed states.
        self._conn = sqlite3.connect(str(self.path), timeout=busy_timeout_s,
                                     isolation_level=None, check_same_thread=False)
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            self._conn.close()
            raise ConfigError(f"SVT session store {self.path} cannot use WAL (got {mode!r})")
        self._conn.execute("PRAGMA synchronous = FULL")
        self._conn.execute("PRAGMA foreign_keys = ON")
        with self._connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            for stmt in _SCHEMA:
                conn.execute(stmt)
            conn.execute("COMMIT")

    def close(self) -> None:
        """Close the store's connection."""
        with self._lock:
            self._conn.close()

    @contextlib.contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._conn
            finally:
                with contextlib.suppress(sqlite3.Error):
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")

    @staticmethod
    def _row(row: tuple[Any, ...]) -> StoredSession:
        return StoredSession(str(row[0]), str(row[1]), json.loads(row[2]),
                             SessionState(float(row[3]), int(row[4]), int(row[5])), bool(row[6]))

    _COLUMNS = ("session_id, open_task_id, params, noisy_threshold, n_examined, n_positives, "
                "closed")

    def get(self, session_id: str) -> StoredSession | None:
        """Return the session, or None."""
        with self._connection() as conn:
            row = conn.execute(f"SELECT {self._COLUMNS} FROM svt_sessions WHERE session_id = ?",
                               (session_id,)).fetchone()
        return None if row is None else self._row(row)

    def stored_batch(self, task_id: str) -> tuple[str, bytes] | None:
        """(payload digest, released bytes) of an already answered batch, or None."""
        with self._connection() as conn:
            row = conn.execute("SELECT payload_digest, result FROM svt_batches WHERE task_id = ?",
                               (task_id,)).fetchone()
        return None if row is None else (str(row[0]), bytes(row[1]))

    def session_queries(self, session_id: str) -> list[Any]:
        """Return the canonical query lists of the session's batches, in order."""
        with self._connection() as conn:
            rows = conn.execute("SELECT queries FROM svt_batches WHERE session_id = ? "
                                "ORDER BY seq", (session_id,)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def open_session(self, session_id: str, open_task_id: str, params: dict[str, Any],
                     draw: Callable[[], SessionState]) -> StoredSession:
        """Create the session (drawing its threshold noise once) or return the existing one.

        Raises
        ------
        IdempotencyConflictError
            The session id exists with other parameters or another opening task.
        """
        text = json.dumps(params, sort_keys=True)
        with self._connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            row = conn.execute(f"SELECT {self._COLUMNS} FROM svt_sessions WHERE session_id = ?",
                               (session_id,)).fetchone()
            if row is not None:
                conn.execute("ROLLBACK")
                existing = self._row(row)
                if existing.open_task_id != open_task_id or existing.params != json.loads(text):
                    raise IdempotencyConflictError(
                        f"SVT session {session_id!r} already exists with other parameters")
                log.info("session=%s exists; its threshold "
                         "noise is reused (no redraw)", session_id)
                return existing
            state = draw()
            conn.execute(
                "INSERT INTO svt_sessions (session_id, open_task_id, params, noisy_threshold, "
                "n_examined, n_positives, closed, created_at) VALUES (?, ?, ?, ?, 0, 0, 0, ?)",
                (session_id, open_task_id, text, state.noisy_threshold, _now()))
            conn.execute("COMMIT")
        log.info("opened session=%s", session_id)
        return StoredSession(session_id, open_task_id, json.loads(text), state, False)

    def run_batch(self, session_id: str, task_id: str, payload_digest: str, queries: Any,
                  step: Callable[[SessionState, bool], tuple[SessionState, bytes, bool]]) -> bytes:
        """Answer one batch at most once: replay its bytes, or step the state and store both.

        ``step(state, closed) -> (new_state, released_bytes, close)`` draws the batch's noise;
        it runs under the store's write lock, and the new state, the bytes and the closing
        flag commit in one transaction before the bytes are returned.

        Raises
        ------
        IdempotencyConflictError
            ``task_id`` was answered for a different payload.
        ValidationError
            Unknown session.
        """
        with self._connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            done = conn.execute("SELECT payload_digest, result FROM svt_batches WHERE "
                                "task_id = ?", (task_id,)).fetchone()
            if done is not None:
                conn.execute("ROLLBACK")
                if done[0] != payload_digest:
                    raise IdempotencyConflictError(
                        f"task {task_id!r} was already answered for a different request")
                log.info("task=%s replayed (same transcript)",
                         task_id)
                return bytes(done[1])
            row = conn.execute(f"SELECT {self._COLUMNS} FROM svt_sessions WHERE session_id = ?",
                               (session_id,)).fetchone()
            if row is None:
                raise ValidationError(f"this site has no SVT session {session_id!r}")
            current = self._row(row)
            new_state, result, close = step(current.state, current.closed)
            seq = int(conn.execute("SELECT COUNT(*) FROM svt_batches WHERE session_id = ?",
                                   (session_id,)).fetchone()[0])
            conn.execute(
                "UPDATE svt_sessions SET n_examined = ?, n_positives = ?, closed = ? "
                "WHERE session_id = ?",
                (new_state.n_examined, new_state.n_positives, int(current.closed or close),
                 session_id))
            conn.execute(
                "INSERT INTO svt_batches (task_id, session_id, seq, payload_digest, queries, "
                "result, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (task_id, session_id, seq, payload_digest, json.dumps(queries, sort_keys=True),
                 result, _now()))
            conn.execute("COMMIT")
        return result


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")
