"""Site step of secure aggregation: sign an ephemeral key, then send a noised and masked sum.

Two stages of the kind ``secagg`` (see :mod:`dpfed.common.secagg.secure_sum` for the protocol
and its privacy argument):

``keys``
    Make a fresh X25519 key pair for the sum task named in the parameters, sign its public half
    with this site's certificate key, and return it with the certificate and the site's policy
    (minimum participants, tolerated colluders). Nothing here depends on the data, so nothing is
    charged; a retried keys task gets the same key back (kept in memory, never on disk — a site
    restarted after the key exchange refuses the sum, and the coordinator retries the round with
    fresh keys).
``contribute``
    Verify every participant's signed key against the federation CA, let the task's *source*
    (parameter ``source``, default ``pca``; :data:`SOURCES`) validate its parameters and state
    the public dimension and row bound, recompute the plan (bound, sensitivity, noise variance)
    from those, the public scale and (epsilon, delta) — so the noise never depends on a number
    the site cannot check — compute the source's exact integer statistic, add this site's
    Skellam share and its pairwise masks. Charged to the ledger with the pooled guarantee; the
    ledger's mechanism name records the mode, the number of participants and the tolerated
    colluders.

Privacy
-------
Replace-one at this site. Sources (:mod:`dpfed.site_agent.handlers.secure_sources`): ``pca``
maps rows with the PCA feature map into the unit ball (clip norm from the task) and clips them
to the public radius ``row_norm`` (centring happens at the coordinator, from a secure row sum);
``synth_counts`` and ``synth_latent`` (:mod:`dpfed.site_agent.handlers.synth_secure`) give the
synth job's exact per-column counts (L2 ``sqrt(2 C)``, L1 ``2 C``) and its unit-ball latent
rows. :func:`dpfed.common.secagg.secure_sum.plan_from_scale` derives the sensitivity of the
pooled integer statistic and calibrates the Skellam variance; this site adds ``mu / (n - t)``.
"""

from __future__ import annotations

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

from dpfed.common.errors import AuthenticationError, DataError, ProtocolError, ValidationError
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.secagg.keys import (
    SignedKey,
    generate_ephemeral,
    sign_ephemeral,
    verify_signed_key,
)
from dpfed.common.secagg.masking import MaskContext
from dpfed.common.secagg.messages import signed_key_arrays, signed_key_from_arrays
from dpfed.common.secagg.secure_sum import plan_from_scale, site_contribution
from dpfed.common.transport.certs import (
    parse_certificates,
    parse_private_key,
    principal_from_certificate,
    read_pem_file,
)
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.common.validation import check_choice, check_int, check_positive
from dpfed.site_agent.handlers.base import DataAccess, PreparedRelease, TaskHandler
from dpfed.site_agent.handlers.secure_sources import PCASource, SecureSource
from dpfed.site_agent.handlers.synth_secure import SynthCountsSource, SynthLatentSource
from dpfed.site_agent.secure_policy import SecureAggregationPolicy

log = logging.getLogger(__name__)

#: Ephemeral keys kept for sum tasks not yet contributed (oldest evicted first).
_MAX_PENDING = 64

