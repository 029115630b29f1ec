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

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.secagg.secure_sum import (
    SecureSumPlan,
    integer_gram_upper,
    integer_row_sum,
    plan_from_scale,
)
from dpfed.common.transport.protocol import Task
from dpfed.common.validation import check_choice, check_positive
from dpfed.site_agent.handlers.base import DataAccess

__all__ = ["Contribution", "ContributionBuilder", "ContributionSource", "planned_contribution",
           "row_statistic"]

#: A statistic computed against a plan: ``compute(plan, rng) -> (int64 vector, n_rows)``.
PlannedCompute = Callable[[SecureSumPlan, np.random.Generator], tuple[np.ndarray, int]]


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


class ContributionBuilder(Protocol):
    """``build(task, data, participants, tolerated, site_dir=...) -> Contribution``.

    ``site_dir`` is the site's state directory (the ledger's), for sources that keep site
    secrets there (the synth job's evaluation holdout); None when the handler is unbound.
    Raises ValidationError to refuse the task (nothing charged).
    """

    def __call__(self, task: Task, data: DataAccess, participants: list[str], tolerated: int,
                 *, site_dir: Path | None = None) -> Contribution:
        """Validate the task's source parameters and build the contribution."""


@dataclass(frozen=True)
class ContributionSource:
    """A registered source: its builder and the job kind it serves.

    The site refuses a source whose job kind is not among its allowed jobs.
    """

    job_kind: str
    build: ContributionBuilder


def planned_contribution(task: Task, participants: list[str], tolerated: int, *,
                         statistics: tuple[str, ...], dim: int, row_norm: float,
                         compute: PlannedCompute) -> Contribution:
    """Recompute a gram / row-sum / counts / scores plan from public inputs; bind ``compute``.

    ``dim`` and ``row_norm`` are what the *source* states from the site's own schema and the
    task's validated parameters; the task's ``row_norm`` (what the coordinator planned with)
    must equal it, so the sensitivity the noise is calibrated for is the one the rows obey.
    The statistic must be one the source produces.
    """
    p = task.params
    statistic = check_choice(p.get("statistic"), "statistic", statistics)
    sent = check_positive(p.get("row_norm", row_norm), "row_norm")
    if abs(sent - row_norm) > 1e-12 * row_norm:
        raise ValidationError(f"secure round refused: the plan's row_norm {sent!r} is not the "
                              f"{row_norm!r} this source's rows obey")
    plan = plan_from_scale(statistic, dim=dim, scale=check_positive(p.get("scale"), "scale"),
                           row_norm=row_norm, epsilon=task.epsilon, delta=task.delta,
                           participants=participants, tolerated=tolerated)
    return Contribution(plan, lambda rng: compute(plan, rng))


def row_statistic(rows: Callable[[np.random.Generator], Iterator[np.ndarray]]
                  ) -> PlannedCompute:
    """Return a compute that streams ``rows(rng)`` into the plan's exact gram or row sum."""

    def compute(plan: SecureSumPlan, rng: np.random.Generator) -> tuple[np.ndarray, int]:
        n_rows = 0

        def counted() -> Iterator[np.ndarray]:
            nonlocal n_rows
            for x in rows(rng):
                n_rows += x.shape[0]
                yield x

        make = integer_gram_upper if plan.statistic == "gram" else integer_row_sum
        return make(counted(), plan, rng), n_rows

    return compute
