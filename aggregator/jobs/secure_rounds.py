"""A round as a secure sum: relay signed keys, plan, collect masked vectors, decode, check.

One secure sum is two tasks of the ``secagg`` kind (docs/secure-aggregation.md):
``<round>-keys-<attempt>`` collects every eligible site's signed ephemeral key and policy;
``<round>-sum-<attempt>`` sends the participants, the relayed keys and the public plan, and
collects the masked contributions. A participant that does not contribute leaves masks that
cannot cancel: the attempt is abandoned (nothing is unmasked; its charges stay on the
ledgers) and retried without that site, with fresh keys. The decoded integer sum is checked
against the bounds the statistic and the public row counts imply before anything uses it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from dpfed.aggregator.jobs.outgoing import OutgoingTask
from dpfed.common.errors import ProtocolError, QuorumError
from dpfed.common.jobs.contract import (
    Ask,
    Budget,
    PlannedSum,
    Pooled,
    SecureSum,
    SumEncoding,
    SumRound,
)
from dpfed.common.jobs.params import Params
from dpfed.common.jobs.registry import SECURE_TASK_KIND
from dpfed.common.jobs.results import RESULT_ENVELOPE_BYTES
from dpfed.common.secagg.messages import plan_params, signed_key_from_arrays
from dpfed.common.secagg.secure_sum import decode_integer_sum, plan_for, plan_within_rho
from dpfed.common.transport.protocol import RefusalCode, TaskResult

if TYPE_CHECKING:
    from dpfed.aggregator.jobs.job import Job

log = logging.getLogger(__name__)

P = TypeVar("P", bound=Params)
I = TypeVar("I")  # noqa: E741
V = TypeVar("V")

#: Attempts of one secure sum before the job fails (each drops the sites that vanished).
MAX_ATTEMPTS = 3
#: Largest row count a site may report with its contribution (the decode divides by the sum).
MAX_SITE_ROWS = 10 ** 12
#: A keys answer: a 32-byte key, a signature and a certificate (each array capped at 16 KiB
#: by the decoder), in the usual envelope.
KEYS_RESULT_BYTES = 3 * (16 << 10) + RESULT_ENVELOPE_BYTES


def _check_keys(result: TaskResult, site_id: str) -> None:
    signed_key_from_arrays(result.arrays, site_id)  # shape and size checks
    for name in ("min_participants", "tolerated"):
        value = result.metadata.get(name)
        if not isinstance(value, int) or not 0 <= value <= 1000:
            raise ProtocolError(f"secure keys lack a valid {name}")


def _check_masked(result: TaskResult, n_values: int) -> None:
    masked = result.arrays.get("masked")
    if masked is None or masked.dtype != np.uint64 or masked.shape != (n_values,):
        raise ProtocolError(f"expected a uint64 masked vector of length {n_values}")
    n_rows = result.metadata.get("n_rows")
    if not isinstance(n_rows, int) or not 1 <= n_rows <= MAX_SITE_ROWS:
        raise ProtocolError("a secure contribution lacks a valid positive n_rows")


async def _plan(rnd: SumRound[Any, Any, Any], enc: SumEncoding, budget: Budget,
                participants: list[str], tolerated: int, total_rows: int) -> PlannedSum:
    if enc.planner is not None:
        return await enc.planner(participants, tolerated, total_rows)
    if budget.rho is not None:
        plan = await asyncio.to_thread(
            plan_within_rho, rnd.statistic, dim=enc.dim, total_rows=total_rows,
            epsilon=budget.epsilon, delta=budget.delta, rho=budget.rho,
            participants=participants, tolerated=tolerated, row_norm=enc.row_norm)
    else:  # the exact Skellam calibration takes seconds at a large epsilon: off the loop
        plan = await asyncio.to_thread(
            plan_for, rnd.statistic, dim=enc.dim, total_rows=total_rows,
            epsilon=budget.epsilon, delta=budget.delta, participants=participants,
            tolerated=tolerated, row_norm=enc.row_norm)
    return PlannedSum(plan)


async def secure_release(job: Job[P], rnd: SumRound[P, I, V], ask: Ask[P, I], *,
                         among: Collection[str] | None,
                         progress: tuple[float, float]) -> Pooled[V]:
    """Run ``rnd`` as one secure sum over the eligible sites; return its pooled value.

    ``ask.budget.rho`` (a round of a job composed in zCDP) plans the least noise charged at
    most that rho (:func:`dpfed.common.secagg.secure_sum.plan_within_rho`); the task then
    carries that plan's epsilon, which the sites calibrate to and record.

    Raises
    ------
    QuorumError
        Fewer sites than the job's quorum or the strictest site policy requires, or no
        attempt in which every participant contributed.
    ImpossibleSumError
        The decoded sum is one no honest run produces (a participant shifted its integers).
    """
    name = rnd.name
    enc = rnd.encoding(ask)
    lo, hi = progress
    excluded: set[str] = set()
    for attempt in range(1, MAX_ATTEMPTS + 1):
        sum_round = f"{name}-sum-{attempt}"
        await job.wait_for_sites()  # a resumed job: the sites dial back in first
        eligible = [s.site_id for s in job.registry.connected() if s.site_id not in excluded
                    and job.kind.name in s.hello.allowed_kinds
                    and (among is None or s.site_id in among)]
        keys = await job.dispatch(
            OutgoingTask(f"{name}-keys-{attempt}", SECURE_TASK_KIND, Budget(0.0, 0.0),
                 {"stage": "keys", "job_id": job.job_id, "sum_round": sum_round,
                  "sum_task_id": f"{job.job_id}/{sum_round}"}, {}, KEYS_RESULT_BYTES),
            only=eligible, progress=(lo, lo + (hi - lo) * 0.2))
        for site_id in list(keys):
            try:
                _check_keys(keys[site_id], site_id)
            except Exception as exc:  # a malformed answer excludes the site, never the job
                log.warning("site=%s sent invalid keys: %s", site_id, exc)
                keys.pop(site_id)
        participants = sorted(keys)
        tolerated = max(int(keys[s].metadata["tolerated"]) for s in participants) if keys else 0
        needed = max([job.min_sites, tolerated + 1, 2]
                     + [int(keys[s].metadata["min_participants"]) for s in participants])
        if len(participants) < needed:
            raise QuorumError(f"secure aggregation needs at least {needed} participating sites "
                              f"(the job's quorum and the sites' policies); "
                              f"{len(participants)} sent keys")
        rows = {}
        for s in participants:
            session = job.registry.get(s)
            rows[s] = session.hello.row_count if session is not None else 0
        planned = await _plan(rnd, enc, ask.budget, participants, tolerated,
                              max(1, sum(rows.values())))
        plan = planned.plan
        budget = Budget(plan.calibration.epsilon if ask.budget.rho is not None
                        else ask.budget.epsilon, ask.budget.delta, ask.budget.rho)
        relayed: dict[str, np.ndarray] = dict(enc.arrays)
        for s in participants:
            relayed.update({k: v for k, v in keys[s].arrays.items() if k.endswith("/" + s)})
        params = {"stage": "contribute", "sum_round": sum_round, **dict(enc.params),
                  **plan_params(plan, row_norm=enc.row_norm)}
        job.emit("secure", f"secure sum {name!r} attempt {attempt}: {len(participants)} "
                 f"participants, tolerating {tolerated} colluding parties",
                 lo + (hi - lo) * 0.25)
        try:
            results = await job.dispatch(
                OutgoingTask(sum_round, SECURE_TASK_KIND, budget, params, relayed,
                             8 * plan.n_values + RESULT_ENVELOPE_BYTES,
                             functools.partial(_check_masked, n_values=plan.n_values)),
                only=participants, progress=(lo + (hi - lo) * 0.3, hi))
        except QuorumError:
            results = {}
        missing = sorted(set(participants) - set(results))
        if not missing:
            return _decoded(rnd, ask, enc, planned, budget, results, attempt)
        # Sites that vanished or failed are left out of the next attempt; a site that only
        # refused as a conflict (its ledger holds an earlier run's answer to this task id, e.g.
        # after it restarted) may take part again with fresh task ids.
        excluded.update(s for s in missing if job.outcomes.get(s) is None
                        or job.outcomes[s].code is not RefusalCode.CONFLICT)
        log.warning("job=%s %s attempt %d: no contribution from %s; retrying without them "
                    "(their masks cannot cancel)", job.job_id, name, attempt, missing)
        job.emit("secure", f"secure sum {name!r}: {', '.join(missing)} did not contribute; "
                 "retrying with fresh keys", lo + (hi - lo) * 0.5)
    raise QuorumError(f"secure sum {name!r} failed {MAX_ATTEMPTS} times: participants kept "
                      "dropping out")


def _decoded(rnd: SumRound[P, I, V], ask: Ask[P, I], enc: SumEncoding, planned: PlannedSum,
             budget: Budget, results: dict[str, TaskResult], attempt: int) -> Pooled[V]:
    """Decode the sum, check it is one honest sites can produce, pool it."""
    plan = planned.plan
    total = decode_integer_sum({s: results[s].arrays["masked"] for s in plan.participants},
                               plan)
    rows = {s: int(results[s].metadata["n_rows"]) for s in plan.participants}
    rnd.check_sum(total, planned, sum(rows.values()), enc)
    summed = SecureSum(total.astype(np.float64) / plan.scale ** plan.degree, plan, rows,
                       attempt, planned.detail, rnd.secure_releases)
    value = rnd.pool_secure(summed, Ask(ask.params, ask.schema, ask.inputs, budget))
    return Pooled(rnd.name, value, budget, rows, dict.fromkeys(plan.participants, plan.cost()),
                  {}, summed)
