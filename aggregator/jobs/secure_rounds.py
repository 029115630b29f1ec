"""A round as a secure sum: keys, shares, masked vectors, a signed view, reveals, decode.

One secure sum is five tasks of the ``secagg`` kind (docs/secure-aggregation.md):
``<round>-keys-<attempt>`` collects every eligible site's signed round keys and policy;
``<round>-shares-<attempt>`` relays them and collects each site's sealed Shamir shares;
``<round>-sum-<attempt>`` sends each dealer the shares addressed to it and the public plan,
and collects the masked contributions; ``<round>-confirm-<attempt>`` has every survivor sign
the participant and survivor sets, and ``<round>-unmask-<attempt>`` relays the signatures and
collects the revealed shares, from which the survivors' self-masks and the dropped sites'
pairwise masks are rebuilt. Sites mask with and deal to their neighbours in the sum's graph
(:mod:`dpfed.common.secagg.graph`: complete for small federations, else sparse and derived
from the signed keys). Up to ``d`` dealers may drop after dealing; more, or too few revealers
in a neighbourhood, abandon the attempt (nothing is unmasked; its charges stay on the ledgers),
which is retried without them, with fresh keys. The decoded integer sum is checked against
the bounds the statistic and the public row counts imply before anything uses it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from dpfed.aggregator.jobs.outgoing import OutgoingTask
from dpfed.common.errors import ImpossibleSumError, ProtocolError, QuorumError
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
from dpfed.common.secagg.dropouts import SEALED_BYTES, mask_public, recovery_correction
from dpfed.common.secagg.graph import NeighbourGraph, choose_degree, derive_graph
from dpfed.common.secagg.masking import MaskContext
from dpfed.common.secagg.messages import plan_params, signed_key_from_arrays
from dpfed.common.secagg.secure_sum import decode_survivors, plan_for, plan_within_rho
from dpfed.common.secagg.shamir import SHARE_BYTES
from dpfed.common.transport.protocol import RefusalCode, SiteStatus, TaskResult

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
    for name in ("min_participants", "tolerated", "dropouts"):
        value = result.metadata.get(name, 0 if name == "dropouts" else None)
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
        attempt that could be decoded (more drops than tolerated, every time).
    ImpossibleSumError
        The decoded sum is one no honest run produces (a participant shifted its integers).
    """
    name = rnd.name
    enc = rnd.encoding(ask)
    lo, hi = progress
    span = hi - lo
    excluded: set[str] = set()
    for attempt in range(1, MAX_ATTEMPTS + 1):
        sum_round = f"{name}-sum-{attempt}"
        sum_task_id = f"{job.job_id}/{sum_round}"
        ids = {"job_id": job.job_id, "sum_round": sum_round, "sum_task_id": sum_task_id}
        await job.wait_for_sites()  # a resumed job: the sites dial back in first
        eligible = [s.site_id for s in job.registry.connected() if s.site_id not in excluded
                    and job.kind.name in s.hello.allowed_kinds
                    and (among is None or s.site_id in among)]
        keys = await job.dispatch(
            OutgoingTask(f"{name}-keys-{attempt}", SECURE_TASK_KIND, Budget(0.0, 0.0),
                         {"stage": "keys", **ids}, {}, KEYS_RESULT_BYTES),
            only=eligible, progress=(lo, lo + span * 0.1))
        for site_id in list(keys):
            try:
                _check_keys(keys[site_id], site_id)
            except Exception as exc:  # a malformed answer excludes the site, never the job
                log.warning("site=%s sent invalid keys: %s", site_id, exc)
                keys.pop(site_id)
        order = sorted(keys)
        tolerated = max(int(keys[s].metadata["tolerated"]) for s in order) if keys else 0
        wanted_drops = max([int(keys[s].metadata.get("dropouts", 0)) for s in order] or [0])
        needed = max([job.min_sites, tolerated + 1, 2]
                     + [int(keys[s].metadata["min_participants"]) for s in order])
        if len(order) < needed:
            raise QuorumError(f"secure aggregation needs at least {needed} participating sites "
                              f"(the job's quorum and the sites' policies); "
                              f"{len(order)} sent keys")
        relayed: dict[str, np.ndarray] = {}
        for s in order:
            relayed.update({k: v for k, v in keys[s].arrays.items() if k.endswith("/" + s)})
        context = MaskContext(job.job_id, sum_round, sum_task_id)
        graph = sum_graph(context, relayed, order, tolerated, wanted_drops)
        threshold_ = graph.share_threshold(tolerated)
        shares = await _quietly(job.dispatch(
            OutgoingTask(f"{name}-shares-{attempt}", SECURE_TASK_KIND, Budget(0.0, 0.0),
                         {"stage": "shares", **ids, "participants": order,
                          "tolerated": tolerated, **graph_params(graph, wanted_drops)},
                         relayed, _shares_bytes(graph.degree + 1),
                         functools.partial(check_shares, order=order, graph=graph)),
            only=order, progress=(lo + span * 0.1, lo + span * 0.2), quorum=1))
        participants = sorted(shares)
        dropouts = min(wanted_drops,
                       graph.capacity(tolerated) - (len(order) - len(participants)))
        if len(participants) < needed or dropouts < 0:
            excluded.update(s for s in order if s not in shares)
            _retrying(job, name, attempt, sorted(set(order) - set(shares)), lo + span * 0.5)
            continue
        rows = {}
        for s in participants:
            session = job.registry.get(s)
            rows[s] = session.hello.row_count if session is not None else 0
        planned = await _plan(rnd, enc, ask.budget, participants, tolerated,
                              max(1, sum(rows.values())))
        planned = PlannedSum(dataclasses.replace(planned.plan, dropouts=dropouts),
                             planned.detail)
        plan = planned.plan
        budget = Budget(plan.calibration.epsilon if ask.budget.rho is not None
                        else ask.budget.epsilon, ask.budget.delta, ask.budget.rho)
        params = {"stage": "contribute", "sum_round": sum_round, **dict(enc.params),
                  **plan_params(plan, row_norm=enc.row_norm)}
        job.emit("secure", f"secure sum {name!r} attempt {attempt}: {len(participants)} "
                 f"participants, tolerating {tolerated} colluding parties and {dropouts} "
                 "dropouts", lo + span * 0.25)
        results = await _quietly(job.dispatch(
            OutgoingTask(sum_round, SECURE_TASK_KIND, budget, params, dict(enc.arrays),
                         8 * plan.n_values + RESULT_ENVELOPE_BYTES,
                         functools.partial(_check_masked, n_values=plan.n_values),
                         addressed_shares(shares, participants, graph)),
            only=participants, progress=(lo + span * 0.3, lo + span * 0.8), quorum=1))
        survivors = sorted(results)
        if len(survivors) >= max(len(participants) - dropouts, job.min_sites):
            view = {**ids, "participants": participants, "survivors": survivors}
            signed = await _quietly(job.dispatch(
                OutgoingTask(f"{name}-confirm-{attempt}", SECURE_TASK_KIND, Budget(0.0, 0.0),
                             {"stage": "confirm", **view}, {}, KEYS_RESULT_BYTES),
                only=survivors, progress=(lo + span * 0.8, lo + span * 0.85), quorum=1))
            signatures = {k: v for r in signed.values() for k, v in r.arrays.items()
                          if k.startswith("view_signature/")}
            revealed = await _quietly(job.dispatch(
                OutgoingTask(f"{name}-unmask-{attempt}", SECURE_TASK_KIND, Budget(0.0, 0.0),
                             {"stage": "unmask", **view}, signatures,
                             _reveal_bytes(min(len(participants), graph.holders)),
                             functools.partial(check_reveal, survivors=survivors,
                                               participants=participants, graph=graph)),
                only=sorted(signed), progress=(lo + span * 0.85, hi), quorum=1))
            if (len(signed) >= graph.view_threshold(tolerated)
                    and len(revealed) >= threshold_):
                recovery = Recovery(order, participants, keys, shares, revealed, threshold_,
                                    context, graph)
                try:
                    return await _decoded(rnd, ask, enc, planned, budget, results, attempt,
                                          recovery)
                except ImpossibleSumError:
                    raise
                except ProtocolError as exc:  # too few shares matched their commitments
                    log.warning("job=%s %s attempt %d: masks not recovered: %s", job.job_id,
                                name, attempt, exc)
        missing = sorted(s for s in order if job.outcomes.get(s) is None
                         or job.outcomes[s].status != SiteStatus.OK)
        # Sites that vanished or failed are left out of the next attempt; a site that only
        # refused as a conflict (its ledger holds an earlier run's answer to this task id, e.g.
        # after it restarted) may take part again with fresh task ids.
        excluded.update(s for s in missing if job.outcomes.get(s) is None
                        or job.outcomes[s].code is not RefusalCode.CONFLICT)
        _retrying(job, name, attempt, missing, lo + span * 0.5)
    raise QuorumError(f"secure sum {name!r} failed {MAX_ATTEMPTS} times: participants kept "
                      "dropping out")


