"""The choices of job parameters the command line offers, without importing numpy.

``dpfed --help`` must answer at once, so the CLI takes its choices from here; the full
validation lives in :mod:`dpfed.common.job_params`.
"""

from __future__ import annotations

import argparse

#: How the sites' contributions are combined: each noised alone, or summed securely.
AGGREGATIONS: tuple[str, ...] = ("site", "secure")
CENTERINGS: tuple[str, ...] = ("mean", "none")
SITE_WEIGHTINGS: tuple[str, ...] = ("size", "equal")


def parse_clip_norm(text: str) -> float | str:
    """Parse the command-line ``--clip-norm``: ``auto``, ``schema`` or a number > 0."""
    if text in ("auto", "schema"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected 'auto' (a DP quantile of the row norms), 'schema' (the worst case the "
            f"schema allows) or a number > 0, got {text!r}")
    return value
