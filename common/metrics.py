"""What the coordinator's and the sites' Prometheus endpoints share.

- :class:`MetricsConfig` and :func:`metrics_config`: the ``[metrics]`` table of
  ``aggregator.toml`` and ``site.toml`` (``enabled``, ``listen``, ``port_file``);
- :func:`refusal_code`: a site's refusal code as a bounded label value;
- :func:`budget_gauges`: a site's budget (what its Hello and budget reports carry) as gauges;
- :class:`MetricsServer` / :func:`serve_metrics`: ``GET /metrics`` over plain HTTP on the
  process's own event loop, so collectors read the coordinator's and the agent's state on the
  thread that owns it. Each process passes its own ``CollectorRegistry`` (never the global
  one), so several servers in one test process do not share series.

What may be exported, and why none of it is data-derived: docs/operations.md, "Metrics".
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from dpfed.common.cli_support import check_address
from dpfed.common.privacy.accounting import BudgetStatus
from dpfed.common.toml_config import Section

log = logging.getLogger(__name__)

#: Refusal codes sites send (``dpfed.common.transport.protocol.Refusal.code``); any other
#: code is counted as "other", so a misbehaving site cannot create unbounded label values.
REFUSAL_CODES: tuple[str, ...] = ("not_allowed", "invalid", "budget_exceeded", "conflict",
                                  "deadline", "internal", "awaiting_approval", "denied")
#: Longest HTTP request head (request line and headers) the endpoint reads.
MAX_REQUEST_HEAD = 8192
#: Seconds a scraper has to send its request.
REQUEST_TIMEOUT_S = 10.0


def refusal_code(code: str) -> str:
    """Return ``code`` if it is a known refusal code, else ``"other"``."""
    return code if code in REFUSAL_CODES else "other"


@dataclass(frozen=True)
class MetricsConfig:
    """The ``[metrics]`` table.

    Attributes
    ----------
    enabled : bool
        Serve the endpoint.
    listen : str
        ``HOST:PORT`` of the plain-HTTP endpoint (port 0 picks a free port).
    port_file : Path or None
        Where to write the bound port once serving.
    explicit : bool
        The file sets ``enabled`` or ``listen``: failing to bind is then a start-up error;
        an endpoint that is on only by default is skipped with a warning instead.
    """

    enabled: bool
    listen: str
    port_file: Path | None = None
    explicit: bool = False


def metrics_config(section: Section, *, enabled: bool, listen: str) -> MetricsConfig:
    """Read and check a ``[metrics]`` table, with this program's defaults."""
    explicit = section.has("enabled") or section.has("listen")
    on = section.boolean("enabled", enabled)
    address = section.string("listen", listen) or listen
    check_address(address, f"{section.source}: {section.name}.listen", allow_port_zero=True)
    port_file = section.path("port_file")
    section.check_unknown()
    return MetricsConfig(on, address, port_file, explicit)


def budget_gauges(prefix: str, label_names: Sequence[str],
                  budgets: Iterable[tuple[Sequence[str], BudgetStatus]],
                  ) -> list[GaugeMetricFamily]:
    """Return gauges of spent, remaining and cap of epsilon and delta, and the event count.

    ``budgets`` yields (label values, status): one status per site at the coordinator, the
    site's own at a site. These are exactly the fields of the budget report a site sends the
    coordinator after every task.
    """
    fields = (  # (metric name, BudgetStatus attribute, help)
        ("epsilon_spent", "epsilon_spent", "epsilon spent (under the site's accountant)"),
        ("epsilon_remaining", "epsilon_remaining", "epsilon left"),
        ("epsilon_cap", "epsilon_cap", "total epsilon budget"),
        ("delta_spent", "delta_spent", "delta spent"),
        ("delta_remaining", "delta_remaining", "delta left"),
        ("delta_cap", "delta_cap", "total delta budget"),
        ("rho_spent", "rho_spent", "zCDP rho spent"),
        ("ledger_events", "events", "releases charged to the ledger"),
    )
    families = [GaugeMetricFamily(f"{prefix}_{name}", f"Privacy budget: {doc}.",
                                  labels=list(label_names)) for name, _, doc in fields]
    for labels, status in budgets:
        for family, (_, attribute, _) in zip(families, fields, strict=True):
            family.add_metric(list(labels), float(getattr(status, attribute)))
    return families


class MetricsServer:
    """A running ``/metrics`` endpoint (see :func:`serve_metrics`)."""

    def __init__(self, server: asyncio.Server, port: int) -> None:
        self._server = server
        self.port = port

    async def close(self) -> None:
        """Stop listening and close open scrapes."""
        self._server.close()
        with contextlib.suppress(AttributeError):  # Python < 3.12 has no close_clients
            self._server.close_clients()  # type: ignore[attr-defined]
        await self._server.wait_closed()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def _answer(registry: CollectorRegistry, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    """Answer one HTTP request: the exposition for GET/HEAD /metrics, an error otherwise."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
        method, target, _version = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
            ConnectionError, ValueError):
        writer.close()
        return
    path = target.split("?", 1)[0]
    body, status, content_type = b"", "200 OK", CONTENT_TYPE_LATEST
    if method not in ("GET", "HEAD"):
        status, body, content_type = "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
    elif path not in ("/metrics", "/"):
        status, body, content_type = "404 Not Found", b"GET /metrics\n", "text/plain"
    else:
        body = generate_latest(registry)
    head_out = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("latin-1")
    try:
        writer.write(head_out + (b"" if method == "HEAD" else body))
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def serve_metrics(config: MetricsConfig, registry: CollectorRegistry,
                        who: str) -> MetricsServer | None:
    """Start the endpoint if ``config`` enables it; None when it is off (or skipped).

    Raises
    ------
    OSError
        When an explicitly configured address cannot be bound (exit code 3, naming the key).
    """
    if not config.enabled:
        return None
    host, _, port_text = config.listen.rpartition(":")
    host = host.strip("[]")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer(registry, reader, writer)

    try:
        server = await asyncio.start_server(handle, host, int(port_text),
                                            limit=MAX_REQUEST_HEAD)
    except OSError as exc:
        if not config.explicit:
            log.warning("[Metrics.start] %s metrics are on by default at %s, which cannot be "
                        "bound (%s); running without them -- set [metrics] listen or "
                        "enabled = false", who, config.listen, exc.strerror or exc)
            return None
        raise OSError(exc.errno, f"cannot listen on metrics.listen {config.listen}: "
                                 f"{exc.strerror or exc}") from None
    port = int(server.sockets[0].getsockname()[1])
    if config.port_file is not None:
        tmp = config.port_file.with_suffix(".tmp")
        tmp.write_text(f"{port}\n")
        tmp.replace(config.port_file)
    if _is_loopback(host):
        log.info("[Metrics.start] %s metrics at http://%s:%d/metrics", who, host, port)
    else:
        log.warning("[Metrics.start] %s metrics at http://%s:%d/metrics: not loopback, so "
                    "anyone who can reach this address can read them (plain HTTP, no "
                    "authentication); restrict it with a firewall or network policy",
                    who, host or "*", port)
    return MetricsServer(server, port)
