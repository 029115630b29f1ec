"""Approval at the site: the data steward's durable queue of jobs waiting to run.

Under ``[policy] approval = "manual"`` (or a per-kind / per-analyst rule saying so) a task is
held before anything is computed from the site's rows: the first task of a job opens one
approval request, which stays pending until the data steward runs ``dpfed-site approve ID``
or ``dpfed-site deny ID``. Until then every task of the job is answered with the refusal code
``awaiting_approval`` (the coordinator resends it until its deadline); after ``deny`` with
``denied``; after ``approve`` the job's tasks run and are charged as usual, each once.

The queue lives in the ledger's SQLite file (tables ``approval_requests`` and
``approval_decisions``, added to older files when opened), so it survives a restart of the
site with its charges. A decision is final: the decisions table is append-only.
"""

from __future__ import annotations

import getpass
import json
import logging
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from dpfed.common.errors import ConfigError, NotFoundError, ValidationError
from dpfed.common.transport.protocol import Refusal, RefusalCode, Task
from dpfed.site_agent.ledger import MAX_ID_LENGTH, Ledger

log = logging.getLogger(__name__)

#: Values of ``policy.approval`` and of its per-kind / per-analyst rules.
APPROVAL_MODES: tuple[str, ...] = ("auto", "manual")
#: The most requests left pending at once; a coordinator that opens more jobs is refused.
MAX_PENDING = 1000
#: The most characters of a request's parameters kept (the rest is cut, with its length noted).
MAX_PARAMS_CHARS = 65536
#: Longest reason a steward may give for a denial.
MAX_REASON_CHARS = 500
APPROVED, DENIED = "approved", "denied"

_SCHEMA: tuple[str, ...] = (
    f"""CREATE TABLE IF NOT EXISTS approval_requests (
        id             INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id         TEXT    NOT NULL UNIQUE
                               CHECK (length(job_id) BETWEEN 1 AND {MAX_ID_LENGTH}),
        analyst        TEXT    NOT NULL,
        study          TEXT    NOT NULL,
        task_id        TEXT    NOT NULL,
        kind           TEXT    NOT NULL,
        epsilon        REAL    NOT NULL,
        delta          REAL    NOT NULL,
        params         TEXT    NOT NULL,
        arrays         TEXT    NOT NULL,
        payload_digest TEXT    NOT NULL,
        deadline_unix  REAL,
        created_at     TEXT    NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS approval_decisions (
        request_id INTEGER PRIMARY KEY NOT NULL REFERENCES approval_requests(id),
        decision   TEXT    NOT NULL CHECK (decision IN ('approved', 'denied')),
        reason     TEXT    NOT NULL,
        decided_by TEXT    NOT NULL,
        decided_at TEXT    NOT NULL
    )""",
    """CREATE TRIGGER IF NOT EXISTS approval_decisions_no_update BEFORE UPDATE
        ON approval_decisions BEGIN SELECT RAISE(ABORT, 'approval decisions are final'); END""",
    """CREATE TRIGGER IF NOT EXISTS approval_decisions_no_delete BEFORE DELETE
        ON approval_decisions BEGIN SELECT RAISE(ABORT, 'approval decisions are final'); END""",
    """CREATE TRIGGER IF NOT EXISTS approval_requests_no_delete BEFORE DELETE
        ON approval_requests BEGIN SELECT RAISE(ABORT, 'approval requests are kept'); END""",
)

_COLUMNS = ("r.id, r.job_id, r.analyst, r.study, r.task_id, r.kind, r.epsilon, r.delta, r.params, "
            "r.arrays, r.payload_digest, r.deadline_unix, r.created_at, d.decision, d.reason, "
            "d.decided_by, d.decided_at")
_FROM = "approval_requests r LEFT JOIN approval_decisions d ON d.request_id = r.id"


@dataclass(frozen=True)
class ApprovalPolicy:
    """Which tasks wait for the data steward (``[policy] approval`` and its rules).

    A rule for the task's analyst wins over a rule for its task kind, which wins over
    ``default``. Each value is ``"auto"`` or ``"manual"``.
    """

    default: str = "auto"
    kinds: Mapping[str, str] = field(default_factory=dict)
    analysts: Mapping[str, str] = field(default_factory=dict)

    def manual(self, kind: str, analyst: str) -> bool:
        """Whether a task of ``kind`` attributed to ``analyst`` needs the steward's approval."""
        if analyst and analyst in self.analysts:
            return self.analysts[analyst] == "manual"
        return self.kinds.get(kind, self.default) == "manual"

    @property
    def any_manual(self) -> bool:
        """Whether some task can need approval at all."""
        return "manual" in (self.default, *self.kinds.values(), *self.analysts.values())

    def describe(self) -> str:
        """One line for the log and ``dpfed-site check``."""
        rules = [f"{k}={v}" for k, v in sorted(self.kinds.items())]
        rules += [f"analyst {a}={v}" for a, v in sorted(self.analysts.items())]
        return self.default + (f" ({', '.join(rules)})" if rules else "")


