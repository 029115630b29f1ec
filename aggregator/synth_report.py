"""The synthesis report (``report.html``): DP marginals vs synthetic, correlations, budget.

Everything in the report an analyst gets is DP or post-processing: the released DP marginals
(the model's link proportions), the DP latent correlation, the DP 2-way tables of the chosen
column pairs (the fitted joint proportions the model keeps in its metadata), the synthetic
sample and the budget plan. No real row is read -- except by ``dpfed simulate``, which made
every site's rows itself and adds a section comparing the synthetic table with them
(:func:`add_real_rows_section`: marginals, point masses, tails with the band the DP release
allows, correlations), which no real deployment can show.
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
from dpfed.common.evaluation.utility_metrics import (  # noqa: E402
    correlation_matrix,
    table_correlation_error,
)
from dpfed.common.pca.features import UnitBallMap, feature_names  # noqa: E402
from dpfed.common.privacy.composition import round_rho  # noqa: E402
from dpfed.common.privacy.rng import production_rng  # noqa: E402
from dpfed.common.privacy.skellam import skellam_rho  # noqa: E402
from dpfed.common.synth.fidelity import (  # noqa: E402
    column_fidelity,
    released_quantile_band,
    value_text,
)
from dpfed.common.synth.link_release import (  # noqa: E402
    histogram_sizes,
    link_histogram_mechanism,
    release_noise_sd,
    split_proportions,
)
from dpfed.common.synth.missing_cells import from_cells_table, to_cells_table  # noqa: E402
from dpfed.common.synth.quantile_link import QuantileLink, bin_codes  # noqa: E402

_COLS_PER_FIGURE_ROW = 4
#: Most pairs drawn as heat maps (the table lists every pair).
MAX_PAIR_FIGURES = 12
#: Most categories/levels written as tick labels on a heat map axis.
MAX_TICK_LABELS = 12


def released_marginals(model: SynthModel) -> dict[str, np.ndarray]:
    """Per column, the released DP marginal on the report's cells (coarse cells)."""
    blocks = split_proportions(model.proportions, model.cells_schema, model.n_bins,
                               model.resolution)
    out = {}
    for link in model.links.links:
        p = blocks[link.column.name]
        out[link.column.name] = (np.bincount(link.layout.coarse, weights=p,
                                             minlength=link.layout.n_coarse)
                                 if isinstance(link, QuantileLink) else p)
    return out


def synthetic_marginals(model: SynthModel, table: EncodedTable) -> dict[str, np.ndarray]:
    """Per column, the synthetic proportions on the report's cells (as :func:`released_marginals`).

    Categories and levels, or a continuous column's coarse cells (its bins, and its bounds'
    point cells under ``resolution="fine"``); missing values in their cell (``table``
    follows :attr:`SynthModel.cells_schema`).
    """
    out: dict[str, np.ndarray] = {}
    links = model.links
    for col, link in zip(links.schema.columns, links.links, strict=True):
        values = table.columns[col.name]
        if isinstance(link, QuantileLink):
            codes = link.layout.coarse_codes(values)
            size = link.layout.n_coarse
        elif isinstance(col, ContinuousColumn):
            codes = bin_codes(col, values, model.n_bins)
            size = model.n_bins
        else:
            codes = np.asarray(values, dtype=np.intp)
            size = col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories
        out[col.name] = np.bincount(codes, minlength=size)[:size] / max(table.n_rows, 1)
    return out


def _marginal_figure(model: SynthModel, synthetic: dict[str, np.ndarray]) -> str:
    dp = released_marginals(model)
    cols = model.cells_schema.columns
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
    axes[0, 0].legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    return figure_to_data_uri(fig)


def _heatmaps(dp_corr: np.ndarray, synth_corr: np.ndarray, names: tuple[str, ...],
              titles: tuple[str, str] = ("DP latent correlation (released)",
                                         "synthetic latent correlation")) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, mat, title in ((axes[0], dp_corr, titles[0]), (axes[1], synth_corr, titles[1])):
        im = ax.imshow(mat, vmin=-1, vmax=1, cmap="RdBu_r")
        ax.set_title(title, fontsize=10)
        if len(names) <= 30:
            ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
            ax.set_yticks(range(len(names)), names, fontsize=6)
    fig.colorbar(im, ax=axes, shrink=0.8)
    return figure_to_data_uri(fig)


