"""HTML reports for ``svt`` and ``query`` results (``dpfed report``, ``dpfed simulate``).

:mod:`dpfed.aggregator.result_reports` picks the builder by the result's kind. A simulation may
pass the true (non-private) values, which only it can compute, to draw them beside the DP
estimates.
"""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from dpfed.aggregator.query_results import QueryJobResult, SVTJobResult
from dpfed.aggregator.report import Report, figure_to_data_uri

#: Rows of a long table shown in the HTML (the CSV holds all of them).
MAX_TABLE_ROWS = 60


def histogram_plot(result: QueryJobResult, truth: np.ndarray | None = None) -> str:
    """Plot the estimated pooled histogram with +-1.96 std-error bars (and the truth if known)."""
    h = result.histogram
    n = len(h)
    fig, ax = plt.subplots(figsize=(max(7.0, min(14.0, 0.12 * n + 4)), 4))
    x = np.arange(n)
    ax.bar(x, h["estimate"], color="#8fb3d9", label="DP estimate")
    ax.errorbar(x, h["estimate"], yerr=1.96 * h["std_error"], fmt="none", ecolor="#234",
                elinewidth=0.8, capsize=1.5, label="95% interval (expected error)")
    if truth is not None:
        ax.plot(x, truth, "r.", ms=4, label="true pooled count (simulation only)")
    if n <= 30:
        ax.set_xticks(x)
        ax.set_xticklabels(h["cell"], rotation=60, ha="right", fontsize=7)
    else:
        ax.set_xlabel("cell (C order over the domain)")
    ax.set_ylabel("count")
    ax.set_title(f"Pooled histogram: strategy {result.strategy}, {result.noise} noise, "
                 f"{result.metadata.get('n_sites')} site(s)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return figure_to_data_uri(fig)


def strategy_plot(result: QueryJobResult) -> str:
    """Plot the expected per-query RMSE of every candidate strategy (the chosen one highlighted)."""
    ranking = result.metadata.get("ranking", [])
    labels = [f"{r[0]}\n{r[1]}" for r in ranking]
    values = [float(r[2]) for r in ranking]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    colors = ["#d98f8f" if i == 0 else "#8fb3d9" for i in range(len(values))]
    ax.bar(range(len(values)), values, color=colors)
    ax.axhline(result.identity_expected_rmse, color="k", ls="--", lw=1, label="identity")
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("expected RMSE per query")
    ax.set_title(f"Strategies for {result.metadata.get('workload_name')}")
    ax.legend(loc="upper right")
    return figure_to_data_uri(fig)


def query_report(result: QueryJobResult, truth: np.ndarray | None = None,
                 rep: Report | None = None) -> Report:
    """Sections for a ``query`` result: strategy, histogram with error bars, answers."""
    rep = rep or Report(f"dpfed query {result.metadata.get('job_id', '')}")
    m = result.metadata
    rep.heading("Matrix mechanism query")
    gain = result.identity_expected_rmse / result.expected_rmse if result.expected_rmse else 1.0
    rep.key_values({
        "domain": ", ".join(m["domain"]["columns"]), "cells": len(result.histogram),
        "workload": m.get("workload_name"), "strategy": result.strategy, "noise": result.noise,
        "epsilon per site": m.get("epsilon"), "delta per site": m.get("delta"),
        "sites": m.get("n_sites"), "rows (total, public N_s)": m.get("n_rows_total"),
        "expected RMSE per query (chosen)": result.expected_rmse,
        "expected RMSE per query (identity)": result.identity_expected_rmse,
        "identity / chosen": gain, "reconstruction": m.get("reconstruction"),
        "strategy digest": m.get("strategy_digest")})
    secure = m.get("secure")
    if isinstance(secure, dict):
        rep.key_values({
            "aggregation": ("secure (distributed discrete Laplace noise from Pólya shares, one "
                            "pooled draw)" if result.noise == "dlaplace" else
                            "secure (distributed Skellam noise, one pooled draw)"),
            "participants": ", ".join(secure.get("participants", [])),
            "tolerated colluders t": secure.get("tolerated_colluders"),
            "fixed-point scale s": secure.get("scale"),
            "sensitivity of Ã (L2, integer)": secure.get("l2_sensitivity_integer"),
            "sensitivity of Ã (L1, integer)": secure.get("l1_sensitivity_integer"),
            "pooled noise sigma per answer": secure.get("pooled_noise_sigma"),
            "guarantee": secure.get("guarantee")})
    modes = m.get("aggregation_comparison")
    if isinstance(modes, dict) and isinstance(modes.get("sentence"), str):
        other = "site-level" if isinstance(secure, dict) else "secure"
        rep.paragraph(f"Aggregation modes: {modes['sentence']}. With its best strategy "
                      f"under its own noise, {other} aggregation would give an expected RMSE "
                      "per query of "
                      f"{float(modes['expected_rmse_other_mode']):.4g} (this job: "
                      f"{result.expected_rmse:.4g}).")
    rep.image(strategy_plot(result), "expected error per strategy")
    rep.heading("Estimated histogram")
    rep.image(histogram_plot(result, truth), "estimated histogram with error bars")
    rep.heading("Workload answers")
    a = result.answers
    if truth is not None:
        rep.paragraph(f"Observed RMSE against the truth over {len(a)} queries: see the "
                      "simulation summary.")
    rep.paragraph(f"{len(a)} queries; the first {min(len(a), MAX_TABLE_ROWS)} are shown "
                  "(the CSV has all).")
    rep.table(("query", "estimate", "std_error"),
              [tuple(r) for r in a.head(MAX_TABLE_ROWS).itertuples(index=False)])
    return rep


def svt_report(result: SVTJobResult, truth: dict[str, np.ndarray] | None = None,
               rep: Report | None = None, threshold: float | None = None) -> Report:
    """Sections for an ``svt`` batch: which queries were above T where, and the values.

    ``threshold`` is the session's T (a continuation's result does not repeat it); with
    ``truth`` (simulation only) the precision/recall of "above" is added.
    """
    m = result.metadata
    rep = rep or Report(f"dpfed svt {m.get('job_id', '')}")
    rep.heading(f"SVT session {result.session} ({m.get('action')})")
    params = m.get("params", {})
    rep.key_values({"session": result.session, "action": m.get("action"),
                    "threshold T": params.get("threshold", "(fixed at opening)"),
                    "cut-off c": params.get("cutoff", "(fixed at opening)"),
                    "session epsilon (charged at opening)": m.get("epsilon"),
                    "charged by this job": m.get("charged_now"),
                    "sites": len(m.get("site_ids", [])),
                    "sites halted (cut-off reached)": ", ".join(result.halted_sites) or "none"})
    t = result.table
    if len(t):
        fig, ax = plt.subplots(figsize=(max(7.0, min(14.0, 0.25 * len(t) + 3)), 3.8))
        ax.bar(range(len(t)), t["sites_above"], color="#8fb3d9", label="sites answering above")
        ax.plot(range(len(t)), t["sites_examined"], "k_", ms=12, label="sites that examined it")
        if len(t) <= 40:
            ax.set_xticks(range(len(t)))
            ax.set_xticklabels(t["query"], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("sites")
        ax.set_title("Per query: how many sites reported 'above T'")
        ax.legend(loc="upper right", fontsize=8)
        rep.image(figure_to_data_uri(fig), "sites above per query")
        header = ["query", "sites above", "examined", "which", "value sum", "std error"]
        rows: list[tuple[Any, ...]] = [tuple(r) for r in t.head(MAX_TABLE_ROWS).itertuples(
            index=False)]
        rep.table(header, rows)
    rep.heading("Sites")
    s = result.sites
    rep.table(tuple(s.columns), [tuple(r) for r in s.itertuples(index=False)])
    t_value = threshold if threshold is not None else params.get("threshold")
    if truth and isinstance(t_value, int | float):
        rep.heading("Against the true per-site counts (simulation only)")
        prec, rec = svt_precision_recall(result, truth, float(t_value))
        rep.key_values({"precision of 'above'": prec, "recall of 'above'": rec})
    return rep


def svt_precision_recall(result: SVTJobResult, truth: dict[str, np.ndarray],
                         threshold: float) -> tuple[float, float]:
    """Precision and recall of the sites' 'above' answers against true count >= T.

    Only examined (site, query) pairs count; ``truth`` maps site id -> true counts.
    """
    above = result.arrays["above"]
    tp = fp = fn = 0
    for i, s in enumerate(result.metadata.get("site_ids", [])):
        q = np.asarray(truth[s])[: above.shape[1]]
        examined = above[i] >= 0
        said = above[i] == 1
        real = q >= threshold
        tp += int(np.sum(said & real & examined))
        fp += int(np.sum(said & ~real & examined))
        fn += int(np.sum(~said & real & examined))
    prec = tp / (tp + fp) if tp + fp else float("nan")
    rec = tp / (tp + fn) if tp + fn else float("nan")
    return prec, rec
