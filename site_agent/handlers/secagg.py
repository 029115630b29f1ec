"""Site step of secure aggregation: keys, shares, a noised and masked sum, then recovery.

Five stages of the kind ``secagg`` (docs/secure-aggregation.md has the protocol and its
privacy argument). ``keys`` signs two fresh X25519 keys (mask and channel) for the sum task
named in the parameters; nothing is read or charged, and a retried task gets the same keys
back (held in memory only: a site restarted mid-sum refuses it, and the coordinator retries
with fresh keys). ``shares`` verifies every participant's signed keys, that every one is a
listed, unrevoked site (``SecureAggregationPolicy.check_round``; verified once per sum and
cached), checks that the neighbour graph it is shown is the one the keys give
(:mod:`dpfed.common.secagg.graph`), and deals its neighbours Shamir shares of the site's mask
key and a fresh self-mask seed.
``contribute`` checks the shares dealt to it, lets the round the task names (``source``,
``statistic``) recompute the plan and bind its exact statistic, and adds the Skellam share
``mu / (n - t - d)``, its pairwise masks with its neighbours and its self-mask; the ledger
charges the pooled guarantee first. ``confirm`` signs the participant and survivor sets it is
shown (one view per sum); ``unmask`` checks that enough survivors signed that same view and
reveals the survivors' self-mask shares and the dropped sites' mask-key shares it holds, never
both for one site.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.jobs.contract import DataAccess, Free, NewCharge, Release, Site
from dpfed.common.jobs.registry import secure_round
from dpfed.common.jobs.release import require_rows
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.secagg.dropouts import (
    Dealt,
    RevealRecord,
    RoundKeys,
    deal,
    mask_public,
    open_share,
    sign_view,
    verify_view,
)
from dpfed.common.secagg.graph import NeighbourGraph, choose_degree, derive_graph
from dpfed.common.secagg.keys import SignedKey, sign_ephemeral
from dpfed.common.secagg.masking import MaskContext
from dpfed.common.secagg.messages import (
    MAX_PARTICIPANTS,
    as_array,
    as_bytes,
    check_plan_noise,
    signed_key_arrays,
    signed_key_from_arrays,
)
from dpfed.common.secagg.policy import SecureAggregationPolicy
from dpfed.common.secagg.secure_sum import SecureSumPlan, masked_contribution
from dpfed.common.transport.certs import (
    parse_certificates,
    parse_private_key,
    principal_from_certificate,
    read_pem_file,
)
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.common.validation import check_int
from dpfed.site_agent.handlers.base import TaskHandler

log = logging.getLogger(__name__)

#: Ephemeral keys kept for sum tasks not yet contributed (oldest evicted first).
_MAX_PENDING = 64


@dataclass(frozen=True)
class SiteIdentity:
    """The site's own certificate material, as the secure rounds need it."""

    site_id: str
    signing_key: ec.EllipticCurvePrivateKey
    certificate_pem: bytes
    ca: x509.Certificate

    @classmethod
    def load(cls, ca: Path, cert: Path, key: Path) -> SiteIdentity:
        """Load from the TLS files of the site's config (already checked at start-up)."""
        cert_pem = read_pem_file(cert, "site certificate")
        (certificate, *_rest) = parse_certificates(cert_pem, cert, "site certificate")
        principal = principal_from_certificate(certificate, source=str(cert))
        if principal.role != "site":
            raise ValidationError(f"{cert} is a {principal.role} certificate, not a site's")
        ca_cert = parse_certificates(read_pem_file(ca, "CA certificate"), ca,
                                     "CA certificate")[0]
        return cls(principal.name, parse_private_key(read_pem_file(key, "site key"), key,
                                                     "site key"), cert_pem, ca_cert)


