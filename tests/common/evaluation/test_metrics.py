"""Tests of the site-local evaluation metrics (seed 003, DCR, NNDR, marginals, correlations)."""

from __future__ import annotations

import dataclasses
import json
import math
import tracemalloc

import numpy as np
import pandas as pd
import pytest
from scipy.spatial.distance import mahalanobis
from scipy.stats import ks_2samp

from dpfed.common.data.encoding import encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.evaluation.disclosure import _BLAS_THREADS, _block_shape
from dpfed.common.evaluation.metrics import (
    DCRSummary,
    MeanDistance,
    SyntheticReport,
    correlation_error,
    correlation_match,
    correlation_matrix,
    d1_squared,
    d2_squared,
    d3_squared,
    dcr_summary,
    disclosure_m,
    disclosure_m_best,
    disclosure_risk,
    distance_to_closest_record,
    evaluate_synthetic,
    ks_statistic,
    marginal_distances,
    nearest_neighbours,
    nndr,
    nndr_summary,
    standardize,
    table_correlation_error,
    total_variation_distance,
)

SCHEMA = Schema.from_toml("""
[[columns]]
name = "age"
type = "continuous"
min = 0
max = 110

[[columns]]
name = "bmi"
type = "continuous"
min = 10
max = 60

[[columns]]
name = "severity"
type = "ordinal"
levels = ["mild", "moderate", "severe"]

[[columns]]
name = "ward"
type = "nominal"
categories = ["cardiology", "oncology", "surgery"]
""")


def make_table(n: int, rng: np.random.Generator) -> pd.DataFrame:
    age = rng.uniform(20, 90, n)
    return pd.DataFrame({
        "age": age,
        "bmi": np.clip(15 + 0.2 * age + rng.normal(0, 4, n), 10, 60),
        "severity": rng.choice(["mild", "moderate", "severe"], n, p=[0.5, 0.3, 0.2]),
        "ward": rng.choice(["cardiology", "oncology", "surgery"], n),
    })


def brute_force_cosines(original: np.ndarray, masked: np.ndarray) -> np.ndarray:
    u = original - original.mean(axis=0)
    v = masked - masked.mean(axis=0)
    cos: np.ndarray = (v @ u.T) / np.outer(np.linalg.norm(v, axis=1), np.linalg.norm(u, axis=1))
    return cos


