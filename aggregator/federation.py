"""Facts about the federation that every job needs: its schema and default job settings."""

from __future__ import annotations

from dataclasses import dataclass

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
    resume_wait_s : float
        How long a job resumed after a coordinator restart waits for its quorum to reconnect.

    Who may connect is decided by :mod:`dpfed.aggregator.access_control`, not here.
    """

    schema: Schema
    min_sites: int = 1
    task_deadline_s: float = 600.0
    resume_wait_s: float = 60.0

    @property
    def schema_digest(self) -> str:
        """Digest sites must match."""
        return self.schema.digest()

    @property
    def feature_names(self) -> tuple[str, ...]:
        """Numeric feature names of the schema (``dpfed.common.pca.features``)."""
        return feature_names(self.schema)
