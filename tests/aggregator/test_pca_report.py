"""The DP-PCA HTML report: `dpfed report`, its content, and the simulation's pooled comparison."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from dpfed.aggregator import cli
from dpfed.aggregator.pca_report import (
    PooledReference,
    _integer_ticks,
    captured_fraction,
    pca_report,
    privacy_sentence,
)
from dpfed.aggregator.pca_result import PCAResult
from dpfed.aggregator.report import plt
from dpfed.common import exit_codes
from tests.aggregator.test_pca_result import make_result


def full_result() -> PCAResult:
    r = make_result()
    r.metadata.update({
        "rank": 4, "clip_norm_requested": "auto", "clip_quantile": 0.9,
        "site_weighting": "size", "calibration": "analytic",
        "rounds": [{"round": "mean", "epsilon": 0.1, "delta": 1e-6, "sites": ["a", "b"]},
                   {"round": "norms", "epsilon": 0.1, "delta": 1e-6, "sites": ["a", "b"]},
                   {"round": "pca", "epsilon": 0.8, "delta": 8e-6, "sites": ["a", "b"]}]})
    return r


def test_dpfed_report_writes_a_self_contained_page(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = full_result().save(tmp_path / "pca.npz")
    out = tmp_path / "sub" / "report.html"
    assert cli.main(["report", str(path), "--out", str(out)]) == exit_codes.OK
    assert f"wrote {out}" in capsys.readouterr().out
    html = out.read_text()
    assert "<th>parameter</th><th>value</th>" in html  # a real header row
    assert "<th></th>" not in html
    assert "{&#x27;" not in html and "{'" not in html  # no Python dicts
    for section in ("Privacy", "Job parameters", "Rounds", "Sites", "Scree plot",
                    "Cumulative explained variance", "Loadings", "Centre (mean_)"):
        assert f"<h2>{section}</h2>" in html
    assert html.count("data:image/png;base64,") == 3  # scree, cumulative, heat map
    assert "swapping it for any other valid row" in html and "epsilon=1.0" in html
    assert "<td>centering</td><td>mean</td>" in html
    assert "Quality" not in html  # only a simulation has the pooled rows


def test_dpfed_report_missing_file_is_a_clear_error(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["report", str(tmp_path / "nope.npz")])
    assert code == exit_codes.DATA_ERROR  # a missing input file, as for every command
    err = capsys.readouterr().err
    assert "no such result file" in err and "Traceback" not in err


def test_integer_ticks_on_the_k_axis() -> None:
    for n in (3, 10, 40):
        fig, ax = plt.subplots()
        _integer_ticks(ax, n)
        ticks = ax.get_xticks()
        assert np.all(ticks == np.round(ticks)) and ticks[0] == 1 and ticks[-1] <= n
        plt.close(fig)


def test_quality_section_compares_with_the_real_pooled_rows() -> None:
    result = full_result()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 4))
    matrix = a @ a.T
    exact = np.linalg.eigh(matrix)[1][:, ::-1][:, :2].T
    same = type(result)(exact, result.explained_variance_, result.explained_variance_ratio_,
                        result.feature_names_in_, result.metadata, result.spectrum_,
                        result.scaled_center_)
    ref = PooledReference(matrix, [200, 100], "non-private PCA of the real pooled rows (test)")
    np.testing.assert_allclose(captured_fraction(same, ref), 1.0)
    assert np.all(captured_fraction(result, ref) <= 1 + 1e-12)
    html = pca_report(result, reference=ref).render()
    assert "Quality (simulation only)" in html and "real pooled rows (test)" in html
    assert html.count("data:image/png;base64,") == 4
    assert re.search(r"<td>1</td><td>0\.\d{4}</td>", html)  # captured energy as a fraction


def test_privacy_sentence_names_the_budget_and_the_relation() -> None:
    text = privacy_sentence(full_result())
    assert "epsilon=1.0" in text and "delta=1e-05" in text and "3 round(s)" in text
    assert "row count N_s" in text
