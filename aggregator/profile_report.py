"""The tables of a ``profile`` result: per-site policy counts, missing rates, impute values.

The same tables are printed by ``dpfed profile`` and written as the HTML report
(``dpfed report``): counts with their noise sd, per column the pooled DP missing rate over
the rows read, and per chosen column the DP mean of its observed values as the value to
write as ``impute`` in the schema (dates as dates).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dpfed.aggregator.report import Report
from dpfed.aggregator.result_file import decode_result

Table = tuple[str, list[str], list[list[Any]]]


def profile_tables(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> list[Table]:
    """Return ``(title, header, rows)`` for each table of a profile result."""
    sites = [s["site_id"] for s in meta["sites"]]
    counts = arrays["policy_counts"]
    sd = float(meta["policy_sigma"])
    tables: list[Table] = [(
        f"What each site's row policy did (DP counts, noise sd {sd:.3g} each; epsilon "
        f"{meta['policy_epsilon']:g}, delta {meta['policy_delta']:g})",
        ["count", *sites],
        [[name, *(f"{v:.1f}" for v in counts[:, i])]
         for i, name in enumerate(meta["count_names"])])]
    tables.append(("Missing rate per column over the rows read (pooled, DP)",
                   ["column", "missing rate"],
                   [[c, f"{r:.2%}"] for c, r in zip(meta["columns"], arrays["missing_rate"],
                                                     strict=True)]))
    if "means" in arrays:
        tables.append((
            f"DP mean of the observed values, to use as `impute` (epsilon "
            f"{meta['means_epsilon']:g}, delta {meta['means_delta']:g}; sd approximate)",
            ["column", "impute", "mean", "noise sd"],
            [[c, meta["impute"][c], f"{m:.6g}", f"{s:.3g}"]
             for c, m, s in zip(meta["mean_columns"], arrays["means"], arrays["mean_sd"],
                                strict=True)]))
    return tables


def _text_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, header)), *([str(c) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in cells)


def profile_text(data: bytes) -> str:
    """Return the tables of a profile result file as plain text (``dpfed profile`` prints it)."""
    arrays, meta = decode_result(data)
    return "\n\n".join(f"{title}\n{_text_table(header, rows)}"
                       for title, header, rows in profile_tables(arrays, meta))


def profile_report(data: bytes) -> Report:
    """Build the HTML report of a profile result file."""
    arrays, meta = decode_result(data)
    rep = Report("dpfed profile result")
    rep.paragraph(f"Job {meta['job_id']}: epsilon {meta['epsilon']:g}, delta "
                  f"{meta['delta']:g} per site, {len(meta['sites'])} site(s).")
    for title, header, rows in profile_tables(arrays, meta):
        rep.heading(title)
        rep.table(header, rows)
    return rep
