"""``dpfed-aggregator``: run the coordinator.

Usage: ``dpfed-aggregator --config aggregator.toml [--listen HOST:PORT] [--store DIR]
[--port-file FILE] [--log-level LEVEL] [--log-format text|json] [--insecure]``, or
``dpfed-aggregator --config aggregator.toml --health-check`` to probe a running coordinator's
plaintext health port (``server.health_listen``): exit 0 when it is SERVING, 6 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import sys

from dpfed.common import exit_codes
from dpfed.common.cli_support import add_version, parse_args, run_command
from dpfed.common.errors import ConfigError, CoordinatorUnavailableError

log = logging.getLogger("dpfed.aggregator")

#: Seconds a --health-check probe waits for an answer.
HEALTH_CHECK_TIMEOUT_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    """Build the command-line interface."""
    p = argparse.ArgumentParser(prog="dpfed-aggregator",
                                description="Run the dpfed coordinator (aggregator).",
                                epilog="Exit codes: docs/cli.md.")
    add_version(p)
    p.add_argument("--config", required=True, help="path to aggregator.toml")
    p.add_argument("--listen", help="HOST:PORT to listen on (overrides server.listen; port 0 "
                   "picks a free port)")
    p.add_argument("--store", help="job store directory (overrides store.path)")
    p.add_argument("--port-file", help="write the bound port to this file once serving")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", choices=["text", "json"],
                   help="text lines, or one JSON event per line (overrides logging.format)")
    p.add_argument("--insecure", action="store_true",
                   help="serve without TLS (development only; identities are not verified)")
    p.add_argument("--health-check", action="store_true",
                   help="do not serve: probe the running coordinator's server.health_listen "
                   "port and exit 0 if it is SERVING (a container healthcheck)")
    return p


def health_check(health_listen: str | None, timeout: float = HEALTH_CHECK_TIMEOUT_S) -> int:
    """Probe the plaintext health port; return OK or raise CoordinatorUnavailableError."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if health_listen is None:
        raise ConfigError("--health-check needs server.health_listen in the config (a "
                          "plaintext health port, e.g. \"127.0.0.1:50052\")")
    host, _, port = health_listen.rpartition(":")
    if host in ("0.0.0.0", "[::]", ""):
        host = "127.0.0.1"
    target = f"{host}:{port}"
    with grpc.insecure_channel(target) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as exc:
            raise CoordinatorUnavailableError(
                f"health probe at {target}: {exc.code().name}: {exc.details()}") from None
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        raise CoordinatorUnavailableError(f"health probe at {target}: {status}")
    print(f"coordinator health at {target}: SERVING")
    return exit_codes.OK


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = parse_args(build_parser(), argv)

    def run() -> int:
        import asyncio

        from dpfed.aggregator.config import load_aggregator_config
        from dpfed.common.logs import configure_logging

        config = load_aggregator_config(args.config, {
            "listen": args.listen, "store": args.store, "port_file": args.port_file,
            "log_level": args.log_level, "log_format": args.log_format,
            "insecure": args.insecure})
        if args.health_check:
            return health_check(config.health_listen)
        configure_logging(config.log_level, config.log_file, config.log_format)
        from dpfed.aggregator.server import serve

        asyncio.run(serve(config))
        return exit_codes.OK

    return run_command("dpfed-aggregator", run)


if __name__ == "__main__":
    sys.exit(main())
