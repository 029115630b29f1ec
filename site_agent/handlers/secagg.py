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
    Verify every participant's signed key against the federation CA and the site's copy of the
    federation's lists (no revoked or unlisted peer; :mod:`dpfed.site_agent.secure_policy`),
    recompute the plan (bound,
    sensitivity, noise variance) from the public scale and (epsilon, delta) — so the noise never
    depends on a number the site cannot check — compute the exact integer statistic of the
    task's ``source`` (:data:`CONTRIBUTION_SOURCES`: ``pca``, the default, ``query``,
    ``synth_counts``, ``synth_latent``, ``synth_pair_scores`` or ``synth_pairs``; see
    :mod:`dpfed.site_agent.handlers.secagg_sources`),
    add this site's Skellam share and its
    pairwise masks. Charged to the ledger with the pooled guarantee; the ledger's mechanism name
    records the mode, the number of participants and the tolerated colluders. A source serving
    a job kind the site does not allow is refused.

Privacy
-------
Replace-one at this site. ``pca``: rows are the PCA feature map's unit-ball rows (clip norm
from the task), clipped to the public radius ``row_norm`` (centring happens at the coordinator,
from a secure row sum); :func:`dpfed.common.secagg.secure_sum.plan_from_scale` derives the
sensitivity of the pooled integer statistic from the rounded-row bound and calibrates the
Skellam variance. ``query``: :mod:`dpfed.site_agent.handlers.secagg_query`. ``synth_counts``
and ``synth_latent``: :mod:`dpfed.site_agent.handlers.synth_secure` (the synth job's exact
per-column counts, L2 ``sqrt(2 C)`` and L1 ``2 C``, and its unit-ball latent rows);
``synth_pair_scores`` and ``synth_pairs``: the same module (floored dependence scores, per-entry
bound 2, L2 ``2 sqrt(P)``; the chosen pairs' tables, L2 ``sqrt(2 K)``). This site adds
``mu / (n - t)``.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from dpfed.common.errors import DataError, ValidationError
from dpfed.common.pca.features import UnitBallMap
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.secagg.keys import SignedKey, generate_ephemeral, sign_ephemeral
from dpfed.common.secagg.masking import MaskContext
from dpfed.common.secagg.messages import signed_key_arrays, signed_key_from_arrays
from dpfed.common.secagg.secure_sum import site_contribution
from dpfed.common.transport.certs import (
    parse_certificates,
    parse_private_key,
    principal_from_certificate,
    read_pem_file,
)
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.common.validation import check_choice, check_int, check_positive
from dpfed.site_agent.handlers.base import DataAccess, PreparedRelease, TaskHandler
from dpfed.site_agent.handlers.secagg_query import QUERY_SOURCE
from dpfed.site_agent.handlers.secagg_sources import (
    Contribution,
    ContributionSource,
    planned_contribution,
    row_statistic,
)
from dpfed.site_agent.handlers.synth_secure import (
    SYNTH_COUNTS_SOURCE,
    SYNTH_LATENT_SOURCE,
    SYNTH_PAIR_SCORES_SOURCE,
    SYNTH_PAIRS_SOURCE,
)
from dpfed.site_agent.secure_policy import SecureAggregationPolicy

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

    kind = "secagg"

    def __init__(self, identity: SiteIdentity, policy: SecureAggregationPolicy,
                 allowed_kinds: tuple[str, ...] | None = None) -> None:
        self.identity = identity
        self.policy = policy
        #: The site's allowed job kinds; a source serving another kind is refused (None: any).
        self.allowed_kinds = allowed_kinds
        self._pending: OrderedDict[str, tuple[X25519PrivateKey, SignedKey]] = OrderedDict()
        self._lock = threading.Lock()
        #: The site's state directory (the ledger's), set by :meth:`for_site`; sources that
        #: keep site secrets there (the synth evaluation holdout) read it.
        self.state_dir: Path | None = None

    def for_site(self, ledger_path: Path) -> TaskHandler:
        """Return a copy bound to the directory of ``ledger_path`` (pending keys shared)."""
        bound = copy.copy(self)
        bound.state_dir = Path(ledger_path).parent
        return bound

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
        source = check_choice(p.get("source", "pca"), "source", tuple(CONTRIBUTION_SOURCES))
        registered = CONTRIBUTION_SOURCES[source]
        if self.allowed_kinds is not None and registered.job_kind not in self.allowed_kinds:
            raise ValidationError(f"secure round refused: this site does not run "
                                  f"{registered.job_kind!r} jobs (allowed: "
                                  f"{', '.join(self.allowed_kinds)})")
        contribution = registered.build(task, data, participants,
                                        check_int(p.get("tolerated"), "tolerated", minimum=0),
                                        site_dir=self.state_dir)
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
        cost = PrivacyCost(plan.calibration.epsilon, plan.calibration.delta,
                           plan.calibration.cost().rho,
                           f"secure-skellam[n={len(plan.participants)},t={plan.tolerated}]",
                           plan.calibration.l2_sensitivity, plan.share ** 0.5)
        try:  # every peer is verified, listed and unrevoked before the ledger is touched
            self.policy.check_round(plan.participants, signed, context=context,
                                    ca=self.identity.ca)
        except ValidationError as exc:
            log.warning("[SecureAggregationHandler.prepare] task=%s %s", task.task_id, exc)
            raise

        def release(rng: np.random.Generator) -> TaskResult:
            stat, n_rows = contribution.compute(rng)
            if n_rows == 0:  # raised inside the ledger's transaction: nothing is charged
                raise DataError("the site has no valid rows to compute a summary from")
            masked = site_contribution(stat, plan=plan, own_id=self.identity.site_id,
                                       own_key=held[0], signed_keys=signed, context=context,
                                       ca=self.identity.ca,
                                       min_participants=self.policy.min_participants,
                                       tolerated=self.policy.tolerated, rng=rng)
            return TaskResult(task.task_id, cost, {"masked": masked},
                              {"n_rows": n_rows, "statistic": plan.statistic, "source": source,
                               **contribution.metadata})

        return PreparedRelease(cost, release)


def pca_contribution(task: Task, data: DataAccess, participants: list[str],
                     tolerated: int, *, site_dir: Path | None = None) -> Contribution:
    """Build the ``pca`` source: the exact integer Gram or row sum of the feature map's rows.

    Rows are the unit-ball rows of :class:`dpfed.common.pca.features.UnitBallMap` (clip norm
    from the task), scaled onto the public radius ``row_norm`` where longer, and rounded into
    the plan's ball.
    """
    del site_dir  # no site state: the statistic depends on the task and the rows only
    unit = UnitBallMap(data.schema, clip_norm=task.params.get("clip_norm"))
    row_norm = check_positive(task.params.get("row_norm", 1.0), "row_norm")

    def rows(_rng: np.random.Generator) -> Iterator[np.ndarray]:
        for table, _report in data.iter_chunks():
            x, _clipped = unit.transform(table)
            norms = np.linalg.norm(x, axis=1)
            over = norms > row_norm
            if np.any(over):
                x[over] *= (row_norm / norms[over])[:, None]
            yield x

    return planned_contribution(task, participants, tolerated, statistics=("gram", "row_sum"),
                                dim=unit.n_features, row_norm=row_norm,
                                compute=row_statistic(rows))


#: ``source`` name -> what a contribution sums (the task parameter; ``"pca"`` when absent).
CONTRIBUTION_SOURCES: dict[str, ContributionSource] = {
    "pca": ContributionSource("pca", pca_contribution),
    "query": QUERY_SOURCE,
    "synth_counts": SYNTH_COUNTS_SOURCE,
    "synth_latent": SYNTH_LATENT_SOURCE,
    "synth_pair_scores": SYNTH_PAIR_SCORES_SOURCE,
    "synth_pairs": SYNTH_PAIRS_SOURCE,
}
