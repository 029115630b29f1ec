"""The running agent's status file, and the health verdict ``dpfed-site health`` draws from it.

The site opens no port, so a container or service-manager probe cannot ask it anything.
Instead the agent writes a small JSON file beside its ledger (``ledger.sqlite`` ->
``ledger.agent-status.json``) every :data:`HEARTBEAT_S` seconds and at every change:
``connecting`` or ``connected`` (to which coordinator, as which site, since when) and, when it
exits, ``stopped`` with its exit code. The probe only reads that file: it costs no data scan,
no TLS handshake and no coordinator call, and it reads only ``[ledger] path`` of the config
(:func:`configured_status_path`), so it imports nothing heavy. A file older than ``max_age``
means the agent is not running or its event loop is stuck. Two verdicts: *ready* (connected)
and, for liveness probes, *alive* (connected or still trying: a site waiting for its
coordinator is not restarted). The file holds no data value, only state and times.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dpfed.common import exit_codes
from dpfed.common.errors import ConfigError
from dpfed.common.toml_config import Section, read_toml

log = logging.getLogger(__name__)

CONNECTING = "connecting"
CONNECTED = "connected"
STOPPED = "stopped"
#: Seconds between two writes of an unchanged state.
HEARTBEAT_S = 5.0
#: ``dpfed-site health``: a status older than this is stale (the agent is gone or stuck).
DEFAULT_MAX_AGE_S = 30.0


def status_path(ledger_path: Path) -> Path:
    """Where the agent using ``ledger_path`` writes its status."""
    return ledger_path.with_name(f"{ledger_path.stem}.agent-status.json")


def ledger_file(ledger: Section) -> Path:
    """Return the ledger a ``[ledger]`` table names (default ``ledger.sqlite`` beside site.toml).

    The one reading of ``ledger.path``, shared by the full config loader and the probe.
    """
    path = ledger.path("path", "ledger.sqlite")
    assert path is not None
    return path


def configured_status_path(config_file: Path, ledger_override: str | None = None) -> Path:
    """Return the status file of the agent run with ``config_file`` (reads ``[ledger] path``).

    A probe runs every few seconds: loading the whole config would import numpy, scipy and
    pandas (about 2 s of CPU each time) for one path.
    """
    if ledger_override:
        return status_path(Path(ledger_override))
    root = Section(read_toml(config_file), "", str(config_file), config_file.resolve().parent)
    return status_path(ledger_file(root.section("ledger")))


@dataclass(frozen=True)
class AgentStatus:
    """One snapshot of the agent (times are Unix seconds)."""

    state: str
    since: float
    updated: float
    pid: int
    coordinator: str
    site_id: str = ""
    exit_code: int | None = None


def write_status(path: Path, status: AgentStatus) -> None:
    """Replace the status file atomically (a reader never sees half a file)."""
    fd, tmp = tempfile.mkstemp(prefix=".agent-status.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(asdict(status), fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_status(path: Path) -> AgentStatus | None:
    """Read the status file; None when there is none. ConfigError if it is not one."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return AgentStatus(**raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path} is not a dpfed-site status file: {exc}") from None


def health(status: AgentStatus | None, path: Path, max_age: float,
           now: float | None = None, *, alive_is_enough: bool = False) -> tuple[int, str]:
    """Return ``(exit code, one line)``: 0 only for a fresh ``connected`` status.

    With ``alive_is_enough`` (a liveness probe) a fresh ``connecting`` status is healthy too:
    the agent is running and waits for its coordinator, which a restart would not bring. A
    stopped agent gives its own exit code (7 when the coordinator refused it, 4 for a data
    error, ...); not connected or stale gives ``COORDINATOR_UNREACHABLE``.
    """
    now = time.time() if now is None else now
    if status is None:
        return (exit_codes.COORDINATOR_UNREACHABLE,
                f"no status file {path}: the agent has not started (or uses another ledger)")
    age = now - status.updated
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(status.since))
    if status.state == STOPPED:
        meaning = {c: m for c, _, m in exit_codes.TABLE}.get(status.exit_code or 0, "?")
        if not status.exit_code:
            meaning = "stopped on request"
        code = status.exit_code or exit_codes.COORDINATOR_UNREACHABLE
        return code, f"the agent stopped at {when} with exit code {status.exit_code} ({meaning})"
    if age > max_age:
        return (exit_codes.COORDINATOR_UNREACHABLE,
                f"status last written {age:.0f}s ago (more than {max_age:g}s): the agent "
                f"(pid {status.pid}) is not running or is stuck")
    if status.state != CONNECTED:
        waiting = f"not connected: trying to reach {status.coordinator} since {when}"
        if alive_is_enough:
            return exit_codes.OK, f"running, {waiting} (status written {age:.0f}s ago)"
        return exit_codes.COORDINATOR_UNREACHABLE, waiting
    return (exit_codes.OK, f"connected to {status.coordinator} as {status.site_id} since {when}"
                           f" (status written {age:.0f}s ago)")


class StatusWriter:
    """Keep the status file of one running agent current.

    Parameters
    ----------
    path : Path
        The status file (:func:`status_path` of the ledger).
    coordinator : str
        The address the agent dials (shown by ``dpfed-site health``).
    """

    def __init__(self, path: Path, coordinator: str) -> None:
        self.path = path
        self.coordinator = coordinator
        self._state = ""
        self._since = 0.0
        self._last_write = 0.0
        self._warned = False

    def update(self, state: str, site_id: str = "", exit_code: int | None = None) -> None:
        """Record ``state``; written at once on a change, else every :data:`HEARTBEAT_S`."""
        now = time.time()
        if state == self._state and now - self._last_write < HEARTBEAT_S:
            return
        if state != self._state:
            self._state, self._since = state, now
        try:
            write_status(self.path, AgentStatus(state, self._since, now, os.getpid(),
                                                self.coordinator, site_id, exit_code))
            self._last_write = now
        except OSError as exc:  # the probe then reports a stale status; the agent carries on
            if not self._warned:
                log.warning("[AgentStatus] cannot write %s: %s", self.path, exc)
                self._warned = True