#: source name (the contribute task's ``source`` parameter; default ``pca``) -> what the
#: site sums (:mod:`dpfed.site_agent.handlers.secure_sources`).
SOURCES: dict[str, SecureSource] = {s.name: s for s in (
    PCASource(), SynthCountsSource(), SynthLatentSource())}

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

    kind = "secagg"

    def __init__(self, identity: SiteIdentity, policy: SecureAggregationPolicy) -> None:
        self.identity = identity
        self.policy = policy
        self._pending: OrderedDict[str, tuple[X25519PrivateKey, SignedKey]] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ keys (no data)
    def responds_without_data(self, task: Task) -> bool:
        """Return True for the ``keys`` stage (no data read, nothing charged)."""
        return task.params.get("stage") == "keys"

    def respond(self, task: Task) -> TaskResult:
        """Answer the ``keys`` stage: sign a fresh ephemeral key for the named sum task."""
        if self.policy.mode == "off":
            raise ValidationError("this site's policy does not take part in secure aggregation")
        if task.params.get("stage") != "keys":
            raise ValidationError("a secagg task without data must be the 'keys' stage")
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
        log.info("[SecureAggregationHandler.keys] task=%s signed an ephemeral key for %s",
                 task.task_id, context.task_id)
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
    def prepare(self, task: Task, data: DataAccess) -> PreparedRelease:
        """Prepare the ``contribute`` stage: verify every key, plan, and price the release."""
        p = task.params
        if p.get("stage") != "contribute":
            raise ValidationError("stage must be 'contribute' for a charged secagg task")
        if self.policy.mode == "off":
            raise ValidationError("this site's policy does not take part in secure aggregation")
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
        source = SOURCES[check_choice(p.get("source", "pca"), "source", tuple(SOURCES))]
        statistic = check_choice(p.get("statistic"), "statistic", source.statistics)
        given = source.open(task, data, statistic)  # validates the source's parameters
        sent_norm = check_positive(p.get("row_norm", given.row_norm), "row_norm")
        if abs(sent_norm - given.row_norm) > 1e-12 * given.row_norm:
            raise ValidationError(f"secure round refused: the plan's row_norm {sent_norm!r} is "
                                  f"not the {given.row_norm!r} of source {source.name!r}")
        plan = plan_from_scale(statistic, dim=given.dim,
                               scale=check_positive(p.get("scale"), "scale"),
                               row_norm=given.row_norm, epsilon=task.epsilon, delta=task.delta,
                               participants=participants,
                               tolerated=check_int(p.get("tolerated"), "tolerated", minimum=0))
        try:
            signed = {s: signed_key_from_arrays(task.arrays, s) for s in plan.participants}
        except ValidationError as exc:
            raise ValidationError(f"secure round refused: {exc}") from None
        if signed.get(self.identity.site_id) != held[1]:
            raise ValidationError("secure round refused: the relayed key of this site is not "
                                  "the one it signed")
        if len(plan.participants) < self.policy.min_participants:
            raise ValidationError(f"secure round refused: {len(plan.participants)} participants; "
                                  f"this site's policy requires at least "
                                  f"{self.policy.min_participants}")
        if plan.tolerated < self.policy.tolerated:
            raise ValidationError(f"secure round refused: noise sized for {plan.tolerated} "
                                  f"colluding parties; this site's policy requires "
                                  f"{self.policy.tolerated}")
        cost = PrivacyCost(plan.calibration.epsilon, plan.calibration.delta,
                           plan.calibration.cost().rho,
                           f"secure-skellam[n={len(plan.participants)},t={plan.tolerated}]",
                           plan.calibration.l2_sensitivity, plan.share ** 0.5)
        try:  # every peer's key is checked before the ledger is touched
            for s in plan.participants:
                verify_signed_key(signed[s], context=context, ca=self.identity.ca)
        except (ProtocolError, AuthenticationError) as exc:
            log.warning("[SecureAggregationHandler.prepare] task=%s refused: %s",
                        task.task_id, exc)
            raise ValidationError(f"secure round refused: {exc}") from None

        def release(rng: np.random.Generator) -> TaskResult:
            stat, n_rows = given.compute(plan, rng)
            if n_rows == 0:  # raised inside the ledger's transaction: nothing is charged
                raise DataError("the site has no valid rows to compute a summary from")
            masked = site_contribution(stat, plan=plan, own_id=self.identity.site_id,
                                       own_key=held[0], signed_keys=signed, context=context,
                                       ca=self.identity.ca,
                                       min_participants=self.policy.min_participants,
                                       tolerated=self.policy.tolerated, rng=rng)
            return TaskResult(task.task_id, cost, {"masked": masked},
                              {"n_rows": n_rows, "statistic": statistic,
                               "source": source.name})

        return PreparedRelease(cost, release)