def synthetic_pair_tables(model: SynthModel, table: EncodedTable) -> list[np.ndarray]:
    """Per chosen pair, the synthetic joint proportions on the model's pair cells."""
    correction = model.pair_correction
    if correction is None:
        return []
    grid = correction.grid
    codes = grid.group_codes(grid.fine_codes(table))
    sizes = grid.sizes
    out = []
    for a, b in correction.edges:
        counts = np.bincount(codes[a] * sizes[b] + codes[b], minlength=sizes[a] * sizes[b])
        out.append(counts.reshape(sizes[a], sizes[b]) / max(table.n_rows, 1))
    return out


def released_pair_tables(model: SynthModel) -> list[np.ndarray] | None:
    """Per chosen pair, the fitted DP joint proportions the metadata keeps (None if absent)."""
    correction = model.pair_correction
    raw = model.metadata.get("pair_tables")
    if correction is None or not isinstance(raw, list) or len(raw) != len(correction.edges):
        return None
    sizes = correction.grid.sizes
    out = []
    for (a, b), flat in zip(correction.edges, raw, strict=True):
        t = np.asarray(flat, dtype=np.float64)
        if t.shape != (sizes[a] * sizes[b],) or not np.all(np.isfinite(t)):
            return None
        out.append(t.reshape(sizes[a], sizes[b]))
    return out


def _group_labels(model: SynthModel, column: int) -> list[str] | None:
    """Tick labels of a column's pair cells: its categories/levels when each is its own cell."""
    col = model.cells_schema.columns[column]
    correction = model.pair_correction
    if correction is None or isinstance(col, ContinuousColumn):
        return None
    labels = list(col.levels if isinstance(col, OrdinalColumn) else col.categories)
    size = correction.grid.sizes[column]
    return labels if size == len(labels) and size <= MAX_TICK_LABELS else None


def _pair_figure(model: SynthModel, released: list[np.ndarray],
                 synthetic: list[np.ndarray]) -> str:
    assert model.pair_correction is not None
    edges = model.pair_correction.edges
    cols = model.schema.names
    names = [(cols[a], cols[b]) for a, b in edges]
    n = min(len(names), MAX_PAIR_FIGURES)
    fig, axes = plt.subplots(n, 2, figsize=(6.4, 2.8 * n), squeeze=False, layout="constrained")
    for i in range(n):
        top = max(float(released[i].max()), float(synthetic[i].max()), 1e-12)
        for ax, mat, what in ((axes[i, 0], released[i], "DP 2-way table"),
                              (axes[i, 1], synthetic[i], "synthetic")):
            im = ax.imshow(mat, vmin=0.0, vmax=top, cmap="viridis", aspect="auto")
            ax.set_title(f"{what}\n{names[i][0]} x {names[i][1]}", fontsize=8)
            ax.set_xlabel(f"{names[i][1]} (group)", fontsize=7)
            ax.set_ylabel(f"{names[i][0]} (group)", fontsize=7)
            ax.tick_params(labelsize=6)
            y_labels, x_labels = _group_labels(model, edges[i][0]), _group_labels(model,
                                                                                  edges[i][1])
            if x_labels is not None:
                ax.set_xticks(range(len(x_labels)), x_labels, rotation=90)
            if y_labels is not None:
                ax.set_yticks(range(len(y_labels)), y_labels)
        fig.colorbar(im, ax=axes[i].tolist(), shrink=0.8)
    return figure_to_data_uri(fig)