#: Every task runs without the steward (the default policy).
AUTO = ApprovalPolicy()


def check_mode(value: object, where: str) -> str:
    """Return ``value`` if it is an approval mode, else raise ConfigError naming ``where``."""
    if value not in APPROVAL_MODES:
        raise ConfigError(f"{where} must be one of {', '.join(APPROVAL_MODES)}, got {value!r}")
    return str(value)


@dataclass(frozen=True)
class ApprovalRequest:
    """One job waiting for (or decided by) the data steward, as the first task described it."""

    id: int
    job_id: str
    analyst: str
    study: str
    task_id: str
    kind: str
    epsilon: float
    delta: float
    params: str
    arrays: str
    payload_digest: str
    deadline_unix: float | None
    created_at: str
    decision: str = ""
    reason: str = ""
    decided_by: str = ""
    decided_at: str = ""

    @property
    def pending(self) -> bool:
        """Whether the steward has not decided yet."""
        return not self.decision

    @property
    def expired(self) -> bool:
        """Whether the first task's deadline has passed (the coordinator stopped waiting)."""
        return self.deadline_unix is not None and time.time() > self.deadline_unix

    def as_json(self) -> dict[str, Any]:
        """Return a JSON-ready view (``dpfed-site approvals --json``)."""
        return {"id": self.id, "job_id": self.job_id, "analyst": self.analyst,
                "study": self.study, "task_id": self.task_id, "kind": self.kind,
                "epsilon": self.epsilon, "delta": self.delta, "params": self.params,
                "arrays": self.arrays,
                "deadline": _iso(self.deadline_unix), "created_at": self.created_at,
                "state": self.decision or "pending", "reason": self.reason,
                "decided_by": self.decided_by, "decided_at": self.decided_at}


