"""Task handlers: one plug-in per job kind, looked up by ``Task.kind``.

A handler turns a task into a :class:`~dpfed.site_agent.handlers.base.PreparedRelease`: it validates
the parameters, does the exact (non-private) computation over the site's rows, and returns the
release's privacy cost together with a function that draws the noise. The runner charges the
ledger with that cost *before* calling the function, inside the same transaction that stores
the released bytes.
"""

from __future__ import annotations

from dpfed.site_agent.handlers.base import (
    DataAccess,
    PreparedContinuation,
    PreparedRelease,
    TaskHandler,
)
from dpfed.site_agent.handlers.pca import PCAHandler
from dpfed.site_agent.handlers.query import QueryHandler
from dpfed.site_agent.handlers.svt import SVTHandler
from dpfed.site_agent.handlers.synth import (
    SynthEvaluationHandler,
    SynthHandler,
    SynthRowsHandler,
)
from dpfed.site_agent.handlers.synth_summary import SynthEvaluationSummaryHandler

#: kind -> handler; adding a job kind means adding a handler here.
HANDLERS: dict[str, TaskHandler] = {h.kind: h for h in (
    PCAHandler(), SVTHandler(), QueryHandler(), SynthHandler(), SynthRowsHandler(),
    SynthEvaluationHandler(), SynthEvaluationSummaryHandler())}

__all__ = ["HANDLERS", "DataAccess", "PreparedContinuation", "PreparedRelease", "TaskHandler"]
