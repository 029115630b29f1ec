"""What the rounds of every kind share at a site: job parameters, releases, contributions.

A site-level task carries the job's canonical parameters beside the round's own keys; a
secure contribution carries the public part of the sum's plan, which the site recomputes
from its own schema and the round's stated bound (:func:`planned_contribution`), so its noise
never depends on a number it cannot check.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np

from dpfed import __version__
from dpfed.common.errors import DataError, ValidationError
from dpfed.common.jobs.contract import Contribution, NewCharge, Release, Site
from dpfed.common.jobs.params import Params
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.secagg.secure_sum import (
    SecureSumPlan,
    integer_gram_upper,
    integer_row_sum,
    plan_from_scale,
)
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.common.validation import check_choice, check_positive

P = TypeVar("P", bound=Params)

#: ``compute(plan, rng) -> (int64 statistic, n_rows)`` against a plan the site recomputed.
PlannedCompute = Callable[[SecureSumPlan, np.random.Generator], tuple[np.ndarray, int]]


def job_params(cls: type[P], task: Task, site: Site, round_keys: Collection[str]) -> P:
    """Parse the job's parameters a site-level task carries beside ``round_keys``.

    A job that runs with secure aggregation has no site-level release: such a task is refused
    (its rounds are secure sums, task kind ``secagg``).
    """
    raw = {k: v for k, v in task.params.items() if k not in round_keys}
    params = cls.parse(raw, site.data.schema)
    if params.secure:
        raise ValidationError(f"this job runs with --aggregation secure: its rounds are secure "
                              f"sums (kind 'secagg'), so a site-level {cls.kind} release of it "
                              "is refused")
    return params


def require_rows(n_rows: int) -> None:
    """Refuse a release computed from no rows (DataError: its details stay in the site's log)."""
    if n_rows == 0:
        raise DataError("the site has no valid rows to compute a summary from")


def noisy_release(task: Task, cost: PrivacyCost,
                  arrays: Callable[[np.random.Generator], Mapping[str, np.ndarray]],
                  metadata: Mapping[str, Any]) -> Release:
    """Return a charged release: ``arrays(rng)`` (which draws the noise) with ``metadata``.

    Every answer also names the software version that produced it.
    """
    def produce(rng: np.random.Generator) -> TaskResult:
        return TaskResult(task.task_id, cost, dict(arrays(rng)),
                          {**metadata, "software_version": __version__})

    return Release(NewCharge(cost), produce)


def planned_contribution(task: Task, participants: list[str], tolerated: int, *,
                         statistic: str, dim: int, row_norm: float,
                         compute: PlannedCompute) -> Contribution:
    """Recompute a sum's plan from public inputs; bind ``compute`` to it.

    ``dim`` and ``row_norm`` are what the round states from the site's own schema and the
    task's validated parameters; the task's ``row_norm`` (what the coordinator planned with)
    must equal it, so the sensitivity the noise is calibrated for is the one the rows obey.
    """
    p = task.params
    check_choice(p.get("statistic"), "statistic", (statistic,))
    sent = check_positive(p.get("row_norm", row_norm), "row_norm")
    if abs(sent - row_norm) > 1e-12 * row_norm:
        raise ValidationError(f"secure round refused: the plan's row_norm {sent!r} is not the "
                              f"{row_norm!r} this source's rows obey")
    plan = plan_from_scale(statistic, dim=dim, scale=check_positive(p.get("scale"), "scale"),
                           row_norm=row_norm, epsilon=task.epsilon, delta=task.delta,
                           participants=participants, tolerated=tolerated)
    return Contribution(plan, lambda rng: compute(plan, rng))


def rows_statistic(rows: Callable[[np.random.Generator], Iterator[np.ndarray]],
                   clip_to: float | None = None) -> PlannedCompute:
    """Return a compute that streams ``rows(rng)`` into the plan's exact Gram or row sum.

    With ``clip_to``, rows longer than that are scaled onto its sphere first; without, a row
    outside the plan's public bound is refused by the rounding (never summed).
    """

    def compute(plan: SecureSumPlan, rng: np.random.Generator) -> tuple[np.ndarray, int]:
        n_rows = 0

        def counted() -> Iterator[np.ndarray]:
            nonlocal n_rows
            for x in rows(rng):
                if clip_to is not None:
                    norms = np.linalg.norm(x, axis=1)
                    over = norms > clip_to
                    if np.any(over):
                        x[over] *= (clip_to / norms[over])[:, None]
                n_rows += x.shape[0]
                yield x

        make = integer_gram_upper if plan.statistic == "gram" else integer_row_sum
        return make(counted(), plan, rng), n_rows

    return compute
