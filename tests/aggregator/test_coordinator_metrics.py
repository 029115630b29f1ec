"""The coordinator's and a site's metrics, scraped over HTTP from real in-process servers.

A real coordinator on loopback with two real site agents and a hand-driven site that
refuses tasks (hardening_harness); jobs run over mTLS; the series are read back through the
/metrics endpoint and parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from dpfed.common.metrics import MetricsConfig, serve_metrics
from dpfed.common.pb.v1 import site_link_pb2
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.transport.protocol import JobSpec, Refusal
from dpfed.common.transport.wire import refusal_to_proto
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.metrics import SiteMetrics
from tests.aggregator.hardening_harness import HandSite, harness

ON = MetricsConfig(True, "127.0.0.1:0", explicit=True)
PCA = {"n_components": 1, "rank": 2, "centering": "none", "clip_norm": "schema"}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def parse_samples(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _families(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


async def _refuse_next(hand: HandSite, code: str) -> None:
    task = await hand.next_task()
    await hand.call.write(site_link_pb2.SiteMessage(refusal=refusal_to_proto(
        Refusal(task.task_id, code, "not today"))))


async def test_coordinator_series_over_http(tmp_path: Path) -> None:
    async with harness(tmp_path / "a") as h, harness(tmp_path / "b", honest=("hospital-1",),
                                                     min_sites=1) as idle:
        server = await serve_metrics(ON, h.coordinator.registry.metrics.registry, "coordinator")
        other = await serve_metrics(ON, idle.coordinator.registry.metrics.registry, "idle")
        assert server is not None and other is not None
        hand = HandSite(h)
        try:
            await hand.connect()
            await h.wait_connected("hospital-3")
            for code in ("budget_exceeded", "a-code-no-site-sends"):
                refusing = asyncio.ensure_future(_refuse_next(hand, code))
                job = await h.submit(JobSpec("pca", 1.0, 1e-5, PCA, min_sites=2))
                await refusing
                assert job.state == "succeeded", job.error
            text = await asyncio.to_thread(_scrape, server.port)
            idle_text = await asyncio.to_thread(_scrape, other.port)
            statuses = {site: h.ledgers[site].status() for site in ("hospital-1", "hospital-2")}
        finally:
            await hand.close()
            await server.close()
            await other.close()
    s = parse_samples(text)
    assert s[("dpfed_jobs", (("kind", "pca"), ("state", "succeeded")))] == 2
    assert s[("dpfed_sites_connected", ())] == 3
    assert s[("dpfed_round_seconds_count", (("kind", "pca"), ("outcome", "ok")))] == 2
    for site in ("hospital-1", "hospital-2", "hospital-3"):
        assert s[("dpfed_transfer_bytes_total", (("direction", "sent"), ("site", site)))] > 0
        assert s[("dpfed_site_connected", (("site", site),))] == 1
    for site in ("hospital-1", "hospital-2"):
        assert s[("dpfed_transfer_bytes_total", (("direction", "received"), ("site", site)))] > 0
        # The site's own accountant (tight by default): two ε=1 jobs cost less than 2 together.
        ledger_status = statuses[site]
        assert 0 < ledger_status.epsilon_spent < 2.0
        assert s[("dpfed_site_budget_epsilon_spent", (("site", site),))] == pytest.approx(
            ledger_status.epsilon_spent)
        assert s[("dpfed_site_budget_epsilon_remaining", (("site", site),))] == pytest.approx(
            1e4 - ledger_status.epsilon_spent)
        assert s[("dpfed_site_budget_ledger_events", (("site", site),))] == 2
        assert s[("dpfed_site_rows", (("site", site),))] == 300
    # A refusal counts under its code; a code no site sends is "other" (bounded labels).
    assert s[("dpfed_site_refusals_total", (("code", "budget_exceeded"),
                                            ("site", "hospital-3")))] == 1
    assert s[("dpfed_site_refusals_total", (("code", "other"), ("site", "hospital-3")))] == 1
    assert "process_resident_memory_bytes" in _families(text)
    # Two coordinators in one process keep their own series, and the global registry none.
    idle_samples = parse_samples(idle_text)
    assert not any(name == "dpfed_jobs" for name, _ in idle_samples)
    assert idle_samples[("dpfed_sites_connected", ())] == 1
    assert not any(m.name.startswith("dpfed") for m in REGISTRY.collect())


#: Every family a site's endpoint may show: what its Hello, budget reports and answers carry.
SITE_FAMILIES = {"dpfed_site_connected", "dpfed_site_tasks", "dpfed_site_refusals",
                 "dpfed_site_transfer_bytes", "dpfed_site_budget_epsilon_spent",
                 "dpfed_site_budget_epsilon_remaining", "dpfed_site_budget_epsilon_cap",
                 "dpfed_site_budget_delta_spent", "dpfed_site_budget_delta_remaining",
                 "dpfed_site_budget_delta_cap", "dpfed_site_budget_rho_spent",
                 "dpfed_site_budget_ledger_events"}


async def test_site_series_hold_only_what_the_coordinator_sees(tmp_path: Path) -> None:
    with Ledger(tmp_path / "ledger.sqlite", BudgetPolicy(10.0, 1e-5)) as ledger:
        metrics = SiteMetrics(ledger, ("pca", "svt"))
        metrics.connected(True)
        metrics.task("pca", 1000, b"x" * 250)
        metrics.task("pca", 900, Refusal("t", "budget_exceeded", "no"))
        metrics.task("a" * 200, 10, Refusal("u", "something-else", "no"))
        server = await serve_metrics(ON, metrics.registry, "site")
        assert server is not None
        try:
            text = await asyncio.to_thread(_scrape, server.port)
        finally:
            await server.close()
    # (a counter's _created time is when the site first answered such a task: seen there too)
    names = {f.removesuffix("_created") for f in _families(text)}
    assert names <= SITE_FAMILIES, names - SITE_FAMILIES
    s = parse_samples(text)
    assert s[("dpfed_site_connected", ())] == 1
    assert s[("dpfed_site_tasks_total", (("kind", "pca"), ("outcome", "answered")))] == 1
    assert s[("dpfed_site_tasks_total", (("kind", "pca"), ("outcome", "refused")))] == 1
    assert s[("dpfed_site_tasks_total", (("kind", "other"), ("outcome", "refused")))] == 1
    assert s[("dpfed_site_refusals_total", (("code", "other"),))] == 1
    assert s[("dpfed_site_transfer_bytes_total", (("direction", "received"),))] == 1910
    assert s[("dpfed_site_transfer_bytes_total", (("direction", "sent"),))] == 250
    assert s[("dpfed_site_budget_epsilon_remaining", ())] == 10.0
