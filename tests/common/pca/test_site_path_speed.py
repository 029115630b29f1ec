"""The fast site path gives the same numbers as the straightforward formulas it replaced."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from scipy import linalg

from dpfed.common.data.encoding import RowPolicy, encode_table
from dpfed.common.data.schema import ContinuousColumn, NominalColumn, OrdinalColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.linalg import mirror_upper, syrk_upper
from dpfed.common.pca.dppca import GramAccumulator, site_release
from dpfed.common.pca.features import UnitBallMap
from dpfed.common.privacy.mechanisms import symmetric_gaussian_noise

SCHEMA = Schema((
    ContinuousColumn("age", 0, 110),
    ContinuousColumn("bmi", 10, 70),
    OrdinalColumn("severity", ("mild", "moderate", "severe")),
    NominalColumn("ward", ("icu", "surgery", "general")),
))


def _table(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({
        "age": rng.uniform(0, 110, n), "bmi": rng.uniform(10, 70, n),
        "severity": rng.choice(["mild", "moderate", "severe"], n),
        "ward": rng.choice(["icu", "surgery", "general"], n)})


def _reference_transform(fmap: UnitBallMap, enc: object) -> tuple[np.ndarray, int]:
    """The former row-major fill, then per-row clip and division by the clip norm."""
    cols = []
    for col in SCHEMA.columns:
        v = enc.columns[col.name]  # type: ignore[attr-defined]
        if isinstance(col, ContinuousColumn):
            cols.append(((v - col.center) / col.half_range)[:, None])
        elif isinstance(col, OrdinalColumn):
            cols.append((v * (2.0 / (col.n_levels - 1)) - 1.0)[:, None])
        else:
            cols.append(np.eye(col.n_categories)[v])
    x = np.hstack(cols)
    norms = np.linalg.norm(x, axis=1)
    scale = np.where(norms > fmap.norm, 1.0 / np.maximum(norms, 1e-300), 1.0 / fmap.norm)
    return x * scale[:, None], int(np.count_nonzero(norms > fmap.norm))


@pytest.mark.parametrize("clip_norm", [None, 2.0, 1.2, 0.5])
def test_column_major_transform_equals_the_reference(clip_norm: float | None) -> None:
    enc, _ = encode_table(SCHEMA, _table(500))
    fmap = UnitBallMap(SCHEMA, clip_norm=clip_norm)
    x, clipped = fmap.transform(enc)
    ref, ref_clipped = _reference_transform(fmap, enc)
    assert x.flags.f_contiguous and x.shape == ref.shape
    np.testing.assert_allclose(x, ref, rtol=1e-14, atol=1e-15)
    assert clipped == ref_clipped
    assert (clipped == 0) == (clip_norm is None or clip_norm >= 2.0)
    assert np.max(np.linalg.norm(x, axis=1)) <= 1 + 1e-12


def test_typed_float_fast_path_agrees_with_the_text_path() -> None:
    table = _table(300, seed=1)
    fast, fast_report = encode_table(SCHEMA, table)
    as_text = pa.table({n: pa.array([str(v) for v in table.column(n).to_pylist()])
                        for n in table.column_names})
    slow, slow_report = encode_table(SCHEMA, as_text)
    for name in SCHEMA.names:
        np.testing.assert_array_equal(fast.columns[name], slow.columns[name])
    assert fast_report == slow_report
    # NaN, infinity, nulls and out-of-range values leave the fast path and meet the policy.
    age = table.column("age").to_numpy().copy()
    age[[3, 4, 5]] = [np.nan, np.inf, 120.0]
    bad = table.set_column(0, "age", pa.array(age))
    bad = bad.set_column(1, "bmi", pa.array([None] + table.column("bmi").to_pylist()[1:]))
    enc, report = encode_table(SCHEMA, bad, policy=RowPolicy(missing="drop"))
    # (A NaN float counts as invalid, as it did before the fast path.)
    assert (report.dropped_missing, report.dropped_invalid, report.values_clipped) == (1, 2, 1)
    assert enc.n_rows == 297 and enc.columns["age"].max() == 110.0


@pytest.mark.parametrize("order", ["C", "F"])
def test_gram_accumulator_either_order_and_hand_over(order: str) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1000, 37))
    acc = GramAccumulator(37)
    for part in np.array_split(x, 7):
        acc.add(np.asarray(part, order=order))  # type: ignore[call-overload]
    g = acc.gram()
    assert g.flags.c_contiguous
    np.testing.assert_allclose(g, x.T @ x, rtol=1e-12, atol=1e-10)
    np.testing.assert_array_equal(g, g.T)
    with pytest.raises(ValidationError, match="already called"):
        acc.gram()
    with pytest.raises(ValidationError, match="takes no more rows"):
        acc.add(x[:3])


@pytest.mark.parametrize("sizes", [[3, 1500, 7, 2000, 1, 1], [700] * 5, [1024, 1023, 1]])
def test_gram_accumulator_buffers_short_chunks_exactly(sizes: list[int]) -> None:
    rng = np.random.default_rng(len(sizes))
    x = np.asfortranarray(rng.standard_normal((sum(sizes), 9)))
    acc = GramAccumulator(9)
    start = 0
    for n in sizes:
        acc.add(x[start:start + n])
        start += n
    assert acc.n_rows == x.shape[0]
    np.testing.assert_allclose(acc.gram(), x.T @ x, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("p", [1, 2, 5, 600, 2100])
def test_mirror_upper_equals_triu_formula(p: int) -> None:
    a = np.random.default_rng(p).standard_normal((p, p))
    expected = np.triu(a) + np.triu(a, 1).T
    np.testing.assert_array_equal(mirror_upper(a.copy()), expected)
    np.testing.assert_array_equal(mirror_upper(np.asfortranarray(a)), expected)


@pytest.mark.parametrize("order", ["C", "F"])
def test_syrk_upper_in_either_memory_order_is_the_exact_upper_gram(order: str) -> None:
    """Integer-valued rows: both layouts give exactly ``triu(x^T x)``, fresh or accumulated."""
    x = np.asarray(np.random.default_rng(1).integers(-50, 50, (700, 9)), dtype=np.float64,
                   order=order)
    exact = np.triu(x.T @ x)
    np.testing.assert_array_equal(np.triu(syrk_upper(x)), exact)
    ones = np.triu(np.ones((9, 9)))
    np.testing.assert_array_equal(np.triu(syrk_upper(x, into=np.asfortranarray(ones))),
                                  exact + ones)


def test_noise_in_place_draws_the_same_matrix_as_before() -> None:
    p, sigma = 301, 0.7
    noise = symmetric_gaussian_noise(p, sigma, np.random.default_rng(5))
    raw = np.random.default_rng(5).standard_normal((p, p))
    np.testing.assert_array_equal(noise, (np.triu(raw) + np.triu(raw, 1).T) * sigma)


def test_site_release_top_r_eigenvalues_match_full_eigh() -> None:
    rng = np.random.default_rng(6)
    p, rank, n = 300, 12, 2000
    x = rng.uniform(-1, 1, (n, p)) / np.sqrt(p)
    gram = x.T @ x
    out = site_release(gram.copy(), n, epsilon=1.0, delta=1e-5, rank=rank,
                       rng=np.random.default_rng(7))
    noisy = gram / n + symmetric_gaussian_noise(p, out.sigma, np.random.default_rng(7))
    full = linalg.eigh(noisy, eigvals_only=True)[::-1][:rank]
    released = np.sum(out.factor ** 2, axis=0)  # = clipped eigenvalues
    np.testing.assert_allclose(released, np.clip(full, 0, None), rtol=0, atol=1e-12)
