"""Record each test file's wall time from a JUnit XML report into tests/file_durations.json.

``python -m tests.support.durations report.xml`` after ``bash .ci/run --junitxml report.xml``.
A file's time is the sum of its test cases' times (setup, call and teardown, which is where a
module's shared federation starts and stops). tests/conftest.py reads the record to start the
longest files first.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

RECORD = Path(__file__).resolve().parent.parent / "file_durations.json"


def file_durations(junit_xml: Path) -> dict[str, float]:
    """Seconds per test file (its path from the repository root) in a JUnit XML report."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "")
        parts = module.split(".")
        # classname is "tests.e2e.test_x" or "tests.e2e.test_x.TestClass"
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        if not parts:
            continue
        totals["/".join(parts) + ".py"] += float(case.get("time", "0") or 0)
    return dict(totals)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.support.durations JUNIT_XML", file=sys.stderr)
        return 2
    record = {k: round(v, 1) for k, v in sorted(file_durations(Path(argv[0])).items(),
                                                key=lambda kv: -kv[1])}
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{len(record)} files, {sum(record.values()):.0f} s in all -> {RECORD}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