def add_pairs_section(report: Report, model: SynthModel, table: EncodedTable) -> None:
    """Add the chosen column pairs: DP 2-way table vs synthetic (table and heat maps)."""
    meta = model.metadata
    correction = model.pair_correction
    if correction is None:
        if meta.get("pair_edges") == []:
            report.heading("Column pairs (DP 2-way marginals)")
            report.paragraph("No column pair had a table small enough to measure; the pair "
                             "rounds were skipped and nothing was charged for them.")
        return
    cols = model.schema.names
    names = [(cols[a], cols[b]) for a, b in correction.edges]
    synthetic = synthetic_pair_tables(model, table)
    released = released_pair_tables(model)
    report.heading("Column pairs (DP 2-way marginals)")
    report.paragraph(
        f"The sites scored {meta.get('pair_candidates', '?')} candidate column pair(s) with "
        f"noise; the coordinator chose the {len(names)} pair(s) below (a maximum-weight "
        "forest of the noisy scores, parent first) and the sites released their 2-way "
        f"tables on groups of cells (at most {correction.grid.max_groups} per ordinal or "
        "continuous column). Every synthetic row is corrected towards these tables, by the "
        "share of each table's difference from the factor model that its noise does not "
        "explain: where a table differs from the model by about its noise alone, the rows "
        "keep the model's table, so a TVD of the size of that noise is expected below.")
    rows = []
    for i, ((parent, child), t) in enumerate(zip(names, synthetic, strict=True)):
        tvd: Any = "-" if released is None else 0.5 * float(np.abs(released[i] - t).sum())
        rows.append((parent, child, t.size, tvd))
    report.table(("parent column", "child column", "cells",
                  "TVD(DP 2-way table, synthetic)"), rows)
    if released is not None and names:
        report.image(_pair_figure(model, released, synthetic),
                     "DP 2-way tables vs synthetic (heat maps)")


def _secure_charge(secure_round: dict[str, Any] | None) -> tuple[Any, Any]:
    """Return the (epsilon, rho) a secure round's sites were charged, or dashes."""
    if not secure_round:
        return "-", "-"
    return secure_round["epsilon"], skellam_rho(secure_round["noise_variance_integer"],
                                                secure_round["l2_sensitivity_integer"],
                                                secure_round["l1_sensitivity_integer"])


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


def links_noise_sd(model: SynthModel) -> np.ndarray | None:
    """Return the public noise standard deviation of every cell of the summed link release.

    From the model's metadata (the links round's plan, its sites, the secure sum's noise);
    None when the metadata does not say (a model built outside a job).
    """
    meta = model.metadata
    plan = {p.get("round"): p for p in meta.get("plan", []) if isinstance(p, dict)}
    secure = (meta.get("secure") or {}).get("rounds", {}).get("links")
    try:
        if isinstance(secure, dict):
            n = len(secure["participants"])
            t = int(secure.get("tolerated_colluders", 0))
            pooled = math.sqrt(float(secure["noise_variance_integer"]) * n / max(n - t, 1))
            return release_noise_sd(model.cells_schema, model.n_bins, pooled, model.resolution,
                                    secure=True)
        links = plan["links"]
        sites = len(meta.get("rounds", {}).get("links", [])) or 1
        sigma = link_histogram_mechanism(model.cells_schema, float(links["epsilon"]),
                                         float(links["delta"])).sigma * math.sqrt(sites)
        return release_noise_sd(model.cells_schema, model.n_bins, sigma, model.resolution)
    except (KeyError, TypeError, ValueError):
        return None


