"""The contract between the task runner and what answers a task kind at the site."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from dpfed.common.jobs.contract import DataAccess, Release, Site
from dpfed.common.jobs.registry import site_round
from dpfed.common.transport.protocol import Task


class TaskHandler(ABC):
    """Answers the tasks of one task kind at a site."""

    def for_site(self, ledger_path: Path) -> TaskHandler:
        """Return the handler bound to one site's state directory (default: ``self``)."""
        del ledger_path
        return self

    @abstractmethod
    def prepare(self, task: Task, data: DataAccess) -> Release:
        """Validate ``task``, compute the exact statistic, and return the pending release.

        Raises
        ------
        dpfed.common.errors.ValidationError
            For invalid parameters (the site refuses the task; nothing is charged).
        """


class RoundsHandler(TaskHandler):
    """A task kind answered by the rounds of the registered job kinds.

    The round that answers a task is the registry's (:func:`dpfed.common.jobs.registry.
    site_round`); it reads the site's table and, bound with :meth:`for_site`, the state kept
    beside its ledger (SVT sessions, the evaluation holdout's secret).
    """

    def __init__(self, ledger_path: Path | None = None) -> None:
        self.ledger_path = ledger_path
        self._kept: dict[str, Any] = {}  # what rounds keep open at this site (a store)

    def for_site(self, ledger_path: Path) -> TaskHandler:
        """Return a copy bound to the site whose ledger is ``ledger_path``."""
        return RoundsHandler(Path(ledger_path))

    def prepare(self, task: Task, data: DataAccess) -> Release:
        """Let the task's round validate it, compute its statistic and price it."""
        return site_round(task).prepare(task, Site(data, self.ledger_path, self._kept))


def site_release(task: Task, data: DataAccess, ledger_path: Path | None = None) -> Release:
    """Prepare ``task`` as the site would (tests and tools that hold a table)."""
    return RoundsHandler(ledger_path).prepare(task, data)
