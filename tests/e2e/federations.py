"""What the end-to-end tests share: a running local federation, a look at a site's ledger,
and a coordinator SIGKILLed in the middle of a job and restarted."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
from scipy import stats

from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.transport.protocol import JobInfo, JobSpec, TaskResult
from dpfed.common.transport.wire import result_from_bytes
from dpfed.site_agent.ledger import Ledger, LedgerEvent


def roomy_settings(**overrides: Any) -> SiteSettings:
    """Site settings whose budget no test runs out of, with ``overrides`` applied."""
    return replace(SiteSettings(budget_epsilon=1e4, budget_delta=0.1, connect_timeout_s=30),
                   **overrides)


def running(federation: LocalFederation) -> Iterator[LocalFederation]:
    """Start the coordinator and every site, wait until they are connected; stop all after.

    For fixtures: ``yield from running(LocalFederation.create(...))``.
    """
    federation.start_coordinator()
    federation.start_sites()
    try:
        federation.wait_for_sites()
        yield federation
    finally:
        federation.stop_all()


def with_keepalive(fed: LocalFederation, seconds: float) -> None:
    """Set ``keepalive_s`` in the coordinator's and every site's config file."""
    text = fed.aggregator_config.read_text()
    fed.aggregator_config.write_text(text.replace("[server]\n",
                                                  f"[server]\nkeepalive_s = {seconds}\n"))
    for site_id in fed.site_ids:
        path = fed.site_config(site_id)
        path.write_text(path.read_text().replace("[coordinator]\n",
                                                 f"[coordinator]\nkeepalive_s = {seconds}\n"))


def charged_events(fed: LocalFederation, site_id: str) -> list[LedgerEvent]:
    """Every event in a site's ledger, in the order it was charged (read-only look)."""
    with Ledger(fed.ledger_path(site_id), BudgetPolicy(1e6, 0.5)) as ledger:
        return list(ledger.events())


def released_results(fed: LocalFederation, site_id: str) -> list[TaskResult]:
    """What a site sent for each charge, in order: its ledger keeps exactly those bytes."""
    with Ledger(fed.ledger_path(site_id), BudgetPolicy(1e6, 0.5)) as ledger:
        return [result_from_bytes(ledger.stored_result(e.task_id)) for e in ledger.events()]


def ring_uniformity_p(masked: np.ndarray, bits: int = 2) -> float:
    """Chi-square p-value of the top ``bits`` bits of masked uint64 ring elements.

    Uniform ring elements give a large p-value; an unmasked statistic (integers well inside
    the ring and their negatives) has its top bits all 0 or all 1.
    """
    top = masked.astype(np.uint64) >> np.uint64(64 - bits)
    return float(stats.chisquare(np.bincount(top.astype(np.int64), minlength=2 ** bits)).pvalue)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` every 0.1 s; fail the test naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop every process still running: SIGTERM, then SIGKILL after 15 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def killed_and_resumed(fed: LocalFederation, spec: JobSpec, reached: Callable[[], None], *,
                       before_restart: Callable[[], None] | None = None) -> JobInfo:
    """Submit ``spec``, SIGKILL the coordinator mid-job, restart it and follow the resumed job.

    ``reached`` blocks until the moment to kill (e.g. :func:`wait_until` on the ledgers);
    ``before_restart`` runs while the coordinator is down (e.g. SIGCONT a frozen site). The
    coordinator restarts on its port; returns the resumed job's final state.
    """
    port = fed.port

    def submit() -> None:
        try:
            with fed.analyst() as coord:
                coord.submit(spec)
        except Exception:  # noqa: BLE001 -- the stream dies with the coordinator
            pass

    t = threading.Thread(target=submit, daemon=True)
    t.start()
    reached()
    fed.signal("coordinator", signal.SIGKILL)
    fed.wait("coordinator")
    t.join(30)
    if before_restart is not None:
        before_restart()
    fed.start_coordinator(port=port)
    with fed.analyst() as coord:
        return coord.watch(coord.jobs(1)[0].job_id)