@dataclass
class SumState:
    """What a site holds for one secure sum between its stages (memory only)."""

    keys: RoundKeys
    signed: SignedKey
    #: Set by ``shares``: the dealers, their verified keys, t, the graph and its thresholds.
    order: tuple[str, ...] = ()
    verified: dict[str, SignedKey] = field(default_factory=dict)
    tolerated: int = 0
    graph: NeighbourGraph | None = None
    threshold: int = 0
    view_threshold: int = 0
    self_seed: bytes = b""
    own_self_share: bytes = b""
    dealt: TaskResult | None = None
    #: The degree and ring the coordinator showed at ``shares`` (None, None: complete).
    shown: tuple[Any, Any] = (None, None)
    #: Set by ``contribute``: who it masked with, the tolerated drops and the shares it holds.
    participants: tuple[str, ...] = ()
    dropouts: int = 0
    received: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    #: Set by ``confirm``: the one view (participants, survivors) it signed, and its signature.
    view: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    view_signature: bytes = b""
    reveals: RevealRecord = field(default_factory=RevealRecord)


def _site_list(params: Mapping[str, Any], name: str) -> tuple[str, ...]:
    value = params.get(name)
    if (not isinstance(value, list) or not all(isinstance(v, str) for v in value)
            or len(value) > MAX_PARTICIPANTS or len(set(value)) != len(value)):
        raise ValidationError(f"{name} must be a list of at most {MAX_PARTICIPANTS} distinct "
                              "site ids")
    return tuple(sorted(value))


