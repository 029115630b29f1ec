"""A hostile site agent for the tests: it reveals garbage in place of the shares it holds.

Run as a real process in place of ``python -m dpfed.site_agent`` (same arguments): the real
site agent, whose ``unmask`` stage answers with every share replaced by a random field
element -- what a participant can do to spoil the recovery of the others' masks. The
coordinator must check every share against its dealer's commitment and rebuild the masks
from the honest ones.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from dpfed.common.jobs.contract import DataAccess, Free, Release
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.site_agent.handlers import secagg


class LyingHandler(secagg.SecureAggregationHandler):
    """The ``secagg`` handler, with every revealed share replaced by random bytes."""

    def prepare(self, task: Task, data: DataAccess) -> Release:
        release = super().prepare(task, data)
        if task.params.get("stage") != "unmask":
            return release
        honest = release.produce(np.random.default_rng())
        assert isinstance(honest, TaskResult)
        lies = {name: np.frombuffer(b"\x00" + os.urandom(arr.size - 1), np.uint8).copy()
                for name, arr in honest.arrays.items()}
        answer = TaskResult(honest.task_id, honest.spend, lies, dict(honest.metadata))
        return Release(Free(), lambda _rng: answer)


def main(argv: list[str] | None = None) -> int:
    """Start the real site agent with the lying handler."""
    secagg.SecureAggregationHandler = LyingHandler  # type: ignore[misc]
    from dpfed.site_agent.cli import main as site_main

    return site_main(argv)


if __name__ == "__main__":
    sys.exit(main())
