"""``dpfed simulate --metrics``: every process serves Prometheus metrics on loopback.

The coordinator and each site bind a free loopback port (``[metrics] listen =
"127.0.0.1:0"``) and write it to a port file; once the sites are connected the simulation
prints each endpoint's address, and just before it stops the processes it scrapes every
endpoint once over HTTP and keeps the text under ``metrics/<process>.prom`` in the output
directory -- what Prometheus would have read at the end of the run.
"""

from __future__ import annotations

import time
import urllib.request
from typing import TYPE_CHECKING

from dpfed.aggregator.simulation_output import say

if TYPE_CHECKING:
    from dpfed.aggregator.local_federation import LocalFederation

#: Seconds to wait for a process to write its metrics port, and for one scrape.
PORT_WAIT_S = 10.0
SCRAPE_TIMEOUT_S = 10.0


def metrics_url(fed: LocalFederation, name: str, wait_s: float = 0.0) -> str | None:
    """Return ``http://127.0.0.1:PORT/metrics`` of a process, or None if it has no port."""
    path = fed.metrics_port_file(name)
    deadline = time.monotonic() + wait_s
    while True:
        text = path.read_text().strip() if path.exists() else ""
        if text:
            return f"http://127.0.0.1:{int(text)}/metrics"
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def scrape(url: str, timeout: float = SCRAPE_TIMEOUT_S) -> str:
    """Read one exposition over HTTP (raises OSError when the endpoint does not answer)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 -- loopback
        return str(response.read().decode("utf-8"))


def announce(fed: LocalFederation) -> None:
    """Print every process's metrics address."""
    for name in ("coordinator", *fed.site_ids):
        url = metrics_url(fed, name, PORT_WAIT_S)
        say("metrics", f"{name}: {url or 'no metrics port written (see its log)'}")


def save_snapshots(fed: LocalFederation) -> None:
    """Scrape every running process once and write ``metrics/<name>.prom``."""
    out = fed.root / "metrics"
    out.mkdir(exist_ok=True)
    for name in ("coordinator", *fed.site_ids):
        url = metrics_url(fed, name)
        if url is None or name not in fed.procs or fed.procs[name][0].poll() is not None:
            continue
        try:
            (out / f"{name}.prom").write_text(scrape(url), encoding="utf-8")
        except OSError as exc:
            say("metrics", f"{name}: the last scrape failed ({exc})")
    say("metrics", f"last scrape of every process -> {out}")
