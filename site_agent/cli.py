"""``dpfed-site``: the hospital's site agent.

    dpfed-site --config site.toml [--coordinator HOST:PORT] [--data FILE] [--ledger FILE]
               [--log-level LEVEL] [--insecure]        run the agent (dials out)
    dpfed-site check --config site.toml                check config, certificates, schema, data
    dpfed-site ledger --config site.toml [--json]      list the privacy ledger and totals

Exit codes (``dpfed.common.exit_codes``): 3 bad config, 4 data/schema problem, 5 certificate
problem,
6 coordinator unreachable, 7 rejected by the coordinator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from dataclasses import dataclass

from dpfed import __version__
from dpfed.common import exit_codes
from dpfed.common.data.data_sources import (
    DataSource,
    DataSourceSpec,
    open_data_source,
    spec_from_path,
)
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ConfigError, DpfedError
from dpfed.common.logs import configure_logging
from dpfed.common.transport.access import WatchedAccessList, read_access_list
from dpfed.common.transport.certs import Role
from dpfed.common.transport.protocol import PROTOCOL_VERSION, SiteHello
from dpfed.common.transport.tls import check_tls_files, load_channel_credentials
from dpfed.site_agent.agent import SiteAgent
from dpfed.site_agent.config import SiteConfig, load_site_config
from dpfed.site_agent.coordinator_check import CoordinatorCheck
from dpfed.site_agent.handlers import HANDLERS, TaskHandler
from dpfed.site_agent.handlers.secagg import SUM_KINDS, SecureAggregationHandler, SiteIdentity
from dpfed.site_agent.ledger import Ledger, format_ledger, ledger_as_json
from dpfed.site_agent.row_count import CountedData
from dpfed.site_agent.runner import TaskRunner

log = logging.getLogger("dpfed.site")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="path to site.toml")


def build_parser() -> argparse.ArgumentParser:
    """Build the command-line interface."""
    p = argparse.ArgumentParser(prog="dpfed-site", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the agent (the default command)")
    for target in (p, run):
        target.add_argument("--config", help="path to site.toml")
        target.add_argument("--coordinator", help="coordinator HOST:PORT (overrides the file)")
        target.add_argument("--data", help="data file (overrides data.path)")
        target.add_argument("--ledger", help="ledger file (overrides ledger.path)")
        target.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
        target.add_argument("--insecure", action="store_true",
                            help="connect without TLS (development only)")
    check = sub.add_parser("check", help="validate config, certificates, schema and data")
    _add_common(check)
    ledger = sub.add_parser("ledger", help="list the privacy ledger's events and totals")
    _add_common(ledger)
    ledger.add_argument("--json", action="store_true", help="print JSON")
    return p


def data_spec(config: SiteConfig) -> DataSourceSpec:
    """Return the data source spec described by the config."""
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
    schema = Schema.load(config.data.schema)
    source = open_data_source(data_spec(config), schema)
    sample = source.check_sample()
    log.info("[Site.start] data %s: columns match the schema; first rows: %s",
             source.describe(), sample.summary())
    return _Prepared(config, schema, source, CountedData(source))


def _handlers(config: SiteConfig) -> tuple[dict[str, TaskHandler], tuple[str, ...]]:
    """Return the handlers and the kinds the site advertises (secure rounds need its key)."""
    handlers: dict[str, TaskHandler] = dict(HANDLERS)
    kinds = config.allowed_jobs
    if config.secure.mode != "off" and config.tls is not None:
        identity = SiteIdentity.load(config.tls.ca, config.tls.cert, config.tls.key)
        handlers["secagg"] = SecureAggregationHandler(identity, config.secure)
        kinds = (*kinds, "secagg")
    elif config.secure.mode == "required":
        raise ConfigError(f"{config.source}: policy.secure_aggregation = \"required\" needs TLS "
                          "certificates (secure rounds are signed with the site's key)")
    return handlers, kinds


def _run(config: SiteConfig) -> int:
    if config.deterministic_noise_seed is not None:
        log.warning("[Site.start] testing.deterministic_noise_seed is set: noise is "
                    "reproducible from the seed and NOT private. Use only for demos and tests.")
    credentials = None
    if config.tls is None:
        log.warning("[Site.start] --insecure: no TLS; never use this outside development")
    else:
        credentials = load_channel_credentials(config.tls.ca, config.tls.cert, config.tls.key,
                                               role="site")
    prepared = _prepare(config)
    ledger = Ledger(config.ledger_path, config.budget, analyst_budgets=config.analyst_budgets)
    handlers, allowed_kinds = _handlers(config)
    runner = TaskRunner(prepared.data, ledger, allowed_kinds, handlers=handlers,
                        deterministic_noise_seed=config.deterministic_noise_seed,
                        secure_required_kinds=(SUM_KINDS if config.secure.mode == "required"
                                               else ()))

    def hello() -> SiteHello:
        # 0 until the first full pass: "not counted yet" (docs/data-sources.md, "Start-up").
        return SiteHello(__version__, PROTOCOL_VERSION, prepared.schema.digest(),
                         prepared.data.row_count or 0, allowed_kinds,
                         config.budget.max_epsilon_per_task, ledger.status())

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
                      after_connect=prepared.data.ensure_counted)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stop)
        return await agent.run()

    try:
        return asyncio.run(main())
    finally:
        ledger.close()


def _check(config: SiteConfig) -> int:
    if config.tls is not None:
        site_role: tuple[Role, ...] = ("site",)
        material = check_tls_files(config.tls.ca, config.tls.cert, config.tls.key, use="client",
                                   roles=site_role)
        print(f"certificate: {material.principal}, valid until {material.not_after:%Y-%m-%d}")
    if config.revocation_list is not None:
        revoked = read_access_list(config.revocation_list).revoked
        print(f"revocation list: {config.revocation_list}: {len(revoked)} revoked certificate(s)")
    prepared = _prepare(config)
    print(f"schema: {len(prepared.schema.columns)} columns, digest "
          f"{prepared.schema.digest()[:12]}...")
    prepared.data.ensure_counted()  # an explicit check may read the whole table
    print(f"data: {prepared.source.describe()}: {prepared.data.row_count} valid rows")
    ledger = Ledger(config.ledger_path, config.budget, analyst_budgets=config.analyst_budgets)
    try:
        s = ledger.status()
        print(f"ledger: {config.ledger_path}: {s.events} event(s); epsilon spent "
              f"{s.epsilon_spent:.6g} of {s.epsilon_cap:g} ({s.accountant})")
        for analyst in sorted(config.analyst_budgets):
            share = ledger.analyst_status(analyst)
            assert share is not None
            print(f"  analyst {analyst}: epsilon spent {share.epsilon_spent:.6g} of its share "
                  f"{share.epsilon_cap:g}")
    finally:
        ledger.close()
    print(f"coordinator: {config.coordinator_address}")
    print("ok")
    return exit_codes.OK


def _ledger(config: SiteConfig, as_json: bool) -> int:
    ledger = Ledger(config.ledger_path, config.budget)
    try:
        if as_json:
            print(json.dumps(ledger_as_json(ledger), indent=2))
        else:
            print(format_ledger(ledger))
    finally:
        ledger.close()
    return exit_codes.OK


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    command = args.command or "run"
    if not args.config:
        print("dpfed-site: --config is required (path to site.toml)", file=sys.stderr)
        return exit_codes.USAGE
    overrides = {}
    if command == "run":
        overrides = {"coordinator": args.coordinator, "data": args.data, "ledger": args.ledger,
                     "log_level": args.log_level, "insecure": args.insecure}
    try:
        config = load_site_config(args.config, overrides)
        configure_logging(config.log_level if command == "run" else "WARNING", config.log_file
                          if command == "run" else None)
        if command == "check":
            return _check(config)
        if command == "ledger":
            return _ledger(config, args.json)
        return _run(config)
    except (DpfedError, KeyboardInterrupt) as exc:
        if not isinstance(exc, KeyboardInterrupt):
            print(f"dpfed-site: {exc}", file=sys.stderr)
        return exit_codes.for_error(exc)


if __name__ == "__main__":
    sys.exit(main())
