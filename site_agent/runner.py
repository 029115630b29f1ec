"""Run one task at the site: policy, idempotent replay, handler, ledger, release.

Order of operations (docs/privacy.md, invariants 2 and 4):

1. Refuse at once what local policy does not allow (job kind, deadline already passed).
2. A task id the ledger already holds returns the stored bytes (same payload digest) or is
   refused as a conflict (different digest) -- no recomputation, no fresh noise.
3. The handler validates the parameters and computes the exact statistic (nothing drawn).
4. ``Ledger.charge_and_release`` checks the budget and, only if it fits, calls the release
   function (which draws the noise) inside the transaction that stores charge and bytes.
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
from dpfed.common.privacy.rng import production_rng
from dpfed.common.transport.protocol import Refusal, Task
from dpfed.common.transport.wire import result_to_bytes
from dpfed.site_agent.handlers import (
    HANDLERS,
    DataAccess,
    PreparedContinuation,
    PreparedRelease,
    TaskHandler,
)
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
    """

    def __init__(self, data: DataAccess, ledger: Ledger, allowed_kinds: tuple[str, ...], *,
                 handlers: dict[str, TaskHandler] | None = None,
                 deterministic_noise_seed: int | None = None,
                 secure_required_kinds: tuple[str, ...] = (),
                 local_dir: Path | None = None) -> None:
        self.data = data
        self.secure_required_kinds = secure_required_kinds
        self.ledger = ledger
        #: Where local-only tasks write their output (default: the ledger's directory).
        self.local_dir = local_dir if local_dir is not None else ledger.path.parent
        self.allowed_kinds = allowed_kinds
        # Bind the allowed kinds' handlers to this site (the svt handler opens its session
        # store beside the ledger); a kind the site does not allow is refused before lookup.
        self.handlers = {kind: h.for_site(ledger.path)
                         for kind, h in (handlers if handlers is not None else HANDLERS).items()
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
        try:
            return self._run(task, deadline_unix)
        except ValidationError as exc:
            log.warning("[TaskRunner.run] task=%.80r refused as invalid: %s", task.task_id, exc)
            return Refusal(task.task_id, "invalid", str(exc))
        except Exception:
            log.exception("[TaskRunner.run] task=%.80r failed", task.task_id)
            return Refusal(task.task_id, "internal",
                           "the site failed to run the task (see its log)")

    def _run(self, task: Task, deadline_unix: float | None) -> bytes | Refusal:
        tag = (f"task={_loggable(task.task_id, 80)} job={_loggable(task.job_id, 80)} "
               f"kind={_loggable(task.kind, 40)}")
        if task.kind not in self.allowed_kinds or task.kind not in self.handlers:
            log.warning("[TaskRunner.run] %s outcome=refused: kind not allowed by local policy",
                        tag)
            return Refusal(task.task_id, "not_allowed",
                           f"this site does not run {task.kind!r} jobs "
                           f"(allowed: {', '.join(self.allowed_kinds)})")
        handler = self.handlers[task.kind]
        if (task.kind in self.secure_required_kinds
                and task.params.get("aggregation", "site") != "secure"):
            log.warning("[TaskRunner.run] %s refused: policy requires secure aggregation", tag)
            return Refusal(task.task_id, "not_allowed",
                           f"this site's policy requires secure aggregation for {task.kind!r} "
                           "jobs (--aggregation secure)")
        if handler.responds_without_data(task):
            try:
                answer = handler.respond(task)
            except ValidationError as exc:
                log.warning("[TaskRunner.run] %s refused as invalid: %s", tag, exc)
                return Refusal(task.task_id, "invalid", str(exc))
            log.info("[TaskRunner.run] %s answered without data (nothing charged)", tag)
            return result_to_bytes(answer)
        digest = task.digest()
        stored = self.ledger.lookup(task.task_id)
        if stored is not None:
            if (stored.payload_digest, stored.job_id, stored.kind) == (digest, task.job_id,
                                                                      task.kind):
                log.info("[TaskRunner.run] %s outcome=replayed from the ledger (no new charge)",
                         tag)
                return self.ledger.stored_result(task.task_id)
            log.warning("[TaskRunner.run] %s outcome=refused: task id reused with a different "
                        "payload", tag)
            return Refusal(task.task_id, "conflict",
                           "this task id was already used for a different request")
        if deadline_unix is not None and time.time() > deadline_unix:
            return Refusal(task.task_id, "deadline", "the task's deadline passed before it started")
        try:
            prepared = handler.prepare(task, self.data)
            if isinstance(prepared, PreparedContinuation):
                return self._continue(task, prepared, tag)
            if prepared.local_output is not None:
                return self._run_local(task, prepared, tag)
            rng = self._rng(task.kind)
            outcome = self.ledger.charge_and_release(
                task_id=task.task_id, job_id=task.job_id, kind=task.kind, payload_digest=digest,
                cost=prepared.cost,
                release=lambda: result_to_bytes(prepared.release(rng)),
                analyst=task.analyst_id,
                deadline_unix=deadline_unix,
            )
        except TaskExpiredError as exc:
            log.warning("[TaskRunner.run] %s refused: %s", tag, exc)
            return Refusal(task.task_id, "deadline", "the task's deadline passed before it "
                           "could be charged; nothing was charged or released")
        except BudgetExceededError as exc:
            log.warning("[TaskRunner.run] %s outcome=refused: %s", tag, exc)
            return Refusal(task.task_id, "budget_exceeded", str(exc))
        except IdempotencyConflictError as exc:
            log.warning("[TaskRunner.run] %s outcome=refused: %s", tag, exc)
            return Refusal(task.task_id, "conflict", str(exc))
        except DataError as exc:
            # Data problems (a bad row under on_invalid="error", no valid rows, ...) are facts
            # about the site's data: the details stay in the local log, never in the refusal.
            log.error("[TaskRunner.run] %s outcome=refused: the data cannot be read: %s", tag, exc)
            return Refusal(task.task_id, "invalid",
                           "the site's data cannot be read under its row policy (details are "
                           "in the site's log)")
        except ValidationError as exc:
            # Problems with the task's own parameters: safe to explain to the coordinator.
            log.warning("[TaskRunner.run] %s outcome=refused as invalid: %s", tag, exc)
            return Refusal(task.task_id, "invalid", str(exc))
        except Exception:
            log.exception("[TaskRunner.run] %s outcome=failed", tag)
            return Refusal(task.task_id, "internal",
                           "the site failed to run the task (see its log)")
        state = "replayed" if outcome.replayed else "charged"
        assert not isinstance(prepared, PreparedContinuation)
        log.info("[TaskRunner.run] %s outcome=%s epsilon=%g delta=%g, %d bytes released", tag,
                 state, prepared.cost.epsilon, prepared.cost.delta, len(outcome.result))
        return outcome.result

    def _continue(self, task: Task, prepared: PreparedContinuation, tag: str) -> bytes | Refusal:
        """Run a step of an already-charged release (nothing new is charged)."""
        if self.ledger.lookup(prepared.charged_by) is None:
            log.warning("[TaskRunner.run] %s refused: its opening task %s was never charged "
                        "here", tag, prepared.charged_by)
            return Refusal(task.task_id, "invalid",
                           "this site never charged the release this task continues")
        if self.ledger.analyst_of(prepared.charged_by) != task.analyst_id:
            log.warning("[TaskRunner.run] %s refused: it continues %s, opened by another "
                        "analyst", tag, prepared.charged_by)
            return Refusal(task.task_id, "not_allowed", "this task continues a release "
                           "another analyst opened (and paid for); only that analyst may")
        salt = json.dumps(dict(task.params), sort_keys=True, default=str)
        result = prepared.run(self._rng(task.kind, salt))
        log.info("[TaskRunner.run] %s continued %s (no new charge), %d bytes released", tag,
                 prepared.charged_by, len(result))
        return result

    def _run_local(self, task: Task, prepared: PreparedRelease, tag: str) -> bytes:
        """Run a local-only task: write its output here; send back only that it was done."""
        assert prepared.local_output is not None
        if prepared.cost.epsilon != 0.0 or prepared.cost.delta != 0.0 or prepared.cost.rho != 0.0:
            raise ValidationError("a local-only task must not spend budget")
        where = prepared.local_output(self.local_dir)
        result = prepared.release(self._rng(task.kind))
        if result.arrays or result.spend.epsilon or result.spend.delta:
            raise ValidationError("a local-only task must not release arrays or spend budget")
        log.info("[TaskRunner.run] %s local-only: %s (nothing released, nothing charged)",
                 tag, where)
        return result_to_bytes(result)
