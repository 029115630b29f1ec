"""One task of a round as the dispatcher sends it: what travels, and how answers are checked."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpfed.common.jobs.contract import DEFAULT_MAX_RESULT_BYTES, Budget
from dpfed.common.transport.protocol import TaskResult


@dataclass(frozen=True)
class OutgoingTask:
    """A task for every site of a round.

    Its name (the task id's tail), kind, budget, payload, the largest answer accepted and the
    check every answer must pass.
    """

    round_name: str
    kind: str
    budget: Budget
    params: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray]
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    check: Callable[[TaskResult], None] | None = None
    #: Arrays for one site only (site id -> arrays added to its copy of the task).
    site_arrays: Mapping[str, Mapping[str, np.ndarray]] = field(default_factory=dict)
