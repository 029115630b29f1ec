"""Run the longest test files first, so parallel workers finish together.

CI spreads whole files over pytest-xdist workers (``--dist loadfile --no-loadscope-reorder``)
in collection order. Left in directory order, the end-to-end files, which are few tests each
but most of the suite's wall time, were reached last and ran one after another on the last busy
worker. Here the files are ordered by their recorded wall time (``file_durations.json``,
longest first; a file not in the record counts as an end-to-end file's median if it starts
processes, else as short), which is the classic longest-processing-time-first schedule. Tests
keep their order inside a file. Refresh the record with ``python -m tests.support.durations
JUNIT_XML`` after a run with ``--junitxml``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RECORD = Path(__file__).with_name("file_durations.json")


def _recorded() -> dict[str, float]:
    try:
        data = json.loads(RECORD.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order files longest first (stable inside each file)."""
    recorded = _recorded()
    e2e_times = sorted(v for k, v in recorded.items() if "/e2e/" in k)
    unknown_e2e = e2e_times[len(e2e_times) // 2] if e2e_times else 60.0

    def weight(item: pytest.Item) -> float:
        path = item.nodeid.split("::", 1)[0]
        if path in recorded:
            return recorded[path]
        return unknown_e2e if item.get_closest_marker("e2e") is not None else 1.0

    first_seen = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::", 1)[0], index)
    items.sort(key=lambda it: (-weight(it), first_seen[it.nodeid.split("::", 1)[0]]))
