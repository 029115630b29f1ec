"""What answers each task kind at the site.

The rounds of the registered job kinds answer their task kinds
(:class:`~dpfed.site_agent.handlers.base.RoundsHandler`); the secure sums' ``secagg`` kind
is :class:`~dpfed.site_agent.handlers.secagg.SecureAggregationHandler`, which needs the
site's certificate. A handler validates a task, computes the exact statistic and returns the
release with its charge; the runner charges the ledger before the noise is drawn.
"""

from __future__ import annotations

from dpfed.common.jobs.contract import DataAccess, Release
from dpfed.common.jobs.registry import task_kinds
from dpfed.site_agent.handlers.base import RoundsHandler, TaskHandler


def default_handlers() -> dict[str, TaskHandler]:
    """One handler for every task kind of the registered job kinds (not ``secagg``)."""
    return {kind: RoundsHandler() for kind in task_kinds()}


__all__ = ["DataAccess", "Release", "RoundsHandler", "TaskHandler", "default_handlers"]