async def _quietly(dispatched: Awaitable[dict[str, TaskResult]]) -> dict[str, TaskResult]:
    """Return the answers of a stage (each stage's own count is checked by the caller)."""
    try:
        return await dispatched
    except QuorumError:
        return {}


def _retrying(job: Job[Any], name: str, attempt: int, missing: list[str],
              progress: float) -> None:
    log.warning("job=%s %s attempt %d: too few sites completed the sum (missing %s); "
                "retrying with fresh keys", job.job_id, name, attempt, missing)
    job.emit("secure", f"secure sum {name!r}: {', '.join(missing) or 'a site'} did not "
             "contribute; retrying with fresh keys", progress)


def _shares_bytes(n: int) -> int:
    return n * (SEALED_BYTES + 2 * 32 + 3 * 64) + RESULT_ENVELOPE_BYTES


def _reveal_bytes(n: int) -> int:
    return n * (SHARE_BYTES + 64) + RESULT_ENVELOPE_BYTES


def sum_graph(context: MaskContext, relayed: Mapping[str, np.ndarray], order: list[str],
              tolerated: int, wanted_drops: int) -> NeighbourGraph:
    """Return the graph of a sum over the dealers ``order`` whose signed keys are ``relayed``.

    Its degree follows from their number, ``t`` and the drops asked for; its ring from their
    signed round keys.
    """
    publics = {s: signed_key_from_arrays(relayed, s).public_key for s in order}
    return derive_graph(context, publics, choose_degree(len(publics), tolerated, wanted_drops))


