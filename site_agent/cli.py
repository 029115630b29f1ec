"""``dpfed-site``: the hospital's site agent.

    dpfed-site --config site.toml [--coordinator HOST:PORT] [--data FILE] [--ledger FILE]
               [--log-level LEVEL] [--log-format text|json] [--insecure]
                                                       run the agent (dials out)
    dpfed-site check --config site.toml [--timeout S]  check config, certificates, schema,
                                                       data, ledger and the coordinator
    dpfed-site ledger --config site.toml [--json]      list the privacy ledger and totals
    dpfed-site health --config site.toml [--max-age S] [--alive]
                                                       is the running agent connected (or,
                                                       with --alive, running at all)?
    dpfed-site ledger export --config site.toml --out FILE   signed export for auditors
    dpfed-site approvals --config site.toml [--all]    jobs waiting for the steward's approval
    dpfed-site approve ID --config site.toml           let a waiting job run
    dpfed-site deny ID --config site.toml [--reason R] refuse it (nothing charged)

``check`` changes nothing: it creates no ledger (an existing one is opened read-only), asks
the coordinator's health service whether it is serving and asks the coordinator whether it
would accept this site's Hello (identity, allow-list, schema), over the same mutual TLS a
running agent uses; it registers nothing. ``health`` only reads the running agent's status
file (:mod:`dpfed.site_agent.agent_status`), for container and service-manager probes.

Exit codes (``dpfed.common.exit_codes``, table in docs/cli.md): 3 bad config, 4 data/schema
problem, 5 certificate problem, 6 coordinator unreachable, 7 rejected by the coordinator.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpfed import __version__
from dpfed.common import exit_codes
from dpfed.common.cli_support import add_version, address, parse_args, run_command
from dpfed.common.errors import (
    CertificateError,
    ConfigError,
    CoordinatorUnavailableError,
    DataError,
    DpfedError,
    SiteRejectedError,
)
from dpfed.common.warm_imports import import_in_background
from dpfed.site_agent.agent_status import DEFAULT_MAX_AGE_S
from dpfed.site_agent.approval_cli import COMMANDS as APPROVAL_COMMANDS
from dpfed.site_agent.approval_cli import add_approval_commands, approval_command

# numpy, pandas, pyarrow and grpc are imported inside the functions that use them, so that
# ``dpfed-site --help`` and ``--version`` answer at once.
if TYPE_CHECKING:
    from dpfed.common.data.data_sources import DataSource, DataSourceSpec
    from dpfed.common.data.schema import Schema
    from dpfed.common.transport.identity import Role
    from dpfed.site_agent.agent_status import StatusWriter
    from dpfed.site_agent.config import SiteConfig
    from dpfed.site_agent.handlers import TaskHandler
    from dpfed.site_agent.row_count import CountedData

#: The certificate role a site dials with.
SITE_ROLE: tuple[Role, ...] = ("site",)
#: Seconds ``dpfed-site check`` waits for the coordinator's health answer.
CHECK_TIMEOUT_S = 10.0


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="path to site.toml")


def build_parser() -> argparse.ArgumentParser:
    """Build the command-line interface."""
    p = argparse.ArgumentParser(prog="dpfed-site", description=__doc__.split("\n\n")[0],
                                epilog="Exit codes: docs/cli.md.")
    add_version(p)
    sub = p.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the agent (the default command)")
    for target in (p, run):
        target.add_argument("--config", help="path to site.toml")
        target.add_argument("--coordinator", type=address("--coordinator"), metavar="HOST:PORT",
                            help="coordinator address (overrides coordinator.address)")
        target.add_argument("--data", help="data file (overrides data.path)")
        target.add_argument("--ledger", help="ledger file (overrides ledger.path)")
        target.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
        target.add_argument("--log-format", choices=["text", "json"],
                            help="text lines, or one JSON event per line (overrides "
                            "logging.format)")
        target.add_argument("--insecure", action="store_true",
                            help="connect without TLS (development only)")
    check = sub.add_parser("check", help="check config, certificates, schema, data, ledger and "
                           "that the coordinator answers over mutual TLS (changes nothing)")
    _add_common(check)
    check.add_argument("--timeout", type=float, default=CHECK_TIMEOUT_S,
                       help=f"seconds to wait for the coordinator (default {CHECK_TIMEOUT_S:g})")
    ledger = sub.add_parser("ledger", help="list the privacy ledger's events and totals")
    _add_common(ledger)
    ledger.add_argument("--json", action="store_true", help="print JSON")
    from dpfed.site_agent.audit_export import add_export_arguments

    add_export_arguments(ledger)
    health = sub.add_parser("health", help="is the running agent connected to the "
                            "coordinator? (reads its status file: a cheap container probe)")
    _add_common(health)
    health.add_argument("--ledger", help="ledger file, if the agent runs with --ledger")
    health.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE_S,
                        help="seconds after which the agent's status counts as stale "
                        f"(default {DEFAULT_MAX_AGE_S:g})")
    health.add_argument("--alive", action="store_true",
                        help="a liveness verdict: healthy while the agent runs, connected or "
                        "still trying to reach the coordinator")
    add_approval_commands(sub)
    return p


def data_spec(config: SiteConfig) -> DataSourceSpec:
    """Return the data source spec described by the config."""
    from dpfed.common.data.data_sources import DataSourceSpec, spec_from_path

    d = config.data
    if d.format == "postgres":
        return DataSourceSpec("postgres", None, table=d.table, query=d.query,
                              chunk_rows=d.chunk_rows, policy=d.row_policy,
                              conninfo=d.conninfo, password=d.password())
    assert d.path is not None
    if d.format is None:
        return spec_from_path(d.path, table=d.table, query=d.query, delimiter=d.delimiter,
                              chunk_rows=d.chunk_rows, policy=d.row_policy)
    return DataSourceSpec(d.format, d.path, table=d.table, query=d.query,
                          delimiter=d.delimiter or ",", chunk_rows=d.chunk_rows,
                          policy=d.row_policy)


@dataclass
class _Prepared:
    config: SiteConfig
    schema: Schema
    source: DataSource
    data: CountedData


def _prepare(config: SiteConfig) -> _Prepared:
    """Everything that must be right before connecting; raises the project's errors.

    Checks the schema, the source's columns and the first rows -- never the whole table:
    the row count is learnt after connecting (:mod:`dpfed.site_agent.row_count`).
    """
    import logging

    from dpfed.common.data.data_sources import open_data_source
    from dpfed.common.data.schema import Schema
    from dpfed.site_agent.row_count import CountedData

    log = logging.getLogger("dpfed.site")
    schema = Schema.load(config.data.schema)
    source = open_data_source(data_spec(config), schema)
    sample = source.check_sample()
    log.info("[Site.start] data %s: columns match the schema; first rows: %s",
             source.describe(), sample.summary())
    return _Prepared(config, schema, source,
                     CountedData(source, config.data.warn_dropped_fraction))


def _handlers(config: SiteConfig) -> tuple[dict[str, TaskHandler], tuple[str, ...]]:
    """Return the handlers and the kinds the site advertises (secure rounds need its key)."""
    import logging

    from dpfed.site_agent.handlers import default_handlers
    from dpfed.site_agent.handlers.secagg import SecureAggregationHandler, SiteIdentity

    handlers: dict[str, TaskHandler] = default_handlers()
    kinds = config.advertised_kinds
    if config.secure.mode != "off" and config.tls is not None:
        identity = SiteIdentity.load(config.tls.ca, config.tls.cert, config.tls.key)
        handlers["secagg"] = SecureAggregationHandler(identity, config.secure,
                                                      allowed_kinds=config.allowed_jobs)
        kinds = (*kinds, "secagg")
        if config.revocation_list is None:
            logging.getLogger("dpfed.site").warning(
                "[Site.start] no tls.revocation_list: every secure round will be refused (the "
                "site cannot tell the federation's sites from revoked or unlisted ones)")
    elif config.secure.mode == "required":
        raise ConfigError(f"{config.source}: policy.secure_aggregation = \"required\" needs TLS "
                          "certificates (secure rounds are signed with the site's key)")
    return handlers, kinds


def _run(config: SiteConfig, status_file: StatusWriter) -> int:
    import asyncio
    import logging
    import signal

    from dpfed.common.jobs.registry import sum_kinds
    from dpfed.common.logs import add_log_context
    from dpfed.common.transport.access import WatchedAccessList
    from dpfed.common.transport.protocol import PROTOCOL_VERSION, SiteHello
    from dpfed.common.transport.tls import check_tls_files, load_channel_credentials
    from dpfed.site_agent.agent import SiteAgent
    from dpfed.site_agent.agent_status import CONNECTED, CONNECTING
    from dpfed.site_agent.coordinator_check import CoordinatorCheck
    from dpfed.site_agent.ledger import Ledger
    from dpfed.site_agent.metrics import SiteMetrics, serving_metrics
    from dpfed.site_agent.runner import TaskRunner

    log = logging.getLogger("dpfed.site")
    if config.deterministic_noise_seed is not None:
        log.warning("[Site.start] testing.deterministic_noise_seed is set: noise is "
                    "reproducible from the seed and NOT private. Use only for demos and tests.")
    credentials = None
    if config.tls is None:
        log.warning("[Site.start] --insecure: no TLS; never use this outside development")
    else:
        material = check_tls_files(config.tls.ca, config.tls.cert, config.tls.key, use="client",
                                   roles=SITE_ROLE)
        add_log_context(site=material.principal.name)
        credentials = load_channel_credentials(config.tls.ca, config.tls.cert, config.tls.key,
                                               role="site")
    prepared = _prepare(config)
    import_in_background()  # what the first task would otherwise import (warm_imports)
    ledger = Ledger(config.ledger_path, config.budget, analyst_budgets=config.analyst_budgets,
                    studies=config.studies)
    handlers, allowed_kinds = _handlers(config)
    runner = TaskRunner(prepared.data, ledger, allowed_kinds, handlers=handlers,
                        deterministic_noise_seed=config.deterministic_noise_seed,
                        secure_required_kinds=(sum_kinds() if config.secure.mode == "required"
                                               else ()),
                        approval=config.approval)
    if config.approval.any_manual:
        log.info("[Site.start] approval policy: %s; waiting jobs: dpfed-site approvals",
                 config.approval.describe())

    def hello() -> SiteHello:
        # 0 until the first full pass: "not counted yet" (docs/data-sources.md, "Start-up").
        return SiteHello(__version__, PROTOCOL_VERSION, prepared.schema.digest(),
                         prepared.data.row_count or 0, allowed_kinds,
                         config.budget.max_epsilon_per_task, ledger.status(),
                         config.secure.summary() if "secagg" in allowed_kinds else "")

    status = ledger.status()
    log.info("[Site.start] ledger %s: %d event(s), epsilon spent %.6g of %g", config.ledger_path,
             status.events, status.epsilon_spent, status.epsilon_cap)
    check = None
    if config.tls is not None and config.revocation_list is not None:
        check = CoordinatorCheck(WatchedAccessList(config.revocation_list), config.tls.ca,
                                 config.tls.cert, config.tls.key, config.server_name)
        log.info("[Site.start] coordinator certificates are checked against %s",
                 config.revocation_list)
    agent = SiteAgent(address=config.coordinator_address, credentials=credentials, runner=runner,
                      hello=hello, connect_timeout_s=config.connect_timeout_s,
                      server_name=config.server_name, coordinator_check=check,
                      keepalive_s=config.keepalive_s,
                      after_connect=prepared.data.ensure_counted,
                      metrics=SiteMetrics(ledger, allowed_kinds))

    async def heartbeat() -> None:
        while True:
            status_file.update(CONNECTED if agent.connected else CONNECTING,
                               agent.site_id or "")
            await asyncio.sleep(1.0)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stop)
        beat = asyncio.create_task(heartbeat())
        try:
            async with serving_metrics(config.metrics, agent.metrics):
                return await agent.run()
        finally:
            beat.cancel()

    try:
        return asyncio.run(main())
    finally:
        ledger.close()


def _run_with_status(config: SiteConfig) -> int:
    """Run the agent, its status file saying ``stopped`` with the exit code at the end.

    ``connecting`` is written first, before the data and ledger are opened, so that a probe
    never reads the verdict of a previous (restarted) process.
    """
    from dpfed.site_agent.agent_status import CONNECTING, STOPPED, StatusWriter, status_path

    status_file = StatusWriter(status_path(config.ledger_path), config.coordinator_address)
    status_file.update(CONNECTING)
    code = exit_codes.INTERNAL_ERROR
    try:
        code = _run(config, status_file)
        return code
    except BaseException as exc:
        code = exit_codes.for_error(exc)
        raise
    finally:
        status_file.update(STOPPED, exit_code=code)


def _coordinator_channel(config: SiteConfig) -> tuple[Any, str]:
    """Open a channel to the coordinator as the agent does; say how it is secured."""
    import grpc

    from dpfed.common.transport.grpc_options import channel_options
    from dpfed.common.transport.tls import load_channel_credentials

    options = channel_options(config.server_name)
    if config.tls is None:
        return (grpc.insecure_channel(config.coordinator_address, options=options),
                "without TLS (--insecure)")
    creds = load_channel_credentials(config.tls.ca, config.tls.cert, config.tls.key,
                                     role="site")
    return (grpc.secure_channel(config.coordinator_address, creds, options=options),
            "mutual TLS handshake ok")


def probe_coordinator(config: SiteConfig, timeout: float) -> str:
    """Ask the coordinator's health service, over mutual TLS with the site's certificate.

    A successful answer proves the address is reachable, the coordinator's certificate
    chains to our CA and names the address (or ``server_name``), and the coordinator
    accepted our client certificate. The health service registers nothing: the site does
    not appear as connected.

    Returns
    -------
    str
        A one-line description of what was verified.

    Raises
    ------
    CoordinatorUnavailableError, CertificateError
        With the gRPC reason and a hint for TLS failures.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from dpfed.common.transport.grpc_errors import tls_hint

    target = config.coordinator_address
    channel, how = _coordinator_channel(config)
    with channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout,
                wait_for_ready=False)
        except grpc.RpcError as exc:
            details = exc.details() or exc.code().name
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED,
                              grpc.StatusCode.PERMISSION_DENIED):
                raise CertificateError(f"{target} refused our certificate: {details}") from None
            raise CoordinatorUnavailableError(
                f"{target} not reachable within {timeout:g}s: {exc.code().name}: "
                f"{details}{tls_hint(details)}") from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        raise CoordinatorUnavailableError(f"{target} answered but is {status}")
    return f"{target} reachable, {how}, health {status}"


