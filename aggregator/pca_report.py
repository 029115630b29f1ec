"""The HTML report of a DP-PCA result (``dpfed report``, ``dpfed pca --report``, ``simulate``).

Everything in it comes from the result file -- DP releases and public metadata -- except the
optional :class:`PooledReference`, which only ``dpfed simulate`` has (it alone can read every
site's rows) and which adds the comparison with non-private PCA of the real pooled rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np

from dpfed.aggregator.pca_result import PCAResult
from dpfed.aggregator.report import Report, figure_to_data_uri, plt
from dpfed.common.pca.dppca import captured_energy, top_components

#: Components shown in the loadings heat map and the components table.
MAX_SHOWN_COMPONENTS = 8
#: Features shown in the heat map (those with the largest loadings when p is larger).
MAX_SHOWN_FEATURES = 40

ROUND_RELEASES = {
    "mean": "each site's noisy sum of its rows (Gaussian, L2 sensitivity 2) -> the DP mean",
    "norms": "each site's noisy histogram of row norms on a public grid (L2 sensitivity "
             "sqrt(2)) -> the clip radius",
    "pca": "each site's P_s, the top R eigenpairs of its noisy second-moment matrix of the "
           "clipped rows (symmetric Gaussian noise) -> the components",
}
#: The same rounds under secure aggregation (the coordinator sees only the masked totals).
SECURE_ROUND_RELEASES = {
    "mean": "a masked integer row sum with a share of Skellam noise; only the total is "
            "decoded -> the DP mean",
    "pca": "a masked integer Gram matrix with a share of Skellam noise; only the total is "
           "decoded and centred at the coordinator -> the components",
}


@dataclass(frozen=True)
class PooledReference:
    """Non-private PCA target built from the real pooled rows (simulation only).

    ``matrix`` is in the scaled space ``u`` (every column to [-1, 1] by the schema bounds):
    the covariance of all sites' rows together (centred job) or their second moment about the
    schema midpoints (uncentred job). ``label`` says exactly that in the report.
    """

    matrix: np.ndarray
    counts: list[int]
    label: str


def _integer_ticks(ax: Any, n: int) -> None:
    step = max(1, int(np.ceil(n / 15)))
    ax.set_xticks(np.arange(1, n + 1, step))


def scree_plot(result: PCAResult, reference: PooledReference | None) -> str:
    """DP eigenvalues (the whole released spectrum) on a log scale, integer component ticks."""
    spectrum = result.spectrum_
    shown = min(len(spectrum), max(2 * result.n_components_, 10))
    fig, ax = plt.subplots(figsize=(7, 4))
    k = np.arange(1, shown + 1)
    ax.semilogy(k, np.maximum(spectrum[:shown], 1e-12), "s-", ms=4,
                label="DP eigenvalues (released)")
    if reference is not None:
        exact = np.sort(np.linalg.eigvalsh(reference.matrix))[::-1][:shown]
        scale = result.clip_radius ** 2  # the DP matrix is in the unit space u / c
        ax.semilogy(np.arange(1, len(exact) + 1), np.maximum(exact / scale, 1e-12), "o-", ms=3,
                    label="non-private, real pooled rows")
    ax.axvline(result.n_components_ + 0.5, color="grey", lw=0.8, ls="--", label="K")
    _integer_ticks(ax, shown)
    ax.set_xlabel("component k")
    ax.set_ylabel("eigenvalue (unit space)")
    ax.set_title("Scree plot: choose K where the curve flattens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right")
    return figure_to_data_uri(fig)


def cumulative_variance_plot(result: PCAResult) -> str:
    """Cumulative explained-variance ratio of the DP spectrum."""
    spectrum = result.spectrum_
    total = float(np.sum(spectrum))
    shown = min(len(spectrum), max(2 * result.n_components_, 10))
    cum = np.cumsum(spectrum[:shown]) / total if total > 0 else np.zeros(shown)
    fig, ax = plt.subplots(figsize=(7, 4))
    k = np.arange(1, shown + 1)
    ax.plot(k, cum, "s-", ms=4)
    ax.axvline(result.n_components_ + 0.5, color="grey", lw=0.8, ls="--", label="K")
    _integer_ticks(ax, shown)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("components kept k")
    ax.set_ylabel("cumulative explained-variance ratio")
    ax.set_title("Cumulative explained variance (DP eigenvalues / their sum)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    return figure_to_data_uri(fig)


def loadings_heatmap(result: PCAResult) -> str:
    """Heat map of the loadings of the top components (rows) over the features (columns)."""
    k = min(result.n_components_, MAX_SHOWN_COMPONENTS)
    comps = result.components_[:k]
    names = list(result.feature_names_in_)
    cols = np.arange(len(names))
    if len(names) > MAX_SHOWN_FEATURES:
        cols = np.sort(np.argsort(-np.max(np.abs(comps), axis=0))[:MAX_SHOWN_FEATURES])
    fig, ax = plt.subplots(figsize=(min(14, 2 + 0.35 * len(cols)), 1.2 + 0.45 * k))
    lim = float(np.max(np.abs(comps[:, cols]))) or 1.0
    im = ax.imshow(comps[:, cols], cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_yticks(np.arange(k), [f"PC{i + 1}" for i in range(k)])
    ax.set_xticks(np.arange(len(cols)), [names[j] for j in cols], rotation=60, ha="right",
                  fontsize=8)
    fig.colorbar(im, ax=ax, label="loading")
    title = "Loadings of the top components"
    if len(cols) < len(names):
        title += f" ({len(cols)} of {len(names)} features: the largest loadings)"
    ax.set_title(title)
    return figure_to_data_uri(fig)


def captured_fraction(result: PCAResult, reference: PooledReference) -> np.ndarray:
    """For k = 1..K: captured variance of the DP top-k over the exact top-k, real pooled rows."""
    k = result.n_components_
    exact = top_components(reference.matrix, k)
    return np.array([captured_energy(result.components_[:i], reference.matrix)
                     / captured_energy(exact[:i], reference.matrix) for i in range(1, k + 1)])


def captured_fraction_plot(fraction: np.ndarray) -> str:
    """Captured-energy fraction vs k (1 = as good as non-private PCA of the pooled rows)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    k = np.arange(1, len(fraction) + 1)
    ax.plot(k, fraction, "s-", ms=4)
    _integer_ticks(ax, len(fraction))
    ax.set_ylim(min(0.0, float(fraction.min()) - 0.05), 1.02)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("components kept k")
    ax.set_ylabel("captured energy, DP / non-private")
    ax.set_title("Share of the real pooled rows' energy the DP top-k captures")
    ax.grid(True, alpha=0.3)
    return figure_to_data_uri(fig)


