"""The synthesis report's sections on rounds and evaluation (what the model's metadata says).

Shows which sites each round used, which sites wrote a local evaluation report, and the DP
evaluation summaries the sites whose policy allows it released (noisy, with each statistic's
noise standard deviation). Everything here is a DP release or public metadata.
"""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)
import numpy as np  # noqa: E402

from dpfed.aggregator.report import Report, figure_to_data_uri  # noqa: E402
from dpfed.common.evaluation.dp_summary import excess_near_copies  # noqa: E402


def add_rounds_section(report: Report, meta: dict[str, Any]) -> None:
    """Add the table of which sites' releases each round used."""
    rounds = meta.get("rounds")
    if not rounds:
        return
    report.heading("Sites used by each round")
    report.paragraph("A round after the first goes only to the sites that answered the round "
                     "before; a site that dropped out keeps the charges of the rounds it "
                     "answered.")
    order = [p.get("round") for p in meta.get("plan", []) if isinstance(p, dict)]
    names = sorted(rounds, key=lambda n: order.index(n) if n in order else len(order))
    report.table(("round", "sites"), [(name, ", ".join(rounds[name])) for name in names])


def _summary_figure(summaries: dict[str, Any]) -> str:
    sites = sorted(summaries)
    columns = list(summaries[sites[0]]["tvd"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(sites)
    x = np.arange(len(columns))
    for i, s in enumerate(sites):
        sm = summaries[s]
        axes[0].bar(x + i * width, [sm["tvd"][c] for c in columns], width,
                    yerr=sm["sigma_tvd"], capsize=2, label=s)
        axes[1].bar(np.array([0, 1]) + i * width, [sm["near_train"], sm["near_holdout"]], width,
                    yerr=[sm["sigma_near_train"], sm["sigma_near_holdout"]], capsize=2, label=s)
    axes[0].set_xticks(x + 0.4 - width / 2, columns, rotation=60, fontsize=7)
    axes[0].set_title("DP TVD, site's training rows vs synthetic (bars: +-1 noise sd)",
                      fontsize=9)
    axes[1].set_xticks([0.4 - width / 2, 1.4 - width / 2], ["training rows", "holdout"])
    axes[1].set_title("DP share of real rows with a synthetic row\nwithin the threshold",
                      fontsize=9)
    axes[0].legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    return figure_to_data_uri(fig)


def add_evaluation_section(report: Report, meta: dict[str, Any]) -> None:
    """Add the evaluation section: local reports and the sites' DP summaries."""
    ev = meta.get("evaluation")
    if not ev:
        return
    report.heading("Evaluation at the sites")
    local = ", ".join(ev.get("local_report_sites", [])) or "none"
    report.paragraph(f"A {ev.get('sample_rows')}-row synthetic sample was compared with each "
                     "site's rows at the site. Every site held out some of its rows from every "
                     "round of this job (the model never saw them). Local reports (exact, kept "
                     f"at the site, nothing came back): {local}.")
    if "summaries" not in ev:
        return
    summaries = ev["summaries"]
    asked = ", ".join(ev.get("summary_sites_asked", [])) or "none"
    report.paragraph(
        f"DP evaluation summaries were asked of the sites whose policy allows them ({asked}), "
        f"each charged epsilon {ev.get('summary_epsilon'):g}, delta {ev.get('summary_delta'):g} "
        "in its ledger. 'near' is the share of real rows whose closest synthetic row is within "
        "the threshold (the 5th percentile of the distance between synthetic rows): training "
        "rows well above the holdout means the model reproduces its training rows. The excess "
        "(near: training - near: holdout) x training rows / synthetic rows estimates the share "
        "of synthetic rows that sit on a training row beyond chance: about 1 for a model that "
        "copies its rows, about 0 for one that does not.")
    if not summaries:
        report.paragraph("No site returned a summary.")
        return
    m = int(ev.get("sample_rows") or 1)
    rows = []
    for s, v in sorted(summaries.items()):
        excess = excess_near_copies(v["near_train"], v["near_holdout"], n_train=int(v["n_train"]),
                                    n_synthetic=m)
        excess_sd = float(np.hypot(v["sigma_near_train"], v["sigma_near_holdout"])) * (
            v["n_train"] / m)
        rows.append((s, int(v["n_train"]), int(v["n_holdout"]),
                     f"{np.mean(list(v['tvd'].values())):.3f} ({v['sigma_tvd']:.3f})",
                     f"{v['near_train']:.3f} ({v['sigma_near_train']:.3f})",
                     f"{v['near_holdout']:.3f} ({v['sigma_near_holdout']:.3f})",
                     f"{excess:.2f} ({excess_sd:.2f})", f"{v['threshold']:.3g}", v["epsilon"],
                     v["delta"]))
    report.table(("site", "training rows", "holdout rows", "mean TVD (noise sd)",
                  "near: training", "near: holdout", "excess near copies per synthetic row",
                  "threshold", "epsilon", "delta"), rows)
    report.image(_summary_figure(summaries), "DP evaluation summaries per site")
