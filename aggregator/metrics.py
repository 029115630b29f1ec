"""The coordinator's Prometheus metrics (``[metrics]`` in ``aggregator.toml``).

One :class:`CoordinatorMetrics` per coordinator, with its own ``CollectorRegistry``. Events
are counted where they happen, through one small call each -- rounds (``observe_round``, from
the job context's dispatch), refusals and transfer bytes (from the site sessions). State is
read when Prometheus scrapes: jobs by kind and state from the job store, connected sites, row
counts and budgets from the live sessions and the sites' last Hello. Everything here is
something the coordinator already holds; nothing is computed from a site's data beyond the
DP releases and public counts it receives (docs/operations.md, "Metrics").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from dpfed.common.metrics import budget_gauges, refusal_code

if TYPE_CHECKING:
    from dpfed.aggregator.registry import SiteRegistry
    from dpfed.aggregator.store import JobStore

#: Upper bounds (seconds) of the round-latency histogram: from a replayed round to a long one.
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
                 3600.0)

__all__ = ["CoordinatorMetrics"]


class CoordinatorMetrics:
    """Counters, histograms and scrape-time state of one coordinator."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._rounds = Histogram(
            "dpfed_round_seconds", "Wall time of one round of a job, from sending its task to "
            "the last answer (or the deadline), by task kind and outcome (ok: quorum reached).",
            ["kind", "outcome"], buckets=ROUND_BUCKETS, registry=self.registry)
        self._refusals = Counter(
            "dpfed_site_refusals", "Tasks sites refused, by site and refusal code.",
            ["site", "code"], registry=self.registry)
        self._bytes = Counter(
            "dpfed_transfer_bytes", "Bytes of tasks sent to and results received from sites.",
            ["site", "direction"], registry=self.registry)

    def observe_round(self, kind: str, seconds: float, *, ok: bool) -> None:
        """Record one finished round of a job."""
        self._rounds.labels(kind, "ok" if ok else "failed").observe(max(seconds, 0.0))

    def refused(self, site_id: str, code: str) -> None:
        """Count a refusal a site sent for a task it was sent."""
        self._refusals.labels(site_id, refusal_code(code)).inc()

    def sent(self, site_id: str, n_bytes: int) -> None:
        """Count the bytes of a task sent to a site."""
        self._bytes.labels(site_id, "sent").inc(n_bytes)

    def received(self, site_id: str, n_bytes: int) -> None:
        """Count result bytes accepted from a site."""
        self._bytes.labels(site_id, "received").inc(n_bytes)

    def watch(self, sites: SiteRegistry, store: JobStore) -> None:
        """Export the jobs, sites and budgets of this coordinator at every scrape."""
        self.registry.register(_StateCollector(sites, store))


class _StateCollector:
    """Reads the coordinator's state when Prometheus scrapes (on the event loop's thread)."""

    def __init__(self, sites: SiteRegistry, store: JobStore) -> None:
        self.sites = sites
        self.store = store

    def collect(self) -> Iterator[Metric]:
        """Yield the jobs, connection, row-count and budget families."""
        jobs = GaugeMetricFamily("dpfed_jobs", "Jobs in the store by kind and state (pending, "
                                 "running, succeeded, failed).", labels=["kind", "state"])
        for kind, state, n in self.store.job_counts():
            jobs.add_metric([kind, state], n)
        yield jobs
        live = {s.site_id: s for s in self.sites.connected()}
        yield GaugeMetricFamily("dpfed_sites_connected", "Sites connected now.",
                                value=len(live))
        connected = GaugeMetricFamily("dpfed_site_connected", "1 when the site is connected, 0 "
                                      "when it was seen before but is not now.",
                                      labels=["site"])
        rows = GaugeMetricFamily("dpfed_site_rows", "The row count the site reported (public "
                                 "under the replace-one relation).", labels=["site"])
        budgets = []
        for site_id, _first, _last, stored in self.store.known_sites():
            session = live.get(site_id)
            hello = session.hello if session is not None else stored
            connected.add_metric([site_id], 1.0 if session is not None else 0.0)
            rows.add_metric([site_id], float(hello.row_count))
            if hello.budget is not None:
                budgets.append(((site_id,), hello.budget))
        yield connected
        yield rows
        yield from budget_gauges("dpfed_site_budget", ["site"], budgets)
