"""Logging set-up shared by the binaries: one line per record, UTC timestamps, component tag."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

FORMAT = "%(asctime)s.%(msecs)03dZ %(levelname)-7s %(name)s: %(message)s"


def configure_logging(level: str = "INFO", file: Path | None = None) -> None:
    """Log to stderr (and ``file`` if given) at ``level``."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(file, encoding="utf-8"))
    formatter = logging.Formatter(FORMAT, datefmt="%Y-%m-%dT%H:%M:%S")
    formatter.converter = time.gmtime
    for h in handlers:
        h.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(level)
