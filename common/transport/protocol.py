"""Domain types of the dpfed protocol: what code sees past the wire codec.

Plain frozen dataclasses and ndarrays; no ``*_pb2`` types leak past
``dpfed.common.transport.wire``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from dpfed.common.privacy.accounting import BudgetStatus, PrivacyCost

#: Bumped when a change to the messages is not backwards compatible.
PROTOCOL_VERSION = 1



class JobState(StrEnum):
    """Where a job is: submitted, running, or finished one way or the other."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """Whether the job has reached its final state."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class SiteStatus(StrEnum):
    """How a site took part in a job (its outcome's status)."""

    OK = "ok"
    REFUSED = "refused"
    TIMEOUT = "timeout"
    DISCONNECTED = "disconnected"
    ERROR = "error"
    #: The site holds the task until its data steward approves it (the round is still open).
    AWAITING_APPROVAL = "awaiting_approval"


class RefusalCode(StrEnum):
    """Why a site refused a task, or why the coordinator left a site out of a job.

    The site sends the code with its refusal; the coordinator records it with the site's
    outcome, so nothing downstream parses a reason string.
    """

    BUDGET_EXCEEDED = "budget_exceeded"
    NOT_ALLOWED = "not_allowed"
    INVALID = "invalid"
    CONFLICT = "conflict"
    DEADLINE = "deadline"
    INTERNAL = "internal"
    #: The coordinator cancelled the task's job before the task started (nothing charged).
    CANCELLED = "cancelled"
    #: The site's policy needs its data steward's approval of the job, not given yet: the
    #: site holds the request (nothing computed, nothing charged) and the coordinator resends
    #: the task until the steward decides or the task's deadline passes.
    AWAITING_APPROVAL = "awaiting_approval"
    #: The site's data steward denied the job (nothing computed, nothing charged).
    DENIED = "denied"
    #: A code this version does not know (a newer site's): still a refusal, counted apart.
    OTHER = "other"

    @classmethod
    def of_ledger(cls, reason: str) -> RefusalCode:
        """Return the code of a refusal reason the site's ledger stored.

        The ledger's stored reasons predate the codes: ``idempotency_conflict`` is
        :attr:`CONFLICT`.
        """
        return cls.CONFLICT if reason == "idempotency_conflict" else cls(reason)


def _canonical(value: Any) -> Any:
    """JSON-ready canonical form (floats by repr so the digest is exact)."""
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, float):
        return {"f": repr(value)}
    return value


@dataclass(frozen=True)
class Task:
    """One unit of site work: a job's request for one DP release.

    ``task_id`` is the idempotency key at the site's ledger: the same id always yields the
    same released bytes, and the same id with a different payload is refused.
    """

    task_id: str
    job_id: str
    kind: str
    epsilon: float
    delta: float
    params: Mapping[str, Any] = field(default_factory=dict)
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)
    #: The analyst the coordinator attributes the task to (from their certificate); "" if none.
    #: Not part of :meth:`digest`: it does not change the release, and a task resent after an
    #: upgrade keeps its digest. A replay keeps the attribution of the first charge.
    analyst_id: str = ""
    #: The study the job was submitted under ("" = none); the site charges that study's
    #: budget too. Not part of :meth:`digest`, like ``analyst_id``: a job without a study
    #: sends the same task as before studies existed, so existing ledgers replay it.
    study: str = ""

    def digest(self) -> str:
        """SHA-256 over everything that determines the release (not the task id)."""
        h = hashlib.sha256()
        head = {"job_id": self.job_id, "kind": self.kind, "epsilon": self.epsilon,
                "delta": self.delta, "params": self.params}
        h.update(json.dumps(_canonical(head), sort_keys=True, separators=(",", ":")).encode())
        for name in sorted(self.arrays):
            a = np.ascontiguousarray(self.arrays[name])
            h.update(f"|{name}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.tobytes())
        return h.hexdigest()


@dataclass(frozen=True)
class TaskResult:
    """A site's DP release for one task, and what it charged for it."""

    task_id: str
    spend: PrivacyCost
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    """A site declined a task; nothing was charged."""

    task_id: str
    code: RefusalCode
    reason: str


@dataclass(frozen=True)
class SiteHello:
    """What a site tells the coordinator when it connects (its id comes from its certificate)."""

    software_version: str
    protocol_version: int
    schema_digest: str
    row_count: int
    allowed_kinds: tuple[str, ...]
    max_epsilon_per_task: float | None
    budget: BudgetStatus | None
    #: The site's secure-aggregation policy, e.g. ``"allowed, min 2 sites, t=1"`` ("" = off or
    #: not reported by an older site).
    secure_policy: str = ""


@dataclass(frozen=True)
class SiteInfo:
    """The coordinator's view of one site."""

    site_id: str
    connected: bool
    row_count: int
    schema_digest: str
    software_version: str
    allowed_kinds: tuple[str, ...]
    max_epsilon_per_task: float | None
    budget: BudgetStatus | None
    first_seen: str
    last_seen: str
    #: The site's secure-aggregation policy, e.g. ``"allowed, min 2 sites, t=1"`` ("" = off or
    #: not reported by an older site).
    secure_policy: str = ""


@dataclass(frozen=True)
class JobSpec:
    """What an analyst asks for."""

    kind: str
    epsilon: float
    delta: float
    params: Mapping[str, Any] = field(default_factory=dict)
    min_sites: int = 0
    deadline_seconds: float = 0.0
    sites: tuple[str, ...] = ()
    #: The study the job spends from at every site ("" = none; site.toml ``[studies.NAME]``).
    study: str = ""


@dataclass(frozen=True)
class SiteOutcome:
    """How one site took part in a job.

    ``code`` says why a site that is not "ok" was refused (None for the other statuses);
    ``left_out`` marks a site the coordinator left out before the job's first round (a
    decision a resumed job re-applies instead of taking it again).
    """

    site_id: str
    status: SiteStatus
    reason: str = ""
    spend: PrivacyCost | None = None
    row_count: int = 0
    code: RefusalCode | None = None
    left_out: bool = False


@dataclass(frozen=True)
class JobInfo:
    """A job's state as stored by the coordinator."""

    job_id: str
    spec: JobSpec
    state: JobState
    created: str
    updated: str
    error: str = ""
    sites: tuple[SiteOutcome, ...] = ()
    summary: Mapping[str, Any] = field(default_factory=dict)
    submitted_by: str = ""
    result_size: int = 0


@dataclass(frozen=True)
class JobEvent:
    """One progress event of a job."""

    job_id: str
    time: str
    stage: str
    message: str
    progress: float
    state: JobState
    job: JobInfo | None = None
