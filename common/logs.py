"""Logging set-up shared by the binaries: one line per record, UTC time, logger and function.

The formatter names the function that logged, so code never types its own name into a message.

Two formats (``--log-format`` of ``dpfed-aggregator`` and ``dpfed-site``, or ``[logging]
format`` in their config files):

- ``text`` (default): ``2026-01-02T03:04:05.678Z INFO    dpfed.site.start: message``;
- ``json``: one JSON object per line with ``time``, ``level``, ``logger``, ``function``,
  ``message`` and, where the record knows them, ``job_id``, ``task_id``, ``site``, ``kind``
  and ``outcome``
  (docs/operations.md lists the fields). They come from the record's ``extra`` or, following
  the project's log convention, from ``job=``, ``task=``, ``site=``, ``kind=`` and
  ``outcome=`` tokens in the message, so every existing log line gains them without change.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

FORMAT = "%(asctime)s.%(msecs)03dZ %(levelname)-7s %(name)s.%(funcName)s: %(message)s"
LOG_FORMATS: tuple[str, ...] = ("text", "json")

#: message token -> JSON field
_TOKENS = {"job": "job_id", "task": "task_id", "site": "site", "kind": "kind",
           "outcome": "outcome"}
_TOKEN_RE = re.compile(r"(?<![\w.-])(job|task|site|kind|outcome)=([^\s,;:()]+)")


class JsonFormatter(logging.Formatter):
    """Format a record as one line of JSON (see the module docstring for the fields)."""

    def format(self, record: logging.LogRecord) -> str:
        """Return the record as a JSON object on one line."""
        message = record.getMessage()
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": message,
        }
        if record.funcName:
            out["function"] = record.funcName
        for token, value in _TOKEN_RE.findall(message):
            out.setdefault(_TOKENS[token], value)
        for field in _TOKENS.values():
            value = record.__dict__.get(field)
            if value is not None:
                out[field] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str = "INFO", file: Path | None = None,
                      fmt: str = "text") -> None:
    """Log to stderr (and ``file`` if given) at ``level`` in format ``fmt`` (text or json)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(file, encoding="utf-8"))
    formatter: logging.Formatter
    if fmt == "json":
        formatter = JsonFormatter()
    else:
        formatter = logging.Formatter(FORMAT, datefmt="%Y-%m-%dT%H:%M:%S")
        formatter.converter = time.gmtime
    for h in handlers:
        h.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(level)


class _ContextFilter(logging.Filter):
    """Add fixed fields (e.g. this process's site id) to records that lack them."""

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__()
        self.fields = fields

    def filter(self, record: logging.LogRecord) -> bool:
        """Set the missing fields; never drop a record."""
        for key, value in self.fields.items():
            if record.__dict__.get(key) is None:
                record.__dict__[key] = value
        return True


def add_log_context(**fields: Any) -> None:
    """Attach ``fields`` (``site="hospital-a"``) to every record the root handlers emit."""
    f = _ContextFilter(fields)
    for handler in logging.getLogger().handlers:
        handler.addFilter(f)
