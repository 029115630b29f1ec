"""What a ``secagg`` contribution is made of: a named source of the site's integer statistic.

The ``contribute`` stage of :mod:`dpfed.site_agent.handlers.secagg` is the same for every
secure sum — verify the peers' keys, enforce the site's policy, charge, add the Skellam share and
the masks — except for *what* is summed. A :class:`ContributionSource` supplies that part: from
the task's public parameters it builds the plan (sensitivities and noise, recomputed at the
site) and a function computing the exact int64 statistic from the site's data. Sources are
registered by name in ``CONTRIBUTION_SOURCES`` (the task parameter ``source``, ``"pca"`` when
absent); each names the job kind whose permission it needs in the site's ``allowed_jobs``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpfed.common.secagg.secure_sum import SecureSumPlan
from dpfed.common.transport.protocol import Task
from dpfed.site_agent.handlers.base import DataAccess

__all__ = ["Contribution", "ContributionBuilder", "ContributionSource"]


@dataclass(frozen=True)
class Contribution:
    """One site's part of a secure sum, before noise and masks.

    Attributes
    ----------
    plan : SecureSumPlan
        The plan the site recomputed from public inputs (its noise share follows from it).
    compute : callable
        ``compute(rng) -> (statistic, n_rows)``: the exact int64 statistic of length
        ``plan.n_values`` and the number of rows it was computed from. Runs inside the
        ledger's transaction (a raised error charges nothing).
    metadata : mapping
        Extra public fields for the task result (e.g. the strategy digest).
    """

    plan: SecureSumPlan
    compute: Callable[[np.random.Generator], tuple[np.ndarray, int]]
    metadata: Mapping[str, Any] = field(default_factory=dict)


#: ``build(task, data, participants, tolerated) -> Contribution``; raises ValidationError.
ContributionBuilder = Callable[[Task, DataAccess, list[str], int], Contribution]


@dataclass(frozen=True)
class ContributionSource:
    """A registered source: its builder and the job kind it serves.

    The site refuses a source whose job kind is not among its allowed jobs.
    """

    job_kind: str
    build: ContributionBuilder
