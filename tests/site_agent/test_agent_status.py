"""The agent's status file and the verdict of `dpfed-site health` (no processes needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpfed.common import exit_codes
from dpfed.common.errors import ConfigError
from dpfed.site_agent import agent_status as st


def status(state: str, updated: float, exit_code: int | None = None) -> st.AgentStatus:
    return st.AgentStatus(state, since=updated - 60, updated=updated, pid=123,
                          coordinator="coord:50051", site_id="hospital-a", exit_code=exit_code)


def test_verdicts(tmp_path: Path) -> None:
    path = tmp_path / "ledger.agent-status.json"
    now = 1_000_000.0
    assert st.health(status(st.CONNECTED, now - 3), path, 30, now)[0] == exit_codes.OK
    code, line = st.health(status(st.CONNECTED, now - 31), path, 30, now)
    assert code == exit_codes.COORDINATOR_UNREACHABLE and "not running or is stuck" in line
    code, line = st.health(status(st.CONNECTING, now - 1), path, 30, now)
    assert code == exit_codes.COORDINATOR_UNREACHABLE and "trying to reach coord:50051" in line
    code, line = st.health(status(st.STOPPED, now - 500, 7), path, 30, now)
    assert code == exit_codes.REJECTED_BY_COORDINATOR and "exit code 7" in line
    code, line = st.health(status(st.STOPPED, now, 0), path, 30, now)
    assert code == exit_codes.COORDINATOR_UNREACHABLE and "stopped on request" in line
    assert st.health(None, path, 30, now)[0] == exit_codes.COORDINATOR_UNREACHABLE


def test_alive_verdicts_accept_a_running_agent_that_waits_for_its_coordinator(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger.agent-status.json"
    now = 1_000_000.0

    def alive(s: st.AgentStatus | None) -> tuple[int, str]:
        return st.health(s, path, 30, now, alive_is_enough=True)

    code, line = alive(status(st.CONNECTING, now - 1))
    assert code == exit_codes.OK and line.startswith("running, not connected: trying to reach")
    assert alive(status(st.CONNECTED, now - 1))[0] == exit_codes.OK
    for stuck in (st.CONNECTING, st.CONNECTED):  # stale: gone or stuck, whatever the state
        assert alive(status(stuck, now - 31))[0] == exit_codes.COORDINATOR_UNREACHABLE
    assert alive(status(st.STOPPED, now - 1, 4))[0] == exit_codes.DATA_ERROR
    assert alive(status(st.STOPPED, now - 1, 0))[0] == exit_codes.COORDINATOR_UNREACHABLE
    assert alive(None)[0] == exit_codes.COORDINATOR_UNREACHABLE


def test_the_probe_finds_the_status_file_from_the_ledger_path_alone(tmp_path: Path) -> None:
    config = tmp_path / "site.toml"
    config.write_text('[ledger]\npath = "state/ledger.sqlite"\n[data]\nunknown_key = 1\n')
    # Relative to the config file, like the agent's own reading; other tables are not read.
    assert st.configured_status_path(config) == tmp_path / "state" / "ledger.agent-status.json"
    config.write_text("[budget]\nepsilon = 1.0\n")
    assert st.configured_status_path(config) == tmp_path / "ledger.agent-status.json"
    assert st.configured_status_path(config, "/x/l.sqlite") == Path("/x/l.agent-status.json")
    config.write_text("[ledger\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        st.configured_status_path(config)


def test_writer_writes_changes_at_once_and_heartbeats(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = tmp_path / "ledger.sqlite"
    path = st.status_path(ledger)
    assert path == tmp_path / "ledger.agent-status.json"
    clock = [100.0]
    monkeypatch.setattr(st.time, "time", lambda: clock[0])
    writer = st.StatusWriter(path, "coord:50051")
    writer.update(st.CONNECTING)
    first = st.read_status(path)
    assert first is not None and first.state == st.CONNECTING and first.updated == 100.0
    clock[0] = 101.0
    writer.update(st.CONNECTING)  # unchanged, within the heartbeat: not rewritten
    assert st.read_status(path) == first
    writer.update(st.CONNECTED, "hospital-a")  # a change: written at once
    now = st.read_status(path)
    assert now is not None and now.state == st.CONNECTED and now.since == 101.0
    clock[0] = 101.0 + st.HEARTBEAT_S
    writer.update(st.CONNECTED, "hospital-a")  # the heartbeat: newer time, same since
    beat = st.read_status(path)
    assert beat is not None and beat.updated == clock[0] and beat.since == 101.0
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left


def test_a_broken_file_is_a_config_error_and_an_unwritable_one_does_not_stop_the_agent(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger.agent-status.json"
    path.write_text(json.dumps({"state": "connected"}))
    with pytest.raises(ConfigError, match="not a dpfed-site status file"):
        st.read_status(path)
    st.StatusWriter(tmp_path / "missing" / "x.json", "coord:50051").update(st.CONNECTING)