class _NotAsked(Exception):
    """A check that could not be made (printed as ``skipped``, not a failure)."""


def ask_admission(config: SiteConfig, schema: Schema, rows: int, timeout: float) -> str:
    """Ask the coordinator whether it would accept this site's Hello (``SiteLink.Preflight``).

    The coordinator makes the checks of a real connection -- the certificate's id on its
    allow-list and not revoked, the protocol version, the schema digest -- and registers
    nothing.

    Raises
    ------
    SiteRejectedError
        The coordinator would refuse the agent (which would then exit 7), with its reason.
    CoordinatorUnavailableError
        No answer.
    """
    import grpc

    from dpfed.common.pb.v1 import site_link_pb2_grpc
    from dpfed.common.transport.protocol import PROTOCOL_VERSION, SiteHello
    from dpfed.common.transport.wire import hello_to_proto

    hello = SiteHello(__version__, PROTOCOL_VERSION, schema.digest(), rows,
                      config.advertised_kinds, config.budget.max_epsilon_per_task, None)
    target = config.coordinator_address
    channel, _ = _coordinator_channel(config)
    with channel:
        try:
            welcome = site_link_pb2_grpc.SiteLinkStub(channel).Preflight(
                hello_to_proto(hello), timeout=timeout)
        except grpc.RpcError as exc:
            details = exc.details() or exc.code().name
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise _NotAsked(f"the coordinator at {target} is older than this site's dpfed "
                                f"{__version__}: it compares the schema when the agent "
                                "connects") from None
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                              grpc.StatusCode.FAILED_PRECONDITION,
                              grpc.StatusCode.INVALID_ARGUMENT):
                raise SiteRejectedError(f"{target} would refuse this site: {details}") from None
            raise CoordinatorUnavailableError(f"{target}: {exc.code().name}: {details}") from None
    return (f"{target} accepts site {welcome.site_id} with this schema (digest "
            f"{schema.digest()[:12]}...), protocol {welcome.protocol_version}, coordinator "
            f"dpfed {welcome.coordinator_version}")