def graph_params(graph: NeighbourGraph, wanted_drops: int) -> dict[str, Any]:
    """Return the graph as the shares stage shows it: nothing for a complete graph."""
    if graph.complete:
        return {}
    return {"degree": graph.degree, "wanted_dropouts": wanted_drops, "ring": list(graph.ring)}


def check_shares(result: TaskResult, order: list[str],
                 graph: NeighbourGraph | None = None) -> None:
    """Refuse a shares answer that is not one dealer's sealed shares for its neighbours.

    ``graph``: the sum's graph over ``order`` (default complete: every other dealer).
    """
    committed = {k.split("/", 1)[1] for k in result.arrays if k.startswith("commit_self/")}
    sealed = {k.split("/", 1)[1] for k in result.arrays if k.startswith("sealed/")}
    dealers = sorted(committed - sealed)
    if len(dealers) != 1 or dealers[0] not in order:
        raise ProtocolError("the shares lack the dealer's own commitment")
    dealer = dealers[0]
    peers = order if graph is None else [dealer, *graph.neighbours(dealer)]
    for peer in peers:
        fields = ((("commit_self", 32),) if peer == dealer else
                  (("sealed", SEALED_BYTES), ("commit_self", 32), ("commit_key", 32)))
        for f, size in fields:
            arr = result.arrays.get(f"{f}/{peer}")
            if arr is None or arr.dtype != np.uint8 or arr.shape != (size,):
                raise ProtocolError(f"the shares lack a valid {f}/{peer}")
    if len(result.arrays) != 3 * len(peers) - 2:
        raise ProtocolError("the shares carry arrays for sites that are not its neighbours")


