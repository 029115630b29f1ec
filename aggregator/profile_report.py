"""The tables of a ``profile`` result: per-site policy counts, missing rates, impute values.

The same tables are printed by ``dpfed profile`` and written as the HTML report
(``dpfed report``): counts with their noise sd, per column the pooled DP missing rate over
the rows read, and per chosen column the DP mean of its observed values as the value to
write as ``impute`` in the schema (dates as dates). ``dpfed simulate --job profile``, which
alone can read every site's rows, passes the noise-free figures as ``truth`` (arrays named
as the result's) and each table gains a "true" column beside the DP one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfed.aggregator.report import Report
from dpfed.aggregator.result_file import decode_result

Table = tuple[str, list[str], list[list[Any]]]


@dataclass(frozen=True)
class ProfileTruth:
    """The noise-free figures of a profile, from the sites' real rows (simulation only).

    Shaped as the result's arrays: ``policy_counts`` one row per site (the result's order),
    ``missing_rate`` per schema column, ``means`` per mean column, and ``impute`` the means
    written as the schema would take them (dates as dates).
    """

    policy_counts: np.ndarray
    missing_rate: np.ndarray
    means: np.ndarray
    impute: Mapping[str, str]


def profile_tables(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any],
                   truth: ProfileTruth | None = None) -> list[Table]:
    """Return ``(title, header, rows)`` for each table of a profile result.

    With ``truth`` (simulation only) each DP figure is followed by its true value.
    """
    sites = [s["site_id"] for s in meta["sites"]]
    counts = arrays["policy_counts"]
    sd = float(meta["policy_sigma"])
    title = (f"What each site's row policy did (DP counts, noise sd {sd:.3g} each; epsilon "
             f"{meta['policy_epsilon']:g}, delta {meta['policy_delta']:g}; left unbiased, so a "
             "count near 0 may show as negative)")
    if truth is None:
        header, per_count = ["count", *sites], counts.T
    else:
        title += "; true: the exact counts (simulation only)"
        header = ["count", *(f"{s} {what}" for s in sites for what in ("DP", "true"))]
        per_count = np.stack([counts, truth.policy_counts], axis=1).reshape(-1, counts.shape[1]).T
    tables: list[Table] = [(title, header,
                            [[name, *(f"{v:.1f}" for v in per_count[i])]
                             for i, name in enumerate(meta["count_names"])])]
    rates = [arrays["missing_rate"], *([] if truth is None else [truth.missing_rate])]
    tables.append(("Missing rate per column over the rows read (pooled, DP)",
                   ["column", "missing rate", *([] if truth is None else ["true"])],
                   [[c, *(f"{r[i]:.2%}" for r in rates)]
                    for i, c in enumerate(meta["columns"])]))
    if "means" in arrays:
        tables.append((
            f"DP mean of the observed values, to use as `impute` (epsilon "
            f"{meta['means_epsilon']:g}, delta {meta['means_delta']:g}; sd approximate)",
            ["column", "impute", "mean", "noise sd",
             *([] if truth is None else ["true impute", "true mean"])],
            [[c, meta["impute"][c], f"{arrays['means'][i]:.6g}", f"{arrays['mean_sd'][i]:.3g}",
              *([] if truth is None else [truth.impute[c], f"{truth.means[i]:.6g}"])]
             for i, c in enumerate(meta["mean_columns"])]))
    return tables


def _text_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, header)), *([str(c) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in cells)


def profile_text(data: bytes, truth: ProfileTruth | None = None) -> str:
    """Return the tables of a profile result file as plain text (``dpfed profile`` prints it)."""
    arrays, meta = decode_result(data)
    return "\n\n".join(f"{title}\n{_text_table(header, rows)}"
                       for title, header, rows in profile_tables(arrays, meta, truth))


def profile_report(data: bytes, truth: ProfileTruth | None = None) -> Report:
    """Build the HTML report of a profile result file (with ``truth``: a simulation's)."""
    arrays, meta = decode_result(data)
    rep = Report("dpfed profile result" if truth is None else
                 "dpfed simulate: profile job, DP figures against the truth")
    rep.paragraph(f"Job {meta['job_id']}: epsilon {meta['epsilon']:g}, delta "
                  f"{meta['delta']:g} per site, {len(meta['sites'])} site(s).")
    for title, header, rows in profile_tables(arrays, meta, truth):
        rep.heading(title)
        rep.table(header, rows)
    return rep
