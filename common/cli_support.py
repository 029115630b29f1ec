"""What the command lines of ``dpfed``, ``dpfed-site`` and ``dpfed-aggregator`` share.

- :func:`add_version`: ``--version`` printing ``dpfed.__version__``;
- :func:`run_command`: the one path from an exception to a message on stderr and an exit
  code (:mod:`dpfed.common.exit_codes`), with internal field names rewritten to the flags the
  user typed (:func:`user_message`) and a quiet exit when stdout's reader goes away
  (``dpfed jobs | head``);
- :func:`address`: the ``HOST:PORT`` check used by every ``--coordinator`` / ``--listen``;
- :func:`add_json_flag` / :func:`print_json`: ``--json`` output.

This module imports only the standard library and ``dpfed.common.errors`` so that
``--help`` stays fast: commands import numpy, grpc or pandas inside their own function.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

from dpfed import __version__
from dpfed.common import exit_codes
from dpfed.common.errors import ConfigError, DpfedError

#: Field names of job parameters as the coordinator and the library name them, and the flag a
#: CLI user typed for each. A command adds its own with ``set_defaults(field_flags={...})``.
COMMON_FIELD_FLAGS: Mapping[str, str] = {
    "epsilon": "--epsilon",
    "delta": "--delta",
    "min_sites": "--min-sites",
    "deadline_seconds": "--deadline",
}


def add_version(parser: argparse.ArgumentParser) -> None:
    """Add ``--version`` (prints ``PROG VERSION`` and exits 0)."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--json``: machine-readable output (field names documented in docs/cli.md)."""
    parser.add_argument("--json", action="store_true",
                        help="print JSON (stable field names, see docs/cli.md)")


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def print_json(value: Any) -> None:
    """Print ``value`` as indented JSON (NaN and infinities become null)."""
    print(json.dumps(_json_safe(value), indent=2))


_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^\s:\[\]]+)):(?P<port>\d+)$")


def check_address(text: str, what: str, *, allow_port_zero: bool = False) -> str:
    """Return ``text`` if it is ``host:port`` (``[v6]:port`` for IPv6); raise ConfigError.

    Parameters
    ----------
    text : str
        The address.
    what : str
        How the user gave it (``"--coordinator"``, ``"DPFED_COORDINATOR"``), for the message.
    allow_port_zero : bool
        Whether port 0 ("pick a free port", for listening) is accepted.
    """
    m = _HOST_PORT.match(text.strip())
    low = 0 if allow_port_zero else 1
    if m is None or not low <= int(m.group("port")) <= 65535:
        host = text.strip().rsplit(":", 1)[0] if ":" in text and "]" not in text else text.strip()
        example = f"{host or 'coordinator.example.org'}:50051"
        raise ConfigError(f"{what} must be host:port with a port in {low}..65535 (e.g. "
                          f"{example}), got {text!r}")
    return text.strip()


def address(what: str) -> Callable[[str], str]:
    """Return an argparse ``type=`` that checks ``HOST:PORT`` for the flag ``what``."""

    def parse(text: str) -> str:
        try:
            return check_address(text, what)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "HOST:PORT"
    return parse


def user_message(exc: BaseException, field_flags: Mapping[str, str] | None = None) -> str:
    """Return ``str(exc)`` with internal parameter names replaced by the user's flags.

    Names with an underscore (``n_components``) are replaced wherever they appear;
    ``name=value`` becomes ``--flag value``; plain words (``rank``, ``epsilon``) are replaced
    only where they lead a validation message ("rank must be ..."), so prose such as "spent
    epsilon 1.0" is left alone. A dotted configuration key (``jobs.min_sites``, ``budget.delta``)
    names a file's key, not a flag, and is never rewritten.
    """
    text = str(exc)
    flags = {**COMMON_FIELD_FLAGS, **(field_flags or {})}
    for name in sorted(flags, key=len, reverse=True):
        flag = flags[name]
        # name='value' / name=value  ->  --flag value
        text = re.sub(rf"(?<![\w.-]){re.escape(name)}=(['\"]?)([^\s'\",;)]*)\1",
                      rf"{flag} \2", text)
        if "_" in name:
            text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?!\w)", flag, text)
        else:
            text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?= must )", flag, text)
    return text


def _quiet_stdout() -> None:
    # Point stdout at /dev/null so the interpreter's final flush cannot fail again
    # (the recipe of the Python documentation for SIGPIPE).
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def run_command(prog: str, func: Callable[[], int],
                field_flags: Mapping[str, str] | None = None) -> int:
    """Run a command; turn every expected failure into a one-line message and an exit code.

    Parameters
    ----------
    prog : str
        Prefix of the message on stderr (``"dpfed pca"``).
    func : callable
        The command; returns its exit code.
    field_flags : mapping, optional
        Internal field name -> flag, for :func:`user_message`.

    Returns
    -------
    int
        ``func``'s code, or :func:`dpfed.common.exit_codes.for_error` of what it raised.
        Anything that is not a :class:`DpfedError`, ``OSError`` or interruption is a bug and
        propagates with its traceback (exit 1).
    """
    try:
        code = func()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return exit_codes.PIPE_CLOSED
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return exit_codes.INTERRUPTED
    except (DpfedError, OSError) as exc:
        print(f"{prog}: {user_message(exc, field_flags)}", file=sys.stderr)
        return exit_codes.for_error(exc)


def format_table(headers: tuple[str, ...], rows: list[tuple[Any, ...]],
                 right: tuple[int, ...] = ()) -> str:
    """Render rows under a header, every column as wide as its widest cell (nothing cut).

    Columns whose index is in ``right`` are right-aligned (numbers); the last column is not
    padded, so a long free-text column (an error message) stays whole at the end of its line.
    """
    cells = [tuple(str(c) for c in headers)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [r[i].rjust(widths[i]) if i in right else r[i].ljust(widths[i])
                 for i in range(len(headers))]
        parts[-1] = r[-1] if len(headers) - 1 not in right else parts[-1]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


class LazyArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose arguments are added on first use.

    Used as the ``parser_class`` of a CLI's sub-commands: a sub-command whose options live
    in a heavy module (``dpfed simulate`` imports numpy) passes ``populate=fn``; ``fn(parser)``
    runs only when that sub-command is parsed (its own ``--help`` included), so the top-level
    ``--help`` imports nothing heavy.
    """

    def __init__(self, *args: Any,
                 populate: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._populate = populate

    def _ensure_populated(self) -> None:
        if self._populate is not None:
            populate, self._populate = self._populate, None
            populate(self)

    def parse_known_args(self, args: Any = None,  # type: ignore[override]
                         namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        """Add the deferred arguments, then parse."""
        self._ensure_populated()
        return super().parse_known_args(args, namespace)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, exiting quietly if ``--help`` output meets a closed pipe."""
    try:
        return parser.parse_args(argv)
    except BrokenPipeError:
        _quiet_stdout()
        raise SystemExit(exit_codes.PIPE_CLOSED) from None
