"""Strict reading of TOML configuration files (``site.toml``, ``aggregator.toml``).

Every error is a :class:`dpfed.common.errors.ConfigError` naming the file, the key (as
``section.key``) and what would be valid. Unknown keys are errors, so a typo never silently
falls back to a default. Relative paths are resolved against the config file's directory.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpfed.common.errors import ConfigError


@dataclass(frozen=True)
class TlsConfig:
    """Certificate files: the federation CA, this principal's certificate and its key."""

    ca: Path
    cert: Path
    key: Path


def read_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file, with clear errors for a missing or malformed file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except IsADirectoryError:
        raise ConfigError(f"config path is a directory, not a file: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {p}: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None


class Section:
    """Typed, strict access to one table of a TOML document.

    Parameters
    ----------
    data : dict
        The table.
    name : str
        Its dotted name (``""`` for the top level), used in messages.
    source : str
        The file it came from, used in messages.
    base_dir : Path
        Directory that relative paths are resolved against.
    """

    def __init__(self, data: Any, name: str, source: str, base_dir: Path) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: [{name}] must be a table, got {type(data).__name__}")
        self.data = data
        self.name = name
        self.source = source
        self.base_dir = base_dir
        self._read: set[str] = set()

    def _key(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name else key

    def _fail(self, key: str, what: str, value: Any) -> ConfigError:
        return ConfigError(f"{self.source}: {self._key(key)} must be {what}, got {value!r}")

    def section(self, key: str, *, required: bool = False) -> Section:
        """Return a sub-table (empty when absent and not required)."""
        self._read.add(key)
        if key not in self.data:
            if required:
                raise ConfigError(f"{self.source}: missing required table [{self._key(key)}]")
            return Section({}, self._key(key), self.source, self.base_dir)
        return Section(self.data[key], self._key(key), self.source, self.base_dir)

    def has(self, key: str) -> bool:
        """Whether ``key`` is present."""
        return key in self.data

    def get(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """Return the raw value."""
        self._read.add(key)
        if key not in self.data:
            if required:
                raise ConfigError(f"{self.source}: missing required key {self._key(key)}")
            return default
        return self.data[key]

    def string(self, key: str, default: str | None = None, *,
               required: bool = False) -> str | None:
        """Return a string value."""
        v = self.get(key, default, required=required)
        if v is not None and not isinstance(v, str):
            raise self._fail(key, "a string", v)
        return v

    def number(self, key: str, default: float | None = None, *, required: bool = False,
               positive: bool = False, minimum: float | None = None,
               maximum: float | None = None, unit: str = "") -> float | None:
        """Return a finite number (optionally > 0, and within ``[minimum, maximum]``).

        The error names the key and the valid range (``unit``, e.g. ``" seconds"``, is added
        to the message).
        """
        v = self.get(key, default, required=required)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise self._fail(key, "a finite number", v)
        low = "> 0" if positive and minimum is None else (
            f">= {minimum:g}" if minimum is not None else "")
        if (positive and v <= 0) or (minimum is not None and v < minimum) or (
                maximum is not None and v > maximum):
            bounds = " and ".join(b for b in (low, "" if maximum is None else f"<= {maximum:g}")
                                  if b)
            raise self._fail(key, f"{bounds}{unit}", v)
        return float(v)

    def integer(self, key: str, default: int | None = None, *, required: bool = False,
                minimum: int | None = None, maximum: int | None = None) -> int | None:
        """Return an integer value (optionally within ``[minimum, maximum]``)."""
        v = self.get(key, default, required=required)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._fail(key, "an integer", v)
        if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
            bounds = " and ".join(b for b in ("" if minimum is None else f">= {minimum}",
                                              "" if maximum is None else f"<= {maximum}") if b)
            raise self._fail(key, bounds, v)
        return v

    def boolean(self, key: str, default: bool = False) -> bool:
        """Return a boolean value."""
        v = self.get(key, default)
        if not isinstance(v, bool):
            raise self._fail(key, "true or false", v)
        return v

    def str_list(self, key: str, default: list[str] | None = None) -> list[str]:
        """Return a list of strings."""
        v = self.get(key, default if default is not None else [])
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self._fail(key, "a list of strings", v)
        return list(v)

    def path(self, key: str, default: str | None = None, *, required: bool = False) -> Path | None:
        """Return a path, resolved against the config file's directory when relative."""
        v = self.string(key, default, required=required)
        if v is None or v == "":
            if required:
                raise ConfigError(f"{self.source}: {self._key(key)} must be a non-empty path")
            return None
        p = Path(v).expanduser()
        return p if p.is_absolute() else (self.base_dir / p)

    def check_unknown(self) -> None:
        """Raise if the table has keys nobody read (typos, options from another version)."""
        unknown = sorted(set(self.data) - self._read)
        if unknown:
            known = ", ".join(sorted(self._read)) or "(none)"
            where = f"[{self.name}]" if self.name else "the top level"
            raise ConfigError(
                f"{self.source}: unknown key(s) {unknown} in {where}; known keys: {known}")


def tls_from_section(section: Section, insecure: bool) -> TlsConfig | None:
    """Read ``[tls]`` ca/cert/key: required unless ``insecure``.

    The keys are read either way, so a file with certificates still passes the strict key
    check when ``--insecure`` overrides it.
    """
    ca, cert, key = (section.path(k, required=not insecure) for k in ("ca", "cert", "key"))
    if insecure:
        return None
    assert ca is not None and cert is not None and key is not None
    return TlsConfig(ca, cert, key)
