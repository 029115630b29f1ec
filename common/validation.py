"""Argument checks shared by every mechanism and job.

Each check raises :class:`dpfed.common.errors.ValidationError` (a ``ValueError``) whose message
names the parameter, the value and what would be valid.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from typing import Any

import numpy as np

from dpfed.common.errors import ValidationError


def _as_real(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValidationError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def check_positive(value: Any, name: str) -> float:
    """Return ``value`` as a float if it is finite and > 0."""
    x = _as_real(value, name)
    if not math.isfinite(x) or x <= 0:
        raise ValidationError(f"{name} must be finite and > 0, got {x!r}")
    return x


def check_nonnegative(value: Any, name: str) -> float:
    """Return ``value`` as a float if it is finite and >= 0."""
    x = _as_real(value, name)
    if not math.isfinite(x) or x < 0:
        raise ValidationError(f"{name} must be finite and >= 0, got {x!r}")
    return x


def check_epsilon(epsilon: Any, name: str = "epsilon") -> float:
    """Return a privacy parameter epsilon (finite, > 0) as a float."""
    return check_positive(epsilon, name)


#: The smallest positive delta anything is calibrated to: below it the Gaussian calibrations
#: underflow in double precision (a budget or task delta under it is refused as invalid).
MIN_DELTA = 1e-300


def check_delta(delta: Any, name: str = "delta") -> float:
    """Return a privacy parameter delta (strictly inside (0, 1)) as a float."""
    x = _as_real(delta, name)
    if not math.isfinite(x) or not 0.0 < x < 1.0:
        raise ValidationError(f"{name} must be in the open interval (0, 1), got {x!r}")
    return x


def check_probability(value: Any, name: str, *, open_interval: bool = True) -> float:
    """Return ``value`` if it is in (0, 1) (or [0, 1] when ``open_interval`` is False)."""
    x = _as_real(value, name)
    ok = 0.0 < x < 1.0 if open_interval else 0.0 <= x <= 1.0
    if not math.isfinite(x) or not ok:
        interval = "(0, 1)" if open_interval else "[0, 1]"
        raise ValidationError(f"{name} must be in {interval}, got {x!r}")
    return x


def check_int(value: Any, name: str, *, minimum: int | None = None,
              maximum: int | None = None) -> int:
    """Return ``value`` as an int within ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValidationError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    x = int(value)
    if minimum is not None and x < minimum:
        raise ValidationError(f"{name} must be >= {minimum}, got {x}")
    if maximum is not None and x > maximum:
        raise ValidationError(f"{name} must be <= {maximum}, got {x}")
    return x


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``."""
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValidationError(f"{name} must be one of {allowed}, got {value!r}")
    return str(value)


def check_finite_array(array: Any, name: str, *, ndim: int | None = None) -> np.ndarray:
    """Return ``array`` as a float64 ndarray after checking it is finite (and its rank)."""
    try:
        a = np.asarray(array, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{name} must be a numeric array: {exc}") from None
    if ndim is not None and a.ndim != ndim:
        raise ValidationError(f"{name} must be {ndim}-dimensional, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValidationError(f"{name} must contain only finite values (no NaN or inf)")
    return a


def path_component(name: str) -> str:
    """Return ``name`` as one safe file-name component (for ids that came over the wire).

    Letters, digits, ``-``, ``_`` and ``.`` are kept; anything else becomes ``_``; the result is
    never empty, ``.`` or ``..``, never starts with a dot and is at most 100 characters. A name
    that had to change gets a short digest of the original appended, so two different ids
    never share a file. Ids the coordinator makes (``20261122T101500-3fa9c2``) are unchanged.
    """
    safe = "".join(c if (c.isascii() and c.isalnum()) or c in "-_." else "_"
                   for c in name)[:100].lstrip(".")
    if safe and safe == name:
        return safe
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{safe[:80]}-{digest}" if safe else f"id-{digest}"
