"""Run one task at the site: policy, idempotent replay, handler, ledger, release.

Order of operations (docs/privacy.md, invariants 2 and 4):

1. Refuse at once what local policy does not allow (job kind, deadline already passed).
2. A task id the ledger already holds returns the stored bytes (same payload digest) or is
   refused as a conflict (different digest) -- no recomputation, no fresh noise.
2b. A task the site's approval policy holds waits for the data steward
   (:mod:`dpfed.site_agent.approvals`): refused as ``awaiting_approval`` or ``denied`` until
   its job is approved, before anything is read from the rows.
3. The handler validates the parameters and computes the exact statistic (nothing drawn).
4. One path for the three charges (:mod:`dpfed.common.jobs.contract`): a new charge goes
   through ``Ledger.charge_and_release``, which checks the budget and, only if it fits, draws
   the noise inside the transaction that stores charge and bytes; a release covered by an
   earlier charge runs only if the ledger holds that charge; a free one charges nothing.
5. Only the committed bytes leave the site.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np

from dpfed.common.errors import (
    BudgetExceededError,
    DataError,
    IdempotencyConflictError,
    ValidationError,
)
from dpfed.common.jobs.contract import CoveredBy, DataAccess, NewCharge, Release
from dpfed.common.privacy.rng import production_rng
from dpfed.common.transport.protocol import Refusal, RefusalCode, Task, TaskResult
from dpfed.common.transport.wire import result_to_bytes
from dpfed.site_agent.approvals import AUTO, ApprovalPolicy, ApprovalQueue
from dpfed.site_agent.handlers import TaskHandler, default_handlers
from dpfed.site_agent.ledger import Ledger, TaskExpiredError

log = logging.getLogger(__name__)


def _loggable(value: str, limit: int) -> str:
    """Return ``value`` cut to ``limit`` characters, non-printable or space characters as ``?``.

    An id from the network can then neither forge log lines nor break ``key=value`` parsing.
    """
    return "".join(c if 33 <= ord(c) < 127 else "?" for c in value[:limit]) or "?"


class TaskRunner:
    """Execute tasks against the site's data under its ledger and policy.

    Parameters
    ----------
    data : DataAccess
        The site's table.
    ledger : Ledger
        The durable privacy ledger (budget policy included).
    allowed_kinds : tuple of str
        Job kinds the site operator allows.
    handlers : dict, optional
        kind -> handler (default: every registered handler).
    secure_required_kinds : tuple of str
        Job kinds whose site-level release this site refuses (its policy requires secure
        aggregation for them).
    deterministic_noise_seed : int, optional
        Demo/test only (a local config key, never settable over the network): derive each
        release's generator from this seed and the task id so a simulation is reproducible.
    approval : ApprovalPolicy
        Which tasks wait for the data steward's approval (default: none).
    """

    def __init__(self, data: DataAccess, ledger: Ledger, allowed_kinds: tuple[str, ...], *,
                 handlers: dict[str, TaskHandler] | None = None,
                 deterministic_noise_seed: int | None = None,
                 secure_required_kinds: tuple[str, ...] = (),
                 local_dir: Path | None = None,
                 approval: ApprovalPolicy = AUTO) -> None:
        self.data = data
        self.approval = approval
        #: The steward's queue, in the ledger's file (opened only when some task can wait).
        self.approvals = ApprovalQueue(ledger) if approval.any_manual else None
        self.secure_required_kinds = secure_required_kinds
        self.ledger = ledger
        #: Where local-only tasks write their output (default: the ledger's directory).
        self.local_dir = local_dir if local_dir is not None else ledger.path.parent
        self.allowed_kinds = allowed_kinds
        # Bind the allowed kinds' handlers to this site (the svt handler opens its session
        # store beside the ledger); a kind the site does not allow is refused before lookup.
        self.handlers = {kind: h.for_site(ledger.path)
                         for kind, h in (handlers if handlers is not None
                                         else default_handlers()).items()
                         if kind in allowed_kinds}
        self.noise_seed = deterministic_noise_seed

    def _rng(self, kind: str, salt: str = "") -> np.random.Generator:
        if self.noise_seed is None:
            return production_rng()
        # Demo mode: key the stream on what is stable across runs of a seeded simulation --
        # the job kind and how many releases this site made before (job ids are random).
        # Tasks run one at a time on the agent's single worker thread, so the count is stable.
        tag = int.from_bytes(hashlib.sha256((kind + salt).encode()).digest()[:8], "little")
        n_before = len(self.ledger.events())
        return np.random.Generator(
            np.random.PCG64DXSM(np.random.SeedSequence([self.noise_seed, tag, n_before])))

    def run(self, task: Task, deadline_unix: float | None = None) -> bytes | Refusal:
        """Return the released bytes (a serialized TaskResult) or a Refusal -- always one.

        Nothing a coordinator sends makes this raise: a malformed task id, parameters or
        arrays are refused with a reason, anything unexpected with code "internal".
        """
        tag = (f"task={_loggable(task.task_id, 80)} job={_loggable(task.job_id, 80)} "
               f"kind={_loggable(task.kind, 40)}")
        try:
            answer = self._run(task, deadline_unix, tag)
        except TaskExpiredError as exc:
            log.warning("%s refused: %s", tag, exc)
            return Refusal(task.task_id, RefusalCode.DEADLINE, "the task's deadline passed "
                           "before it could be charged; nothing was charged or released")
        except BudgetExceededError as exc:
            log.warning("%s outcome=refused: %s", tag, exc)
            return Refusal(task.task_id, RefusalCode.BUDGET_EXCEEDED, str(exc))
        except IdempotencyConflictError as exc:
            log.warning("%s outcome=refused: %s", tag, exc)
            return Refusal(task.task_id, RefusalCode.CONFLICT, str(exc))
        except DataError as exc:
            # Data problems (a bad row under on_invalid="error", no valid rows, ...) are facts
            # about the site's data: the details stay in the local log, never in the refusal.
            log.error("%s outcome=refused: the data cannot be read: %s", tag, exc)
            return Refusal(task.task_id, RefusalCode.INVALID,
                           "the site's data cannot be read under its row policy (details are "
                           "in the site's log)")
        except ValidationError as exc:
            # Problems with the task's own parameters: safe to explain to the coordinator.
            log.warning("%s outcome=refused as invalid: %s", tag, exc)
            return Refusal(task.task_id, RefusalCode.INVALID, str(exc))
        except Exception:
            log.exception("%s outcome=failed", tag)
            return Refusal(task.task_id, RefusalCode.INTERNAL,
                           "the site failed to run the task (see its log)")
        if isinstance(answer, Refusal) and answer.code is RefusalCode.AWAITING_APPROVAL:
            log.info("%s outcome=held: %s", tag, answer.reason)
        elif isinstance(answer, Refusal):
            log.warning("%s outcome=refused: %s", tag, answer.reason)
        return answer

    def _run(self, task: Task, deadline_unix: float | None, tag: str) -> bytes | Refusal:
        if task.kind not in self.allowed_kinds or task.kind not in self.handlers:
            return Refusal(task.task_id, RefusalCode.NOT_ALLOWED,
                           f"this site does not run {task.kind!r} jobs "
                           f"(allowed: {', '.join(self.allowed_kinds)})")
        if (task.kind in self.secure_required_kinds
                and task.params.get("aggregation", "site") != "secure"):
            return Refusal(task.task_id, RefusalCode.NOT_ALLOWED,
                           f"this site's policy requires secure aggregation for {task.kind!r} "
                           "jobs (--aggregation secure)")
        digest = task.digest()
        stored = self.ledger.lookup(task.task_id)
        if stored is not None:
            if (stored.payload_digest, stored.job_id, stored.kind) != (digest, task.job_id,
                                                                      task.kind):
                return Refusal(task.task_id, RefusalCode.CONFLICT,
                               "this task id was already used for a different request")
            log.info("%s outcome=replayed from the ledger (no new charge)", tag)
            return self.ledger.stored_result(task.task_id)
        if deadline_unix is not None and time.time() > deadline_unix:
            return Refusal(task.task_id, RefusalCode.DEADLINE,
                           "the task's deadline passed before it started")
        # A study the site does not hold, or one that expired, is refused before anything is
        # read (its cap is checked with the charge, in the ledger's transaction).
        self.ledger.check_study(task.study)
        if self.approvals is not None and self.approval.manual(task.kind, task.analyst_id):
            held = self.approvals.gate(task, deadline_unix)
            if held is not None:
                return held
        release = self.handlers[task.kind].prepare(task, self.data)
        return self._release(task, release, digest, deadline_unix, tag)

    def _release(self, task: Task, release: Release, digest: str,
                 deadline_unix: float | None, tag: str) -> bytes | Refusal:
        """Charge what the release's charge says, then let it draw its noise."""
        charge = release.charge
        if isinstance(charge, NewCharge):
            rng = self._rng(task.kind)
            outcome = self.ledger.charge_and_release(
                task_id=task.task_id, job_id=task.job_id, kind=task.kind, payload_digest=digest,
                cost=charge.cost, release=lambda: _as_bytes(release.produce(rng)),
                analyst=task.analyst_id, study=task.study, deadline_unix=deadline_unix)
            log.info("%s outcome=%s epsilon=%g delta=%g, %d bytes released", tag,
                     "replayed" if outcome.replayed else "charged", charge.cost.epsilon,
                     charge.cost.delta, len(outcome.result))
            return outcome.result
        if isinstance(charge, CoveredBy):
            if self.ledger.lookup(charge.task_id) is None:
                return Refusal(task.task_id, RefusalCode.INVALID,
                               "this site never charged the release this task continues")
            if self.ledger.analyst_of(charge.task_id) != task.analyst_id:
                return Refusal(task.task_id, RefusalCode.NOT_ALLOWED, "this task continues a "
                               "release another analyst opened (and paid for); only that "
                               "analyst may")
            salt = json.dumps(dict(task.params), sort_keys=True, default=str)
            answer = _as_bytes(release.produce(self._rng(task.kind, salt)))
            log.info("%s outcome=continued %s (no new charge), %d bytes released", tag,
                     _loggable(charge.task_id, 80), len(answer))
            return answer
        where = charge.local_output(self.local_dir) if charge.local_output else "nothing"
        result = release.produce(self._rng(task.kind))
        if charge.local_output is not None and (
                not isinstance(result, TaskResult) or result.arrays
                or result.spend.epsilon or result.spend.delta or result.spend.rho):
            raise ValidationError("a local-only task must not release arrays or spend budget")
        log.info("%s outcome=free: %s written (nothing computed from rows released, "
                 "nothing charged)", tag, where)
        return _as_bytes(result)


def _as_bytes(answer: TaskResult | bytes) -> bytes:
    return answer if isinstance(answer, bytes) else result_to_bytes(answer)
