"""``dpfed report``: the HTML report of any result file, chosen by the file's ``kind``.

A job kind's descriptor names its report builder (:mod:`dpfed.aggregator.pca_report`,
:mod:`dpfed.aggregator.query_report`, ...); a kind without one gets the generic report of
its result file: the job's parameters and budget, the sites, and every array.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dpfed.aggregator.report import Report
from dpfed.aggregator.result_file import decode_result
from dpfed.common.errors import ConfigError, ValidationError
from dpfed.common.jobs.contract import resolve
from dpfed.common.jobs.registry import job_kind, names

#: Array entries the generic report shows in full (a longer array shows its first ones).
MAX_SHOWN_VALUES = 200


def pca(data: bytes) -> Report:
    """Build the report of a ``pca`` result file."""
    from dpfed.aggregator.pca_report import pca_report
    from dpfed.aggregator.pca_result import PCAResult

    return pca_report(PCAResult.from_bytes(data))


def svt(data: bytes) -> Report:
    """Build the report of an ``svt`` result file."""
    from dpfed.aggregator.query_report import svt_report
    from dpfed.aggregator.query_results import SVTJobResult

    return svt_report(SVTJobResult.from_bytes(data))


def query(data: bytes) -> Report:
    """Build the report of a ``query`` result file."""
    from dpfed.aggregator.query_report import query_report
    from dpfed.aggregator.query_results import QueryJobResult

    return query_report(QueryJobResult.from_bytes(data))


def generic_report(kind: str, arrays: Mapping[str, np.ndarray],
                   metadata: Mapping[str, Any]) -> Report:
    """Build the report of a result file whose kind has no report of its own."""
    rep = Report(f"dpfed {kind} result")
    rep.heading("Job")
    rep.key_values({k: v for k, v in metadata.items()
                    if not isinstance(v, dict | list) and k != "schema_toml"})
    sites = metadata.get("sites")
    if isinstance(sites, list) and sites and all(isinstance(s, dict) for s in sites):
        rep.heading("Sites")
        header = sorted({k for s in sites for k in s})
        rep.table(header, [[s.get(k, "") for k in header] for s in sites])
    if isinstance(metadata.get("secure"), dict):
        rep.heading("Secure aggregation")
        rep.key_values({k: v for k, v in metadata["secure"].items()
                        if not isinstance(v, dict)})
    for name, a in arrays.items():
        rep.heading(f"{name} ({a.dtype}, shape {a.shape})")
        flat = np.asarray(a).ravel()
        rep.table(("index", "value"), list(enumerate(flat[:MAX_SHOWN_VALUES].tolist())))
        if flat.size > MAX_SHOWN_VALUES:
            rep.paragraph(f"... and {flat.size - MAX_SHOWN_VALUES} more values in the file")
    return rep


def report_for_result(path: str | Path) -> Report:
    """Build the report of a result file, chosen by its ``kind``.

    Raises
    ------
    ConfigError
        The file does not exist or cannot be read.
    ValidationError
        It is not a dpfed result file, or its kind is unknown.
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
    if kind not in names():
        raise ValidationError(f"{p}: no report for result kind {kind!r} (reports exist for "
                              f"{sorted(names())})")
    descriptor = job_kind(str(kind))
    if descriptor.report is None:
        return generic_report(str(kind), arrays, metadata)
    report: Report = resolve(descriptor.report)(data)
    return report