def add_real_rows_section(report: Report, model: SynthModel, real: EncodedTable,
                          synthetic: EncodedTable) -> dict[str, Any]:
    """Add the simulation's comparison with the real pooled rows; return its key figures.

    Per column: the TVD against the real rows of the synthetic table and of the released
    DP marginal alone (a draw of every column from its own released marginal: what the
    1-way release gives, before any model), the most common real value's share, and the
    tails (p1, p50, p99, sd) with the band of the p99 the release's noise allows
    (:func:`~dpfed.common.synth.fidelity.released_quantile_band`). Then the correlations:
    of the values (real vs synthetic) and in the latent space (the real rows' latent
    correlation against the DP release and against the synthetic rows), with heat maps.
    Only a simulation may do this: it reads real rows. ``real`` and ``synthetic`` are rows
    of :attr:`SynthModel.schema` (missing values marked).
    """
    rng = np.random.default_rng(0)  # evaluation draws only: no privacy involved
    links = model.links
    released = from_cells_table(links.from_latent(rng.standard_normal(
        (min(50_000, 4 * real.n_rows), links.dim))), model.schema)
    syn = column_fidelity(model.schema, real, synthetic)
    rel = {f.column: f for f in column_fidelity(model.schema, real, released)}
    blocks = split_proportions(model.proportions, model.cells_schema, model.n_bins,
                               model.resolution)
    sd = links_noise_sd(model)
    sizes = histogram_sizes(model.cells_schema, model.n_bins, model.resolution)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    n = float(model.metadata.get("n_rows_total") or real.n_rows)
    rows = []
    figures: dict[str, Any] = {"columns": {}}
    for j, (col, f) in enumerate(zip(model.schema.columns, syn, strict=True)):
        band = "-"
        link = links.links[j]
        if f.real_tail is not None and sd is not None and isinstance(link, QuantileLink):
            cells = link.layout
            coarse_sd = sd[starts[j]:starts[j] + cells.n_coarse]
            low, mid, high = released_quantile_band(cells, blocks[f.column], coarse_sd, n, 0.99)
            band = (f"{value_text(col, mid)} [{value_text(col, low)}, "
                    f"{value_text(col, high)}]")
        texts = f.texts(col)
        rows.append((f.column, f.kind, f.tvd, rel[f.column].tvd, *texts, band))
        figures["columns"][f.column] = {"tvd": f.tvd, "tvd_released": rel[f.column].tvd,
                                        "real_tail": f.real_tail,
                                        "synthetic_tail": f.synthetic_tail, "p99_band": band,
                                        "missing": f.missing, "p99_text": texts[4],
                                        "sd_text": texts[5]}
    report.heading("Simulation only: the synthetic table against the real rows")
    report.paragraph(
        f"dpfed simulate made every site's rows, so it can compare the synthetic table with "
        f"all {real.n_rows} real rows -- which no real deployment can, and which the rest of "
        "this report never does. TVDs are on the columns' categories or, for continuous "
        "columns, on 20 cells cut at quantiles of the real rows, each cut halfway between two "
        "neighbouring distinct real values (a point mass such as zero visits sits inside its "
        "cell). 'released' is a draw of every column from its own released DP marginal (what "
        "the 1-way release gives before any model): the synthetic columns reproduce it, so "
        "the two TVDs are close, and the gap to the real rows is the release's noise. The "
        "p99 band is where the real p99 lies for most noise draws of the release (computed "
        "from its public noise level; tails too thin to tell from the noise are cut off by "
        "the estimate and can fall below it).")
    report.table(("column", "type", "TVD real vs synthetic", "TVD real vs released",
                  "missing rate real / synthetic",
                  "most common real value: share real / synthetic", "p1 real / synthetic",
                  "p50 real / synthetic", "p99 real / synthetic", "sd real / synthetic",
                  "released p99 [band]"), rows)
    # correlations of the values (mixed types scaled by the schema, nominal one-hot)
    values = table_correlation_error(real, synthetic, model.schema)
    latent_real = _latent_correlation(links, real)
    latent_syn = _latent_correlation(links, synthetic)
    off = ~np.eye(links.dim, dtype=bool)
    released_err = float(np.abs(model.dp_correlation - latent_real)[off].mean())
    synthetic_err = float(np.abs(latent_syn - latent_real)[off].mean())
    figures.update(correlation_error=values.mean_abs, correlation_max=values.max_abs,
                   latent_released_error=released_err, latent_synthetic_error=synthetic_err)
    report.key_values({
        "correlation error of the values (mean / max |difference|)":
            f"{values.mean_abs:.4f} / {values.max_abs:.4f}",
        "latent correlation: released DP estimate vs real (mean |difference|)":
            f"{released_err:.4f} (the DP release's own error: before any modelling)",
        "latent correlation: synthetic vs real (mean |difference|)": f"{synthetic_err:.4f}"})
    real_values = correlation_matrix(UnitBallMap(model.schema).scaled(real))
    syn_values = correlation_matrix(UnitBallMap(model.schema).scaled(synthetic))
    report.image(_heatmaps(real_values, syn_values, feature_names(model.schema),
                           ("real rows: correlation", "synthetic rows: correlation")),
                 "correlations of the real and the synthetic rows")
    return figures


def _latent_correlation(links: Any, table: EncodedTable) -> np.ndarray:
    latent = links.to_latent(to_cells_table(table, links.schema), np.random.default_rng(1))
    return np.asarray(np.corrcoef(latent, rowvar=False))


