"""Site step of secure aggregation: sign an ephemeral key, then send a noised and masked sum.

Two stages of the kind ``secagg`` (docs/secure-aggregation.md has the protocol and its
privacy argument). ``keys`` signs a fresh X25519 key for the sum task named in the
parameters with the site's certificate key and returns it with the site's policy; nothing is
read or charged, and a retried keys task gets the same key back (held in memory only: a site
restarted after the key exchange refuses the sum, and the coordinator retries with fresh
keys). ``contribute`` finds the round the task names (``source``, ``statistic``), lets it
recompute the plan and bind its exact statistic, verifies every participant's signed key
and that every participant is a listed, unrevoked site (``SecureAggregationPolicy.check_round``),
and adds this site's Skellam share ``mu / (n - t)`` and its pairwise masks; the ledger charges
the pooled guarantee first.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from dpfed.common.errors import ValidationError
from dpfed.common.jobs.contract import DataAccess, Free, NewCharge, Release, Site
from dpfed.common.jobs.registry import secure_round
from dpfed.common.jobs.release import require_rows
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.secagg.keys import SignedKey, generate_ephemeral, sign_ephemeral
from dpfed.common.secagg.masking import MaskContext
from dpfed.common.secagg.messages import signed_key_arrays, signed_key_from_arrays
from dpfed.common.secagg.policy import SecureAggregationPolicy
from dpfed.common.secagg.secure_sum import SecureSumPlan, site_contribution
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


class SecureAggregationHandler(TaskHandler):
    """The ``secagg`` kind: the ``keys`` and ``contribute`` stages of one secure sum."""

    def __init__(self, identity: SiteIdentity, policy: SecureAggregationPolicy,
                 allowed_kinds: tuple[str, ...] | None = None) -> None:
        self.identity = identity
        self.policy = policy
        #: The site's allowed job kinds; a round of another kind is refused (None: any).
        self.allowed_kinds = allowed_kinds
        self._pending: OrderedDict[str, tuple[X25519PrivateKey, SignedKey]] = OrderedDict()
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
        """Prepare the ``keys`` stage (free) or the ``contribute`` stage (charged)."""
        if self.policy.mode == "off":
            raise ValidationError("this site's policy does not take part in secure aggregation")
        stage = task.params.get("stage")
        if stage == "keys":
            answer = self._keys(task)
            return Release(Free(), lambda _rng: answer)
        if stage != "contribute":
            raise ValidationError("stage must be 'keys' or 'contribute' for a secagg task")
        return self._contribute(task, data)

    # ------------------------------------------------------------------ keys (no data)
    def _keys(self, task: Task) -> TaskResult:
        """Sign a fresh ephemeral key for the named sum task (the same one on a retry)."""
        context = self._context(task.params)
        with self._lock:
            held = self._pending.get(context.task_id)
            if held is None:
                key, public = generate_ephemeral()
                signed = sign_ephemeral(site_id=self.identity.site_id, public_key=public,
                                        context=context, signing_key=self.identity.signing_key,
                                        certificate_pem=self.identity.certificate_pem)
                self._pending[context.task_id] = (key, signed)
                while len(self._pending) > _MAX_PENDING:
                    self._pending.popitem(last=False)
                held = (key, signed)
        log.info("task=%s signed an ephemeral key for %s", task.task_id, context.task_id)
        return TaskResult(task.task_id, PrivacyCost(0.0, 0.0, 0.0, "secagg-keys"),
                          signed_key_arrays(held[1]),
                          {"min_participants": self.policy.min_participants,
                           "tolerated": self.policy.tolerated, "mode": self.policy.mode})

    @staticmethod
    def _context(params: Mapping[str, Any]) -> MaskContext:
        job_id, round_name, sum_task = (params.get("job_id"), params.get("sum_round"),
                                        params.get("sum_task_id"))
        if not all(isinstance(v, str) and 0 < len(v) <= 200 for v in
                   (job_id, round_name, sum_task)):
            raise ValidationError("a secure round names its job_id, sum_round and sum_task_id")
        return MaskContext(str(job_id), str(round_name), str(sum_task))

    # ------------------------------------------------------------------ contribute
    def _contribute(self, task: Task, data: DataAccess) -> Release:
        """Verify every key, let the round plan and bind its statistic, price the release."""
        p = task.params
        context = MaskContext(task.job_id, str(p.get("sum_round", "")), task.task_id)
        with self._lock:
            held = self._pending.get(task.task_id)
        if held is None:
            raise ValidationError("no ephemeral key for this secure round (the site restarted "
                                  "after the key exchange); retry the round with fresh keys")
        participants = p.get("participants")
        if not isinstance(participants, list) or not all(isinstance(s, str)
                                                         for s in participants):
            raise ValidationError("participants must be a list of site ids")
        source = p.get("source", "pca")
        kind, rnd = secure_round(str(source), str(p.get("statistic")))
        if self.allowed_kinds is not None and kind.name not in self.allowed_kinds:
            raise ValidationError(f"secure round refused: this site does not run "
                                  f"{kind.name!r} jobs (allowed: "
                                  f"{', '.join(self.allowed_kinds)})")
        contribution = rnd.contribution(task, Site(data, self.ledger_path), participants,
                                        check_int(p.get("tolerated"), "tolerated", minimum=0))
        plan = contribution.plan
        try:
            signed = {s: signed_key_from_arrays(task.arrays, s) for s in plan.participants}
        except ValidationError as exc:
            raise ValidationError(f"secure round refused: {exc}") from None
        if signed.get(self.identity.site_id) != held[1]:
            raise ValidationError("secure round refused: the relayed key of this site is not "
                                  "the one it signed")

        if plan.tolerated < self.policy.tolerated:
            raise ValidationError(f"secure round refused: noise sized for {plan.tolerated} "
                                  f"colluding parties; this site's policy requires "
                                  f"{self.policy.tolerated}")
        cost = plan.cost()
        try:  # every peer is verified, listed and unrevoked before the ledger is touched
            self.policy.check_round(plan.participants, signed, context=context,
                                    ca=self.identity.ca)
        except ValidationError as exc:
            log.warning("task=%s %s", task.task_id, exc)
            raise

        def produce(rng: np.random.Generator) -> TaskResult:
            stat, n_rows = contribution.compute(rng)
            require_rows(n_rows)  # raised inside the ledger's transaction: nothing is charged
            masked = self.masked(stat, plan, held[0], signed, context, rng)
            return TaskResult(task.task_id, cost, {"masked": masked},
                              {"n_rows": n_rows, "statistic": plan.statistic, "source": source,
                               **contribution.metadata})

        return Release(NewCharge(cost), produce)

    def masked(self, statistic: np.ndarray, plan: SecureSumPlan, own_key: X25519PrivateKey,
               signed: Mapping[str, SignedKey], context: MaskContext,
               rng: np.random.Generator) -> np.ndarray:
        """Return this site's noised and masked vector (see :func:`site_contribution`)."""
        return site_contribution(statistic, plan=plan, own_id=self.identity.site_id,
                                 own_key=own_key, signed_keys=signed, context=context,
                                 ca=self.identity.ca,
                                 min_participants=self.policy.min_participants,
                                 tolerated=self.policy.tolerated, rng=rng)
