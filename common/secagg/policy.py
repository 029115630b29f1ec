"""A site's policy on secure aggregation (``[policy]`` in site.toml); no heavy imports.

The site advertises it in its hello as a one-line summary (:meth:`SecureAggregationPolicy.
summary`); the coordinator and ``dpfed <kind> --plan`` read it back with :meth:`from_summary`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpfed.common.errors import ValidationError
from dpfed.common.validation import check_choice, check_int

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
    """

    mode: str = "allowed"
    min_participants: int = 2
    tolerated: int = 1

    def summary(self) -> str:
        """One line for ``dpfed sites``: the mode, the minimum participants and t."""
        return f"{self.mode}, min {self.min_participants} sites, t={self.tolerated}"

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
        if (len(parts) != 3 or parts[1][:4] != "min " or parts[1][-6:] != " sites"
                or parts[2][:2] != "t="):
            raise ValidationError(f"not a secure-aggregation policy summary: {text[:120]!r}")
        try:
            return cls(parts[0], int(parts[1][4:-6]), int(parts[2][2:]))
        except ValueError:
            raise ValidationError(f"not a secure-aggregation policy summary: "
                                  f"{text[:120]!r}") from None

    def __post_init__(self) -> None:
        check_choice(self.mode, "secure_aggregation", SECURE_MODES)
        check_int(self.min_participants, "secure_min_participants", minimum=2)
        check_int(self.tolerated, "secure_tolerated_colluders", minimum=0)
        if self.tolerated >= self.min_participants:
            raise ValidationError(
                f"secure_tolerated_colluders ({self.tolerated}) must be smaller than "
                f"secure_min_participants ({self.min_participants})")
