"""`dpfed simulate` as a user runs it (real processes), and its output directory handling."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpfed.aggregator.pca_result import PCAResult
from dpfed.aggregator.simulation_output import MARKER, prepare_output
from dpfed.common.errors import ConfigError


def test_prepare_output_refuses_foreign_directories(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("important")
    with pytest.raises(ConfigError, match="not an earlier dpfed simulation"):
        prepare_output(foreign)
    assert (foreign / "thesis.tex").exists()
    earlier = tmp_path / "earlier"
    prepare_output(earlier)
    (earlier / "sites").mkdir()
    prepare_output(earlier)
    assert (earlier / MARKER).exists() and not (earlier / "sites").exists()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_simulate_end_to_end_is_reproducible_with_a_seed(tmp_path: Path) -> None:
    def run(out: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dpfed.aggregator.cli", "simulate",
                               "--sites", "3",
                               "--rows", "3000", "--features", "8", "--k", "3", "--epsilon",
                               "2", "--seed", "4", "--out", str(out)],
                              capture_output=True, text=True, timeout=240)

    first = run(tmp_path / "a")
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    assert "[simulate] pca" in out and "result received (3/3)" in out
    assert "captured energy of the DP subspace relative to non-private PCA" in out
    # three rounds of epsilon 2 in all, composed tightly by the sites' (default) pld ledgers
    spent = [float(v) for v in re.findall(r"spent epsilon ([0-9.]+) of 10", out)]
    assert len(spent) == 3 and all(1.0 < v < 2.0 for v in spent), spent
    a = tmp_path / "a"
    for rel in ("pca.npz", "report.html", "certs/ca.pem", "data/schema.toml", "data/site_01.csv",
                "sites/hospital-1/ledger.sqlite", "coordinator/store/jobs.sqlite",
                "logs/coordinator.log", "logs/hospital-2.log"):
        assert (a / rel).exists(), rel
    html = (a / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 2 and "Scree plot" in html
    second = run(tmp_path / "b")
    assert second.returncode == 0, second.stderr
    r1, r2 = PCAResult.load(a / "pca.npz"), PCAResult.load(tmp_path / "b" / "pca.npz")
    np.testing.assert_array_equal(r1.components_, r2.components_)  # --seed: reproducible


def test_pooled_reference_is_the_real_pooled_rows_not_an_average_of_sites(
        tmp_path: Path) -> None:
    """9,000 and 1,000 rows with different structure: the reference weights every row once."""
    import pandas as pd

    from dpfed.aggregator.simulate import pooled_reference
    from dpfed.common.data.schema import Schema

    schema = Schema.from_toml("".join(f'[[columns]]\nname = "c{j}"\ntype = "continuous"\n'
                                      'min = -4\nmax = 4\n' for j in range(3)))
    rng = np.random.default_rng(0)
    big = rng.normal(0, 1, (9000, 3)) * [1.0, 0.1, 0.1] + [1, 0, 0]
    small = rng.normal(0, 1, (1000, 3)) * [0.1, 0.1, 1.0]
    paths = []
    for name, x in (("a.csv", big), ("b.csv", small)):
        pd.DataFrame(x.clip(-4, 4), columns=["c0", "c1", "c2"]).to_csv(tmp_path / name,
                                                                       index=False)
        paths.append(tmp_path / name)
    u = np.vstack([big, small]).clip(-4, 4) / 4
    centred = pooled_reference(schema, paths, centred=True)
    np.testing.assert_allclose(centred.matrix, np.cov(u, rowvar=False, bias=True), atol=1e-9)
    assert centred.counts == [9000, 1000] and "real pooled rows" in centred.label
    uncentred = pooled_reference(schema, paths, centred=False)
    np.testing.assert_allclose(uncentred.matrix, u.T @ u / len(u), atol=1e-9)
    assert "midpoints" in uncentred.label