def privacy_sentence(result: PCAResult) -> str:
    """One sentence on what the guarantee covers."""
    m = result.metadata
    rounds = m.get("rounds") or [{"round": "pca"}]
    return (f"Each participating hospital spent at most epsilon={m.get('epsilon')} and "
            f"delta={m.get('delta')} on this job (all {len(rounds)} round(s) together): "
            "whatever one patient's row holds, swapping it for any other valid row changes the "
            "probability of anything in this report by at most that much; the guarantee covers "
            "row values, not each site's row count N_s or the schema, which are public.")


def secure_sentence(result: PCAResult) -> str | None:
    """Return what secure aggregation adds to the guarantee (None for a site-level job)."""
    s = result.metadata.get("secure")
    if not isinstance(s, dict):
        return None
    return (f"Aggregation: secure. The {len(s.get('participants', []))} participating sites "
            "summed their contributions under pairwise masks; the coordinator saw only the "
            "noisy total, whose Skellam noise (variance "
            f"{s.get('noise_variance_integer', 0):.4g} at fixed-point scale "
            f"{s.get('scale', 0):.4g}; the honest sites' shares alone carry at least "
            f"{s.get('guaranteed_variance_integer', s.get('noise_variance_integer', 0)):.4g}) "
            "is calibrated to one row of the pooled data. Every site "
            f"sized its share so that the guarantee above holds even if "
            f"{s.get('tolerated_colluders', '?')} other part(ies), the coordinator included, "
            f"pool what they know; the sum took {s.get('attempts', 1)} attempt(s).")