class _Checks:
    """Run named checks, print one ``ok``/``FAILED`` line each, remember the first failure."""

    def __init__(self) -> None:
        self.failures: list[DpfedError | OSError] = []

    def run(self, name: str, fn: Callable[[], str]) -> bool:
        try:
            detail = fn()
        except _NotAsked as exc:
            self.skip(name, str(exc))
            return False
        except (DpfedError, OSError) as exc:
            print(f"FAILED  {name}: {exc}", flush=True)
            self.failures.append(exc)
            return False
        print(f"ok      {name}: {detail}", flush=True)
        return True

    def skip(self, name: str, why: str) -> None:
        print(f"skipped {name}: {why}", flush=True)


def _check(config: SiteConfig, timeout: float) -> int:
    """Check everything a running agent needs, with no side effect; return an exit code."""
    import os

    from dpfed.common.data.data_sources import open_data_source, scan
    from dpfed.common.data.parquet_row_groups import row_group_warning
    from dpfed.common.data.policy_counts import dropped_fraction_warning
    from dpfed.common.data.schema import Schema
    from dpfed.common.transport.access import read_access_list
    from dpfed.common.transport.tls import check_tls_files
    from dpfed.site_agent.ledger import read_status_readonly

    checks = _Checks()
    print(f"ok      config: {config.source}", flush=True)
    state: dict[str, Any] = {}

    def certificate() -> str:
        assert config.tls is not None
        material = check_tls_files(config.tls.ca, config.tls.cert, config.tls.key, use="client",
                                   roles=SITE_ROLE)
        return (f"{material.principal}, chains to {config.tls.ca}, valid until "
                f"{material.not_after:%Y-%m-%d}")

    certs_ok = True
    if config.tls is None:
        checks.skip("certificate", "TLS disabled (tls.insecure); development only")
    else:
        certs_ok = checks.run("certificate", certificate)

    def schema() -> str:
        state["schema"] = Schema.load(config.data.schema)
        s: Schema = state["schema"]
        return f"{config.data.schema}: {len(s.columns)} columns, digest {s.digest()[:12]}..."

    def data() -> str:
        source = open_data_source(data_spec(config), state["schema"])
        report = scan(source)
        warning = dropped_fraction_warning(report, config.data.warn_dropped_fraction)
        if warning is not None:
            print(f"warning data: {warning}", flush=True)
        warning = row_group_warning(source.largest_row_group())
        if warning is not None:
            print(f"warning data: {warning}", flush=True)
        if report.rows_kept == 0:
            raise DataError(f"{source.describe()}: no valid rows after the row policy "
                            f"({report.summary()}); the agent would refuse every task. Fix "
                            "the data or [data] on_missing/on_invalid/on_out_of_range")
        state["rows"] = report.rows_kept
        return f"{source.describe()}: {report.rows_kept} valid rows ({report.summary()})"

    schema_ok = checks.run("schema", schema)
    if schema_ok:
        checks.run("data", data)
    else:
        checks.skip("data", "needs a valid schema")

    def ledger() -> str:
        status = read_status_readonly(config.ledger_path, config.budget)
        if status is None:
            parent = config.ledger_path.parent
            if not parent.is_dir():
                raise ConfigError(
                    f"ledger directory {parent} does not exist")
            if not os.access(parent, os.W_OK):
                raise ConfigError(
                    f"ledger directory {parent} is not writable by this user")
            return (f"{config.ledger_path} does not exist yet; the agent creates it on its "
                    "first run (directory writable)")
        return (f"{config.ledger_path}: {status.events} event(s); epsilon spent "
                f"{status.epsilon_spent:.6g} of {status.epsilon_cap:g} ({status.accountant}), "
                "opened read-only")

    checks.run("ledger", ledger)
    if config.revocation_list is not None:
        revocation_list = config.revocation_list

        def revocations() -> str:
            revoked = read_access_list(revocation_list).revoked
            return f"{revocation_list}: {len(revoked)} revoked certificate(s)"

        checks.run("revocation list", revocations)
    for analyst, cap in sorted(config.analyst_budgets.items()):
        checks.skip(f"analyst {analyst}", f"may spend epsilon {cap:g} of this site's "
                    f"{config.budget.epsilon:g}")
    reached = False
    if certs_ok:
        reached = checks.run("coordinator", lambda: probe_coordinator(config, timeout))
    else:
        checks.skip("coordinator", "needs a valid certificate")
    if reached and schema_ok:
        checks.run("admission", lambda: ask_admission(config, state["schema"],
                                                      state.get("rows", 0), timeout))
    else:
        checks.skip("admission", "needs the coordinator and a valid schema")
    if checks.failures:
        print(f"{len(checks.failures)} check(s) failed", flush=True)
        return exit_codes.for_error(checks.failures[0])
    print("all checks passed", flush=True)
    return exit_codes.OK


