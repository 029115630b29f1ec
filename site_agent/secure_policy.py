"""A site's policy on secure aggregation (``[policy]`` in site.toml); no heavy imports."""

from __future__ import annotations

from dataclasses import dataclass

from dpfed.common.errors import ValidationError
from dpfed.common.validation import check_choice, check_int

SECURE_MODES: tuple[str, ...] = ("off", "allowed", "required")
#: Job kinds whose site-level release a site with ``secure_aggregation = "required"`` refuses.
SUM_KINDS: tuple[str, ...] = ("pca", "query", "synth")


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

    def __post_init__(self) -> None:
        check_choice(self.mode, "secure_aggregation", SECURE_MODES)
        check_int(self.min_participants, "secure_min_participants", minimum=2)
        check_int(self.tolerated, "secure_tolerated_colluders", minimum=0)
        if self.tolerated >= self.min_participants:
            raise ValidationError(
                f"secure_tolerated_colluders ({self.tolerated}) must be smaller than "
                f"secure_min_participants ({self.min_participants})")
