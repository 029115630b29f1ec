"""The coordinator's configuration (``aggregator.toml``).

Example (paths relative to the file)::

    [server]
    listen = "0.0.0.0:50051"
    keepalive_s = 10            # a silent (dead or hung) site is dropped within this time
    # health_listen = "127.0.0.1:50052"  # optional plaintext gRPC health port (see
    #                                    # docs/operations.md): health status only, no TLS

    [tls]
    ca = "certs/ca.pem"
    cert = "certs/coordinator/coordinator.pem"
    key = "certs/coordinator/coordinator.key"

    [federation]
    schema = "schema.toml"
    access_list = "certs/coordinator/access.toml"  # written by 'dpfed certs'; re-read on change
    allowed_sites = []          # more site ids admitted besides the access list's
    allowed_analysts = []       # more analyst ids admitted besides the access list's
    # allow_any_site = false    # labs only: admit any site the federation CA signed (logged)
    # allow_any_analyst = false # labs only: admit any analyst the federation CA signed (logged)
    access_reload_s = 1.0       # how often live sessions are checked (0.1 to 3600 s)

A site or analyst is admitted only if its id is on an allow-list (``access_list`` or the
inline lists) and its certificate is not revoked; with no list at all nobody is admitted.

    [access]                    # optional: who may see other analysts' jobs
    admins = []                 # analyst ids that may read and cancel every job
    [access.groups]             # members read (watch, list, fetch) each other's jobs
    # cardiology = ["alice", "bob"]

Without ``[access]`` every analyst sees, fetches, cancels and continues only its own jobs
and SVT sessions (``dpfed.aggregator.access_control.JobAccess``).

    [jobs]
    min_sites = 2               # default quorum (1 to 10 000)
    task_deadline_s = 600       # default per-task deadline (seconds, at most 30 days)
    resume_wait_s = 60          # after a restart, how long resumed jobs wait for their sites
                                # (above the agents' 30 s maximum reconnect backoff; 0 to 30 days)

    [store]
    path = "store"

    [logging]
    level = "INFO"
    format = "text"             # text | json (one JSON event per line)
    # file = "coordinator.log"

    [metrics]                   # Prometheus endpoint, plain HTTP (docs/operations.md)
    enabled = true              # on by default on the coordinator
    listen = "127.0.0.1:9464"   # loopback by default
    # port_file = "metrics.port"  # write the bound port here once serving
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpfed.common.cli_support import check_address
from dpfed.common.errors import ConfigError
from dpfed.common.logs import LOG_FORMATS
from dpfed.common.metrics import MetricsConfig, metrics_config
from dpfed.common.toml_config import Section, TlsConfig, read_toml, tls_from_section
from dpfed.common.transport.grpc_options import (
    DEFAULT_KEEPALIVE_S,
    MAX_KEEPALIVE_S,
    MIN_KEEPALIVE_S,
)
from dpfed.common.transport.identity import check_principal_id

#: Longest task deadline and resume wait (the same 30 days an analyst's deadline may be).
MAX_DEADLINE_S = 30 * 86400.0
#: Most sites a quorum may name (as for an analyst's request).
MAX_SITES = 10_000
#: Range of ``federation.access_reload_s``.
MIN_RELOAD_S, MAX_RELOAD_S = 0.1, 3600.0


@dataclass(frozen=True)
class AggregatorConfig:
    """Everything ``dpfed-aggregator`` needs."""

    source: str
    listen: str
    tls: TlsConfig | None
    schema_path: Path
    allowed_sites: tuple[str, ...]
    min_sites: int
    task_deadline_s: float
    resume_wait_s: float
    store_path: Path
    log_level: str = "INFO"
    log_file: Path | None = None
    port_file: Path | None = None
    access_list: Path | None = None
    allowed_analysts: tuple[str, ...] = ()
    allow_any_site: bool = False
    allow_any_analyst: bool = False
    access_reload_s: float = 1.0
    keepalive_s: float = DEFAULT_KEEPALIVE_S
    log_format: str = "text"
    health_listen: str | None = None
    metrics: MetricsConfig = MetricsConfig(enabled=False, listen="127.0.0.1:9464")
    #: ``[access]``: analyst groups that read each other's jobs, and the admin analysts.
    read_groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    admins: tuple[str, ...] = ()


def load_aggregator_config(path: str | Path,
                           overrides: dict[str, Any] | None = None) -> AggregatorConfig:
    """Read and validate ``aggregator.toml``; ``overrides`` from flags win.

    Recognised overrides: ``listen``, ``store``, ``port_file``, ``log_level``, ``log_format``,
    ``insecure``.
    """
    overrides = overrides or {}
    p = Path(path)
    root = Section(read_toml(p), "", str(p), p.resolve().parent)
    server = root.section("server")
    file_listen = server.string("listen", "0.0.0.0:50051")  # read even when overridden
    listen = overrides.get("listen") or file_listen
    assert listen is not None
    check_address(listen, f"{p}: server.listen", allow_port_zero=True)
    health_listen = server.string("health_listen") or None
    if health_listen is not None:
        check_address(health_listen, f"{p}: server.health_listen", allow_port_zero=True)
    keepalive_s = server.number("keepalive_s", DEFAULT_KEEPALIVE_S)
    if keepalive_s is None or not MIN_KEEPALIVE_S <= keepalive_s <= MAX_KEEPALIVE_S:
        raise ConfigError(f"{p}: server.keepalive_s must be between {MIN_KEEPALIVE_S:g} and "
                          f"{MAX_KEEPALIVE_S:g} seconds, got {keepalive_s!r}")
    file_port_file = server.path("port_file")
    port_file = Path(overrides["port_file"]) if overrides.get("port_file") else file_port_file
    server.check_unknown()

    tls_s = root.section("tls")
    insecure = bool(overrides.get("insecure")) or tls_s.boolean("insecure", False)
    tls = tls_from_section(tls_s, insecure)
    tls_s.check_unknown()

    fed = root.section("federation", required=True)
    schema_path = fed.path("schema", required=True)
    allowed = tuple(fed.str_list("allowed_sites", []))
    access_list = fed.path("access_list")
    allowed_analysts = tuple(fed.str_list("allowed_analysts", []))
    allow_any_site = fed.boolean("allow_any_site", False)
    allow_any_analyst = fed.boolean("allow_any_analyst", False)
    access_reload_s = fed.number("access_reload_s", 1.0, minimum=MIN_RELOAD_S,
                                 maximum=MAX_RELOAD_S, unit=" seconds")
    fed.check_unknown()

    jobs = root.section("jobs")
    min_sites = jobs.integer("min_sites", 1, minimum=1, maximum=MAX_SITES)
    deadline = jobs.number("task_deadline_s", 600.0, positive=True, maximum=MAX_DEADLINE_S,
                           unit=" seconds (30 days)")
    resume_wait = jobs.number("resume_wait_s", 60.0, minimum=0.0, maximum=MAX_DEADLINE_S,
                              unit=" seconds (30 days)")
    jobs.check_unknown()

    store = root.section("store")
    file_store = store.path("path", "store")
    store_path = Path(overrides["store"]) if overrides.get("store") else file_store
    store.check_unknown()

    access = root.section("access")
    admins = _analyst_ids(access, "admins", access.str_list("admins", []))
    groups_section = access.section("groups")
    read_groups = {name: _analyst_ids(groups_section, name, groups_section.str_list(name, []))
                   for name in list(groups_section.data)}
    groups_section.check_unknown()
    access.check_unknown()

    lg = root.section("logging")
    file_level = lg.string("level", "INFO") or "INFO"
    level = (overrides.get("log_level") or file_level).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"{p}: logging.level must be DEBUG, INFO, WARNING or ERROR, "
                          f"got {level!r}")
    log_file = lg.path("file")
    file_format = lg.string("format", "text") or "text"  # read even when overridden
    log_format = overrides.get("log_format") or file_format
    if log_format not in LOG_FORMATS:
        raise ConfigError(f"{p}: logging.format must be one of {', '.join(LOG_FORMATS)}, "
                          f"got {log_format!r}")
    lg.check_unknown()
    metrics = metrics_config(root.section("metrics"), enabled=True, listen="127.0.0.1:9464")
    root.check_unknown()
    assert schema_path is not None and store_path is not None
    assert min_sites is not None and deadline is not None and resume_wait is not None
    assert access_reload_s is not None
    return AggregatorConfig(str(p), listen, tls, schema_path, allowed, min_sites, deadline,
                            resume_wait, store_path, level, log_file, port_file,
                            access_list=access_list, allowed_analysts=allowed_analysts,
                            allow_any_site=bool(allow_any_site),
                            allow_any_analyst=bool(allow_any_analyst),
                            access_reload_s=access_reload_s,
                            keepalive_s=keepalive_s,
                            log_format=log_format, health_listen=health_listen,
                            metrics=metrics, read_groups=read_groups, admins=admins)


def _analyst_ids(section: Section, key: str, ids: list[str]) -> tuple[str, ...]:
    """Validate a list of analyst ids from ``[access]`` (ConfigError naming the key)."""
    try:
        return tuple(sorted({check_principal_id(i, "analyst") for i in ids}))
    except ValueError as exc:
        raise ConfigError(f"{section.source}: {section.name}.{key}: {exc}") from None