def synth_report(model: SynthModel, sample: pd.DataFrame, *, title: str = "dpfed synthesis",
                 extra: dict[str, Any] | None = None, real: EncodedTable | None = None,
                 figures: dict[str, Any] | None = None) -> str:
    """Build the report's HTML from the model and a synthetic sample of it.

    ``real`` (``dpfed simulate`` only, which made every site's rows) adds the comparison
    with the real rows (:func:`add_real_rows_section`), whose key figures are put in
    ``figures`` when given.
    """
    table, _ = encode_table(model.schema, sample)
    cells = to_cells_table(table, model.cells_schema)  # missing values in their cells
    synthetic = synthetic_marginals(model, cells)
    dp = released_marginals(model)
    links = model.links
    latent = links.to_latent(cells, production_rng())
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
                       "column pairs (DP 2-way tables)": (
                           0 if model.pair_correction is None
                           else len(model.pair_correction.edges)),
                       "synthetic rows in this report": table.n_rows, **(extra or {})})
    secure = secure_paragraph(meta)
    if secure is not None:
        report.heading("Aggregation: secure")
        report.paragraph(secure)
    report.heading("Privacy budget (charged at every site, per round)")
    plan = meta.get("plan", [])
    if meta.get("params", {}).get("composition") == "zcdp":
        rhos = [round_rho(p["epsilon"], p["delta"]) for p in plan]
        report.paragraph(
            f"zCDP composition: every round got its share of rho = {sum(rhos):.4g}, the "
            f"job's (epsilon {meta.get('epsilon')}, delta {meta.get('delta')}); the sites' zCDP "
            "ledgers add the rounds' rho. Each round's epsilon below is that round's own "
            "guarantee (they are not added).")
        secure_rounds = (meta.get("secure") or {}).get("rounds", {})
        if secure_rounds:
            report.paragraph(
                "Secure aggregation: each round's Skellam noise is planned to spend at most its "
                "rho share; the sites' ledgers record the Skellam noise's own epsilon (the "
                "round's guarantee, a little above the Gaussian's epsilon for the same rho) and "
                "rho (last two columns).")
        report.table(("round", "epsilon", "delta", "rho share",
                      *(("epsilon charged", "rho charged") if secure_rounds else ())),
                     [(p["round"], p["epsilon"], p["delta"], r,
                       *(_secure_charge(secure_rounds.get(p["round"])) if secure_rounds
                         else ()))
                      for p, r in zip(plan, rhos, strict=True)])
    else:
        report.table(("round", "epsilon", "delta"),
                     [(p["round"], p["epsilon"], p["delta"]) for p in plan])
    sites = meta.get("sites", [])
    if sites:
        keys = [f"{r}_{x}" for r in ("links", "pca", "pair_scores", "pairs", "factors")
                for x in ("epsilon", "delta") if any(f"{r}_{x}" in s for s in sites)]
        report.table(("site", "rows", *keys),
                     [(s["site_id"], s["n_rows"], *(s.get(k, "-") for k in keys))
                      for s in sites])
    add_rounds_section(report, meta)
    report.heading("Marginals: released DP marginal vs synthetic")
    report.table(("column", "type", "TVD(DP marginal, synthetic)"),
                 [(c.name, c.type, 0.5 * float(np.abs(dp[c.name] - synthetic[c.name]).sum()))
                  for c in model.cells_schema.columns])
    report.image(_marginal_figure(model, synthetic), "DP vs synthetic marginals")
    report.heading("Correlations in the latent space")
    report.paragraph("Left: the correlation of the DP latent second moment the sites released "
                     "(before the correction for the links' independent draws). Right: the "
                     "correlation of the synthetic rows mapped back to the latent space.")
    report.image(_heatmaps(model.dp_correlation, synth_corr, links.latent_names),
                 "latent correlation heat maps")
    add_pairs_section(report, model, cells)
    if real is not None:
        found = add_real_rows_section(report, model, real, table)
        if figures is not None:
            figures.update(found)
    add_evaluation_section(report, meta)
    return report.render()


def write_synth_report(path: str | Path, model: SynthModel, sample: pd.DataFrame,
                       **kwargs: Any) -> Path:
    """Write :func:`synth_report` to ``path``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(synth_report(model, sample, **kwargs), encoding="utf-8")
    return out
