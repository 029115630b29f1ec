"""``dpfed-aggregator``: run the coordinator.

Usage: ``dpfed-aggregator --config aggregator.toml [--listen HOST:PORT] [--store DIR]
[--port-file FILE] [--log-level LEVEL] [--insecure]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from dpfed.aggregator.config import load_aggregator_config
from dpfed.common import exit_codes
from dpfed.common.errors import DpfedError
from dpfed.common.logs import configure_logging

log = logging.getLogger("dpfed.aggregator")


def build_parser() -> argparse.ArgumentParser:
    """Build the command-line interface."""
    p = argparse.ArgumentParser(prog="dpfed-aggregator",
                                description="Run the dpfed coordinator (aggregator).")
    p.add_argument("--config", required=True, help="path to aggregator.toml")
    p.add_argument("--listen", help="HOST:PORT to listen on (overrides server.listen; port 0 "
                   "picks a free port)")
    p.add_argument("--store", help="job store directory (overrides store.path)")
    p.add_argument("--port-file", help="write the bound port to this file once serving")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--insecure", action="store_true",
                   help="serve without TLS (development only; identities are not verified)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        config = load_aggregator_config(args.config, {
            "listen": args.listen, "store": args.store, "port_file": args.port_file,
            "log_level": args.log_level, "insecure": args.insecure})
        configure_logging(config.log_level, config.log_file)
        from dpfed.aggregator.server import serve

        asyncio.run(serve(config))
    except (DpfedError, OSError, KeyboardInterrupt) as exc:
        if not isinstance(exc, KeyboardInterrupt):
            print(f"dpfed-aggregator: {exc}", file=sys.stderr)
        return exit_codes.for_error(exc)
    return exit_codes.OK

if __name__ == "__main__":
    sys.exit(main())