# ------------------------------------------------------------------------- d1, d2, d3 (seed)
class TestDistances:
    # Rows with mean 0, Σ = diag(2/3, 8/3) (ddof 1), max deviations (1, 2).
    A = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 2.0], [0.0, -2.0]])

    def test_hand_computed_point(self) -> None:
        metric = MeanDistance.fit(self.A)
        q = np.array([[1.0, 1.0]])
        assert metric.d1_squared(q)[0] == pytest.approx(1 / (2 / 3) + 1 / (8 / 3))  # 1.875
        assert metric.d2_squared(q)[0] == pytest.approx(1 / 1 + 1 / 4)  # 1.25
        assert metric.d3_squared(q, 0.4)[0] == pytest.approx(0.4 * 1.875 + 0.6 * 1.25)
        assert metric.covariance_rank == 2
        np.testing.assert_allclose(metric.max_deviation, [1.0, 2.0])

    def test_own_rows_and_centre(self) -> None:
        np.testing.assert_allclose(d1_squared(self.A), [1.5, 1.5, 1.5, 1.5])
        np.testing.assert_allclose(d2_squared(self.A), [1.0, 1.0, 1.0, 1.0])
        np.testing.assert_allclose(d3_squared(self.A, 0.25), [1.125] * 4)
        metric = MeanDistance.fit(self.A)
        # Measured from another centre (the seed's ā¹).
        assert metric.d2_squared([[1.0, 0.0]], center=[1.0, 2.0])[0] == pytest.approx(1.0)

    def test_d1_matches_scipy_mahalanobis(self) -> None:
        rng = np.random.default_rng(3)
        a = rng.standard_normal((50, 4)) @ rng.standard_normal((4, 4))
        vi = np.linalg.inv(np.cov(a, rowvar=False))
        q = rng.standard_normal((5, 4))
        expected = [mahalanobis(x, a.mean(axis=0), vi) ** 2 for x in q]
        np.testing.assert_allclose(MeanDistance.fit(a).d1_squared(q), expected, rtol=1e-10)

    def test_sum_of_d1_squared_is_rank_times_m_minus_1(self) -> None:
        # Σ_i (a_i − ā)ᵀ Σ⁺ (a_i − ā) = trace(Σ⁺ (m−1) Σ) = (m − 1) rank(Σ).
        rng = np.random.default_rng(4)
        a = rng.standard_normal((40, 3))
        singular = np.column_stack([a, a[:, 0] + a[:, 1]])  # rank 3 of 4 columns
        assert d1_squared(a).sum() == pytest.approx(39 * 3)
        assert d1_squared(singular).sum() == pytest.approx(39 * 3)

    def test_singular_covariance_pinv_equals_reduced_mahalanobis(self) -> None:
        rng = np.random.default_rng(5)
        a = rng.standard_normal((30, 2))
        dup = np.column_stack([a, a[:, 0]])  # third column repeats the first
        metric = MeanDistance.fit(dup)
        assert metric.covariance_rank == 2
        assert metric.singular == "pinv"
        np.testing.assert_allclose(metric.d1_squared(dup), d1_squared(a), rtol=1e-8)
        # Ridge: nearly the same inside the span, but movement off the span now costs.
        ridge = MeanDistance.fit(dup, singular="ridge")
        assert ridge.ridge > 0
        np.testing.assert_allclose(ridge.d1_squared(dup), d1_squared(a), rtol=1e-4)
        off_span = dup[:1] + np.array([[0.0, 0.0, 0.5]])
        assert ridge.d1_squared(off_span)[0] > 1e3 * metric.d1_squared(off_span)[0]

    def test_d2_ignores_constant_columns(self) -> None:
        a = np.column_stack([self.A, np.full(4, 7.0)])
        metric = MeanDistance.fit(a)
        assert metric.max_deviation[2] == 0.0
        q = np.array([[1.0, 1.0, 100.0]])
        assert metric.d2_squared(q)[0] == pytest.approx(1.25)
        assert np.all(np.isfinite(metric.d1_squared(q)))

    def test_d3_is_convex_combination_of_squares(self) -> None:
        rng = np.random.default_rng(6)
        a = rng.standard_normal((25, 3))
        for theta in (0.1, 0.5, 0.9):
            np.testing.assert_allclose(d3_squared(a, theta),
                                       theta * d1_squared(a) + (1 - theta) * d2_squared(a))

    @pytest.mark.parametrize("theta", [0.0, 1.0, -0.1, 1.5, float("nan"), "0.5"])
    def test_theta_validation(self, theta: object) -> None:
        with pytest.raises(ValidationError, match="theta"):
            d3_squared(self.A, theta)  # type: ignore[arg-type]

    def test_validation(self) -> None:
        with pytest.raises(ValidationError, match="at least 2 rows"):
            MeanDistance.fit(self.A[:1])
        with pytest.raises(ValidationError, match="finite"):
            MeanDistance.fit(np.array([[1.0, np.nan], [0.0, 1.0]]))
        with pytest.raises(ValidationError, match="zero variance in every column"):
            MeanDistance.fit(np.ones((5, 3)))
        with pytest.raises(ValidationError, match="singular"):
            MeanDistance.fit(self.A, singular="inverse")
        with pytest.raises(ValidationError, match="ridge"):
            MeanDistance.fit(self.A, singular="ridge", ridge=-1.0)
        metric = MeanDistance.fit(self.A)
        with pytest.raises(ValidationError, match="2 columns"):
            metric.d1_squared(np.ones((3, 3)))
        with pytest.raises(ValidationError, match="center must have 2"):
            metric.d1_squared(self.A, center=[0.0])
        with pytest.raises(ValidationError, match="distance"):
            metric.squared(self.A, "d4")


