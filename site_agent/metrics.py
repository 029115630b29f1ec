"""A site's Prometheus metrics (``[metrics]`` in ``site.toml``; off by default).

A site's endpoint exports only what the site already tells the coordinator: whether it is
connected, the tasks it answered or refused (by kind and refusal code), the bytes it received
and sent, and its budget as its budget reports carry it (read from the ledger at each scrape).
No timing of the site's own computation, no per-analyst share, no process statistics: those
the coordinator never sees, so shipping a site's metrics to a shared monitoring system tells
it nothing new (docs/operations.md, "Metrics").
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import Metric

from dpfed.common.metrics import MetricsConfig, budget_gauges, refusal_code, serve_metrics
from dpfed.common.transport.protocol import Refusal

if TYPE_CHECKING:
    from dpfed.site_agent.ledger import Ledger

__all__ = ["SiteMetrics", "serving_metrics"]


class SiteMetrics:
    """Counters of one site agent, and its ledger's budget at scrape time.

    Parameters
    ----------
    ledger : Ledger
        Read at each scrape (``Ledger.status``: what the budget reports carry).
    kinds : tuple of str
        The task kinds the site runs; any other kind a coordinator sends is counted as
        ``"other"`` (label values stay bounded).
    """

    def __init__(self, ledger: Ledger, kinds: tuple[str, ...]) -> None:
        self.registry = CollectorRegistry()
        self._kinds = frozenset(kinds)
        self._connected = Gauge("dpfed_site_connected", "1 while the stream to the "
                                "coordinator is open.", registry=self.registry)
        self._tasks = Counter("dpfed_site_tasks", "Tasks answered, by kind and outcome "
                              "(answered, refused).", ["kind", "outcome"],
                              registry=self.registry)
        self._refusals = Counter("dpfed_site_refusals", "Tasks refused, by refusal code.",
                                 ["code"], registry=self.registry)
        self._bytes = Counter("dpfed_site_transfer_bytes", "Bytes of tasks received and of "
                              "answers sent.", ["direction"], registry=self.registry)
        self.registry.register(_BudgetCollector(ledger))

    def connected(self, up: bool) -> None:
        """Record that the stream to the coordinator opened (True) or closed (False)."""
        self._connected.set(1.0 if up else 0.0)

    def task(self, kind: str, task_bytes: int, outcome: bytes | Refusal) -> None:
        """Count one task and its answer (the released bytes, or a refusal)."""
        label = kind if kind in self._kinds else "other"
        self._bytes.labels("received").inc(task_bytes)
        if isinstance(outcome, Refusal):
            self._tasks.labels(label, "refused").inc()
            self._refusals.labels(refusal_code(outcome.code)).inc()
        else:
            self._tasks.labels(label, "answered").inc()
            self._bytes.labels("sent").inc(len(outcome))


class _BudgetCollector:
    """The site's budget, read from its ledger when Prometheus scrapes."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        """Yield the budget gauges (no labels: one site)."""
        yield from budget_gauges("dpfed_site_budget", [], [((), self.ledger.status())])


@asynccontextmanager
async def serving_metrics(config: MetricsConfig,
                          metrics: SiteMetrics | None) -> AsyncIterator[None]:
    """Serve ``metrics`` at ``config.listen`` while the block runs (if enabled)."""
    server = None if metrics is None else await serve_metrics(config, metrics.registry, "site")
    try:
        yield
    finally:
        if server is not None:
            await server.close()
