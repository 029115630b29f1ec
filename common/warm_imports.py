"""Import the libraries jobs load on first use, in the background, once a process is up.

The long-running processes (coordinator, site agent) start without pandas and the heavier
scipy modules, so they listen and connect sooner; this loads them right after, off the
critical path, so the first job does not pay for them either (a round with a short deadline
did, on a loaded machine).
"""

from __future__ import annotations

import importlib
import logging
import threading
import time

log = logging.getLogger(__name__)

#: What :func:`import_job_libraries` logs when done (tests that measure a process wait for it).
IMPORTED_MESSAGE = "job libraries imported"

#: What the job kinds import on first use (the coordinator's results and planning, the
#: sites' accountant, matrix strategies and evaluation).
JOB_LIBRARIES = ("pandas", "scipy.special", "scipy.optimize", "scipy.sparse", "scipy.spatial")


def import_job_libraries() -> None:
    """Import :data:`JOB_LIBRARIES` (blocking); log :data:`IMPORTED_MESSAGE` when done."""
    started = time.monotonic()
    for name in JOB_LIBRARIES:
        importlib.import_module(name)
    log.info("%s in %.2f s", IMPORTED_MESSAGE, time.monotonic() - started)


def import_in_background() -> threading.Thread:
    """Start :func:`import_job_libraries` on a thread; the interpreter waits for it at exit."""
    thread = threading.Thread(target=import_job_libraries, name="dpfed-warm-imports")
    thread.start()
    return thread
