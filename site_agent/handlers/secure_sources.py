"""What a site feeds into a secure sum: the plug-in *sources* of the ``secagg`` contribute stage.

A secure sum (:mod:`dpfed.common.secagg.secure_sum`) adds the sites' exact integer statistics;
which rows or counts a site computes that statistic from depends on the job. Each job names a
*source* in the contribute task's ``source`` parameter; the source validates its part of the
task (parameters, digests, links) before anything is charged, tells the stage the public
dimension and row-norm bound the plan is recomputed from, and computes the exact statistic when
the release runs. Sources are registered in
:data:`dpfed.site_agent.handlers.secagg.SOURCES`; adding one is adding an entry there.

Privacy
-------
A source must produce exactly the statistic its plan's sensitivity assumes: rows inside the
public ball of radius ``row_norm`` for ``gram``/``row_sum`` (the fixed-point rounding then
bounds them by the plan's ``B``), or count vectors in which every row adds exactly one count
to each of ``row_norm^2`` groups for ``counts``. The noise, the masks and the ledger charge are
the contribute stage's, identical for every source.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from dpfed.common.pca.features import UnitBallMap
from dpfed.common.secagg.secure_sum import SecureSumPlan, integer_gram_upper, integer_row_sum
from dpfed.common.transport.protocol import Task
from dpfed.common.validation import check_positive
from dpfed.site_agent.handlers.base import DataAccess

#: A source's exact statistic: (int64 vector of the plan's length, number of rows read).
Compute = Callable[[SecureSumPlan, np.random.Generator], tuple[np.ndarray, int]]


@dataclass(frozen=True)
class SourceInput:
    """What a source gives the contribute stage for one validated task.

    Attributes
    ----------
    dim : int
        The plan's dimension (row length, or number of cells for counts), from the schema.
    row_norm : float
        The public bound the plan is recomputed from (see the module's Privacy section).
    compute : callable
        ``compute(plan, rng) -> (statistic, n_rows)``, run inside the ledger's transaction;
        ``rng`` is the release's generator (rounding and any random link draws).
    """

    dim: int
    row_norm: float
    compute: Compute


class SecureSource(ABC):
    """One kind of contribution to a secure sum (see the module docstring)."""

    #: The name a task gives in its ``source`` parameter.
    name: ClassVar[str]
    #: The statistics (:data:`dpfed.common.secagg.secure_sum.STATISTICS`) it can produce.
    statistics: ClassVar[tuple[str, ...]]

    @abstractmethod
    def open(self, task: Task, data: DataAccess, statistic: str) -> SourceInput:
        """Validate the task's source parameters; raise ValidationError to refuse (uncharged)."""


def row_statistic(rows: Callable[[np.random.Generator], Iterator[np.ndarray]]) -> Compute:
    """Return a :data:`Compute` that streams ``rows(rng)`` into the plan's gram or row sum."""

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


class PCASource(SecureSource):
    """The ``pca`` job's rows: the feature map's unit-ball rows, clipped to ``row_norm``.

    ``clip_norm`` (optional) is the feature map's public clip norm; ``row_norm`` the public
    radius the coordinator plans with (rows beyond it are scaled onto it).
    """

    name = "pca"
    statistics = ("gram", "row_sum")

    def open(self, task: Task, data: DataAccess, statistic: str) -> SourceInput:
        """Build the unit-ball map from the task's clip norm; rows are read at release."""
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

        return SourceInput(unit.n_features, row_norm, row_statistic(rows))
