"""``keepalive_s`` in aggregator.toml and site.toml: read, bounded, and turned into options."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpfed.aggregator.config import load_aggregator_config
from dpfed.aggregator.local_federation import LocalFederation
from dpfed.common.errors import ConfigError
from dpfed.common.transport.grpc_options import (
    DEFAULT_KEEPALIVE_S,
    channel_options,
    server_options,
)
from dpfed.site_agent.config import load_site_config


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> LocalFederation:
    return LocalFederation.create(tmp_path_factory.mktemp("ka") / "fed", n_sites=1, rows=20,
                                  features=2, seed=1)


def set_key(path: Path, section: str, value: str) -> None:
    text = path.read_text()
    path.write_text(text.replace(f"[{section}]\n", f"[{section}]\nkeepalive_s = {value}\n", 1))


def test_defaults_and_values_are_read(fed: LocalFederation, tmp_path: Path) -> None:
    assert load_aggregator_config(fed.aggregator_config).keepalive_s == DEFAULT_KEEPALIVE_S
    agg = tmp_path / "aggregator.toml"
    agg.write_text(fed.aggregator_config.read_text())
    set_key(agg, "server", "4")
    assert load_aggregator_config(agg).keepalive_s == 4.0
    site = tmp_path / "site.toml"
    site.write_text(fed.site_config("hospital-1").read_text())
    set_key(site, "coordinator", "3.5")
    assert load_site_config(site).keepalive_s == 3.5


@pytest.mark.parametrize("value", ["0", "-1", "0.5", "7200", "\"10\"", "nan"])
def test_out_of_range_values_name_the_key(fed: LocalFederation, tmp_path: Path,
                                          value: str) -> None:
    agg = tmp_path / "aggregator.toml"
    agg.write_text(fed.aggregator_config.read_text())
    set_key(agg, "server", value)
    with pytest.raises(ConfigError, match=r"server\.keepalive_s"):
        load_aggregator_config(agg)
    site = tmp_path / "site.toml"
    site.write_text(fed.site_config("hospital-1").read_text())
    set_key(site, "coordinator", value)
    with pytest.raises(ConfigError, match=r"coordinator\.keepalive_s"):
        load_site_config(site)


def test_keepalive_becomes_ping_interval_and_timeout() -> None:
    for options in (dict(server_options(6.0)), dict(channel_options(None, 6.0))):
        assert options["grpc.keepalive_time_ms"] == 3000
        assert options["grpc.keepalive_timeout_ms"] == 3000
        assert options["grpc.http2.ping_timeout_ms"] == 3000