def pca_report(result: PCAResult, *, title: str = "dpfed DP-PCA report",
               reference: PooledReference | None = None,
               intro: str | None = None, extra: dict[str, Any] | None = None) -> Report:
    """Build the report of one DP-PCA result (``reference``: simulation's pooled comparison)."""
    m = result.metadata
    rep = Report(title)
    rep.paragraph(intro or f"Job {m.get('job_id', '?')}; report generated "
                  f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC from the result file alone.")
    rep.heading("Privacy")
    rep.paragraph(privacy_sentence(result))
    secure = secure_sentence(result)
    if secure is not None:
        rep.paragraph(secure)
    modes = result.metadata.get("aggregation_comparison")
    if isinstance(modes, dict) and isinstance(modes.get("sentence"), str):
        rep.paragraph(f"Aggregation modes: {modes['sentence']}.")
    rep.heading("Job parameters")
    params: dict[str, Any] = {
        "job id": m.get("job_id", "?"),
        "components K": result.n_components_,
        "rank R sent per site": m.get("rank", "?"),
        "features p": result.n_features_in_,
        "centering": m.get("centering", "none"),
        "clip norm requested": m.get("clip_norm_requested", m.get("clip_norm", "schema")),
        "clip radius used": result.clip_radius,
        "clip quantile (auto)": m.get("clip_quantile", "-"),
        "site weighting": m.get("site_weighting", "equal"),
        "calibration": m.get("calibration", "?"),
        "epsilon per site": m.get("epsilon", "?"),
        "delta per site": m.get("delta", "?"),
        "sites": len(m.get("sites", [])),
        "rows (total)": m.get("n_rows_total", "?"),
        "software version": m.get("software_version", "?"),
        **(extra or {}),
    }
    rep.key_values(params, header=("parameter", "value"))
    rounds = m.get("rounds") or []
    if rounds:
        rep.heading("Rounds")
        rep.table(("round", "epsilon", "delta", "sites", "what each site released"),
                  [(r["round"], r["epsilon"], r["delta"], len(r["sites"]),
                    (SECURE_ROUND_RELEASES if "secure" in m else ROUND_RELEASES).get(
                        r["round"], "")) for r in rounds])
    rep.heading("Sites")
    rep.table(("site", "rows N_s", "weight", "epsilon spent", "delta spent",
               "noise sigma (pca round)"),
              [(s.get("site_id"), s.get("n_rows"), s.get("weight", "-"), s.get("epsilon"),
                s.get("delta"), s.get("noise_sigma")) for s in m.get("sites", [])])
    if reference is not None:
        fraction = captured_fraction(result, reference)
        rep.heading("Quality (simulation only)")
        rep.paragraph(f"Compared with: {reference.label}. Captured energy is "
                      "tr(V_k^T C V_k) of that matrix C for the DP top-k components V_k, as a "
                      "fraction of the same for its exact top-k eigenvectors.")
        rep.table(("k", "captured energy, DP / non-private"),
                  [(i + 1, f"{f:.4f}") for i, f in enumerate(fraction)])
        rep.image(captured_fraction_plot(fraction), "captured energy fraction")
    rep.heading("Scree plot")
    rep.paragraph("The DP eigenvalues of the aggregated matrix (all of them, not only K): "
                  "noise adds a floor, so components at the floor carry no signal.")
    rep.image(scree_plot(result, reference), "scree plot")
    rep.heading("Cumulative explained variance")
    rep.image(cumulative_variance_plot(result), "cumulative explained variance")
    rep.heading("Loadings")
    rep.image(loadings_heatmap(result), "loadings heat map")
    names = list(result.feature_names_in_)
    rows = []
    for i, comp in enumerate(result.components_[:MAX_SHOWN_COMPONENTS]):
        order = np.argsort(-np.abs(comp))[:5]
        rows.append((f"PC{i + 1}", f"{result.explained_variance_ratio_[i]:.3f}",
                     ", ".join(f"{names[j]} ({comp[j]:+.2f})" for j in order)))
    rep.table(("component", "explained-variance ratio", "largest loadings"), rows)
    rep.heading("Centre (mean_)")
    rep.paragraph("The DP mean in raw units (a one-hot's entry is the category's share)"
                  if result.centering == "mean" else
                  "Uncentred job: the schema's midpoints (no mean was released).")
    rep.table(("feature", "centre"), [(n, float(v)) for n, v in zip(names, result.mean_,
                                                                      strict=True)])
    return rep
