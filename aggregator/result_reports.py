"""``dpfed report``: the HTML report of any result file, chosen by the file's ``kind``.

Each job kind registers a builder here; the builders live with their kinds
(:mod:`dpfed.aggregator.pca_report`, :mod:`dpfed.aggregator.query_report`, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dpfed.aggregator.report import Report
from dpfed.aggregator.result_file import decode_result
from dpfed.common.errors import ConfigError, ValidationError


def _pca(data: bytes) -> Report:
    from dpfed.aggregator.pca_report import pca_report
    from dpfed.aggregator.pca_result import PCAResult

    return pca_report(PCAResult.from_bytes(data))


def _svt(data: bytes) -> Report:
    from dpfed.aggregator.query_report import svt_report
    from dpfed.aggregator.query_results import SVTJobResult

    return svt_report(SVTJobResult.from_bytes(data))


def _query(data: bytes) -> Report:
    from dpfed.aggregator.query_report import query_report
    from dpfed.aggregator.query_results import QueryJobResult

    return query_report(QueryJobResult.from_bytes(data))


#: Result kind -> report builder.
REPORTERS: dict[str, Callable[[bytes], Report]] = {"pca": _pca, "svt": _svt, "query": _query}


def report_for_result(path: str | Path) -> Report:
    """Build the report of a result file, chosen by its ``kind``.

    Raises
    ------
    ConfigError
        The file does not exist or cannot be read.
    ValidationError
        It is not a dpfed result file, or no report exists for its kind.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"no such result file {p} (the file `dpfed pca/svt/query --out` or "
                          "`dpfed fetch` wrote)") from None
    except OSError as exc:
        raise ConfigError(f"cannot read result file {p}: {exc.strerror or exc}") from None
    arrays, metadata = decode_result(data)
    kind = metadata.get("kind")
    if kind is None and "components" in arrays:
        kind = "pca"  # a PCAResult saved by the library, without a job's metadata
    if kind not in REPORTERS:
        raise ValidationError(f"{p}: no report for result kind {kind!r} (reports exist for "
                              f"{sorted(REPORTERS)})")
    return REPORTERS[str(kind)](data)
