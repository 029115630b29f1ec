"""Values that used to pass start-up and break every job later (issue 19, Robustness).

``task_deadline_s = 1e308`` started a coordinator whose every job then failed "internal"; a
site refused a task with delta 1e-320 as "internal" instead of "invalid". Now the binaries
refuse such configuration at start-up (exit 3, naming the key and the valid range), and a
site refuses such a task as invalid, naming the parameter. Real processes throughout; the
task comes from a hostile coordinator speaking the real protocol.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.common import exit_codes
from dpfed.common.transport.protocol import Refusal, Task
from tests.e2e.federations import charged_events, roomy_settings
from tests.e2e.rogue_coordinator import RogueCoordinator

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> LocalFederation:
    return LocalFederation.create(tmp_path_factory.mktemp("ranges") / "fed", n_sites=1, rows=200,
                                  features=4, seed=2, settings=roomy_settings())


def edited(path: Path, out: Path, section: str, key: str, value: str) -> Path:
    """A copy of a TOML config with ``[section] key = value`` set (replaced or added)."""
    text = path.read_text()
    pattern = re.compile(rf"^{re.escape(key)} = .*$", re.MULTILINE)
    head, sep, tail = text.partition(f"[{section}]\n")
    assert sep, section
    block, rest = (tail.split("\n[", 1) + [""])[:2]
    block = pattern.sub(f"{key} = {value}", block) if pattern.search(block) else (
        f"{key} = {value}\n" + block)
    out.write_text(head + sep + block + ("\n[" + rest if rest else ""))
    return out


@pytest.mark.parametrize(("section", "key", "value", "says"), [
    ("jobs", "task_deadline_s", "1e308", "jobs.task_deadline_s must be > 0 and <= 2.592e+06 "
                                         "seconds (30 days), got 1e+308"),
    ("jobs", "resume_wait_s", "-1", "jobs.resume_wait_s must be >= 0 and <= 2.592e+06"),
    ("jobs", "min_sites", "1000000000", "jobs.min_sites must be >= 1 and <= 10000"),
    ("federation", "access_reload_s", "1e308", "federation.access_reload_s must be >= 0.1 and "
                                               "<= 3600 seconds"),
    ("jobs", "task_deadline_s", "inf", "jobs.task_deadline_s must be a finite number"),
])
def test_the_coordinator_refuses_out_of_range_values_at_start_up(
        fed: LocalFederation, tmp_path: Path, section: str, key: str, value: str,
        says: str) -> None:
    config = edited(fed.aggregator_config, tmp_path / "aggregator.toml", section, key, value)
    out = subprocess.run([sys.executable, "-m", "dpfed.aggregator", "--config", str(config),
                          "--listen", "127.0.0.1:0"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == exit_codes.CONFIG_ERROR, out.stderr
    assert says in out.stderr, out.stderr


@pytest.mark.parametrize(("section", "key", "value", "says"), [
    ("budget", "delta", "1e-320", "budget.delta must be >= 1e-300, got 1e-320"),
    ("budget", "delta", "nan", "budget.delta must be a finite number"),
    ("coordinator", "connect_timeout_s", "1e308", "coordinator.connect_timeout_s must be > 0 "
                                                  "and <= 2.592e+06 seconds (30 days)"),
    ("data", "chunk_rows", "1000000000000", "data.chunk_rows must be >= 1 and <= 10000000"),
    ("policy", "secure_min_participants", "1000000000",
     "policy.secure_min_participants must be >= 2 and <= 10000"),
])
def test_a_site_refuses_out_of_range_values_at_start_up(
        fed: LocalFederation, tmp_path: Path, section: str, key: str, value: str,
        says: str) -> None:
    config = edited(fed.site_config("hospital-1"), tmp_path / "site.toml", section, key, value)
    out = subprocess.run([sys.executable, "-m", "dpfed.site_agent", "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == exit_codes.CONFIG_ERROR, out.stderr
    assert says in out.stderr, out.stderr


@pytest.fixture
async def rogue(fed: LocalFederation) -> AsyncIterator[RogueCoordinator]:
    coordinator = RogueCoordinator(fed.certs)
    fed.port = await coordinator.start()
    fed.start_site("hospital-1")
    try:
        await coordinator.wait_for("hospital-1")
        yield coordinator
    finally:
        fed.stop("hospital-1")
        await coordinator.stop()


@pytest.mark.parametrize(("epsilon", "delta", "says"), [
    (1.0, 1e-320, "the task's delta must be 0 or in [1e-300, 1), got 1e-320"),
    (1.0, 5e-324, "the task's delta must be 0 or in [1e-300, 1)"),
    (float("nan"), 1e-5, "the task's epsilon must be finite and >= 0, got nan"),
    (-1.0, 1e-5, "the task's epsilon must be finite and >= 0, got -1.0"),
])
async def test_a_site_refuses_a_task_no_mechanism_can_be_calibrated_to_as_invalid(
        fed: LocalFederation, rogue: RogueCoordinator, epsilon: float, delta: float,
        says: str) -> None:
    answer = await rogue.ask("hospital-1", Task("job-x/pca", "job-x", "pca", epsilon, delta,
                                                {"n_components": 1, "rank": 2}))
    assert isinstance(answer, Refusal) and answer.code == "invalid", answer
    assert says in answer.reason, answer.reason
    assert charged_events(fed, "hospital-1") == []
