"""The /metrics endpoint and the [metrics] config table (real sockets on loopback)."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from dpfed.aggregator.config import load_aggregator_config
from dpfed.common.errors import ConfigError
from dpfed.common.metrics import (
    MAX_REQUEST_HEAD,
    MetricsConfig,
    refusal_code,
    serve_metrics,
)
from dpfed.site_agent.config import load_site_config

ROOT = Path(__file__).resolve().parents[2]


def _aggregator_toml(tmp_path: Path, metrics: str) -> Path:
    path = tmp_path / "aggregator.toml"
    path.write_text(f'[tls]\ninsecure = true\n\n[federation]\nschema = "s.toml"\n\n{metrics}')
    return path


def _site_toml(tmp_path: Path, metrics: str) -> Path:
    path = tmp_path / "site.toml"
    path.write_text('[coordinator]\naddress = "localhost:50051"\n\n[tls]\ninsecure = true\n\n'
                    '[data]\npath = "d.csv"\nschema = "s.toml"\n\n'
                    f'[budget]\nepsilon = 1.0\ndelta = 1e-5\n\n{metrics}')
    return path


def test_defaults_coordinator_on_site_off_both_on_loopback(tmp_path: Path) -> None:
    coordinator = load_aggregator_config(_aggregator_toml(tmp_path, "")).metrics
    site = load_site_config(_site_toml(tmp_path, "")).metrics
    assert (coordinator.enabled, coordinator.listen, coordinator.explicit) == (
        True, "127.0.0.1:9464", False)
    assert (site.enabled, site.listen) == (False, "127.0.0.1:9465")
    on = load_site_config(_site_toml(tmp_path, "[metrics]\nenabled = true\n")).metrics
    assert on.enabled and on.explicit and on.listen == "127.0.0.1:9465"
    # The example configs document the same defaults.
    assert load_aggregator_config(ROOT / "deploy" / "examples" / "aggregator.toml").metrics.enabled
    assert not load_site_config(ROOT / "deploy" / "examples" / "site.toml").metrics.enabled


@pytest.mark.parametrize(("table", "message"), [
    ('listen = "9464"', r"metrics\.listen must be host:port"),
    ('listen = "localhost:70000"', r"metrics\.listen must be host:port"),
    ('enabled = "yes"', r"metrics\.enabled must be true or false"),
    ('lisen = "127.0.0.1:1"', r"unknown key\(s\) \['lisen'\] in \[metrics\]"),
    ("port_file = 3", r"metrics\.port_file must be a string"),
])
def test_bad_metrics_keys_are_refused_at_start_up(tmp_path: Path, table: str,
                                                  message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_aggregator_config(_aggregator_toml(tmp_path, f"[metrics]\n{table}\n"))
    with pytest.raises(ConfigError, match=message):
        load_site_config(_site_toml(tmp_path, f"[metrics]\n{table}\n"))


def test_unknown_refusal_codes_share_one_label() -> None:
    assert refusal_code("budget_exceeded") == "budget_exceeded"
    assert refusal_code("x" * 64) == "other" and refusal_code("") == "other"


async def _request(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return data


async def test_the_endpoint_serves_its_own_registry_and_nothing_else(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    Counter("demo_things", "Things.", registry=registry).inc(3)
    config = MetricsConfig(True, "127.0.0.1:0", tmp_path / "metrics.port", explicit=True)
    server = await serve_metrics(config, registry, "test")
    assert server is not None
    try:
        assert int((tmp_path / "metrics.port").read_text()) == server.port
        ok = await _request(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = ok.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and b"text/plain; version=" in head
        assert b"demo_things_total 3.0" in body and b"dpfed_" not in body
        assert (await _request(server.port, b"HEAD /metrics HTTP/1.1\r\n\r\n")).endswith(
            b"\r\n\r\n")
        assert (await _request(server.port, b"GET /admin HTTP/1.1\r\n\r\n")).startswith(
            b"HTTP/1.1 404")
        assert (await _request(server.port, b"POST /metrics HTTP/1.1\r\n\r\n")).startswith(
            b"HTTP/1.1 405")
        assert await _request(server.port, b"garbage\r\n\r\n") == b""
        # A head that never ends within the limit is dropped, not buffered.
        assert await _request(server.port, b"GET /" + b"a" * (2 * MAX_REQUEST_HEAD)) == b""
        # The server still answers after all of that.
        assert b"demo_things_total" in await _request(server.port, b"GET / HTTP/1.0\r\n\r\n")
    finally:
        await server.close()


async def test_a_busy_port_fails_if_configured_and_is_skipped_if_only_default(
        caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot listen on metrics\.listen 127\.0\.0\.1:{port}"):
            await serve_metrics(MetricsConfig(True, f"127.0.0.1:{port}", explicit=True),
                                CollectorRegistry(), "test")
        with caplog.at_level(logging.WARNING):
            assert await serve_metrics(MetricsConfig(True, f"127.0.0.1:{port}"),
                                       CollectorRegistry(), "coordinator") is None
        assert "running without them" in caplog.text
    assert await serve_metrics(MetricsConfig(False, "127.0.0.1:0", explicit=True),
                               CollectorRegistry(), "test") is None
