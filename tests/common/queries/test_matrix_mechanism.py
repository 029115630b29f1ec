"""Matrix mechanism (seed 004): strategies, releases, reconstruction, closed-form error.

Three layers: validation; cost and sensitivity arithmetic (no randomness); seeded
statistical tests (closed-form RMSE against Monte Carlo), each also run against deliberately
broken releases (half the noise; sensitivity from row instead of column norms) that the same
check must reject. Plus the published shape (HDMM's all-range table) and the properties of
the non-negative reconstructions that actually hold.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import pytest
from scipy import optimize

from dpfed.common.errors import ValidationError
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.queries import matrix_mechanism as mm
from dpfed.common.queries import strategy_templates as st
from dpfed.common.queries import workloads as wl

Release = Callable[[np.ndarray, np.random.Generator], np.ndarray]
POW2 = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


def sparse_histogram(n: int, seed: int) -> np.ndarray:
    """A histogram with many empty cells (where non-negativity matters)."""
    rng = np.random.default_rng(seed)
    x = rng.poisson(4.0, size=n).astype(np.float64)
    x[rng.random(n) < 0.6] = 0.0
    return x


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, math.nan, math.inf, -math.inf, "1", None, True])
def test_epsilon_is_validated(bad: object) -> None:
    with pytest.raises(ValidationError, match="epsilon"):
        mm.MatrixMechanism(np.eye(3), bad)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="epsilon"):
        mm.release(np.ones(3), np.eye(3), epsilon=bad,  # type: ignore[arg-type]
                   rng=np.random.default_rng(0))
    with pytest.raises(ValidationError, match="epsilon"):
        mm.expected_rmse(wl.identity_workload(3), np.eye(3), epsilon=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, 0.0, 1.0, -1e-5, 1.5, math.nan, math.inf, "1e-5"])
def test_gaussian_delta_is_validated(bad: object) -> None:
    with pytest.raises(ValidationError, match="delta"):
        mm.MatrixMechanism(np.eye(3), 1.0, bad, "gaussian")  # type: ignore[arg-type]


def test_gaussian_requires_delta_and_laplace_refuses_it() -> None:
    with pytest.raises(ValidationError, match="delta is required for noise='gaussian'"):
        mm.MatrixMechanism(np.eye(3), 1.0, None, "gaussian")
    with pytest.raises(ValidationError, match="delta must be None for noise='laplace'"):
        mm.MatrixMechanism(np.eye(3), 1.0, 1e-5, "laplace")
    with pytest.raises(ValidationError, match="delta must be None"):
        mm.expected_rmse(wl.identity_workload(3), np.eye(3), epsilon=1.0, delta=1e-5)


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(ValidationError, match="'identity', 'h2', 'wavelet', 'prefix', "
                                              "'optimized', got 'haar'"):
        mm.strategy("haar", 8)
    with pytest.raises(ValidationError, match="noise must be one of 'laplace', 'gaussian'"):
        mm.MatrixMechanism(np.eye(3), 1.0, noise="geometric")
    with pytest.raises(ValidationError, match="nonnegative must be one of 'nnls', 'l1'"):
        mm.reconstruct(np.ones(3), np.eye(3), nonnegative="clip")
    with pytest.raises(ValidationError, match="norm must be one of 'l1', 'l2'"):
        mm.sensitivity(np.eye(3), "linf")
    with pytest.raises(ValidationError, match="workload kind must be one of"):
        wl.Workload("w", "ranges", (3,), 3, gram=np.eye(3))


@pytest.mark.parametrize("bad_x, message", [
    (np.array([1.0, -1.0, 2.0]), r"all >= 0"),
    (np.array([1.0, math.nan, 2.0]), "finite"),
    (np.array([1.0, math.inf, 2.0]), "finite"),
    (np.ones((3, 1)), "1-dimensional"),
    (np.ones(4), "length 3"),
    (["a", "b", "c"], "numeric"),
])
def test_histogram_is_validated(bad_x: object, message: str) -> None:
    mech = mm.MatrixMechanism(np.eye(3), 1.0)
    with pytest.raises(ValidationError, match=message):
        mech.release(bad_x, np.random.default_rng(0))


@pytest.mark.parametrize("bad_a, message", [
    (np.ones(3), "2-dimensional"),
    (np.zeros((0, 3)), "at least one row"),
    (np.zeros((2, 3)), "all zeros"),
    (np.array([[1.0, math.nan]]), "finite"),
])
def test_strategy_matrix_is_validated(bad_a: np.ndarray, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        mm.MatrixMechanism(bad_a, 1.0)
    with pytest.raises(ValidationError, match=message):
        mm.reconstruct(np.ones(3), bad_a)


def test_shapes_are_checked_everywhere() -> None:
    a = mm.h2_strategy(4)  # 7 x 4
    with pytest.raises(ValidationError, match="y must have length 7"):
        mm.reconstruct(np.ones(4), a)
    with pytest.raises(ValidationError, match=r"releases\[1\] must have length 7"):
        mm.combine_releases([np.ones(7), np.ones(6)], a)
    with pytest.raises(ValidationError, match="at least one site"):
        mm.combine_releases([], a)
    with pytest.raises(ValidationError, match="sequence of per-site vectors"):
        mm.combine_releases(np.ones(7), a)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="workload has 5 cells but the strategy has 4"):
        mm.expected_rmse(wl.all_range_workload(5), a, epsilon=1.0)
    with pytest.raises(ValidationError, match="workload has 5 cells"):
        mm.strategy("optimized", 4, workload=wl.all_range_workload(5))
    with pytest.raises(ValidationError, match="needs the workload"):
        mm.strategy("optimized", 4)
    with pytest.raises(ValidationError, match="n_sites must be >= 1"):
        mm.expected_rmse(wl.identity_workload(4), np.eye(4), epsilon=1.0, n_sites=0)
    with pytest.raises(ValidationError, match="n must be >= 1"):
        mm.strategy("h2", 0)


def test_unsupported_workload_is_refused() -> None:
    # The total and one cell cannot estimate every single cell without bias.
    partial = np.vstack([np.ones(4), [1.0, 0.0, 0.0, 0.0]])
    with pytest.raises(ValidationError, match="does not support the workload"):
        mm.expected_rmse(wl.identity_workload(4), partial, epsilon=1.0)
    # ...but they do support the total query: sensitivity ||e_0||_1 = 1 (cell 0 vs another).
    rmse = mm.expected_rmse(np.ones((1, 4)), partial, epsilon=1.0)
    assert rmse == pytest.approx(math.sqrt(2.0))
    # The total alone is a function of the public row count under replace-one: refused.
    with pytest.raises(ValidationError, match="public row count"):
        mm.MatrixMechanism(np.ones((1, 4)), 1.0)


def test_workload_validation() -> None:
    with pytest.raises(ValidationError, match=r"gram must have shape \(3, 3\)"):
        wl.Workload("w", "custom", (3,), 1, gram=np.eye(2))
    with pytest.raises(ValidationError, match="symmetric"):
        wl.Workload("w", "custom", (2,), 1, gram=np.array([[1.0, 2.0], [0.0, 1.0]]))
    with pytest.raises(ValidationError, match="positive semi-definite"):
        wl.gram_workload(np.array([[1.0, 2.0], [2.0, 1.0]]), 2)
    with pytest.raises(ValidationError, match="k must be <= 2"):
        wl.marginal_workload((2, 3), 3)
    with pytest.raises(ValidationError, match="explicit=False"):
        wl.all_range_workload(2048, explicit=True)
    implicit = wl.gram_workload(np.eye(3), 3)
    with pytest.raises(ValidationError, match="only by its Gram matrix"):
        implicit.answer(np.ones(3))
    with pytest.raises(ValidationError, match="x must have length 3"):
        wl.all_range_workload(3).answer(np.ones(4))


# --------------------------------------------------------------------------- arithmetic


def _brute_force_replace_one(a: np.ndarray, order: int) -> float:
    """Largest ||A x' - A x|| over x' = x - e_i + e_j (every replace-one pair of cells)."""
    n = a.shape[1]
    return max((float(np.linalg.norm(a[:, j] - a[:, i], ord=order))
                for i in range(n) for j in range(n) if i != j), default=0.0)


@pytest.mark.parametrize("n", POW2)
def test_tree_strategies_have_the_textbook_sensitivity(n: int) -> None:
    levels = int(math.log2(n)) + 1
    h2 = mm.h2_strategy(n)
    wav = mm.wavelet_strategy(n)
    assert h2.shape == (2 * n - 1, n)
    assert wav.shape == (n, n)
    for a in (h2, wav):
        # The papers' (add/remove) figure: the largest column norm.
        assert mm.column_norm(a, "l1") == levels  # every column: one entry per tree level
        assert mm.column_norm(a, "l2") == pytest.approx(math.sqrt(levels))
        # ...and it is every column, not just the largest (balanced tree).
        np.testing.assert_array_equal(np.abs(a).sum(axis=0), levels)
        # Replace-one: two leaves under different children of the root share only the root,
        # so the exact L1 figure is 2 (levels - 1); the bound 2 levels where not computed.
        value, method = mm.sensitivity_with_method(a, "l1")
        if n == 1:
            assert value == 0.0
        elif method == "exact-pairs":
            assert value == 2 * (levels - 1)
        else:
            assert (value, n) == (2 * levels, 1024)
    # Haar rows are mutually orthogonal.
    gram = wav @ wav.T
    np.testing.assert_allclose(gram, np.diag(np.diag(gram)))
    assert mm.column_norm(mm.prefix_strategy(n), "l1") == n
    assert mm.column_norm(mm.prefix_strategy(n), "l2") == pytest.approx(math.sqrt(n))
    assert mm.column_norm(mm.identity_strategy(n), "l1") == 1
    if 1 < n < 1024:
        # Prefix: cell 0 is in every prefix, cell n-1 in one: they differ in n - 1 rows.
        assert mm.sensitivity(mm.prefix_strategy(n), "l1") == n - 1
        assert mm.sensitivity(mm.identity_strategy(n), "l1") == 2
        assert mm.sensitivity(mm.identity_strategy(n), "l2") == pytest.approx(math.sqrt(2))


@pytest.mark.parametrize("n", [3, 5, 6, 7, 12, 100])
def test_tree_strategies_for_other_domain_sizes(n: int) -> None:
    depth = math.ceil(math.log2(n)) + 1
    h2 = mm.h2_strategy(n)
    wav = mm.wavelet_strategy(n)
    assert h2.shape == (2 * n - 1, n)
    assert mm.column_norm(h2, "l1") == depth
    assert mm.column_norm(wav, "l1") <= depth
    for a in (h2, wav):
        assert mm.sensitivity(a, "l1") <= 2 * mm.column_norm(a, "l1")
        assert np.linalg.matrix_rank(a) == n  # full column rank: supports any workload
        assert not np.any(np.all(a == 0, axis=1))


@pytest.mark.parametrize("name", ["identity", "h2", "wavelet", "prefix"])
@pytest.mark.parametrize("n", [2, 5, 16])
def test_sensitivity_is_the_largest_change_between_replace_one_neighbours(name: str,
                                                                          n: int) -> None:
    # Brute force over every replace-one pair of cells (x - e_i + e_j) of the strategy.
    a = mm.strategy(name, n)
    for norm, order in (("l1", 1), ("l2", 2)):
        value, method = mm.sensitivity_with_method(a, norm)
        assert method == "exact-pairs"
        assert value == pytest.approx(_brute_force_replace_one(a, order), rel=1e-12)


def test_sensitivity_of_a_random_strategy_and_the_bound() -> None:
    rng = np.random.default_rng(7)
    a = rng.normal(size=(9, 6))
    for norm, order in (("l1", 1), ("l2", 2)):
        worst = _brute_force_replace_one(a, order)
        assert mm.sensitivity(a, norm) == pytest.approx(worst)
        assert worst <= 2 * mm.column_norm(a, norm)
    # Opposite columns attain the 2x bound exactly.
    b = np.array([[1.0, -1.0], [2.0, -2.0]])
    assert mm.sensitivity(b, "l1") == 2 * mm.column_norm(b, "l1") == 6.0
    # Above the work budget the bound is used, and it is never below the exact value.
    big = mm.h2_strategy(1024)
    assert mm.sensitivity_with_method(big, "l1") == (22.0, "2x-max-column")
    assert mm.sensitivity_with_method(big, "l2")[1] == "exact-pairs"
    assert mm.sensitivity(big, "l2") == pytest.approx(math.sqrt(2 * 10))


def test_seed_worked_example() -> None:
    # Seed 004, section 2: A = [[1, 1], [1, -1]], x = [100, 200], epsilon = 1.
    a = np.array([[1.0, 1.0], [1.0, -1.0]])
    mech = mm.MatrixMechanism(a, 1.0)
    assert mech.sensitivity == 2.0 and mech.noise_scale == 2.0
    np.testing.assert_allclose(a @ np.array([100.0, 200.0]), [300.0, -100.0])
    np.testing.assert_allclose(mm.reconstruct(np.array([303.0, -101.0]), a), [101.0, 202.0])
    np.testing.assert_allclose(mm.reconstruct(np.array([305.0, -105.0]), a), [100.0, 205.0])
    np.testing.assert_allclose(mm.reconstruct(np.array([300.0, 150.0]), a), [225.0, 75.0])
    # A noisy vector whose least-squares estimate is negative: both non-negative steps fix it.
    y = np.array([100.0, 200.0])  # LS gives [150, -50]
    np.testing.assert_allclose(mm.reconstruct(y, a), [150.0, -50.0])
    for method in ("nnls", "l1"):
        assert np.all(mm.reconstruct(y, a, nonnegative=method) >= 0)


def test_laplace_cost_and_scale() -> None:
    mech = mm.MatrixMechanism(mm.h2_strategy(16), 0.5)
    assert mech.sensitivity == 8.0  # replace-one: two leaves sharing only the root
    assert mech.sensitivity_method == "exact-pairs"
    assert mech.noise_scale == 16.0
    assert mech.noise_variance == 512.0
    cost = mech.cost()
    assert cost == PrivacyCost(0.5, 0.0, 0.125, "matrix-laplace", 8.0, 16.0)


def test_gaussian_cost_and_scale() -> None:
    mech = mm.MatrixMechanism(mm.wavelet_strategy(16), 1.0, 1e-5, "gaussian")
    # Replace-one: leaves in different halves share the total, differ by 2 in the top detail
    # row and by 1 + 1 in each of the 3 lower levels: sqrt(4 + 2 * 3).
    assert mech.sensitivity == pytest.approx(math.sqrt(10.0))
    sigma = gaussian_sigma(1.0, 1e-5, math.sqrt(10.0))
    assert mech.noise_scale == pytest.approx(sigma, rel=1e-12)
    cost = mech.cost()
    assert (cost.epsilon, cost.delta, cost.mechanism) == (1.0, 1e-5, "matrix-gaussian")
    assert cost.rho == pytest.approx(10.0 / (2.0 * sigma * sigma))
    assert mm.noise_variance(mm.wavelet_strategy(16), epsilon=1.0, delta=1e-5,
                             noise="gaussian") == pytest.approx(sigma**2)


def test_mechanism_keeps_its_own_copy_of_the_strategy() -> None:
    a = np.eye(3)
    mech = mm.MatrixMechanism(a, 1.0)
    a[0, 0] = 100.0
    assert mech.strategy_matrix[0, 0] == 1.0
    assert not mech.strategy_matrix.flags.writeable


@pytest.mark.parametrize("name", ["identity", "h2", "wavelet", "prefix"])
@pytest.mark.parametrize("n", [8, 13])
def test_noiseless_reconstruction_is_exact(name: str, n: int) -> None:
    a = mm.strategy(name, n)
    x = sparse_histogram(n, seed=n)
    for method in (None, "nnls", "l1"):
        np.testing.assert_allclose(mm.reconstruct(a @ x, a, nonnegative=method), x,
                                   atol=1e-8)


def test_noiseless_reconstruction_through_optimized_strategy() -> None:
    w = wl.all_range_workload(32)
    a = mm.strategy("optimized", 32, workload=w, noise="gaussian")
    x = sparse_histogram(32, seed=1)
    np.testing.assert_allclose(mm.reconstruct(a @ x, a), x, atol=1e-8)
    np.testing.assert_allclose(mm.answer(w, mm.reconstruct(a @ x, a)), w.answer(x), atol=1e-7)


def test_rank_deficient_strategy_uses_the_pseudo_inverse() -> None:
    a = np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # cells 0 and 1 only as their sum
    y = np.array([4.0, 3.0])
    np.testing.assert_allclose(mm.reconstruct(y, a), np.linalg.pinv(a) @ y)
    total = np.ones((1, 3))  # supported: sum of the two rows
    # W A^+ = [1, 1]; replace-one L1 sensitivity 2 (cell 0 vs cell 2): two Laplace draws of
    # scale 2 (variance 8 each) -> RMSE 4.
    assert np.linalg.norm(total @ np.linalg.pinv(a)) ** 2 == pytest.approx(2.0)
    assert mm.expected_rmse(total, a, epsilon=1.0) == pytest.approx(4.0)


# --------------------------------------------------------------------------- workloads


@pytest.mark.parametrize("n", range(1, 13))
def test_implicit_all_range_gram_equals_explicit(n: int) -> None:
    implicit = wl.all_range_workload(n)
    explicit = wl.all_range_workload(n, explicit=True)
    assert implicit.matrix is None and explicit.matrix is not None
    assert implicit.n_queries == explicit.n_queries == n * (n + 1) // 2
    np.testing.assert_array_equal(implicit.gram, explicit.matrix.T @ explicit.matrix)
    x = sparse_histogram(n, seed=n)
    np.testing.assert_allclose(implicit.answer(x), explicit.answer(x))


def test_prefix_identity_and_marginal_workloads() -> None:
    w = wl.prefix_workload(6)
    assert w.matrix is not None
    np.testing.assert_array_equal(w.gram, w.matrix.T @ w.matrix)
    np.testing.assert_array_equal(w.answer(np.arange(6.0)), np.cumsum(np.arange(6.0)))
    np.testing.assert_array_equal(wl.identity_workload(4).gram, np.eye(4))

    m = wl.marginal_workload((2, 3), 1)
    assert m.n == 6 and m.n_queries == 5
    table = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(m.answer(table.ravel()),
                                  np.concatenate([table.sum(axis=1), table.sum(axis=0)]))
    m2 = wl.marginal_workload((2, 3, 4), 2)
    assert m2.n_queries == 2 * 3 + 2 * 4 + 3 * 4
    cube = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(m2.answer(cube.ravel())[:6], cube.sum(axis=2).ravel())
    total = wl.marginal_workload((2, 3), 0)
    assert total.n_queries == 1 and total.answer(np.ones(6))[0] == 6.0


def test_workload_from_gram_matches_matrix() -> None:
    rng = np.random.default_rng(3)
    w = rng.normal(size=(7, 5))
    by_matrix = wl.custom_workload(w)
    by_gram = wl.gram_workload(w.T @ w, 7)
    a = mm.h2_strategy(5)
    assert mm.expected_rmse(by_matrix, a, epsilon=1.0) == pytest.approx(
        mm.expected_rmse(by_gram, a, epsilon=1.0))
    assert mm.expected_rmse(w, a, epsilon=1.0) == pytest.approx(
        mm.expected_rmse(by_gram, a, epsilon=1.0))


# --------------------------------------------------------------------------- published shape


def test_unit_noise_rmse_reproduces_the_hdmm_table() -> None:
    # HDMM experiments/journal/oned.csv, all ranges, n = 256: 9.27 / 3.84 / 3.51.
    w = wl.all_range_workload(256)
    assert mm.unit_noise_rmse(w, mm.identity_strategy(256)) == pytest.approx(
        math.sqrt(258 / 3))
    assert mm.unit_noise_rmse(w, mm.identity_strategy(256)) == pytest.approx(9.27, abs=0.005)
    assert mm.unit_noise_rmse(w, mm.h2_strategy(256)) == pytest.approx(3.84, abs=0.01)
    assert mm.unit_noise_rmse(w, mm.wavelet_strategy(256)) == pytest.approx(3.51, abs=0.01)


def test_gaussian_h2_and_wavelet_beat_identity_on_all_ranges() -> None:
    w = wl.all_range_workload(256)
    kw = {"epsilon": 1.0, "delta": 1e-5, "noise": "gaussian"}
    identity = mm.expected_rmse(w, mm.identity_strategy(256), **kw)  # type: ignore[arg-type]
    for a in (mm.h2_strategy(256), mm.wavelet_strategy(256)):
        assert identity / mm.expected_rmse(w, a, **kw) >= 2.3  # type: ignore[arg-type]


def test_laplace_trees_lose_at_256_and_win_at_1024() -> None:
    for n, trees_win in ((256, False), (1024, True)):
        w = wl.all_range_workload(n)
        identity = mm.expected_rmse(w, mm.identity_strategy(n), epsilon=1.0)
        h2 = mm.expected_rmse(w, mm.h2_strategy(n), epsilon=1.0)
        wav = mm.expected_rmse(w, mm.wavelet_strategy(n), epsilon=1.0)
        assert (h2 < identity) is trees_win
        assert (wav < identity) is trees_win


@pytest.mark.slow
def test_laplace_wavelet_wins_about_1_6x_at_2048() -> None:
    w = wl.all_range_workload(2048)
    identity = mm.expected_rmse(w, mm.identity_strategy(2048), epsilon=1.0)
    ratio = identity / mm.expected_rmse(w, mm.wavelet_strategy(2048), epsilon=1.0)
    assert 1.5 <= ratio <= 1.7


# --------------------------------------------------------------------------- optimised strategy


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_pidentity_gradient_matches_finite_differences(norm: str) -> None:
    w = wl.all_range_workload(24)
    gram = w.gram / np.trace(w.gram)
    diag = np.diag(gram).copy()
    theta = np.random.default_rng(0).random(3 * 24)

    def loss(t: np.ndarray) -> float:
        return st.pidentity_loss(t, gram, diag, 3, norm)[0]

    def grad(t: np.ndarray) -> np.ndarray:
        return st.pidentity_loss(t, gram, diag, 3, norm)[1]

    err = optimize.check_grad(loss, grad, theta, epsilon=1e-7)
    assert err <= 1e-5 * np.linalg.norm(grad(theta))
    # The O(p n^2) Woodbury loss equals the generic formula on the built matrix.
    a = st.pidentity_matrix(theta.reshape(3, 24), norm)
    assert mm.column_norm(a, norm) == pytest.approx(1.0)
    assert loss(theta) * np.trace(w.gram) == pytest.approx(mm.squared_error(w, a))


@pytest.fixture(scope="module")
def optimized_256() -> dict[str, np.ndarray]:
    # One restart keeps this fast; strategy("optimized") (3 restarts) can only do better.
    w = wl.all_range_workload(256)
    return {noise: mm.optimize_strategy(w, noise=noise, restarts=1).matrix
            for noise in mm.NOISES}


@pytest.mark.parametrize("noise, delta, min_gain", [("laplace", None, 1.5),
                                                    ("gaussian", 1e-5, 2.5)])
def test_optimized_beats_identity_under_both_noises(optimized_256: dict[str, np.ndarray],
                                                    noise: str, delta: float | None,
                                                    min_gain: float) -> None:
    w = wl.all_range_workload(256)
    a = optimized_256[noise]
    norm = "l1" if noise == "laplace" else "l2"
    assert mm.column_norm(a, norm) == pytest.approx(1.0)
    assert 1.0 <= mm.sensitivity(a, norm) <= 2.0 + 1e-9
    identity = mm.expected_rmse(w, np.eye(256), epsilon=1.0, delta=delta, noise=noise)
    optimized = mm.expected_rmse(w, a, epsilon=1.0, delta=delta, noise=noise)
    assert identity / optimized >= min_gain
    if noise == "gaussian":  # and it is better than the fixed trees under their best noise
        assert optimized < mm.expected_rmse(w, mm.wavelet_strategy(256), epsilon=1.0,
                                            delta=delta, noise=noise)


def test_optimization_is_deterministic_and_reports_itself() -> None:
    w = wl.all_range_workload(32)
    first = mm.optimize_strategy(w, noise="laplace", restarts=2, maxiter=40)
    second = mm.optimize_strategy(w, noise="laplace", restarts=2, maxiter=40)
    np.testing.assert_array_equal(first.matrix, second.matrix)  # default: fixed seed
    seeded = mm.optimize_strategy(w, noise="laplace", restarts=2, maxiter=40,
                                  rng=np.random.default_rng(5))
    again = mm.optimize_strategy(w, noise="laplace", restarts=2, maxiter=40,
                                 rng=np.random.default_rng(5))
    np.testing.assert_array_equal(seeded.matrix, again.matrix)
    assert not np.array_equal(first.matrix, seeded.matrix)
    assert first.matrix.shape == (32 + 2, 32) and first.p == 2
    assert first.restarts == 2 and 0 < first.iterations <= 80
    assert not first.used_identity and first.improvement > 1.0
    assert first.squared_error == pytest.approx(mm.squared_error(w, first.matrix, norm="l1"))
    # The identity pays the replace-one L1 sensitivity 2: 4 x ||W||_F^2.
    assert first.identity_squared_error == pytest.approx(4 * np.trace(w.gram))


def test_the_convex_and_marginal_losses_have_their_gradients() -> None:
    w = wl.all_range_workload(16)
    programme = st.ConvexL2(w.gram / np.trace(w.gram))
    x0 = programme.start()
    x1 = 0.5 * x0  # away from the optimum, where the gradient is not small
    err = optimize.check_grad(lambda x: programme.loss(x)[0], lambda x: programme.loss(x)[1],
                              x1, epsilon=1e-7)
    assert err <= 1e-5 * np.linalg.norm(programme.loss(x1)[1])
    a = programme.strategy(x0)
    assert np.allclose(np.diag(a.T @ a), 1.0)
    assert programme.loss(x0)[0] * np.trace(w.gram) == pytest.approx(mm.squared_error(w, a))
    algebra = st.MarginalAlgebra((3, 4, 2))
    rng = np.random.default_rng(1)
    u, v = rng.random(8), rng.random(8)
    assert np.allclose(algebra.gram(u) @ algebra.gram(v), algebra.gram(algebra.x_matrix(u) @ v))
    target = algebra.weights_of(wl.marginal_workload((3, 4, 2), 2).gram)
    assert target is not None and sorted(np.round(target, 12)) == [0.0] * 5 + [1.0] * 3
    value, grad = algebra.trace_loss(u, target)
    assert value == pytest.approx(np.trace(algebra.gram(target) @ np.linalg.inv(algebra.gram(u))))
    err = optimize.check_grad(lambda t: algebra.trace_loss(t, target)[0],
                              lambda t: algebra.trace_loss(t, target)[1], u, epsilon=1e-7)
    assert err <= 1e-5 * np.linalg.norm(grad)
    assert algebra.weights_of(wl.all_range_workload(24).gram) is None


#: HDMM's own optimisers (github.com/dpcomp-org/hdmm, run once; best of 3-5 seeds), per-query
#: RMSE at unit noise in its column-norm normalisation: McKennaConvex (L2) and PIdentity
#: p = n/16 (L1) on all ranges over 256 cells (L2 also in its experiments/journal/oned.csv:
#: 2.902); the Marginals template on all 2-way marginals of a 10 x 10 x 10 domain.
HDMM_OPTIMUM = {("ranges", "gaussian"): 2.9014, ("ranges", "laplace"): 5.7111,
                ("marginals", "gaussian"): 1.6462, ("marginals", "laplace"): 2.8513}


@pytest.mark.parametrize("workload, noise", sorted(HDMM_OPTIMUM))
def test_the_optimiser_reaches_hdmm_s_optimum(workload: str, noise: str) -> None:
    w = (wl.all_range_workload(256) if workload == "ranges"
         else wl.marginal_workload((10, 10, 10), 2))
    result = mm.optimize_strategy(w, noise=noise)
    norm = "l1" if noise == "laplace" else "l2"
    rmse = mm.unit_noise_rmse(w, result.matrix, norm=norm)
    assert rmse <= 1.02 * HDMM_OPTIMUM[(workload, noise)], (workload, noise, rmse)
    assert not result.used_identity and not result.timed_out
    assert result.template == ("marginals" if workload == "marginals" else
                               "convex" if noise == "gaussian" else "p-identity")


def test_planning_is_bounded_from_the_request_s_shape() -> None:
    with pytest.raises(ValidationError, match="at most 2048"):
        mm.optimize_strategy(wl.identity_workload(mm.MAX_OPTIMIZED_CELLS + 1))
    started = time.perf_counter()
    result = mm.optimize_strategy(wl.all_range_workload(256), noise="laplace", restarts=3,
                                  time_limit=0.05)
    assert result.timed_out and time.perf_counter() - started < 30
    assert mm.column_norm(result.matrix, "l1") == pytest.approx(1.0)


def test_optimization_falls_back_to_identity_where_it_does_not_pay() -> None:
    result = mm.optimize_strategy(wl.identity_workload(32), noise="gaussian", restarts=1)
    assert result.used_identity
    np.testing.assert_array_equal(result.matrix, np.eye(32))
    assert result.improvement == 1.0


# --------------------------------------------------------------------------- choosing


def test_best_strategy_follows_the_expected_rmse() -> None:
    w = wl.all_range_workload(256)
    fixed = ("identity", "h2", "wavelet", "prefix")
    laplace_only = mm.best_strategy(w, epsilon=1.0, candidates=fixed)
    assert (laplace_only.name, laplace_only.noise) == ("identity", "laplace")
    assert {z for _, z, _ in laplace_only.ranking} == {"laplace"}
    both = mm.best_strategy(w, epsilon=1.0, delta=1e-5, candidates=fixed)
    assert len(both.ranking) == 8
    rmses = [r for _, _, r in both.ranking]
    assert rmses == sorted(rmses) and both.rmse == rmses[0]
    expected = mm.expected_rmse(w, both.matrix, epsilon=1.0,
                                delta=1e-5 if both.noise == "gaussian" else None,
                                noise=both.noise)
    assert both.rmse == pytest.approx(expected)
    assert (both.name, both.noise) == ("wavelet", "gaussian")  # 13.08 vs identity-Laplace 13.12
    with pytest.raises(ValidationError, match="delta is required"):
        mm.best_strategy(w, epsilon=1.0, noises=("gaussian",), candidates=fixed)


# --------------------------------------------------------------------------- Monte Carlo


N_MC = 16
TRIALS = 4000
RTOL = 0.06  # on the RMSE; >= 4 standard errors, asserted below


def correct_release(a: np.ndarray, noise: str) -> Release:
    mech = mm.MatrixMechanism(a, 1.0, 1e-5 if noise == "gaussian" else None, noise)
    return lambda x, rng: mech.release(x, rng)


def half_noise_release(a: np.ndarray, noise: str) -> Release:
    """Broken: the right sensitivity, half the noise scale."""
    mech = mm.MatrixMechanism(a, 1.0, 1e-5 if noise == "gaussian" else None, noise)
    if noise == "laplace":
        return lambda x, rng: a @ x + rng.laplace(0.0, mech.noise_scale / 2.0, size=a.shape[0])
    return lambda x, rng: a @ x + mech.noise_scale / 2.0 * rng.standard_normal(a.shape[0])


def row_norm_release(a: np.ndarray, noise: str) -> Release:
    """Broken: sensitivity from the largest *row* norm instead of the largest column norm."""
    if noise == "laplace":
        scale = float(np.abs(a).sum(axis=1).max())
        return lambda x, rng: a @ x + rng.laplace(0.0, scale, size=a.shape[0])
    sigma = gaussian_sigma(1.0, 1e-5, float(np.sqrt((a * a).sum(axis=1)).max()))
    return lambda x, rng: a @ x + sigma * rng.standard_normal(a.shape[0])


def monte_carlo_rmse(release_fn: Release, a: np.ndarray, w: wl.Workload, n_sites: int,
                     seed: int) -> tuple[float, float]:
    """Empirical per-query RMSE of LS reconstruction, and the standard error of the MSE."""
    assert w.matrix is not None
    rng = np.random.default_rng(seed)
    xs = [sparse_histogram(a.shape[1], seed=100 + s) for s in range(n_sites)]
    truth = w.matrix @ np.sum(xs, axis=0)
    pinv = np.linalg.pinv(a)
    per_trial = np.empty(TRIALS)
    for t in range(TRIALS):
        y = np.sum([release_fn(x, rng) for x in xs], axis=0)
        err = w.matrix @ (pinv @ y) - truth
        per_trial[t] = np.mean(err * err)
    mse = float(per_trial.mean())
    return math.sqrt(mse), float(per_trial.std(ddof=1)) / math.sqrt(TRIALS) / mse


def within(observed: float, expected: float) -> bool:
    return abs(observed / expected - 1.0) <= RTOL


MC_CASES = [
    ("h2", mm.h2_strategy(N_MC)),
    ("stacked", np.vstack([np.eye(N_MC)] * 3)),  # rows of norm 1, columns of norm 3 / sqrt 3
]


@pytest.mark.parametrize("noise", mm.NOISES)
@pytest.mark.parametrize("label, a", MC_CASES)
def test_closed_form_rmse_matches_monte_carlo(noise: str, label: str, a: np.ndarray) -> None:
    w = wl.all_range_workload(N_MC, explicit=True)
    delta = 1e-5 if noise == "gaussian" else None
    expected = mm.expected_rmse(w, a, epsilon=1.0, delta=delta, noise=noise)
    observed, rel_se = monte_carlo_rmse(correct_release(a, noise), a, w, 1, seed=11)
    assert RTOL >= 4 * rel_se / 2  # RMSE's relative SE is half the MSE's
    assert within(observed, expected), (label, noise, observed, expected)
    # The same check catches half the noise...
    broken, _ = monte_carlo_rmse(half_noise_release(a, noise), a, w, 1, seed=11)
    assert not within(broken, expected)
    # ...and a sensitivity taken over rows (under-noises "stacked", over-noises H2).
    broken, _ = monte_carlo_rmse(row_norm_release(a, noise), a, w, 1, seed=11)
    assert not within(broken, expected)


@pytest.mark.parametrize("noise", mm.NOISES)
def test_sum_over_sites_matches_n_sites_closed_form(noise: str) -> None:
    w = wl.all_range_workload(N_MC, explicit=True)
    a = mm.wavelet_strategy(N_MC)
    delta = 1e-5 if noise == "gaussian" else None
    expected = mm.expected_rmse(w, a, epsilon=1.0, delta=delta, noise=noise, n_sites=3)
    assert expected == pytest.approx(
        math.sqrt(3) * mm.expected_rmse(w, a, epsilon=1.0, delta=delta, noise=noise))
    observed, _ = monte_carlo_rmse(correct_release(a, noise), a, w, 3, seed=12)
    assert within(observed, expected)
    one_site, _ = monte_carlo_rmse(correct_release(a, noise), a, w, 1, seed=12)
    assert not within(one_site, expected)  # a single site's error is sqrt(3) smaller


def test_combine_releases_is_the_sum_then_reconstruct() -> None:
    a = mm.h2_strategy(8)
    rng = np.random.default_rng(4)
    mech = mm.MatrixMechanism(a, 1.0)
    ys = [mech.release(sparse_histogram(8, seed=s), rng) for s in range(3)]
    for method in (None, "nnls", "l1"):
        np.testing.assert_allclose(mm.combine_releases(ys, a, nonnegative=method),
                                   mm.reconstruct(np.sum(ys, axis=0), a, nonnegative=method))


@pytest.mark.parametrize("noise, delta", [("laplace", None), ("gaussian", 1e-5)])
def test_release_function_is_the_mechanism(noise: str, delta: float | None) -> None:
    a = mm.wavelet_strategy(8)
    x = sparse_histogram(8, seed=0)
    by_function = mm.release(x, a, epsilon=0.7, delta=delta, noise=noise,
                             rng=np.random.default_rng(9))
    by_class = mm.MatrixMechanism(a, 0.7, delta, noise).release(x, np.random.default_rng(9))
    np.testing.assert_array_equal(by_function, by_class)


def test_release_default_rng_is_fresh_production_noise() -> None:
    a = mm.h2_strategy(8)
    x = sparse_histogram(8, seed=0)
    first = mm.release(x, a, epsilon=1.0)
    second = mm.release(x, a, epsilon=1.0)
    assert first.shape == (15,) and not np.array_equal(first, second)


# --------------------------------------------------------------------------- non-negativity


@pytest.mark.parametrize("name", ["h2", "wavelet"])
def test_nonnegative_reconstructions_hold_their_guarantees(name: str) -> None:
    n = 32
    a = mm.strategy(name, n)
    w = wl.all_range_workload(n, explicit=True)
    mech = mm.MatrixMechanism(a, 0.5)  # low epsilon: least squares goes negative often
    rng = np.random.default_rng(21)
    ls_err = nnls_err = 0.0
    went_negative = 0
    for trial in range(40):
        x = sparse_histogram(n, seed=trial)
        y = mech.release(x, rng)
        x_ls = mm.reconstruct(y, a)
        x_nnls = mm.reconstruct(y, a, nonnegative="nnls")
        x_l1 = mm.reconstruct(y, a, nonnegative="l1")
        clipped = np.maximum(x_ls, 0.0)
        went_negative += int(np.any(x_ls < 0))
        assert np.all(x_nnls >= 0) and np.all(x_l1 >= 0)
        # Optimality over x >= 0 (clipping is one feasible point):
        assert np.linalg.norm(a @ x_nnls - y) <= np.linalg.norm(a @ clipped - y) + 1e-9
        l1 = np.abs(a @ x_l1 - y).sum()
        assert l1 <= np.abs(a @ clipped - y).sum() + 1e-6
        assert l1 <= np.abs(a @ x_nnls - y).sum() + 1e-6
        # NNLS is the ||A .||-projection of the LS estimate onto x >= 0, and the truth is in
        # that set, so it never moves away from the truth in that norm:
        assert np.linalg.norm(a @ (x_nnls - x)) <= np.linalg.norm(a @ (x_ls - x)) + 1e-9
        ls_err += float(np.sum((w.answer(x_ls) - w.answer(x)) ** 2))
        nnls_err += float(np.sum((w.answer(x_nnls) - w.answer(x)) ** 2))
    assert went_negative >= 30
    assert nnls_err < ls_err  # on sparse data NNLS also helps the workload (seeded)


def test_nnls_is_clipping_for_the_identity_strategy() -> None:
    y = np.array([3.0, -2.0, 0.5, -0.1])
    np.testing.assert_allclose(mm.reconstruct(y, np.eye(4), nonnegative="nnls"),
                               np.maximum(y, 0.0))
