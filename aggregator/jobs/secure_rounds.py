"""The coordinator's side of a secure sum: relay signed keys, plan, collect masked vectors, decode.

One secure sum is two rounds of the ``secagg`` kind (see
:mod:`dpfed.common.secagg.secure_sum`): ``<name>-keys-<attempt>`` collects every eligible
site's signed ephemeral key and its policy; ``<name>-sum-<attempt>`` sends the participants,
the relayed keys and the public plan, and collects the masked contributions. If a participant
does not contribute, the masks cannot cancel: the attempt is abandoned (nothing is unmasked;
its charges stay on the ledgers) and the sum is retried without that site, with fresh keys.
The coordinator sees nothing but uniform-looking vectors and their noisy sum.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfed.aggregator.jobs.base import JobContext
from dpfed.aggregator.jobs.validators import RESULT_ENVELOPE_BYTES
from dpfed.common.errors import ProtocolError, QuorumError
from dpfed.common.secagg.messages import plan_params, signed_key_from_arrays
from dpfed.common.secagg.secure_sum import SecureSumPlan, decode_sum, plan_within_rho
from dpfed.common.secagg.secure_sum import plan_for as plan_statistic
from dpfed.common.transport.protocol import TaskResult

log = logging.getLogger(__name__)

#: Attempts of one secure sum before the job fails (each drops the sites that vanished).
MAX_ATTEMPTS = 3
#: Largest row count a site may report with its contribution (the decode divides by the sum).
MAX_SITE_ROWS = 10 ** 12
#: A keys answer: a 32-byte key, a signature and a certificate (each array capped at 16 KiB
#: by the decoder), in the usual envelope.
KEYS_RESULT_BYTES = 3 * (16 << 10) + RESULT_ENVELOPE_BYTES


@dataclass(frozen=True)
class SecureSumOutcome:
    """A decoded secure sum and what it was computed from."""

    value: np.ndarray
    plan: SecureSumPlan
    n_rows: dict[str, int]
    attempts: int

    @property
    def n_rows_total(self) -> int:
        """Public number of pooled rows."""
        return sum(self.n_rows.values())


def _check_keys(result: TaskResult, site_id: str) -> None:
    signed_key_from_arrays(result.arrays, site_id)  # shape and size checks
    for name in ("min_participants", "tolerated"):
        value = result.metadata.get(name)
        if not isinstance(value, int) or not 0 <= value <= 1000:
            raise ProtocolError(f"secure keys lack a valid {name}")


#: ``plan_for(participants, tolerated, total_rows)``: a job's own planner (e.g. a linear sum's);
#: a coroutine function is awaited (heavy planning belongs in a worker thread).
Planner = Callable[[list[str], int, int], SecureSumPlan | Awaitable[SecureSumPlan]]


async def secure_sum(ctx: JobContext, *, name: str, statistic: str, dim: int,
                     site_params: Mapping[str, Any], epsilon: float, delta: float,
                     row_norm: float = 1.0, arrays: Mapping[str, np.ndarray] | None = None,
                     progress: tuple[float, float] = (0.05, 0.9),
                     plan_for: Planner | None = None,
                     require_kind: str | None = None,
                     among: list[str] | None = None,
                     rho: float | None = None) -> SecureSumOutcome:
    """Run one secure sum over the eligible sites; return the decoded noisy pooled statistic.

    ``plan_for`` replaces the planner of ``statistic`` (``statistic`` and ``dim`` are then only
    descriptive); ``require_kind`` leaves out sites whose advertised allowed jobs lack that
    kind (the site would refuse the contribution anyway, after the others paid); ``among``
    limits the sum to those sites (e.g. the ones whose earlier round this sum builds on).
    ``rho`` (a round of a job composed in zCDP: its rho share, ``(epsilon, delta)`` the
    analytic Gaussian's for it) plans the least noise charged at most ``rho``
    (:func:`dpfed.common.secagg.secure_sum.plan_within_rho`); the task then carries that
    plan's epsilon, which the sites calibrate to and record.

    Raises
    ------
    QuorumError
        Fewer sites than the job's quorum or the strictest site policy requires, or no
        attempt in which every participant contributed.
    """
    lo, hi = progress
    excluded: set[str] = set()
    for attempt in range(1, MAX_ATTEMPTS + 1):
        sum_round = f"{name}-sum-{attempt}"
        await ctx.wait_for_sites()  # a resumed job: the sites dial back in first
        eligible = [s.site_id for s in ctx.registry.connected() if s.site_id not in excluded
                    and (require_kind is None or require_kind in s.hello.allowed_kinds)
                    and (among is None or s.site_id in among)]
        keys = await ctx.dispatch(
            "secagg", {"stage": "keys", "job_id": ctx.job_id, "sum_round": sum_round,
                       "sum_task_id": f"{ctx.job_id}/{sum_round}"},
            round_name=f"{name}-keys-{attempt}", epsilon=0.0, delta=0.0, only=eligible,
            max_result_bytes=KEYS_RESULT_BYTES,
            progress=(lo, lo + (hi - lo) * 0.2))
        for site_id in list(keys):
            try:
                _check_keys(keys[site_id], site_id)
            except Exception as exc:  # a malformed answer excludes the site, never the job
                log.warning("[secure_sum] site=%s sent invalid keys: %s", site_id, exc)
                keys.pop(site_id)
        participants = sorted(keys)
        tolerated = max(int(keys[s].metadata["tolerated"]) for s in participants) if keys else 0
        needed = max([ctx.min_sites, tolerated + 1, 2]
                     + [int(keys[s].metadata["min_participants"]) for s in participants])
        if len(participants) < needed:
            raise QuorumError(f"secure aggregation needs at least {needed} participating sites "
                              f"(the job's quorum and the sites' policies); "
                              f"{len(participants)} sent keys")
        rows = {}
        for s in participants:
            session = ctx.registry.get(s)
            rows[s] = session.hello.row_count if session is not None else 0
        if plan_for is not None:
            planned = plan_for(participants, tolerated, max(1, sum(rows.values())))
            plan = await planned if inspect.isawaitable(planned) else planned
        elif rho is not None:
            plan = await asyncio.to_thread(
                plan_within_rho, statistic, dim=dim, total_rows=max(1, sum(rows.values())),
                epsilon=epsilon, delta=delta, rho=rho, participants=participants,
                tolerated=tolerated, row_norm=row_norm)
        else:
            plan = plan_statistic(statistic, dim=dim, total_rows=max(1, sum(rows.values())),
                                  epsilon=epsilon, delta=delta, participants=participants,
                                  tolerated=tolerated, row_norm=row_norm)
        sum_epsilon = epsilon if rho is None else plan.calibration.epsilon
        relayed: dict[str, np.ndarray] = dict(arrays or {})
        for s in participants:
            relayed.update({k: v for k, v in keys[s].arrays.items() if k.endswith("/" + s)})
        params = {"stage": "contribute", "sum_round": sum_round, **dict(site_params),
                  **plan_params(plan, row_norm=row_norm)}

        def check(result: TaskResult, n: int = plan.n_values) -> None:
            masked = result.arrays.get("masked")
            if masked is None or masked.dtype != np.uint64 or masked.shape != (n,):
                raise ProtocolError(f"expected a uint64 masked vector of length {n}")
            n_rows = result.metadata.get("n_rows")
            if not isinstance(n_rows, int) or not 1 <= n_rows <= MAX_SITE_ROWS:
                raise ProtocolError("a secure contribution lacks a valid positive n_rows")

        ctx.emit("secure", f"secure sum {name!r} attempt {attempt}: {len(participants)} "
                 f"participants, tolerating {tolerated} colluding parties", lo + (hi - lo) * 0.25)
        try:
            results = await ctx.dispatch("secagg", params, round_name=sum_round,
                                         arrays=relayed, epsilon=sum_epsilon, delta=delta,
                                         check_result=check, only=participants,
                                         max_result_bytes=8 * plan.n_values
                                         + RESULT_ENVELOPE_BYTES,
                                         progress=(lo + (hi - lo) * 0.3, hi))
        except QuorumError:
            results = {}
        missing = sorted(set(participants) - set(results))
        # Sites that vanished or failed are left out of the next attempt; a site that only
        # refused as a conflict (its ledger holds an earlier run's answer to this task id, e.g.
        # after it restarted) may take part again with fresh task ids.
        gone = [s for s in missing if ctx.outcomes.get(s) is None
                or not ctx.outcomes[s].reason.startswith("conflict")]
        if not missing:
            value = decode_sum({s: results[s].arrays["masked"] for s in participants}, plan)
            n_rows = {s: int(results[s].metadata.get("n_rows", rows[s])) for s in participants}
            return SecureSumOutcome(value, plan, n_rows, attempt)
        log.warning("[secure_sum] job=%s %s attempt %d: no contribution from %s; retrying "
                    "without them (their masks cannot cancel)", ctx.job_id, name, attempt,
                    missing)
        ctx.emit("secure", f"secure sum {name!r}: {', '.join(missing)} did not contribute; "
                 "retrying with fresh keys", lo + (hi - lo) * 0.5)
        excluded.update(gone)
    raise QuorumError(f"secure sum {name!r} failed {MAX_ATTEMPTS} times: participants kept "
                      "dropping out")


def symmetric_from_upper(upper: np.ndarray, dim: int) -> np.ndarray:
    """Rebuild a symmetric matrix from its row-major upper triangle."""
    m = np.zeros((dim, dim))
    m[np.triu_indices(dim)] = upper
    return m + np.triu(m, 1).T