def check_reveal(result: TaskResult, survivors: list[str], participants: list[str],
                 graph: NeighbourGraph | None = None) -> None:
    """Refuse a reveal that is not exactly the view's shares one survivor holds.

    Self-mask shares of the survivors among it and its neighbours, key shares of the dropped
    sites among its neighbours (``graph`` None: complete, every participant).
    """
    dropped = [s for s in participants if s not in survivors]

    def expected(revealer: str | None) -> set[str]:
        near = set(participants) if revealer is None or graph is None else (
            {revealer, *graph.neighbours(revealer)})
        return ({f"self/{v}" for v in survivors if v in near}
                | {f"key/{u}" for u in dropped if u in near})

    names = set(result.arrays)
    if graph is None or graph.complete:
        fits = names == expected(None)
    else:  # a revealer reveals its own self-mask share: only those named can be it
        fits = any(names == expected(r) for r in survivors if f"self/{r}" in names)
    if not fits:
        raise ProtocolError("the reveal does not hold exactly the shares the view calls for")
    for arr in result.arrays.values():
        if arr.dtype != np.uint8 or arr.shape != (SHARE_BYTES,):
            raise ProtocolError(f"a revealed share must be {SHARE_BYTES} bytes")


def addressed_shares(shares: Mapping[str, TaskResult], participants: list[str],
                     graph: NeighbourGraph | None = None) -> dict[str, dict[str, np.ndarray]]:
    """Per recipient: the sealed shares and commitments its neighbours among them dealt it."""
    out: dict[str, dict[str, np.ndarray]] = {r: {} for r in participants}
    for dealer in participants:
        arrays = shares[dealer].arrays
        near = participants if graph is None else graph.neighbours(dealer)
        for recipient in participants:
            if recipient != dealer and recipient in near:
                out[recipient].update({f"{f}/{dealer}": arrays[f"{f}/{recipient}"]
                                       for f in ("sealed", "commit_self", "commit_key")})
    return out


@dataclass(frozen=True)
class Recovery:
    """What the coordinator needs to remove the masks the survivors' vectors still carry."""

    order: list[str]
    participants: list[str]
    keys: Mapping[str, TaskResult]
    shares: Mapping[str, TaskResult]
    revealed: Mapping[str, TaskResult]
    threshold: int
    context: MaskContext
    #: The sum's graph over ``order`` (None: complete).
    graph: NeighbourGraph | None = None

    def correction(self, survivors: list[str], n_values: int) -> np.ndarray:
        """Rebuild the survivors' self-masks and the dropped sites' pairwise masks."""
        commitments = {}
        for dealer in self.participants:
            for name, arr in self.shares[dealer].arrays.items():
                field_, recipient = name.split("/", 1)
                if field_ in ("commit_self", "commit_key"):
                    commitments[(dealer, recipient, field_[7:])] = arr.tobytes()
        revealed: dict[str, dict[str, dict[str, bytes]]] = {}
        for revealer, result in self.revealed.items():
            for name, arr in result.arrays.items():
                kind, owner = name.split("/", 1)
                revealed.setdefault(revealer, {}).setdefault(kind, {})[owner] = arr.tobytes()
        publics = {s: mask_public(signed_key_from_arrays(self.keys[s].arrays, s).public_key)
                   for s in self.participants}
        graph = self.graph if self.graph is not None else NeighbourGraph(
            tuple(self.order), len(self.order) - 1)
        return recovery_correction(n_values=n_values, order=self.participants,
                                   survivors=survivors, mask_publics=publics,
                                   revealed=revealed, commitments=commitments,
                                   threshold_=self.threshold, context=self.context,
                                   graph=graph)


async def _decoded(rnd: SumRound[P, I, V], ask: Ask[P, I], enc: SumEncoding,
                   planned: PlannedSum, budget: Budget, results: dict[str, TaskResult],
                   attempt: int, recovery: Recovery) -> Pooled[V]:
    """Unmask and decode the sum, check it is one honest sites can produce, pool it."""
    plan = planned.plan
    survivors = sorted(results)
    correction = await asyncio.to_thread(recovery.correction, survivors, plan.n_values)
    total = decode_survivors({s: results[s].arrays["masked"] for s in survivors}, plan,
                             correction)
    rows = {s: int(results[s].metadata["n_rows"]) for s in survivors}
    rnd.check_sum(total, planned, sum(rows.values()), enc)
    graph = recovery.graph
    summed = SecureSum(total.astype(np.float64) / plan.scale ** plan.degree, plan, rows,
                       attempt, planned.detail, rnd.secure_releases,
                       len(recovery.order) - 1 if graph is None else graph.degree)
    value = rnd.pool_secure(summed, Ask(ask.params, ask.schema, ask.inputs, budget))
    return Pooled(rnd.name, value, budget, rows, dict.fromkeys(survivors, plan.cost()),
                  {}, summed)
