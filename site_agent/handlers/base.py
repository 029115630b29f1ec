"""The contract between the task runner and the per-kind handlers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
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
    #: Local-only tasks (e.g. evaluating a synthetic table against the site's rows): the
    #: runner calls this with the site's own directory; nothing computed on real rows is
    #: released, so nothing is charged. ``cost`` must then be zero and ``release`` must return
    #: a result without arrays.
    local_output: Callable[[Path], str] | None = None


@dataclass(frozen=True)
class PreparedContinuation:
    """A step of a release that was already charged (e.g. the next batch of an SVT session).

    The runner refuses it unless the ledger holds the charge of ``charged_by`` (the task that
    opened the session and paid for the whole stream); ``run`` draws the step's noise and
    returns the released bytes, and is responsible for its own durability and replay (see
    :mod:`dpfed.site_agent.svt_sessions`).
    """

    charged_by: str
    run: Callable[[np.random.Generator], bytes]


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

    def for_site(self, ledger_path: Path) -> TaskHandler:
        """Return the handler bound to one site's state directory (default: ``self``).

        Handlers that keep durable state beside the ledger (``svt``) return a bound copy.
        """
        del ledger_path
        return self

    @abstractmethod
    def prepare(self, task: Task, data: DataAccess) -> PreparedRelease | PreparedContinuation:
        """Validate ``task``, compute the exact statistic, and return the pending release.

        Raises
        ------
        dpfed.common.errors.ValidationError
            For invalid parameters (the site refuses the task; nothing is charged).
        """