# --------------------------------------------------------------- correlation probability (seed)
class TestCorrelationProbability:
    ORIGINAL = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])  # mean 0
    MASKED = np.array([[2.0, 1.0], [0.0, -1.0]])  # mean (1, 0): centred (1, 1), (−1, −1)

    def test_hand_computed_signed(self) -> None:
        match = correlation_match(self.ORIGINAL, self.MASKED)
        s = 1 / math.sqrt(2)
        # Row 0: cosines (s, s, −s, −s): max s, others sum −s → mean −s/3, P = 4s/3.
        assert match.max_cosine[0] == pytest.approx(s)
        assert match.mean_other_cosine[0] == pytest.approx(-s / 3)
        assert match.probability[0] == pytest.approx(4 * s / 3)
        assert match.best_match[0] in (0, 1)
        assert match.best_match[1] in (2, 3)
        assert not match.absolute

    def test_hand_computed_absolute(self) -> None:
        # |cos| are all s: the maximum does not stand out, P = 0.
        match = correlation_match(self.ORIGINAL, self.MASKED, absolute=True)
        np.testing.assert_allclose(match.probability, [0.0, 0.0], atol=1e-7)
        np.testing.assert_allclose(match.mean_other_cosine, [1 / math.sqrt(2)] * 2, rtol=1e-6)

    @pytest.mark.parametrize("absolute", [False, True])
    @pytest.mark.parametrize("block", [64, 300, 4096])
    def test_matches_brute_force(self, absolute: bool, block: int) -> None:
        rng = np.random.default_rng(7)
        a = rng.standard_normal((41, 6))
        b = rng.standard_normal((23, 6))
        c = brute_force_cosines(a, b)
        if absolute:
            c = np.abs(c)
        mx = c.max(axis=1)
        expected = np.clip(mx - (c.sum(axis=1) - mx) / (a.shape[0] - 1), 0, 1)
        match = correlation_match(a, b, absolute=absolute, max_block_bytes=block)
        np.testing.assert_array_equal(match.best_match, c.argmax(axis=1))
        np.testing.assert_allclose(match.max_cosine, mx, rtol=1e-12)
        np.testing.assert_allclose(match.probability, expected, rtol=1e-6, atol=1e-6)
        exact = correlation_match(a, b, absolute=absolute, precision="float64",
                                  max_block_bytes=block)
        np.testing.assert_allclose(exact.probability, expected, rtol=1e-12, atol=1e-12)

    def test_exact_copy_gives_probability_near_one(self) -> None:
        # The seed's premise for M(A, A) ≈ 0: an exact copy has max cosine 1 and the other
        # signed cosines average ≈ 0 (the centred rows sum to 0), so P ≈ 1.
        a = np.random.default_rng(8).standard_normal((300, 20))
        match = correlation_match(a, a)
        np.testing.assert_array_equal(match.best_match, np.arange(300))
        np.testing.assert_allclose(match.max_cosine, 1.0, rtol=1e-12)
        assert match.probability.min() > 0.9
        assert match.probability.mean() > 0.99
        # The authors' |cos| averages E|cos| ≈ sqrt(2/(π·20)) ≈ 0.18 over the others in 20
        # dimensions, so P ≈ 0.82 for exact copies: why the signed cosine is the default.
        absolute = correlation_match(a, a, absolute=True)
        assert absolute.probability.mean() == pytest.approx(1 - math.sqrt(2 / (math.pi * 20)),
                                                            abs=0.03)

    def test_zero_rows_have_cosine_zero(self) -> None:
        a = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]])  # last row is the mean
        match = correlation_match(a, np.array([[0.0, 0.0], [2.0, 0.0], [-2.0, 0.0]]))
        assert match.max_cosine[0] == 0.0
        assert np.all(np.isfinite(match.probability))

    def test_validation(self) -> None:
        with pytest.raises(ValidationError, match="original needs at least 2 rows"):
            correlation_match(self.ORIGINAL[:1], self.MASKED)
        with pytest.raises(ValidationError, match="same number of columns"):
            correlation_match(self.ORIGINAL, np.ones((3, 3)))
        with pytest.raises(ValidationError, match="masked must not be empty"):
            correlation_match(self.ORIGINAL, np.empty((0, 2)))
        with pytest.raises(ValidationError, match="finite"):
            correlation_match(self.ORIGINAL, np.array([[np.inf, 0.0]]))
        with pytest.raises(ValidationError, match="precision"):
            correlation_match(self.ORIGINAL, self.MASKED, precision="float16")
        with pytest.raises(ValidationError, match="max_block_bytes"):
            correlation_match(self.ORIGINAL, self.MASKED, max_block_bytes=2**40)


