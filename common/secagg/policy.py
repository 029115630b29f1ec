"""A site's policy on secure aggregation (``[policy]`` in site.toml) and who it sums with.

The site advertises it in its hello as a one-line summary (:meth:`SecureAggregationPolicy.
summary`); the coordinator and ``dpfed <kind> --plan`` read it back with :meth:`from_summary`.
Besides the mode, the minimum number of participants and the tolerated colluders, the policy
holds the site's copy of the federation's lists (``[tls] revocation_list``: the
``revoked.toml`` that ``dpfed certs`` writes into every site kit, with the revoked certificates
and the federation's site ids). :meth:`SecureAggregationPolicy.check_round` refuses a round
before anything is charged unless every participant is a listed, unrevoked site with a valid
signed key and there are at least ``min_participants`` of them: a coordinator holding the
kits of revoked sites (or a certificate the CA issued outside the list) cannot fill a round
with parties whose noise shares and masks it knows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dpfed.common.errors import AuthenticationError, ConfigError, ValidationError
from dpfed.common.validation import check_choice, check_int

if TYPE_CHECKING:
    from cryptography import x509

    from dpfed.common.secagg.keys import SignedKey
    from dpfed.common.secagg.masking import MaskContext
    from dpfed.common.transport.access import WatchedAccessList

SECURE_MODES: tuple[str, ...] = ("off", "allowed", "required")


@dataclass(frozen=True)
class SecureAggregationPolicy:
    """What a site accepts of secure rounds (``[policy]`` in site.toml).

    Attributes
    ----------
    mode : {"off", "allowed", "required"}
        ``required`` also refuses the site-level release of jobs that offer a secure mode.
    min_participants : int
        Refuse a round with fewer verified participants (the coordinator must not shrink the
        honest set by choosing whom to include).
    tolerated : int
        How many other parties (the coordinator counted) may collude; noise shares are sized
        so the honest ones alone meet the target.
    tolerated_dropouts : int
        How many participants may vanish after dealing their shares with the sum still
        completing (``secure_tolerated_dropouts``); every site then adds
        ``mu / (n - t - d)``, so the honest survivors of the worst case carry ``mu``.
    federation_list : Path or None
        The site's ``revoked.toml`` (``[tls] revocation_list``): read at the first secure
        round and again whenever it changes (the agent's coordinator check reads it at
        start-up). Without it, or while it cannot be read, every secure round is refused: the
        site cannot tell a federation site from a revoked or unlisted certificate.
    """

    mode: str = "allowed"
    min_participants: int = 2
    tolerated: int = 1
    federation_list: Path | None = None
    tolerated_dropouts: int = 0
    _watched: list[WatchedAccessList] = field(default_factory=list, init=False, repr=False,
                                              compare=False)

    def summary(self) -> str:
        """One line for ``dpfed sites``: the mode, the minimum participants, t (and d if > 0)."""
        drops = f", d={self.tolerated_dropouts}" if self.tolerated_dropouts else ""
        return f"{self.mode}, min {self.min_participants} sites, t={self.tolerated}{drops}"

    @classmethod
    def from_summary(cls, text: str) -> SecureAggregationPolicy:
        """Read back a :meth:`summary` ("" -- a site that reports none -- is ``off``).

        Raises
        ------
        ValidationError
            The text is not a summary this module wrote.
        """
        if not text:
            return cls("off")
        parts = [p.strip() for p in text.split(",")]
        if (len(parts) not in (3, 4) or parts[1][:4] != "min " or parts[1][-6:] != " sites"
                or parts[2][:2] != "t=" or (len(parts) == 4 and parts[3][:2] != "d=")):
            raise ValidationError(f"not a secure-aggregation policy summary: {text[:120]!r}")
        try:
            drops = int(parts[3][2:]) if len(parts) == 4 else 0
            return cls(parts[0], int(parts[1][4:-6]), int(parts[2][2:]),
                       tolerated_dropouts=drops)
        except ValueError:
            raise ValidationError(f"not a secure-aggregation policy summary: "
                                  f"{text[:120]!r}") from None

    def __post_init__(self) -> None:
        check_choice(self.mode, "secure_aggregation", SECURE_MODES)
        check_int(self.min_participants, "secure_min_participants", minimum=2)
        check_int(self.tolerated, "secure_tolerated_colluders", minimum=0)
        check_int(self.tolerated_dropouts, "secure_tolerated_dropouts", minimum=0)
        if self.tolerated >= self.min_participants:
            raise ValidationError(
                f"secure_tolerated_colluders ({self.tolerated}) must be smaller than "
                f"secure_min_participants ({self.min_participants})")

    def check_round(self, participants: Sequence[str], signed: Mapping[str, SignedKey], *,
                    context: MaskContext, ca: x509.Certificate) -> None:
        """Refuse a round unless every participant is verified, listed and not revoked.

        Parameters
        ----------
        participants : sequence of str
            The plan's participants (this site included).
        signed : mapping of str to SignedKey
            The signed keys the coordinator relayed, one per participant.
        context, ca
            The round's mask context and the federation CA.

        Raises
        ------
        ValidationError
            ``secure round refused: ...`` naming every revoked, unlisted or unverifiable
            participant, or the shortfall against ``min_participants``.
        """
        from dpfed.common.secagg.keys import verify_participants

        if self.federation_list is None:
            raise ValidationError(
                "secure round refused: this site has no list of the federation's sites and "
                "revoked certificates (set [tls] revocation_list to the kit's revoked.toml)")
        try:
            if not self._watched:  # read at the first round, then whenever it changes
                from dpfed.common.transport.access import WatchedAccessList

                self._watched.append(WatchedAccessList(self.federation_list))
            federation = self._watched[0].current()
        except ConfigError as exc:
            raise ValidationError(f"secure round refused: {exc}") from None
        if not federation.sites:
            raise ValidationError(
                f"secure round refused: {self.federation_list} lists no federation sites; "
                "copy the current revoked.toml from the federation directory ('dpfed certs' "
                "writes the site list into it)")
        try:
            verify_participants({s: signed[s] for s in participants}, context=context, ca=ca,
                                federation=federation)
        except AuthenticationError as exc:
            raise ValidationError(f"secure round refused: {exc}") from None
        if len(participants) < self.min_participants:
            raise ValidationError(f"secure round refused: {len(participants)} participants; "
                                  f"this site's policy requires at least "
                                  f"{self.min_participants}")
