"""Metrics scraped over HTTP during a real ``dpfed simulate --metrics`` run.

The simulation runs as a user runs it (its own processes: a coordinator and three sites over
mTLS). While it runs, the test scrapes the coordinator's and a site's endpoints at the
addresses the simulation prints; at the end it reads the last scrape the simulation saved
before stopping the processes, and checks every series the operations docs promise.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.aggregator.test_coordinator_metrics import SITE_FAMILIES, parse_samples

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def test_simulate_serves_the_promised_series(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "dpfed.aggregator.cli", "simulate",
                             "--metrics", "--sites", "3", "--rows", "3000", "--features", "6",
                             "--k", "2", "--epsilon", "1", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    reader = threading.Thread(target=lambda: [lines.put(x) for x in stdout], daemon=True)
    reader.start()
    urls: dict[str, str] = {}
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while len(urls) < 4:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            seen.append(line)
            if line.startswith("[simulate] metrics") and "http://" in line:
                name, _, url = line.split(None, 2)[2].partition(": ")
                urls[name] = url.strip()
        live = parse_samples(_scrape(urls["coordinator"]))
        site_live = parse_samples(_scrape(urls["hospital-1"]))
        assert proc.wait(240) == 0, "".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(30)
        stdout.close()
    # Live, during the run: every site connected, at the coordinator and at the site.
    assert live[("dpfed_sites_connected", ())] == 3
    assert site_live[("dpfed_site_connected", ())] == 1
    assert site_live[("dpfed_site_budget_epsilon_cap", ())] == 10.0

    # The last scrape before the processes stopped: the finished job and what it cost.
    coordinator = (out / "metrics" / "coordinator.prom").read_text()
    s = parse_samples(coordinator)
    assert s[("dpfed_jobs", (("kind", "pca"), ("state", "succeeded")))] == 1
    assert s[("dpfed_round_seconds_count", (("kind", "pca"), ("outcome", "ok")))] == 3
    assert "dpfed_site_refusals" in {f.name for f in text_string_to_metric_families(coordinator)}
    for site in ("hospital-1", "hospital-2", "hospital-3"):
        labels = (("site", site),)
        # The tight (pld) accountant: one ε=1 job of three rounds costs at most 1 together.
        spent = s[("dpfed_site_budget_epsilon_spent", labels)]
        assert 0 < spent <= 1.0
        assert s[("dpfed_site_budget_epsilon_remaining", labels)] == pytest.approx(10.0 - spent)
        assert s[("dpfed_site_budget_ledger_events", labels)] == 3
        for direction in ("sent", "received"):
            assert s[("dpfed_transfer_bytes_total", (("direction", direction), *labels))] > 0
        site_text = (out / "metrics" / f"{site}.prom").read_text()
        names = {f.name.removesuffix("_created")
                 for f in text_string_to_metric_families(site_text)}
        assert names <= SITE_FAMILIES, names - SITE_FAMILIES
        t = parse_samples(site_text)
        assert t[("dpfed_site_tasks_total", (("kind", "pca"), ("outcome", "answered")))] == 3
        assert t[("dpfed_site_budget_epsilon_spent", ())] == pytest.approx(spent)
        # What the site shows is what the coordinator holds for it.
        assert t[("dpfed_site_transfer_bytes_total", (("direction", "sent"),))] == (
            s[("dpfed_transfer_bytes_total", (("direction", "received"), *labels))])