def _ledger(config: SiteConfig, as_json: bool) -> int:
    import json

    from dpfed.site_agent.ledger import Ledger, format_ledger, ledger_as_json

    ledger = Ledger(config.ledger_path, config.budget, studies=config.studies)
    try:
        if as_json:
            print(json.dumps(ledger_as_json(ledger), indent=2))
        else:
            print(format_ledger(ledger))
    finally:
        ledger.close()
    return exit_codes.OK


def _health(config_file: str, ledger: str | None, max_age: float, alive: bool) -> int:
    """Print the running agent's health; reads ``[ledger] path`` only, imports nothing heavy."""
    from pathlib import Path

    from dpfed.site_agent.agent_status import configured_status_path, health, read_status

    path = configured_status_path(Path(config_file), ledger)
    code, line = health(read_status(path), path, max_age, alive_is_enough=alive)
    print(f"{'healthy' if code == exit_codes.OK else 'unhealthy'}: {line}", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = parse_args(build_parser(), argv)
    command = args.command or "run"
    if not args.config:
        print("dpfed-site: --config is required (path to site.toml)", file=sys.stderr)
        return exit_codes.USAGE

    def go() -> int:
        if command == "health":
            return _health(args.config, args.ledger, args.max_age, args.alive)
        from dpfed.common.logs import configure_logging
        from dpfed.site_agent.config import load_site_config

        overrides: dict[str, Any] = {}
        if command in APPROVAL_COMMANDS:
            overrides = {"ledger": args.ledger}
        if command == "run":
            overrides = {"coordinator": args.coordinator, "data": args.data,
                         "ledger": args.ledger, "log_level": args.log_level,
                         "log_format": args.log_format, "insecure": args.insecure}
        config = load_site_config(args.config, overrides)
        if command == "run":
            configure_logging(config.log_level, config.log_file, config.log_format)
        else:
            configure_logging("WARNING", None, config.log_format)
        if command == "check":
            return _check(config, args.timeout)
        if command == "ledger" and args.action == "export":
            from dpfed.site_agent.audit_export import export_command

            return export_command(config, args.out)
        if command == "ledger":
            return _ledger(config, args.json)
        if command in APPROVAL_COMMANDS:
            return approval_command(config, args)
        return _run_with_status(config)

    return run_command(f"dpfed-site {command}" if command != "run" else "dpfed-site", go)


if __name__ == "__main__":
    sys.exit(main())
