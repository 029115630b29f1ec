"""Link round (DP histograms -> links), quantile link and the generative model's calibration."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from dpfed.common.data.encoding import encode_table
from dpfed.common.data.schema import ContinuousColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.pca import dppca
from dpfed.common.privacy.mechanisms import GaussianMechanism
from dpfed.common.synth import link_release
from dpfed.common.synth.generative import (
    calibrate_proportions,
    decoding_links,
    fit_factor_model,
    iter_samples,
)
from dpfed.common.synth.link_release import (
    LinkHistogramAccumulator,
    link_histogram_mechanism,
    link_noise_sd,
    link_noise_weights,
    links_digest,
    links_from_proportions,
    proportions_from_histograms,
    release_link_histograms,
    split_proportions,
    sum_histograms,
)
from dpfed.common.synth.links import clip_to_unit_ball, default_clip_norm
from dpfed.common.synth.quantile_link import (
    QuantileLink,
    bin_codes,
    bin_edges,
    identity_link_from_bins,
    snap_to_whole,
)

SCHEMA = Schema.from_toml("""
[[columns]]
name = "los"
type = "continuous"
min = 0
max = 60
[[columns]]
name = "bimodal"
type = "continuous"
min = -10
max = 10
[[columns]]
name = "grade"
type = "ordinal"
levels = ["1", "2", "3"]
[[columns]]
name = "ward"
type = "nominal"
categories = ["a", "b", "c", "d"]
""")
BINS = 24


def skewed_frame(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, 3)) @ np.array([[1, 0.5, 0.3], [0, 1, 0.4], [0, 0, 1]])
    los = np.clip(np.exp(1.2 + 0.8 * z[:, 0]), 0, 60)  # log-normal: strongly skewed
    bimodal = np.clip(np.where(z[:, 1] > 0, 4.0, -4.0) + rng.normal(0, 1, n), -10, 10)
    grade = np.array(["1", "2", "3"])[np.digitize(z[:, 2], [-0.5, 0.7])]
    ward = np.array(["a", "b", "c", "d"])[np.digitize(z[:, 0] + z[:, 2], [-1, 0, 1.2])]
    return pd.DataFrame({"los": los, "bimodal": bimodal, "grade": grade, "ward": ward})


def exact_links(frame: pd.DataFrame, kind: str = "quantile",
                bins: int = BINS) -> tuple[np.ndarray, object]:
    table, _ = encode_table(SCHEMA, frame)
    acc = LinkHistogramAccumulator(SCHEMA, bins)
    acc.add(table)
    props = proportions_from_histograms(acc.counts.astype(float), SCHEMA, bins)
    return props, links_from_proportions(SCHEMA, props, bins, kind)


def test_histogram_noise_has_the_stated_scale_and_a_broken_copy_is_caught() -> None:
    counts = np.arange(sum(link_release.histogram_sizes(SCHEMA, BINS)), dtype=float)
    mech = link_histogram_mechanism(SCHEMA, 0.7, 1e-6)
    assert mech.sensitivity == pytest.approx(math.sqrt(2 * len(SCHEMA.columns)))
    sd = np.repeat(link_noise_sd(SCHEMA, BINS, 0.7, 1e-6),
                   link_release.histogram_sizes(SCHEMA, BINS))
    rng = np.random.default_rng(1)
    draws = np.stack([release_link_histograms(counts, SCHEMA, BINS, epsilon=0.7, delta=1e-6,
                                              rng=rng) for _ in range(400)]) - counts

    # Each cell's noise must have its column's stated sd (chi-square on the pooled variance).
    def consistent(noise: np.ndarray) -> bool:
        stat = float(((noise / sd) ** 2).sum())
        return bool(stats.chi2.sf(stat, noise.size) > 1e-4
                    and stats.chi2.cdf(stat, noise.size) > 1e-4)

    assert consistent(draws)
    # ... and the weighted vector's noise is the calibrated sigma in every cell.
    weights = np.repeat(link_noise_weights(SCHEMA, BINS),
                        link_release.histogram_sizes(SCHEMA, BINS))
    assert np.allclose(sd * weights, mech.sigma)
    # Broken copy: calibrated for add/remove-one (sensitivity sqrt(n_cols)): sigma too small.
    broken = GaussianMechanism(0.7, 1e-6, math.sqrt(len(SCHEMA.columns)))
    broken_draws = np.stack([broken.release(counts * weights, rng) / weights
                             for _ in range(400)]) - counts
    assert not consistent(broken_draws)
    # Broken copy: every column with the same noise (the weights forgotten at the site).
    flat = np.stack([mech.release(counts, rng) for _ in range(400)]) - counts
    assert not consistent(flat)


def test_noise_weights_favour_columns_with_more_cells_at_a_fixed_sensitivity() -> None:
    sizes = np.asarray(link_release.histogram_sizes(SCHEMA, BINS), dtype=float)
    w = link_noise_weights(SCHEMA, BINS)
    assert float((w ** 2).sum()) == pytest.approx(len(SCHEMA.columns))
    order = np.argsort(sizes, kind="stable")
    assert np.all(np.diff(w[order]) >= -1e-12)  # more cells, more weight (less noise)
    # The weights minimise the expected total L1 error sum_j M_j sigma / w_j at the fixed
    # sensitivity: equal weights (the unweighted release) and random weights normalised the
    # same way do worse.
    def total_l1(weights: np.ndarray) -> float:
        return float((sizes / weights).sum())

    assert total_l1(w) < total_l1(np.ones_like(w))
    rng = np.random.default_rng(3)
    for _ in range(200):
        other = rng.uniform(0.2, 3.0, w.shape)
        other /= math.sqrt(float((other ** 2).mean()))
        assert total_l1(w) <= total_l1(other) + 1e-9


def test_quantile_link_keeps_skewed_and_bimodal_shapes_where_identity_cannot() -> None:
    frame = skewed_frame(40_000)
    table, _ = encode_table(SCHEMA, frame)
    rng = np.random.default_rng(2)
    # Fine public bins: within a bin values are spread uniformly, so the shape is kept up to
    # the bin width (the log-normal column has half its mass in its first 2.5 units).
    for kind, limit in (("quantile", 0.02), ("identity", None)):
        _, links = exact_links(frame, kind, bins=240)
        latent = links.to_latent(table, rng)  # type: ignore[attr-defined]
        # Standard normal latent (quantile link), and decoding N(0,1) recovers the shape.
        z = rng.standard_normal((40_000, links.dim))  # type: ignore[attr-defined]
        back = links.from_latent(z)  # type: ignore[attr-defined]
        ks = [stats.ks_2samp(back.columns[c], table.columns[c]).statistic
              for c in ("los", "bimodal")]
        if limit is not None:
            assert abs(latent[:, 0].mean()) < 0.02 and abs(latent[:, 0].std() - 1) < 0.02
            assert max(ks) < limit, ks
        else:
            assert min(ks) > 0.05, ks  # the identity link loses the shape: the broken copy


def test_quantile_link_validates_and_stays_within_bounds() -> None:
    col = ContinuousColumn("x", 0.0, 1.0)
    with pytest.raises(ValidationError):
        QuantileLink(col, proportions=np.array([0.5, 0.6]))
    link = QuantileLink(col, proportions=np.full(4, 0.25))
    y = link.inverse(np.array([[-40.0], [0.0], [40.0]]))
    assert y.min() >= 0.0 and y.max() <= 1.0
    np.testing.assert_allclose(bin_edges(col, 4), [0, 0.25, 0.5, 0.75, 1.0])
    np.testing.assert_array_equal(bin_codes(col, np.array([-1.0, 0.0, 0.3, 1.0, 2.0]), 4),
                                  [0, 0, 1, 3, 3])
    with pytest.raises(ValidationError, match="rng"):
        link.forward(np.array([0.5]), np.zeros((1, 1)))


@pytest.mark.parametrize("lo, hi, bins", [(1, 15, 32), (0, 3, 32), (18, 65, 32), (0, 40, 20)])
def test_integer_column_decodes_to_whole_numbers_with_the_bins_masses(
        lo: int, hi: int, bins: int) -> None:
    """Every bin's decoded mass lands, evenly, on the whole numbers inside that bin.

    Bins narrower than one hold at most one whole number each: the decoded counts are then
    the DP histogram's exactly (up to sampling), whatever the spacing of the data's values.
    The broken copy -- rounding the continuous decode -- moves mass between whole numbers
    of neighbouring bins and is caught whenever bins hold more than one.
    """
    col = ContinuousColumn("n", float(lo), float(hi), integer=True)
    plain = ContinuousColumn("n", float(lo), float(hi))
    rng = np.random.default_rng(lo + hi)
    data = rng.integers(lo, hi + 1, 100_000).astype(float)
    data = np.where(rng.random(data.size) < 0.6, lo + (data - lo) // 3 * 3, data)  # lumpy
    counts = np.bincount(bin_codes(col, data, bins), minlength=bins) + 1e-9
    link = QuantileLink(col, proportions=counts / counts.sum())
    z = rng.standard_normal((400_000, 1))
    y = link.inverse(z)
    assert np.array_equal(y, np.rint(y)) and y.min() >= lo and y.max() <= hi
    whole = np.arange(lo, hi + 1, dtype=float)
    code = bin_codes(col, whole, bins)
    per_bin = np.bincount(code, minlength=bins)
    # The bins' masses are kept: the same z decodes into the same bin either way, except
    # values in a bin without a whole number (the noise floor's mass, and the decoding
    # table's interpolation across such a bin), which go to the nearest whole number.
    before = bin_codes(plain, QuantileLink(plain, proportions=link.proportions).inverse(z), bins)
    holds = per_bin[before] > 0
    assert holds.mean() > 0.99
    np.testing.assert_array_equal(bin_codes(col, y, bins)[holds], before[holds])
    expected = link.proportions[code] / per_bin[code]  # each bin's mass, evenly split
    got = np.bincount((y - lo).astype(int), minlength=whole.size) / y.size
    assert 0.5 * np.abs(got - expected).sum() < 0.01
    rounded = np.rint(QuantileLink(plain, proportions=link.proportions).inverse(z))
    broken = np.bincount((rounded - lo).astype(int), minlength=whole.size) / y.size
    if per_bin.max() > 1:
        assert 0.5 * np.abs(broken - expected).sum() > 0.05
    else:  # narrow bins: exactly the data's whole-number frequencies
        real = np.bincount((data - lo).astype(int), minlength=whole.size) / data.size
        assert 0.5 * np.abs(got - real).sum() < 0.01


def test_snap_to_whole_edge_cases() -> None:
    col = ContinuousColumn("n", 0.0, 10.0, integer=True)
    # Values at and beyond the bounds, bin edges, and a bin without a whole number.
    y = snap_to_whole(col, np.array([-5.0, 0.0, 0.26, 0.49, 9.99, 10.0, 99.0]), 40)
    np.testing.assert_array_equal(y, [0, 0, 0, 0, 10, 10, 10])
    huge = ContinuousColumn("days", 0.0, 1e9, integer=True)  # too many to enumerate: rint
    v = np.array([0.4, 12345.6, 1e9])
    np.testing.assert_array_equal(snap_to_whole(huge, v, 32), np.rint(v))
    identity = identity_link_from_bins(col, np.full(8, 1 / 8))
    decoded = identity.inverse(np.linspace(-3, 3, 50)[:, None])
    assert np.array_equal(decoded, np.rint(decoded)) and 0 <= decoded.min() <= decoded.max() <= 10


def test_digest_changes_with_any_link_parameter() -> None:
    props, _ = exact_links(skewed_frame(2000))
    d = links_digest(SCHEMA, props, BINS, "quantile")
    assert d == links_digest(SCHEMA, props.copy(), BINS, "quantile")
    other = props.copy()
    other[0] += 1e-12
    assert links_digest(SCHEMA, other, BINS, "quantile") != d
    assert links_digest(SCHEMA, props, BINS, "identity") != d


def test_sum_and_split_validate_hostile_input() -> None:
    size = sum(link_release.histogram_sizes(SCHEMA, BINS))
    with pytest.raises(ValidationError):
        sum_histograms([np.ones(size - 1)], SCHEMA, BINS)
    with pytest.raises(ValidationError):
        sum_histograms([np.full(size, np.nan)], SCHEMA, BINS)
    blocks = split_proportions(proportions_from_histograms(np.ones(size), SCHEMA, BINS),
                               SCHEMA, BINS)
    assert [len(v) for v in blocks.values()] == [BINS, BINS, 3, 4]


def _model_from(frame: pd.DataFrame, seed: int) -> tuple[object, object]:
    props, links = exact_links(frame)
    table, _ = encode_table(SCHEMA, frame)
    rng = np.random.default_rng(seed)
    dim = links.dim  # type: ignore[attr-defined]
    clip = default_clip_norm(dim)
    unit, _ = clip_to_unit_ball(links.to_latent(table, rng), clip)  # type: ignore[attr-defined]
    acc = dppca.GramAccumulator(dim)
    acc.add(unit)
    release = dppca.site_release(acc.gram(), table.n_rows, epsilon=50.0, delta=1e-6, rank=dim,
                                 rng=rng)
    est = dppca.combine([release.factor], dim)
    fm, _ = fit_factor_model(est, links, clip_norm=clip, rng=rng)  # type: ignore[arg-type]
    return fm, links


def test_calibration_reproduces_the_released_marginals() -> None:
    frame = skewed_frame(30_000, seed=4)
    fm, links = _model_from(frame, 5)
    rng = np.random.default_rng(6)
    cal = calibrate_proportions(fm.latent(200_000, rng), links)  # type: ignore[attr-defined]
    decode = decoding_links(links, cal)  # type: ignore[arg-type]
    sample = next(iter_samples(fm, decode, 200_000, rng, chunk_rows=200_000))  # type: ignore
    target = split_proportions(np.concatenate(
        [link.proportions for link in links.links]), SCHEMA, BINS)  # type: ignore[attr-defined]
    for col in SCHEMA.columns:
        values = sample.columns[col.name]
        if isinstance(col, ContinuousColumn):
            codes = bin_codes(col, values, BINS)
            size = BINS
        else:
            codes = values
            size = len(target[col.name])
        got = np.bincount(codes, minlength=size) / sample.n_rows
        assert 0.5 * np.abs(got - target[col.name]).sum() < 0.01, col.name


def test_factor_model_rejects_an_estimate_from_another_space() -> None:
    frame = skewed_frame(3000)
    _, links = exact_links(frame)
    wrong = dppca.PCAEstimate(np.eye(3), np.ones(3), 3.0)
    with pytest.raises(ValidationError, match="latent space"):
        fit_factor_model(wrong, links, clip_norm=2.0, rng=np.random.default_rng(0))  # type: ignore


def test_projection_onto_the_public_row_count() -> None:
    from dpfed.common.synth.link_release import project_counts

    rng = np.random.default_rng(11)
    for _ in range(50):
        c = rng.normal(0, 50, 20) + np.r_[np.full(5, 400.0), np.zeros(15)]
        x = project_counts(c, 2000.0)
        assert x.min() >= 0 and x.sum() == pytest.approx(2000.0)
        # It is the closest such vector: no feasible random point is closer.
        for _ in range(20):
            y = rng.dirichlet(np.ones(20)) * 2000.0
            assert np.linalg.norm(c - x) <= np.linalg.norm(c - y) + 1e-9
    with pytest.raises(ValidationError):
        project_counts(np.ones(3), 0.0)