class ApprovalQueue:
    """The approval requests and decisions kept in the ledger's file."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        with ledger.connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute("COMMIT")

    # ------------------------------------------------------------------ the task runner
    def gate(self, task: Task, deadline_unix: float | None) -> Refusal | None:
        """Return None when ``task``'s job is approved, else the refusal to answer with.

        The job's first task opens its request (recorded durably before the refusal goes
        out); later tasks of the job find it. Nothing here reads the site's rows.
        """
        job_id = _check_job_id(task.job_id)
        with self.ledger.connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            found = _select(conn, "WHERE r.job_id = ?", (job_id,))
            if not found:
                n_pending = conn.execute(
                    "SELECT COUNT(*) FROM approval_requests r WHERE NOT EXISTS (SELECT 1 FROM "
                    "approval_decisions d WHERE d.request_id = r.id)").fetchone()[0]
                if n_pending >= MAX_PENDING:
                    conn.execute("ROLLBACK")
                    return Refusal(task.task_id, RefusalCode.NOT_ALLOWED,
                                   f"this site already holds {MAX_PENDING} jobs waiting for its "
                                   "data steward's approval; it takes no more until they are "
                                   "decided")
                conn.execute(
                    "INSERT INTO approval_requests (job_id, analyst, study, task_id, kind, "
                    "epsilon, delta, params, arrays, payload_digest, deadline_unix, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (job_id, task.analyst_id, task.study, task.task_id, task.kind,
                     float(task.epsilon), float(task.delta), _params_text(task.params),
                     _arrays_text(task), task.digest(), deadline_unix, _utc_now()))
                conn.execute("COMMIT")
                request = _select(conn, "WHERE r.job_id = ?", (job_id,))[0]
                log.info("[ApprovalQueue.gate] job %s (analyst %s, %s) waits for approval: "
                         "request %d", job_id, task.analyst_id or "?", task.kind, request.id)
            else:
                conn.execute("COMMIT")
                request = found[0]
        if (request.analyst, request.study) != (task.analyst_id, task.study):
            return Refusal(task.task_id, RefusalCode.NOT_ALLOWED,
                           f"approval request {request.id} of job {job_id!r} is for another "
                           "analyst or study; this task cannot use it")
        if request.decision == APPROVED:
            return None
        if request.decision == DENIED:
            because = f": {request.reason}" if request.reason else ""
            return Refusal(task.task_id, RefusalCode.DENIED,
                           f"the site's data steward denied this job (request {request.id})"
                           f"{because}; nothing was computed or charged")
        return Refusal(task.task_id, RefusalCode.AWAITING_APPROVAL,
                       f"waiting for the site's data steward to approve this job (request "
                       f"{request.id} there); nothing was computed or charged")

    # ------------------------------------------------------------------ the data steward
    def requests(self, *, pending_only: bool = False) -> list[ApprovalRequest]:
        """Return the requests, oldest first (only those not decided with ``pending_only``)."""
        where = "WHERE d.decision IS NULL" if pending_only else ""
        with self.ledger.connection() as conn:
            return _select(conn, where, ())

    def get(self, request_id: int) -> ApprovalRequest:
        """Return request ``request_id`` (NotFoundError if there is none)."""
        with self.ledger.connection() as conn:
            found = _select(conn, "WHERE r.id = ?", (request_id,))
        if not found:
            raise NotFoundError(f"no approval request {request_id} at this site "
                                "(dpfed-site approvals lists them)")
        return found[0]

    def decide(self, request_id: int, decision: str, reason: str = "",
               decided_by: str | None = None) -> ApprovalRequest:
        """Record the steward's decision on a pending request and return it.

        Raises
        ------
        NotFoundError
            No such request.
        ValidationError
            The request was already decided (a decision is final), or the reason is too long.
        """
        if decision not in (APPROVED, DENIED):
            raise ValidationError(f"decision must be {APPROVED!r} or {DENIED!r}, "
                                  f"got {decision!r}")
        if len(reason) > MAX_REASON_CHARS or not reason.isprintable():
            raise ValidationError(f"--reason must be at most {MAX_REASON_CHARS} printable "
                                  f"characters, got {len(reason)}")
        who = decided_by if decided_by is not None else _local_user()
        with self.ledger.connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            found = _select(conn, "WHERE r.id = ?", (request_id,))
            if not found:
                raise NotFoundError(f"no approval request {request_id} at this site "
                                    "(dpfed-site approvals lists them)")
            if found[0].decision:
                raise ValidationError(
                    f"approval request {request_id} was already {found[0].decision} by "
                    f"{found[0].decided_by} at {found[0].decided_at}; a decision is final")
            try:
                conn.execute("INSERT INTO approval_decisions (request_id, decision, reason, "
                             "decided_by, decided_at) VALUES (?, ?, ?, ?, ?)",
                             (request_id, decision, reason, who, _utc_now()))
            except sqlite3.IntegrityError as exc:  # decided by another process meanwhile
                raise ValidationError(f"approval request {request_id} was already decided: "
                                      f"{exc}") from None
            conn.execute("COMMIT")
            decided = _select(conn, "WHERE r.id = ?", (request_id,))[0]
        log.info("[ApprovalQueue.decide] request %d (job %s, analyst %s) %s by %s%s",
                 request_id, decided.job_id, decided.analyst or "?", decision, who,
                 f": {reason}" if reason else "")
        return decided


def format_requests(requests: list[ApprovalRequest], spent: Mapping[str, float]) -> str:
    """Return the requests as readable blocks (``dpfed-site approvals``).

    ``spent`` maps a job id to the epsilon this site's ledger charged for it so far.
    """
    if not requests:
        return "no approval requests"
    blocks = []
    for r in requests:
        state = r.decision or "PENDING"
        if r.pending and r.expired:
            state += " (its task's deadline passed; approving it runs the job only if the " \
                     "coordinator resends it)"
        lines = [f"request {r.id}: {state}",
                 f"  job       {r.job_id}",
                 f"  analyst   {r.analyst or '(not attributed)'}",
                 f"  study     {r.study or '(none)'}",
                 f"  kind      {r.kind} (first task {r.task_id})",
                 f"  cost      epsilon {r.epsilon:g}, delta {r.delta:g} for this task; each "
                 "later round of the job is charged when it runs",
                 f"  params    {r.params}"]
        if r.arrays:
            lines.append(f"  arrays    {r.arrays}")
        lines.append(f"  received  {r.created_at}; deadline {_iso(r.deadline_unix) or 'none'}")
        if r.decision:
            because = f": {r.reason}" if r.reason else ""
            lines.append(f"  decided   {r.decision} by {r.decided_by} at {r.decided_at}"
                         f"{because}")
            lines.append(f"  charged   epsilon {spent.get(r.job_id, 0.0):g} for this job so far")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _select(conn: sqlite3.Connection, where: str,
            args: tuple[Any, ...]) -> list[ApprovalRequest]:
    rows = conn.execute(f"SELECT {_COLUMNS} FROM {_FROM} {where} ORDER BY r.id", args).fetchall()
    return [ApprovalRequest(int(r[0]), r[1], r[2], r[3], r[4], r[5], float(r[6]), float(r[7]),
                            r[8], r[9], r[10], None if r[11] is None else float(r[11]), r[12],
                            r[13] or "", r[14] or "", r[15] or "", r[16] or "") for r in rows]


def _check_job_id(job_id: object) -> str:
    if (not isinstance(job_id, str) or not 1 <= len(job_id) <= MAX_ID_LENGTH
            or not job_id.isprintable()):
        raise ValidationError(f"job_id must be 1 to {MAX_ID_LENGTH} printable characters")
    return job_id


def _params_text(params: Mapping[str, Any]) -> str:
    text = json.dumps(dict(params), sort_keys=True, default=str)
    if len(text) <= MAX_PARAMS_CHARS:
        return text
    return f"{text[:MAX_PARAMS_CHARS]}... ({len(text)} characters in all)"


def _arrays_text(task: Task) -> str:
    return ", ".join(f"{name}: {a.dtype}{list(a.shape)}"
                     for name, a in sorted(task.arrays.items()))


def _local_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _iso(unix: float | None) -> str:
    return "" if unix is None else datetime.fromtimestamp(unix, UTC).isoformat(timespec="seconds")


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")
