"""Site-local evaluation of a synthetic table against the site's own rows (HTML for its operator).

Runs where the real rows are -- at the site -- and writes ``synth_evaluation.html`` in the
site's own directory: per-column TVD (categorical) and KS (continuous), the pairwise
correlation error, DCR against a local holdout, NNDR and seed 003's disclosure measure
``M_best`` (:func:`dpfed.common.evaluation.metrics.evaluate_synthetic`), and what real
columns look like against the synthetic ones (:func:`dpfed.common.synth.fidelity.
column_fidelity`): each column's TVD on cells cut at quantiles of the site's rows, its most
common value's share (zero visits, a floor) and its tails (p1, p50, p99, sd; dates as
dates). The caller gives the two parts of the site's rows: the training rows of the job and
its holdout, which the job's rounds never read (:mod:`dpfed.common.evaluation.site_holdout`),
so "distance to the training rows" against "distance to the holdout" measures what the model
learnt from individual rows.

**Nothing computed here leaves the site**: it is an exact evaluation of real rows for the
site operator's eyes, not a DP release, and it is never sent to the coordinator.
"""

from __future__ import annotations

import html
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dpfed.common.data.encoding import EncodedTable, encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.errors import DataError
from dpfed.common.evaluation.metrics import SyntheticReport, evaluate_synthetic
from dpfed.common.synth.fidelity import ColumnFidelity, column_fidelity
from dpfed.common.validation import check_int, path_component

log = logging.getLogger(__name__)

REPORT_NAME = "synth_evaluation.html"


def report_dir(site_dir: Path, job_id: str) -> Path:
    """Where a job's evaluation report goes: ``<site dir>/evaluations/<job id>``.

    The job id comes from the coordinator: it is made one safe path component
    (:func:`dpfed.common.validation.path_component`), so no id -- ``..``, ``a/b``, an empty
    one -- writes outside ``evaluations``.
    """
    return Path(site_dir) / "evaluations" / path_component(job_id)


def _cap(table: EncodedTable, max_rows: int) -> EncodedTable:
    """At most ``max_rows`` rows (a fixed subsample: evaluation only, nothing is released)."""
    if table.n_rows <= max_rows:
        return table
    idx = np.sort(np.random.default_rng(20240611).permutation(table.n_rows)[:max_rows])
    return table.take(idx)


def evaluate_at_site(schema: Schema, train: EncodedTable, holdout: EncodedTable,
                     synthetic: pd.DataFrame, *, site_id: str, out_dir: str | Path,
                     max_rows: int = 20_000) -> tuple[Path, SyntheticReport]:
    """Evaluate ``synthetic`` against this site's training rows and holdout; write the report.

    Returns the report path and the metrics (which stay at the site).
    """
    if train.n_rows < 10:
        raise DataError("the site has too few rows to evaluate against")
    cap = check_int(max_rows, "max_rows", minimum=10)
    syn = synthetic.iloc[:cap] if len(synthetic) > cap else synthetic
    report = evaluate_synthetic(_cap(train, cap), syn, schema,
                                holdout=_cap(holdout, cap) if holdout.n_rows else None)
    fidelity = column_fidelity(schema, _cap(train, cap), encode_table(schema, syn)[0])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT_NAME
    path.write_text(_html(site_id, report, _fidelity_rows(schema, fidelity)), encoding="utf-8")
    log.info("site=%s wrote %s (local only)", site_id, path)
    return path, report


def _row(cells: list[Any]) -> str:
    out = []
    for c in cells:
        text = f"{c:.4g}" if isinstance(c, float) else ("-" if c is None else str(c))
        out.append(f"<td>{html.escape(text)}</td>")
    return "<tr>" + "".join(out) + "</tr>"


def _fidelity_rows(schema: Schema, fidelity: list[ColumnFidelity]) -> str:
    return "".join(_row([f.column, f.kind, f.tvd, *f.texts(col)])
                   for col, f in zip(schema.columns, fidelity, strict=True))


def _html(site_id: str, r: SyntheticReport, fidelity_rows: str) -> str:
    d = r.to_dict()
    dcr, nndr, disc = d["dcr"], d["nndr"], d["disclosure"]
    marg = "".join(_row([m.column, m.column_type, m.statistic, m.value]) for m in r.marginals)
    summary = [
        ("training rows compared / holdout (kept out of every round of the job) / synthetic",
         f"{r.n_train} / {r.n_holdout} / {r.n_synthetic}"),
        ("mean / max TVD (categorical columns)", f"{r.mean_tvd} / {r.max_tvd}"),
        ("mean / max KS (continuous columns)", f"{r.mean_ks} / {r.max_ks}"),
        ("correlation error", str(d["correlation"])),
        ("DCR median (synthetic -> train)", str(dcr.get("train_median"))),
        ("DCR median (synthetic -> holdout)", str(dcr.get("holdout_median"))),
        ("share of synthetic rows closer to train than to holdout (expected)",
         f"{dcr.get('share_closer_to_train')} ({dcr.get('expected_share')})"),
        ("exact copies of training rows (share)", str(dcr.get("exact_copy_share"))),
        ("NNDR", str(nndr)),
        ("seed 003 disclosure M_best", str(disc["m_best"])),
    ]
    rows = "".join(_row([k, v]) for k, v in summary)
    css = ("body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto}"
           "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>synthetic data "
            f"evaluation at {html.escape(site_id)}</title><style>{css}</style></head><body>"
            f"<h1>Synthetic data vs this site's rows ({html.escape(site_id)})</h1>"
            "<p>Computed at this site on its real rows. These figures are exact statistics of "
            "real data: they are for the site operator and are not sent anywhere.</p>"
            f"<h2>Summary</h2><table>{rows}</table>"
            f"<h2>Per-column distance</h2><table><tr><th>column</th><th>type</th>"
            f"<th>measure</th><th>value</th></tr>{marg}</table>"
            "<h2>What the columns look like: this site's training rows / synthetic</h2>"
            "<p>TVD on the categories, or for continuous columns on 20 cells cut at quantiles "
            "of this site's rows, each cut halfway between two distinct values (a point mass "
            "such as zero visits sits inside its cell), missing values (missing = \"category\") "
            "a cell of their own; the missing rate; the share of the most common value; "
            "the tails of the values.</p><table><tr><th>column</th><th>type</th><th>TVD</th>"
            "<th>missing rate real / synthetic</th>"
            "<th>most common value: share real / synthetic</th><th>p1</th><th>p50</th>"
            f"<th>p99</th><th>sd</th></tr>{fidelity_rows}</table></body></html>")
