"""Facts about the federation that every job needs: its schema and default job settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from dpfed.common.data.schema import Schema
from dpfed.common.pca.features import feature_names


@dataclass(frozen=True)
class Federation:
    """The coordinator's view of the federation.

    Attributes
    ----------
    schema : Schema
        The public schema every site must hold (compared by digest at connect time).
    min_sites : int
        Default quorum of a job.
    task_deadline_s : float
        Default deadline of one task at one site.
    allowed_sites : frozenset of str
        Site ids admitted; empty means any site with a certificate from the federation CA.
    resume_wait_s : float
        How long a job resumed after a coordinator restart waits for its quorum to reconnect.
    """

    schema: Schema
    min_sites: int = 1
    task_deadline_s: float = 600.0
    allowed_sites: frozenset[str] = field(default_factory=frozenset)
    resume_wait_s: float = 60.0

    @property
    def schema_digest(self) -> str:
        """Digest sites must match."""
        return self.schema.digest()

    @property
    def feature_names(self) -> tuple[str, ...]:
        """Numeric feature names of the schema (``dpfed.common.pca.features``)."""
        return feature_names(self.schema)

    def admits(self, site_id: str) -> bool:
        """Whether a site id may join."""
        return not self.allowed_sites or site_id in self.allowed_sites