# ----------------------------------------------------------------------- M and M_best (seed)
class TestSeedScore:
    def data(self) -> np.ndarray:
        return np.random.default_rng(9).standard_normal((300, 20))

    def test_identity_and_permutation_give_near_zero(self) -> None:
        a = self.data()
        scale = float(d1_squared(a).sum())  # Σ d1² = (m − 1) p: M at P = 0
        same = disclosure_risk(a, a)
        assert same.m / scale < 0.01
        assert same.m_best / scale < 1e-4
        shuffled = a[np.random.default_rng(10).permutation(a.shape[0])]
        perm = disclosure_risk(a, shuffled)
        assert perm.m == pytest.approx(same.m, rel=1e-9)
        assert perm.m_best == pytest.approx(same.m_best, rel=1e-9)
        noise = disclosure_risk(a, np.random.default_rng(11).standard_normal(a.shape))
        assert noise.m_best > 1000 * same.m_best

    def test_authors_absolute_cosine_breaks_the_identity_property(self) -> None:
        # The discriminating counterpart: with |cos| at 20 columns, M(A, A) is no longer ≈ 0.
        a = self.data()
        scale = float(d1_squared(a).sum())
        assert disclosure_risk(a, a, absolute=True).m / scale > 0.1

    def test_grows_as_rows_are_replaced_by_noise(self) -> None:
        a = self.data()
        rng = np.random.default_rng(12)
        values = []
        for fraction in (0.0, 0.25, 0.5, 1.0):
            masked = a.copy()
            k = int(fraction * a.shape[0])
            masked[:k] = rng.standard_normal((k, a.shape[1]))
            values.append(disclosure_m_best(a, masked))
        assert all(x < y for x, y in zip(values, values[1:], strict=False)), values

    def test_grows_with_additive_noise_level(self) -> None:
        a = self.data()
        noise = np.random.default_rng(13).standard_normal(a.shape)
        levels = (0.0, 0.1, 0.3, 1.0, 3.0)
        m_best = [disclosure_m_best(a, a + s * noise) for s in levels]
        m_d2 = [disclosure_m(a, a + s * noise, distance="d2") for s in levels]
        assert all(x < y for x, y in zip(m_best, m_best[1:], strict=False)), m_best
        assert all(x < y for x, y in zip(m_d2, m_d2[1:], strict=False)), m_d2

    def test_probability_saturates_in_low_dimension(self) -> None:
        # Documented weakness of P: in 3 columns an unrelated row still finds an original row
        # pointing the same way, so P ≈ 1 for independent data, while DCR tells them apart.
        rng = np.random.default_rng(30)
        a, fresh = rng.standard_normal((2000, 3)), rng.standard_normal((2000, 3))
        assert correlation_match(a, fresh).probability.mean() > 0.95
        assert dcr_summary(fresh, a).exact_copy_share == 0.0
        assert dcr_summary(a, a).exact_copy_share == 1.0

    def test_formula_against_direct_computation(self) -> None:
        rng = np.random.default_rng(14)
        a = rng.standard_normal((60, 5))
        b = a[:40] + 0.5 * rng.standard_normal((40, 5))
        c = brute_force_cosines(a, b)
        mx = c.max(axis=1)
        p = np.clip(mx - (c.sum(axis=1) - mx) / 59, 0, 1)
        vi = np.linalg.inv(np.cov(a, rowvar=False))
        centre = b.mean(axis=0)
        d1 = np.array([mahalanobis(x, centre, vi) ** 2 for x in b])
        dev = np.abs(a - a.mean(axis=0)).max(axis=0)
        d2 = (((b - centre) / dev) ** 2).sum(axis=1)
        risk = disclosure_risk(a, b, distance="d3", theta=0.3, precision="float64")
        assert risk.m == pytest.approx(float(np.sum((0.3 * d1 + 0.7 * d2) * (1 - p))))
        assert risk.m_best == pytest.approx(float(np.sum(d1 * (1 - p) ** 2)))
        assert risk.m_per_row == pytest.approx(risk.m / 40)
        assert risk.theta == 0.3
        assert risk.n_original == 60 and risk.n_masked == 40
        assert disclosure_m(a, b, precision="float64") == pytest.approx(
            float(np.sum(d1 * (1 - p))))
        json.dumps(risk.to_dict())

    def test_validation(self) -> None:
        a = self.data()
        with pytest.raises(ValidationError, match="distance"):
            disclosure_risk(a, a, distance="euclid")
        with pytest.raises(ValidationError, match="theta"):
            disclosure_risk(a, a, distance="d3", theta=1.0)
        match = correlation_match(a, a[:10])
        with pytest.raises(ValidationError, match="one probability per masked row"):
            disclosure_risk(a, a, match=match)


