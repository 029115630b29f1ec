"""The synthesis report (``report.html``): DP marginals vs synthetic, correlations, budget.

Everything shown is DP or post-processing: the released DP marginals (the model's link
proportions), the DP latent correlation, the synthetic sample and the budget plan. No real
row is read.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from dpfed.aggregator.report import Report, figure_to_data_uri  # noqa: E402
from dpfed.aggregator.synth_evaluation_report import (  # noqa: E402
    add_evaluation_section,
    add_rounds_section,
)
from dpfed.aggregator.synth_model import SynthModel  # noqa: E402
from dpfed.common.data.encoding import EncodedTable, encode_table  # noqa: E402
from dpfed.common.data.schema import ContinuousColumn, OrdinalColumn  # noqa: E402
from dpfed.common.privacy.rng import production_rng  # noqa: E402
from dpfed.common.synth.link_release import split_proportions  # noqa: E402
from dpfed.common.synth.quantile_link import bin_codes  # noqa: E402

_COLS_PER_FIGURE_ROW = 4


def synthetic_marginals(model: SynthModel, table: EncodedTable) -> dict[str, np.ndarray]:
    """Per column, the synthetic proportions on the same cells as the DP marginal."""
    out: dict[str, np.ndarray] = {}
    for col in model.schema.columns:
        values = table.columns[col.name]
        if isinstance(col, ContinuousColumn):
            codes = bin_codes(col, values, model.n_bins)
            size = model.n_bins
        else:
            codes = np.asarray(values, dtype=np.intp)
            size = col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories
        out[col.name] = np.bincount(codes, minlength=size)[:size] / max(table.n_rows, 1)
    return out


def _marginal_figure(model: SynthModel, synthetic: dict[str, np.ndarray]) -> str:
    dp = split_proportions(model.proportions, model.schema, model.n_bins)
    cols = model.schema.columns
    n_rows = math.ceil(len(cols) / _COLS_PER_FIGURE_ROW)
    fig, axes = plt.subplots(n_rows, _COLS_PER_FIGURE_ROW,
                             figsize=(3.2 * _COLS_PER_FIGURE_ROW, 2.4 * n_rows), squeeze=False)
    for ax, col in zip(axes.ravel(), cols, strict=False):
        x = np.arange(dp[col.name].shape[0])
        ax.bar(x - 0.2, dp[col.name], width=0.4, label="released DP marginal")
        ax.bar(x + 0.2, synthetic[col.name], width=0.4, label="synthetic")
        ax.set_title(col.name, fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in axes.ravel()[len(cols):]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    return figure_to_data_uri(fig)


def _heatmaps(dp_corr: np.ndarray, synth_corr: np.ndarray, names: tuple[str, ...]) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, mat, title in ((axes[0], dp_corr, "DP latent correlation (released)"),
                           (axes[1], synth_corr, "synthetic latent correlation")):
        im = ax.imshow(mat, vmin=-1, vmax=1, cmap="RdBu_r")
        ax.set_title(title, fontsize=10)
        if len(names) <= 30:
            ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
            ax.set_yticks(range(len(names)), names, fontsize=6)
    fig.colorbar(im, ax=axes, shrink=0.8)
    return figure_to_data_uri(fig)


def secure_paragraph(meta: dict[str, Any]) -> str | None:
    """Return what secure aggregation adds to the guarantee (None for a site-level job)."""
    s = meta.get("secure")
    if not isinstance(s, dict):
        return None
    rounds = s.get("rounds", {}) if isinstance(s.get("rounds"), dict) else {}
    parts = [f"round {name}: {r.get('statistic')} sum of {len(r.get('participants', []))} "
             f"sites, Skellam variance {float(r.get('noise_variance_integer', 0)):.4g} at "
             f"scale {float(r.get('scale', 0)):.4g}, {r.get('attempts', 1)} attempt(s)"
             for name, r in rounds.items() if isinstance(r, dict)]
    return (f"The participating sites ({', '.join(map(str, s.get('participants', [])))}) "
            "summed their exact histograms and latent Gram matrices under pairwise masks; the "
            "coordinator saw only the noisy pooled totals, whose noise is calibrated to one row "
            "of the pooled data. Every site sized its share so that the guarantee holds even if "
            f"{s.get('tolerated_colluders', '?')} other part(ies), the coordinator included, "
            f"pool what they know (t = {s.get('tolerated_colluders', '?')}). "
            + "; ".join(parts) + ".")


def synth_report(model: SynthModel, sample: pd.DataFrame, *, title: str = "dpfed synthesis",
                 extra: dict[str, Any] | None = None) -> str:
    """Build the report's HTML from the model and a synthetic sample of it."""
    table, _ = encode_table(model.schema, sample)
    synthetic = synthetic_marginals(model, table)
    dp = split_proportions(model.proportions, model.schema, model.n_bins)
    links = model.links
    latent = links.to_latent(table, production_rng())
    synth_corr = np.corrcoef(latent, rowvar=False) if table.n_rows > 1 else np.eye(links.dim)
    report = Report(title)
    meta = model.metadata
    report.heading("Summary")
    report.key_values({"mode": model.mode + (" (one noisy row per real row)"
                                             if model.mode == "row_aligned" else ""),
                       "aggregation": meta.get("aggregation", "site"),
                       "continuous link": model.continuous_link, "bins": model.n_bins,
                       "latent dimension": links.dim, "factors (rank)": model.factor_model.rank,
                       "job": meta.get("job_id", "?"), "epsilon per site": meta.get("epsilon"),
                       "delta per site": meta.get("delta"),
                       "rows pooled": meta.get("n_rows_total"),
                       "synthetic rows in this report": table.n_rows, **(extra or {})})
    secure = secure_paragraph(meta)
    if secure is not None:
        report.heading("Aggregation: secure")
        report.paragraph(secure)
    report.heading("Privacy budget (charged at every site, per round)")
    report.table(("round", "epsilon", "delta"),
                 [(p["round"], p["epsilon"], p["delta"]) for p in meta.get("plan", [])])
    sites = meta.get("sites", [])
    if sites:
        keys = [k for k in ("links_epsilon", "links_delta", "pca_epsilon", "pca_delta",
                            "factors_epsilon", "factors_delta") if any(k in s for s in sites)]
        report.table(("site", "rows", *keys),
                     [(s["site_id"], s["n_rows"], *(s.get(k, "-") for k in keys))
                      for s in sites])
    add_rounds_section(report, meta)
    report.heading("Marginals: released DP marginal vs synthetic")
    report.table(("column", "type", "TVD(DP marginal, synthetic)"),
                 [(c.name, c.type, 0.5 * float(np.abs(dp[c.name] - synthetic[c.name]).sum()))
                  for c in model.schema.columns])
    report.image(_marginal_figure(model, synthetic), "DP vs synthetic marginals")
    report.heading("Correlations in the latent space")
    report.paragraph("Left: the correlation of the DP latent second moment the sites released "
                     "(before the correction for the links' independent draws). Right: the "
                     "correlation of the synthetic rows mapped back to the latent space.")
    report.image(_heatmaps(model.dp_correlation, synth_corr, links.latent_names),
                 "latent correlation heat maps")
    add_evaluation_section(report, meta)
    return report.render()


def write_synth_report(path: str | Path, model: SynthModel, sample: pd.DataFrame,
                       **kwargs: Any) -> Path:
    """Write :func:`synth_report` to ``path``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(synth_report(model, sample, **kwargs), encoding="utf-8")
    return out
