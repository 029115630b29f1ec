"""The contract between the task runner and the per-kind handlers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from dpfed.common.data.encoding import EncodedTable, EncodingReport
from dpfed.common.data.schema import Schema
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.transport.protocol import Task, TaskResult


class DataAccess(Protocol):
    """The site's table as handlers see it: the schema and a fresh chunked pass over the rows."""

    @property
    def schema(self) -> Schema:
        """The federation schema the rows were validated against."""

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        """Stream validated chunks (memory bounded by the chunk size)."""


@dataclass(frozen=True)
class PreparedRelease:
    """A release ready to happen: its cost, and the function that draws noise and builds it.

    ``release`` is called at most once, by the ledger, after the cost was checked and inside
    the transaction that records the charge and stores the result.
    """

    cost: PrivacyCost
    release: Callable[[np.random.Generator], TaskResult]


class TaskHandler(ABC):
    """One job kind's site-side step."""

    kind: ClassVar[str]

    def responds_without_data(self, task: Task) -> bool:
        """Return True if ``task`` is answered without reading data (nothing to charge).

        Such a task (e.g. the key exchange of a secure round) is answered by :meth:`respond`
        and bypasses the ledger: its answer must not depend on the site's rows.
        """
        return False

    def respond(self, task: Task) -> TaskResult:
        """Answer a task for which :meth:`responds_without_data` is True."""
        raise NotImplementedError(f"{type(self).__name__} answers every task from data")

    @abstractmethod
    def prepare(self, task: Task, data: DataAccess) -> PreparedRelease:
        """Validate ``task``, compute the exact statistic, and return the pending release.

        Raises
        ------
        dpfed.common.errors.ValidationError
            For invalid parameters (the site refuses the task; nothing is charged).
        """