# ---------------------------------------------------------------------- nearest neighbours
def brute_force_knn(q: np.ndarray, r: np.ndarray, k: int,
                    exclude_self: bool = False) -> tuple[np.ndarray, np.ndarray]:
    d = np.sqrt(((q[:, None, :] - r[None, :, :]) ** 2).sum(axis=-1))
    if exclude_self:
        np.fill_diagonal(d, np.inf)
    idx = np.argsort(d, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(d, idx, axis=1), idx


class TestNearestNeighbours:
    @pytest.mark.parametrize("block", [64, 100, 1000, 20_000, 4 * 2**20])
    @pytest.mark.parametrize("k", [1, 2, 3])
    @pytest.mark.parametrize("precision", ["float32", "float64"])
    def test_blocked_equals_brute_force(self, block: int, k: int, precision: str) -> None:
        rng = np.random.default_rng(15)
        q = rng.standard_normal((57, 9)) + 5.0  # offset: centring must not change distances
        r = rng.standard_normal((83, 9)) + 5.0
        dist, idx = brute_force_knn(q, r, k)
        nb = nearest_neighbours(q, r, k=k, method="blocked", precision=precision,
                                max_block_bytes=block)
        assert nb.method == "blocked"
        np.testing.assert_array_equal(nb.indices, idx)
        np.testing.assert_allclose(nb.distances, dist, rtol=1e-12)

    @pytest.mark.parametrize("method", ["blocked", "kdtree"])
    @pytest.mark.parametrize("block", [64, 1000, 4 * 2**20])
    def test_exclude_self(self, method: str, block: int) -> None:
        x = np.random.default_rng(16).standard_normal((70, 4))
        dist, idx = brute_force_knn(x, x, 2, exclude_self=True)
        nb = nearest_neighbours(x, x, k=2, exclude_self=True, method=method,
                                max_block_bytes=block)
        np.testing.assert_array_equal(nb.indices, idx)
        np.testing.assert_allclose(nb.distances, dist, rtol=1e-12)

    @pytest.mark.parametrize("exclude_self", [False, True])
    def test_worker_threads_equal_brute_force(self, exclude_self: bool) -> None:
        x = np.random.default_rng(29).standard_normal((101, 8))
        dist, idx = brute_force_knn(x, x, 2, exclude_self=exclude_self)
        for jobs in (2, 3, 200):
            nb = nearest_neighbours(x, x, k=2, exclude_self=exclude_self, method="blocked",
                                    max_block_bytes=512, n_jobs=jobs)
            np.testing.assert_array_equal(nb.indices, idx)
            np.testing.assert_allclose(nb.distances, dist, rtol=1e-12)
        one = correlation_match(x, x[:50] + 0.1, absolute=True, max_block_bytes=512)
        many = correlation_match(x, x[:50] + 0.1, absolute=True, max_block_bytes=512, n_jobs=3)
        np.testing.assert_array_equal(one.best_match, many.best_match)
        np.testing.assert_allclose(one.probability, many.probability, rtol=1e-12)

    def test_blas_threads_restored_after_search(self) -> None:
        before = _BLAS_THREADS.threads()
        with _BLAS_THREADS.single():
            assert all(n == 1 for n in _BLAS_THREADS.threads())
            with _BLAS_THREADS.single():  # nested / concurrent searches
                pass
            assert all(n == 1 for n in _BLAS_THREADS.threads())
        assert _BLAS_THREADS.threads() == before
        x = np.ones((3, 2))
        nearest_neighbours(x, x, method="blocked")
        assert _BLAS_THREADS.threads() == before

    def test_exclude_self_keeps_duplicates(self) -> None:
        x = np.array([[0.0, 0.0], [0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
        for method in ("blocked", "kdtree"):
            nb = nearest_neighbours(x, x, k=1, exclude_self=True, method=method)
            np.testing.assert_allclose(nb.distances[:, 0], [0.0, 0.0, 3.0, 4.0])

    def test_kdtree_and_auto_agree_with_brute_force(self) -> None:
        rng = np.random.default_rng(17)
        q, r = rng.standard_normal((40, 3)), rng.standard_normal((90, 3))
        dist, idx = brute_force_knn(q, r, 2)
        for method in ("kdtree", "auto"):
            nb = nearest_neighbours(q, r, k=2, method=method)
            assert nb.method == "kdtree"
            np.testing.assert_array_equal(nb.indices, idx)
            np.testing.assert_allclose(nb.distances, dist, rtol=1e-12)
        assert nearest_neighbours(rng.standard_normal((5, 12)), rng.standard_normal((9, 12)),
                                  method="auto").method == "blocked"

    def test_exact_copies_have_distance_exactly_zero(self) -> None:
        rng = np.random.default_rng(18)
        r = rng.standard_normal((200, 15)) * 100 + 1e4  # large offset and scale
        q = np.vstack([r[[3, 50, 199]], rng.standard_normal((2, 15))])
        d = distance_to_closest_record(q, r, method="blocked", precision="float32")
        assert np.all(d[:3] == 0.0)
        assert np.all(d[3:] > 0)

    def test_block_shape_bounds_memory(self) -> None:
        for n, m, itemsize, budget in [(10**5, 10**5, 4, 4 * 2**20), (10**5, 10**5, 8, 2**28),
                                       (3, 5, 4, 64), (10**5, 10, 4, 100), (1, 1, 8, 64)]:
            rows, cols = _block_shape(n, m, itemsize, budget)
            assert 1 <= rows <= n and 1 <= cols <= m
            assert rows * cols * itemsize <= max(budget, itemsize)

    def test_peak_memory_stays_far_below_full_matrix(self) -> None:
        rng = np.random.default_rng(19)
        q, r = rng.standard_normal((3000, 10)), rng.standard_normal((3000, 10))
        tracemalloc.start()
        try:
            nearest_neighbours(q, r, k=2, method="blocked", max_block_bytes=2**16)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 3000 * 3000 * 4 / 10  # a tenth of the float32 distance matrix

    def test_validation(self) -> None:
        x = np.ones((4, 2))
        with pytest.raises(ValidationError, match="same number of columns"):
            nearest_neighbours(x, np.ones((4, 3)))
        with pytest.raises(ValidationError, match="at least 3 rows for k=2 with exclude_self"):
            nearest_neighbours(x[:2], x[:2], k=2, exclude_self=True)
        with pytest.raises(ValidationError, match="at least 2 rows for k=2"):
            nearest_neighbours(x, x[:1], k=2)
        with pytest.raises(ValidationError, match="exclude_self needs"):
            nearest_neighbours(x[:3], x, k=1, exclude_self=True)
        with pytest.raises(ValidationError, match="k must be"):
            nearest_neighbours(x, x, k=0)
        with pytest.raises(ValidationError, match="method"):
            nearest_neighbours(x, x, method="ball_tree")
        with pytest.raises(ValidationError, match="n_jobs"):
            nearest_neighbours(x, x, n_jobs=0)
        with pytest.raises(ValidationError, match="max_block_bytes"):
            nearest_neighbours(x, x, max_block_bytes=8)
        with pytest.raises(ValidationError, match="query must not be empty"):
            nearest_neighbours(np.empty((0, 2)), x)
        with pytest.raises(ValidationError, match="2-dimensional"):
            nearest_neighbours(np.ones(3), x)
        with pytest.raises(ValidationError, match="finite"):
            nearest_neighbours(x, np.array([[np.nan, 1.0], [0.0, 0.0]]))


# -------------------------------------------------------------------------------- DCR, NNDR
class TestDCRAndNNDR:
    def test_dcr_summary_hand_computed(self) -> None:
        train = np.array([[0.0], [10.0]])
        holdout = np.array([[5.0], [20.0]])
        synthetic = np.array([[1.0], [6.0], [19.0], [10.0]])
        s = dcr_summary(synthetic, train, holdout=holdout)
        # DCR to train (1, 4, 9, 0); to holdout (4, 1, 1, 5); holdout→train (5, 10).
        assert s.train_median == pytest.approx(2.5)
        assert s.train_p5 == pytest.approx(np.percentile([1, 4, 9, 0], 5))
        assert s.exact_copy_share == 0.25
        assert s.holdout_median == pytest.approx(2.5)
        assert s.share_closer_to_train == pytest.approx(0.5)  # rows 1 and 4
        assert s.expected_share == 0.5
        assert s.holdout_to_train_p5 == pytest.approx(5.25)
        assert s.share_below_holdout_p5 == pytest.approx(0.75)
        assert (s.n_synthetic, s.n_train, s.n_holdout) == (4, 2, 2)
        json.dumps(s.to_dict())

    def test_ties_count_half_and_no_holdout(self) -> None:
        s = DCRSummary.from_distances(np.array([1.0, 2.0]), 5,
                                      holdout_dcr=np.array([1.0, 3.0]),
                                      holdout_to_train_dcr=np.array([0.5, 0.5, 0.5]))
        assert s.share_closer_to_train == pytest.approx(0.75)
        assert s.expected_share == pytest.approx(5 / 8)
        plain = dcr_summary(np.array([[0.0], [1.0]]), np.array([[0.0], [3.0]]))
        assert plain.holdout_median is None and plain.share_closer_to_train is None
        assert plain.n_holdout == 0
        with pytest.raises(ValidationError, match="together"):
            DCRSummary.from_distances(np.ones(2), 3, holdout_dcr=np.ones(2))

    def test_dcr_zero_for_exact_copies(self) -> None:
        rng = np.random.default_rng(20)
        train = rng.standard_normal((500, 12))
        synthetic = np.vstack([train[:100], rng.standard_normal((300, 12))])
        for method in ("blocked", "kdtree"):
            s = dcr_summary(synthetic, train, method=method)
            assert s.exact_copy_share == pytest.approx(0.25)
            assert s.train_p5 == 0.0

    def test_memorising_generator_is_flagged_against_holdout(self) -> None:
        rng = np.random.default_rng(21)
        train, holdout = rng.standard_normal((400, 6)), rng.standard_normal((400, 6))
        fresh = dcr_summary(rng.standard_normal((400, 6)), train, holdout=holdout)
        memorised = dcr_summary(train + 0.01 * rng.standard_normal((400, 6)), train,
                                holdout=holdout)
        assert abs(fresh.share_closer_to_train - 0.5) < 0.08  # type: ignore[operator]
        assert memorised.share_closer_to_train == 1.0
        assert memorised.share_below_holdout_p5 == 1.0

    def test_nndr_hand_computed(self) -> None:
        real = np.array([[0.0], [1.0], [3.0], [3.0]])
        ratio = nndr(np.array([[0.25], [0.0], [3.0], [2.0]]), real)
        # 0.25: 0.25 / 0.75; 0.0: 0 / 1; 3.0 copies two identical rows: 0/0 → 0; 2.0: 1 / 1.
        np.testing.assert_allclose(ratio, [1 / 3, 0.0, 0.0, 1.0])
        s = nndr_summary(np.array([[0.25], [0.0], [3.0], [2.0]]), real)
        assert s.share_above_half == 0.25
        assert s.mean == pytest.approx((1 / 3 + 1) / 4)

    def test_standardize(self) -> None:
        ref = np.array([[1.0, 5.0], [3.0, 5.0]])
        z_ref, z_other = standardize(ref, np.array([[2.0, 6.0]]))
        np.testing.assert_allclose(z_ref, [[-1.0, 0.0], [1.0, 0.0]])
        np.testing.assert_allclose(z_other, [[0.0, 1.0]])  # constant column only centred
        with pytest.raises(ValidationError, match="same number of columns"):
            standardize(ref, np.ones((1, 3)))


# ------------------------------------------------------------------------ marginals, correlation
class TestUtility:
    def test_tvd_hand_computed(self) -> None:
        # p = (.5, .25, .25), q = (.25, .75, 0): ½(.25 + .5 + .25) = 0.5.
        assert total_variation_distance([0, 0, 1, 2], [0, 1, 1, 1], 3) == pytest.approx(0.5)
        assert total_variation_distance([0, 1], [1, 0], 2) == 0.0
        assert total_variation_distance([0, 0], [1, 1], 2) == 1.0

    def test_ks_hand_and_scipy(self) -> None:
        assert ks_statistic([1.0, 2.0, 3.0], [2.0, 3.0, 4.0]) == pytest.approx(1 / 3)
        rng = np.random.default_rng(22)
        for a, b in [(rng.normal(size=300), rng.normal(0.2, 1.0, 170)),
                     (rng.integers(0, 5, 200).astype(float), rng.integers(0, 6, 90).astype(float))]:
            assert ks_statistic(a, b) == pytest.approx(ks_2samp(a, b).statistic, abs=1e-15)

    def test_marginal_distances_on_frames(self) -> None:
        real = pd.DataFrame({"age": [20.0, 30.0, 40.0, 50.0], "bmi": [20.0, 20, 20, 20],
                             "severity": ["mild", "mild", "severe", "moderate"],
                             "ward": ["surgery"] * 4})
        syn = pd.DataFrame({"age": [20.0, 30.0, 60.0, 70.0], "bmi": [20.0, 20, 20, 20],
                            "severity": ["mild", "severe", "severe", "severe"],
                            "ward": ["surgery", "surgery", "oncology", "oncology"]})
        got = {m.column: m for m in marginal_distances(real, syn, SCHEMA)}
        assert [m.column for m in marginal_distances(real, syn, SCHEMA)] == list(SCHEMA.names)
        assert got["age"].statistic == "ks" and got["age"].value == pytest.approx(0.5)
        assert got["bmi"].value == 0.0
        assert got["severity"].statistic == "tvd"
        assert got["severity"].value == pytest.approx(0.5)  # (.5,.25,.25) vs (.25,0,.75)
        assert got["ward"].value == pytest.approx(0.5)

    def test_correlation_error(self) -> None:
        rng = np.random.default_rng(23)
        x = rng.standard_normal((100, 4))
        same = correlation_error(x, x.copy())
        assert (same.frobenius, same.max_abs, same.mean_abs) == (0.0, 0.0, 0.0)
        t = np.arange(10.0)
        err = correlation_error(np.column_stack([t, t]), np.column_stack([t, -t]))
        assert err.frobenius == pytest.approx(math.sqrt(8))
        assert err.max_abs == pytest.approx(2.0)
        with pytest.raises(ValidationError, match="same number of columns"):
            correlation_error(x, x[:, :3])

    def test_constant_column_correlates_zero(self) -> None:
        x = np.column_stack([np.arange(5.0), np.ones(5)])
        np.testing.assert_allclose(correlation_matrix(x), np.eye(2))
        with pytest.raises(ValidationError, match="at least 2 rows"):
            correlation_matrix(x[:1])

    def test_table_correlation_error_identical_tables(self) -> None:
        t = make_table(200, np.random.default_rng(24))
        err = table_correlation_error(t, t.copy(), SCHEMA)
        assert err.frobenius == 0.0 and err.n_features == 6

    def test_validation(self) -> None:
        with pytest.raises(ValidationError, match="codes must be in 0..2"):
            total_variation_distance([0, 3], [0], 3)
        with pytest.raises(ValidationError, match="integer category codes"):
            total_variation_distance([0.5], [0], 3)
        with pytest.raises(ValidationError, match="must not be empty"):
            total_variation_distance([], [0], 3)
        with pytest.raises(ValidationError, match="must not be empty"):
            ks_statistic([], [1.0])
        with pytest.raises(ValidationError, match="finite"):
            ks_statistic([np.nan], [1.0])
        with pytest.raises(ValidationError, match="DataFrame or an EncodedTable"):
            marginal_distances(np.ones((3, 4)), make_table(3, np.random.default_rng(0)),  # type: ignore[arg-type]
                               SCHEMA)


# ------------------------------------------------------------------------- evaluate_synthetic
class TestEvaluateSynthetic:
    def test_exact_copy(self) -> None:
        train = make_table(300, np.random.default_rng(25))
        report = evaluate_synthetic(train, train.copy(), SCHEMA, row_aligned=True)
        assert isinstance(report, SyntheticReport)
        assert report.dcr.exact_copy_share == 1.0
        assert report.nndr.mean == 0.0
        assert report.nearest_match_rate == 1.0  # continuous columns: no duplicate rows
        assert report.correlation_match_rate == 1.0
        assert report.mean_tvd == 0.0 and report.max_ks == 0.0
        assert report.correlation.frobenius == 0.0
        assert report.disclosure.mean_probability > 0.9
        assert report.disclosure.covariance_rank == report.n_features - 1  # one-hot block
        with pytest.raises(dataclasses.FrozenInstanceError):
            report.n_train = 1  # type: ignore[misc]

    def test_fresh_sample_with_holdout(self) -> None:
        rng = np.random.default_rng(26)
        train, holdout, syn = make_table(400, rng), make_table(200, rng), make_table(300, rng)
        report = evaluate_synthetic(train, syn, SCHEMA, holdout=holdout)
        assert (report.n_train, report.n_synthetic, report.n_holdout) == (400, 300, 200)
        assert report.dcr.expected_share == pytest.approx(400 / 600)
        assert abs(report.dcr.share_closer_to_train - 2 / 3) < 0.1  # type: ignore[operator]
        assert report.dcr.exact_copy_share == 0.0
        assert report.nearest_match_rate is None
        assert 0 < report.max_tvd < 0.2  # type: ignore[operator]
        assert 0 < report.mean_ks < 0.2  # type: ignore[operator]
        copy = evaluate_synthetic(train, train.iloc[:300], SCHEMA, holdout=holdout)
        assert copy.dcr.share_closer_to_train == 1.0
        assert copy.disclosure.m_best < report.disclosure.m_best
        out = report.to_dict()
        assert json.loads(json.dumps(out)) == out
        assert out["marginals"][0] == {"column": "age", "column_type": "continuous",
                                       "statistic": "ks", "value": report.marginals[0].value}

    def test_accepts_encoded_tables(self) -> None:
        t = make_table(50, np.random.default_rng(27))
        enc, _ = encode_table(SCHEMA, t)
        a = evaluate_synthetic(enc, enc, SCHEMA).to_dict()
        b = evaluate_synthetic(t, t, SCHEMA).to_dict()
        assert a == b

    def test_validation(self) -> None:
        rng = np.random.default_rng(28)
        t = make_table(20, rng)
        with pytest.raises(ValidationError, match="at least 3 usable rows"):
            evaluate_synthetic(t.iloc[:2], t, SCHEMA)
        with pytest.raises(ValidationError, match="synthetic needs at least 2"):
            evaluate_synthetic(t, t.iloc[:1], SCHEMA)
        with pytest.raises(ValidationError, match="no usable rows"):
            evaluate_synthetic(t, t.iloc[:0], SCHEMA)
        with pytest.raises(ValidationError, match="row_aligned"):
            evaluate_synthetic(t, t.iloc[:10], SCHEMA, row_aligned=True)
        other = Schema.from_toml('[[columns]]\nname = "age"\ntype = "continuous"\n'
                                 'min = 0\nmax = 100\n')
        enc, _ = encode_table(other, t)
        with pytest.raises(ValidationError, match="different schema"):
            evaluate_synthetic(enc, t, SCHEMA)
        with pytest.raises(ValidationError, match="missing column"):
            evaluate_synthetic(t, t.drop(columns=["ward"]), SCHEMA)