class SecureAggregationHandler(TaskHandler):
    """The ``secagg`` kind: the five stages of one secure sum."""

    def __init__(self, identity: SiteIdentity, policy: SecureAggregationPolicy,
                 allowed_kinds: tuple[str, ...] | None = None) -> None:
        self.identity = identity
        self.policy = policy
        #: The site's allowed job kinds; a round of another kind is refused (None: any).
        self.allowed_kinds = allowed_kinds
        self._pending: OrderedDict[str, SumState] = OrderedDict()
        self._lock = threading.Lock()
        #: The site's ledger, set by :meth:`for_site`; rounds that keep site secrets beside it
        #: (the synth evaluation holdout) read them.
        self.ledger_path: Path | None = None

    def for_site(self, ledger_path: Path) -> TaskHandler:
        """Return a copy bound to the site whose ledger is ``ledger_path`` (keys shared)."""
        bound = copy.copy(self)
        bound.ledger_path = Path(ledger_path)
        return bound

    def prepare(self, task: Task, data: DataAccess) -> Release:
        """Prepare one stage: ``contribute`` is charged, the others are free."""
        if self.policy.mode == "off":
            raise ValidationError("this site's policy does not take part in secure aggregation")
        stage = task.params.get("stage")
        if stage == "contribute":
            return self._contribute(task, data)
        stages = {"keys": self._keys, "shares": self._shares, "confirm": self._confirm,
                  "unmask": self._unmask}
        if stage not in stages:
            raise ValidationError("stage must be 'keys', 'shares', 'contribute', 'confirm' or "
                                  "'unmask' for a secagg task")
        answer = stages[str(stage)](task)
        return Release(Free(), lambda _rng: answer)

    def _answer(self, task: Task, arrays: Mapping[str, np.ndarray],
                metadata: Mapping[str, Any] | None = None) -> TaskResult:
        return TaskResult(task.task_id, PrivacyCost(0.0, 0.0, 0.0, "secagg-keys"), dict(arrays),
                          dict(metadata or {}))

    def _state(self, context: MaskContext) -> SumState:
        with self._lock:
            state = self._pending.get(context.task_id)
        if state is None:
            raise ValidationError("no ephemeral key for this secure round (the site restarted "
                                  "after the key exchange); retry the round with fresh keys")
        return state

    # ------------------------------------------------------------------ keys (no data)
    def _keys(self, task: Task) -> TaskResult:
        """Sign fresh round keys for the named sum task (the same ones on a retry)."""
        context = self._context(task.params)
        with self._lock:
            state = self._pending.get(context.task_id)
            if state is None:
                keys = RoundKeys.generate()
                signed = sign_ephemeral(site_id=self.identity.site_id, public_key=keys.public,
                                        context=context, signing_key=self.identity.signing_key,
                                        certificate_pem=self.identity.certificate_pem)
                state = self._pending[context.task_id] = SumState(keys, signed)
                while len(self._pending) > _MAX_PENDING:
                    self._pending.popitem(last=False)
        log.info("task=%s signed round keys for %s", task.task_id, context.task_id)
        return self._answer(task, signed_key_arrays(state.signed),
                            {"min_participants": self.policy.min_participants,
                             "tolerated": self.policy.tolerated, "mode": self.policy.mode,
                             "dropouts": self.policy.tolerated_dropouts})

    @staticmethod
    def _context(params: Mapping[str, Any]) -> MaskContext:
        job_id, round_name, sum_task = (params.get("job_id"), params.get("sum_round"),
                                        params.get("sum_task_id"))
        if not all(isinstance(v, str) and 0 < len(v) <= 200 for v in
                   (job_id, round_name, sum_task)):
            raise ValidationError("a secure round names its job_id, sum_round and sum_task_id")
        return MaskContext(str(job_id), str(round_name), str(sum_task))

    # ------------------------------------------------------------------ shares (no data)
    def _shares(self, task: Task) -> TaskResult:
        """Verify every participant's keys once, then deal shares of the mask key and seed."""
        context = self._context(task.params)
        state = self._state(context)
        order = _site_list(task.params, "participants")
        tolerated = check_int(task.params.get("tolerated"), "tolerated", minimum=0)
        shown = (task.params.get("degree"), task.params.get("ring"))
        if state.dealt is not None:
            if (order, tolerated, shown) != (state.order, state.tolerated, state.shown):
                raise ValidationError("secure round refused: shares were already dealt to "
                                      "another participant set or graph")
            return state.dealt
        me = self.identity.site_id
        if me not in order:
            raise ValidationError(f"secure round refused: {me!r} is not among the participants")
        if tolerated < self.policy.tolerated:
            raise ValidationError(f"secure round refused: noise sized for {tolerated} "
                                  f"colluding parties; this site's policy requires "
                                  f"{self.policy.tolerated}")
        try:
            signed = {s: signed_key_from_arrays(task.arrays, s) for s in order}
        except ValidationError as exc:
            raise ValidationError(f"secure round refused: {exc}") from None
        if signed[me] != state.signed:
            raise ValidationError("secure round refused: the relayed key of this site is not "
                                  "the one it signed")
        try:  # every peer verified, listed and unrevoked -- once per sum, then cached
            self.policy.check_round(order, signed, context=context, ca=self.identity.ca)
        except ValidationError as exc:
            log.warning("task=%s %s", task.task_id, exc)
            raise
        short = [s for s in order if len(signed[s].public_key) != 64]
        if short:
            raise ValidationError(f"secure round refused: {short} sent no channel key (a site "
                                  "of an older dpfed cannot take part in dropout recovery)")
        publics = {s: signed[s].public_key for s in order}
        graph = self._graph(task.params, context, publics, tolerated)
        threshold_ = graph.share_threshold(tolerated)
        seed = os.urandom(32)
        dealt, own_share, own_commit = deal(
            state.keys, seed, own_id=me, publics=publics, context=context,
            threshold_=threshold_, neighbours=graph.neighbours(me))
        arrays = {f"commit_self/{me}": as_array(own_commit)}
        for peer, d in dealt.items():
            arrays.update({f"sealed/{peer}": as_array(d.sealed),
                           f"commit_self/{peer}": as_array(d.commit_self),
                           f"commit_key/{peer}": as_array(d.commit_key)})
        with self._lock:
            state.order, state.verified, state.tolerated = order, signed, tolerated
            state.graph, state.shown = graph, shown
            state.threshold, state.view_threshold = threshold_, graph.view_threshold(tolerated)
            state.self_seed, state.own_self_share = seed, own_share
            state.dealt = self._answer(task, arrays)
        return state.dealt

    @staticmethod
    def _graph(params: Mapping[str, Any], context: MaskContext, publics: Mapping[str, bytes],
               tolerated: int) -> NeighbourGraph:
        """Return the graph the coordinator shows (none: complete) if the keys give exactly it.

        A sparse graph's degree must be the one :func:`choose_degree` gives for the dealers,
        ``t`` and the drops asked for, and its ring the one :func:`derive_graph` gives.
        """
        order = tuple(sorted(publics))
        if params.get("degree") is None:
            return NeighbourGraph(order, len(order) - 1)
        wanted = check_int(params.get("wanted_dropouts"), "wanted_dropouts", minimum=0)
        degree = check_int(params.get("degree"), "degree", minimum=2)
        expected = derive_graph(context, publics, choose_degree(len(order), tolerated, wanted))
        ring = params.get("ring")
        if (degree != expected.degree or expected.complete or not isinstance(ring, list)
                or tuple(ring) != expected.ring):
            raise ValidationError(
                f"secure round refused: the neighbour graph shown (degree {degree}) is not the "
                f"one the round keys give (degree {expected.degree} for {len(order)} sites, "
                f"t={tolerated}, d={wanted}, ring from the hash of the signed keys)")
        return expected

    # ------------------------------------------------------------------ contribute
    def _contribute(self, task: Task, data: DataAccess) -> Release:
        """Check the shares held, let the round plan and bind its statistic, price the release."""
        p = task.params
        context = MaskContext(task.job_id, str(p.get("sum_round", "")), task.task_id)
        state = self._state(context)
        graph = state.graph
        if state.dealt is None or graph is None:
            raise ValidationError("secure round refused: this site dealt no shares for it")
        me = self.identity.site_id
        participants = _site_list(p, "participants")
        if me not in participants or not set(participants) <= set(state.order):
            raise ValidationError("secure round refused: the participants are not a subset of "
                                  "those this site dealt shares to, with this site")
        if len(participants) < self.policy.min_participants:
            raise ValidationError(f"secure round refused: {len(participants)} participants; "
                                  f"this site's policy requires at least "
                                  f"{self.policy.min_participants}")
        neighbours = [s for s in graph.neighbours(me) if s in participants]
        strangers = sorted({name.split("/", 1)[1] for name in task.arrays
                            if name.startswith("sealed/")} - set(neighbours))
        if strangers:
            raise ValidationError(f"secure round refused: shares relayed from {strangers}, "
                                  "which are not this site's neighbours in the sum's graph")
        received = {}
        for dealer in neighbours:
            try:
                dealt = Dealt(*(as_bytes(task.arrays, f"{f}/{dealer}")
                                for f in ("sealed", "commit_self", "commit_key")))
                received[dealer] = open_share(state.keys, dealt, own_id=me, dealer=dealer,
                                              dealer_public=state.verified[dealer].public_key,
                                              context=context)
            except (ValidationError, ProtocolError) as exc:
                raise ValidationError(f"secure round refused: {exc}") from None
        source = p.get("source", "pca")
        kind, rnd = secure_round(str(source), str(p.get("statistic")))
        if self.allowed_kinds is not None and kind.name not in self.allowed_kinds:
            raise ValidationError(f"secure round refused: this site does not run "
                                  f"{kind.name!r} jobs (allowed: "
                                  f"{', '.join(self.allowed_kinds)})")
        tolerated = check_int(p.get("tolerated"), "tolerated", minimum=0)
        if tolerated != state.tolerated:
            raise ValidationError("secure round refused: t differs from the one shares were "
                                  "dealt for")
        contribution = rnd.contribution(task, Site(data, self.ledger_path), list(participants),
                                        tolerated)
        dropouts = check_int(p.get("dropouts", 0), "dropouts", minimum=0)
        plan = dataclasses.replace(contribution.plan, dropouts=dropouts)
        lost = len(state.order) - len(participants)
        if dropouts + lost > graph.capacity(tolerated):
            raise ValidationError(f"secure round refused: {dropouts} dropouts among "
                                  f"{len(participants)} participants ({lost} of the "
                                  f"{len(state.order)} dealers gone already) exceed the "
                                  f"{graph.capacity(tolerated)} its graph of degree "
                                  f"{graph.degree} recovers securely")
        check_plan_noise(plan, p)  # the noise it states is the one computed from public inputs
        cost = plan.cost()
        publics = {s: mask_public(state.verified[s].public_key) for s in neighbours}
        with self._lock:
            state.participants, state.dropouts, state.received = participants, dropouts, received

        def produce(rng: np.random.Generator) -> TaskResult:
            stat, n_rows = contribution.compute(rng)
            require_rows(n_rows)  # raised inside the ledger's transaction: nothing is charged
            masked = self.masked(stat, plan, state, publics, context, rng)
            return TaskResult(task.task_id, cost, {"masked": masked},
                              {"n_rows": n_rows, "statistic": plan.statistic, "source": source,
                               **contribution.metadata})

        return Release(NewCharge(cost), produce)

    def masked(self, statistic: np.ndarray, plan: SecureSumPlan, state: SumState,
               publics: Mapping[str, bytes], context: MaskContext,
               rng: np.random.Generator) -> np.ndarray:
        """Return this site's noised and masked vector (see :func:`masked_contribution`)."""
        stat = np.asarray(statistic)
        if stat.dtype != np.int64 or stat.shape != (plan.n_values,):
            raise ValidationError(f"statistic must be int64 of shape ({plan.n_values},), "
                                  f"got {stat.dtype} {stat.shape}")
        return masked_contribution(stat, plan=plan, own_id=self.identity.site_id,
                                   mask_key=state.keys.mask, mask_publics=publics,
                                   context=context, rng=rng, self_seed=state.self_seed)

    # ------------------------------------------------------------------ confirm, unmask
    def _view(self, task: Task, state: SumState) -> tuple[tuple[str, ...], tuple[str, ...]]:
        participants = _site_list(task.params, "participants")
        survivors = _site_list(task.params, "survivors")
        if participants != state.participants:
            raise ValidationError("secure round refused: the participant set differs from the "
                                  "one this site masked with")
        if not set(survivors) <= set(participants) or self.identity.site_id not in survivors:
            raise ValidationError("secure round refused: the survivors must be participants, "
                                  "this site among them")
        least = max(state.view_threshold, len(participants) - state.dropouts)
        if len(survivors) < least:
            raise ValidationError(f"secure round refused: {len(survivors)} survivors; the sum "
                                  f"needs at least {least} (the threshold, and the drops its "
                                  "noise was sized for)")
        return participants, survivors

    def _confirm(self, task: Task) -> TaskResult:
        """Sign the participant and survivor sets shown (one view per sum)."""
        context = self._context(task.params)
        state = self._state(context)
        view = self._view(task, state)
        with self._lock:
            if state.view is not None and state.view != view:
                raise ValidationError("secure round refused: this site already signed other "
                                      "participant and survivor sets for this sum")
            if state.view is None:
                state.view = view
                state.view_signature = sign_view(self.identity.signing_key, context, *view)
        return self._answer(task, {f"view_signature/{self.identity.site_id}":
                                   as_array(state.view_signature)})

    def _unmask(self, task: Task) -> TaskResult:
        """Reveal shares once enough survivors signed the view this site signed."""
        context = self._context(task.params)
        state = self._state(context)
        view = self._view(task, state)
        if state.view != view:
            raise ValidationError("secure round refused: the participant and survivor sets "
                                  "differ from those this site signed")
        participants, survivors = view
        signers = sorted(name.split("/", 1)[1] for name in task.arrays
                         if name.startswith("view_signature/"))
        bad = [s for s in signers if s not in survivors or not verify_view(
            state.verified[s].certificate_pem, as_bytes(task.arrays, f"view_signature/{s}"),
            context, participants, survivors)]
        if bad:
            raise ValidationError(f"secure round refused: the view signatures of {bad} do not "
                                  "sign the sets this site signed (the coordinator showed "
                                  "sites different sets)")
        if len(signers) < state.view_threshold:
            raise ValidationError(f"secure round refused: {len(signers)} survivors signed the "
                                  f"sets; revealing needs {state.view_threshold}")
        me = self.identity.site_id
        dropped = [s for s in participants if s not in survivors]
        with self._lock:
            state.reveals.allow(survivors, dropped)
        arrays = {f"self/{v}": as_array(state.own_self_share if v == me
                                         else state.received[v][0])
                  for v in survivors if v == me or v in state.received}
        arrays.update({f"key/{u}": as_array(state.received[u][1]) for u in dropped
                       if u in state.received})
        log.info("task=%s revealed %d shares (self-mask shares of survivors, key shares of "
                 "dropped sites)", task.task_id, len(arrays))
        return self._answer(task, arrays)
