"""Sparse Vector Technique (Lyu, Su & Li 2017, Alg. 1): validation, cost, and statistics.

The statistical tests compare the frequencies of whole SVT transcripts with their exact
probabilities (numerical integration over the threshold noise), and each also runs against a
deliberately broken copy (half the query noise; threshold noise re-drawn per query; numeric
answers that re-use the comparison noise) that it must reject. The empirical-epsilon audit
of the same code is in tests/common/privacy/test_privacy_audit.py.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import integrate, stats

from dpfed.common.errors import BudgetExceededError, ValidationError
from dpfed.common.queries.svt import (
    SparseVector,
    SVTCalibration,
    sparse_vector,
    sparse_vector_runs,
    svt_budget_split,
)

# --------------------------------------------------------------------------- exact pmf


def _lap_cdf(x: float, b: float) -> float:
    return 0.5 * math.exp(x / b) if x < 0 else 1.0 - 0.5 * math.exp(-x / b)


def transcript_probabilities(answers: list[float], threshold: float,
                             cal: SVTCalibration) -> dict[tuple[int, ...], float]:
    """Exact probability of every SVT transcript (1 above, 0 below, -1 not examined).

    P(pattern) = integral over rho of f_rho(r) * prod_j P(query j's answer | rho = r), with
    P(above) = P(nu >= T + r - q_j): Lyu Alg. 1 with rho drawn once.
    """
    k = len(answers)
    b_rho, b_nu, c = cal.threshold_scale, cal.query_scale, cal.cutoff
    patterns: set[tuple[int, ...]] = set()
    for bits in itertools.product((0, 1), repeat=k):
        out: list[int] = []
        for bit in bits:
            if sum(x == 1 for x in out) >= c:
                out.append(-1)
            else:
                out.append(bit)
        patterns.add(tuple(out))
    probs = {}
    for pattern in patterns:
        def integrand(r: float, pattern: tuple[int, ...] = pattern) -> float:
            p = math.exp(-abs(r) / b_rho) / (2 * b_rho)
            for q, s in zip(answers, pattern, strict=True):
                if s == 1:
                    p *= 1.0 - _lap_cdf(threshold + r - q, b_nu)
                elif s == 0:
                    p *= _lap_cdf(threshold + r - q, b_nu)
            return p

        # Integrate piecewise between the kinks of the Laplace densities and cdfs.
        kinks = sorted({q - threshold for q in answers} | {0.0})
        edges = [kinks[0] - 60 * (b_rho + b_nu), *kinks, kinks[-1] + 60 * (b_rho + b_nu)]
        probs[pattern] = math.fsum(integrate.quad(integrand, lo, hi, limit=200)[0]
                                   for lo, hi in itertools.pairwise(edges))
    total = math.fsum(probs.values())
    assert abs(total - 1.0) < 1e-7, total
    return probs


def encode(positive: np.ndarray, n_examined: np.ndarray) -> list[tuple[int, ...]]:
    k = positive.shape[1]
    examined = np.arange(k) < n_examined[:, None]
    status = np.where(positive, 1, np.where(examined, 0, -1))
    return [tuple(int(v) for v in row) for row in status]


def chi2_pattern_pvalue(observed: list[tuple[int, ...]],
                        probs: dict[tuple[int, ...], float]) -> float:
    n = len(observed)
    counts: dict[tuple[int, ...], int] = {}
    for p in observed:
        counts[p] = counts.get(p, 0) + 1
    assert set(counts) <= set(probs), set(counts) - set(probs)
    keys = sorted(probs)
    obs = [counts.get(key, 0) for key in keys]
    exp = [n * probs[key] for key in keys]
    return float(stats.chisquare(obs, exp).pvalue)


ANSWERS = [0.5, 2.0, -1.0, 1.5]
THRESHOLD = 1.0


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("eps", [0, -1.0, math.nan, math.inf, "1", None, True])
def test_epsilon_is_validated(eps: object) -> None:
    with pytest.raises(ValidationError, match="epsilon"):
        sparse_vector([1.0], threshold=0.0, epsilon=eps)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="epsilon"):
        SparseVector(threshold=0.0, epsilon=eps)  # type: ignore[arg-type]


@pytest.mark.parametrize("cutoff", [0, -1, 1.5, 2.0, True, "2", None])
def test_cutoff_must_be_integer_at_least_one(cutoff: object) -> None:
    with pytest.raises(ValidationError, match="cutoff"):
        sparse_vector([1.0], threshold=0.0, epsilon=1.0, cutoff=cutoff)  # type: ignore[arg-type]


@pytest.mark.parametrize("answers", [[], [[1.0, 2.0]], [1.0, math.nan], [math.inf], ["a"], 3.0])
def test_answers_must_be_finite_nonempty_1d(answers: object) -> None:
    with pytest.raises(ValidationError, match="answers"):
        sparse_vector(answers, threshold=0.0, epsilon=1.0)


@pytest.mark.parametrize("threshold", [math.nan, math.inf, "1", None, True])
def test_threshold_must_be_finite_real(threshold: object) -> None:
    with pytest.raises(ValidationError, match="threshold"):
        sparse_vector([1.0], threshold=threshold, epsilon=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="threshold"):
        SparseVector(threshold=threshold, epsilon=1.0)  # type: ignore[arg-type]


def test_other_parameters_are_validated() -> None:
    with pytest.raises(ValidationError, match="sensitivity"):
        sparse_vector([1.0], threshold=0.0, epsilon=1.0, sensitivity=0.0)
    with pytest.raises(ValidationError, match="monotonic"):
        sparse_vector([1.0], threshold=0.0, epsilon=1.0, monotonic=1)  # type: ignore[arg-type]
    for bad in (0.0, -0.5, math.nan):
        with pytest.raises(ValidationError, match="numeric_epsilon"):
            sparse_vector([1.0], threshold=0.0, epsilon=1.0, numeric_epsilon=bad)
    with pytest.raises(ValidationError, match="n_runs"):
        sparse_vector_runs([1.0], 0, threshold=0.0, epsilon=1.0)
    with pytest.raises(ValidationError, match="rng"):
        sparse_vector([1.0], threshold=0.0, epsilon=1.0, rng=42)  # type: ignore[arg-type]
    sv = SparseVector(threshold=0.0, epsilon=1.0, rng=np.random.default_rng(0))
    for bad_answer in (math.nan, "1", None):
        with pytest.raises(ValidationError, match="answer"):
            sv.test(bad_answer)  # type: ignore[arg-type]
    assert sv.n_examined == 0  # a refused query consumed nothing


# --------------------------------------------------------------------------- cost arithmetic


@pytest.mark.parametrize("cutoff", [1, 2, 5])
def test_budget_split_and_noise_scales(cutoff: int) -> None:
    eps, delta_q = 1.2, 3.0
    e1, e2 = svt_budget_split(eps, cutoff)
    assert e1 + e2 == pytest.approx(eps, rel=1e-15)
    assert e2 / e1 == pytest.approx((2 * cutoff) ** (2 / 3), rel=1e-12)
    m1, m2 = svt_budget_split(eps, cutoff, monotonic=True)
    assert m2 / m1 == pytest.approx(cutoff ** (2 / 3), rel=1e-12)

    cal = SVTCalibration(eps, cutoff, delta_q, numeric_epsilon=0.4)
    assert (cal.threshold_epsilon, cal.query_epsilon) == (e1, e2)
    assert cal.threshold_scale == pytest.approx(delta_q / e1)  # rho ~ Lap(Delta/eps1)
    assert cal.query_scale == pytest.approx(2 * cutoff * delta_q / e2)  # Lap(2c Delta/eps2)
    assert cal.numeric_scale == pytest.approx(cutoff * delta_q / 0.4)  # Lap(c Delta/eps3)
    mono = SVTCalibration(eps, cutoff, delta_q, monotonic=True)
    assert mono.query_scale == pytest.approx(cutoff * delta_q / m2)  # Lap(c Delta/eps2)
    assert mono.numeric_scale is None


def test_cost_is_epsilon1_plus_epsilon2_plus_epsilon3_not_the_seed_formulas() -> None:
    eps, c = 1.0, 3
    e1, _ = svt_budget_split(eps, c)
    res = sparse_vector([5.0] * 10, threshold=0.0, epsilon=eps, cutoff=c,
                        rng=np.random.default_rng(0))
    # The Yes/No transcript costs eps1 + eps2 = eps, not eps1 alone (seed 001, section 1) ...
    assert res.epsilon_spent == eps and res.cost.epsilon == eps
    assert res.cost.epsilon > e1
    # ... nor c*eps1 + eps2 (seed 001, "Multi-SVT"): that formula would give another value.
    assert res.cost.epsilon != pytest.approx(c * e1 + (eps - e1))
    assert res.cost.rho == pytest.approx(eps**2 / 2)
    assert res.cost.mechanism == "svt"
    paid = sparse_vector([5.0] * 10, threshold=0.0, epsilon=eps, cutoff=c, numeric_epsilon=0.5,
                         rng=np.random.default_rng(0))
    assert paid.epsilon_spent == 1.5 and paid.cost.epsilon == 1.5


def test_cost_does_not_depend_on_outcome_or_query_count() -> None:
    rng = np.random.default_rng(1)
    costs = {sparse_vector(a, threshold=0.0, epsilon=0.7, cutoff=2, rng=rng).cost
             for a in ([1e9] * 3, [-1e9] * 50, [0.0])}
    assert len(costs) == 1
    assert SVTCalibration(0.7, 2).cost() in costs


# --------------------------------------------------------------------------- behaviour


def test_far_above_and_far_below_answers() -> None:
    rng = np.random.default_rng(2)
    above = sparse_vector([1e9] * 6, threshold=0.0, epsilon=1.0, cutoff=2, rng=rng)
    assert above.positives == (0, 1) and above.halted and above.n_examined == 2
    assert above.n_queries == 6 and above.values is None
    assert above.outcomes() == (True, True)
    below = sparse_vector([-1e9] * 6, threshold=0.0, epsilon=1.0, cutoff=2, rng=rng)
    assert below.positives == () and not below.halted and below.n_examined == 6
    assert below.outcomes() == (False,) * 6
    mixed = sparse_vector([-1e9, 1e9, -1e9, 1e9, 1e9], threshold=0.0, epsilon=1.0, cutoff=2,
                          numeric_epsilon=1.0, rng=rng)
    assert mixed.positives == (1, 3) and mixed.n_examined == 4 and mixed.halted
    assert mixed.values is not None and len(mixed.values) == 2


def test_sparse_vector_is_one_run_of_the_batch() -> None:
    a = [0.3, 1.2, -0.4, 2.5, 0.9, 1.1]
    one = sparse_vector(a, threshold=1.0, epsilon=2.0, cutoff=2, numeric_epsilon=1.0,
                        rng=np.random.default_rng(7))
    runs = sparse_vector_runs(a, 1, threshold=1.0, epsilon=2.0, cutoff=2, numeric_epsilon=1.0,
                              rng=np.random.default_rng(7))
    assert one.positives == tuple(int(i) for i in np.flatnonzero(runs.positive[0]))
    assert runs.values is not None and one.values is not None
    assert one.values == tuple(float(runs.values[0, i]) for i in one.positives)
    assert one.n_examined == int(runs.n_examined[0]) and one.halted == bool(runs.halted[0])


@pytest.mark.parametrize("cutoff", [1, 3])
def test_cutoff_is_enforced_over_many_runs(cutoff: int) -> None:
    # Answers straddling the threshold, so runs see many candidate positives.
    a = np.tile([2.0, -2.0, 0.0, 4.0, 1.0], 4)
    runs = sparse_vector_runs(a, 100_000, threshold=0.0, epsilon=1.0, cutoff=cutoff,
                              numeric_epsilon=1.0, rng=np.random.default_rng(3))
    n_pos = runs.positive.sum(axis=1)
    assert n_pos.max() == cutoff  # reached, never exceeded
    assert np.array_equal(runs.halted, n_pos == cutoff)
    assert runs.values is not None
    assert np.array_equal(~np.isnan(runs.values), runs.positive)
    # Nothing after the halting query is examined or released.
    last = np.where(runs.halted, runs.n_examined - 1, a.size - 1)
    assert np.all(runs.positive[np.arange(a.size) > last[:, None]] == 0)
    assert np.all(runs.positive[np.arange(runs.positive.shape[0]), last][runs.halted])


def test_interactive_instance_halts_and_refuses() -> None:
    sv = SparseVector(threshold=0.0, epsilon=1.0, cutoff=2, numeric_epsilon=0.5,
                      rng=np.random.default_rng(4))
    assert sv.test(-1e9) is False
    assert sv.test(1e9) is True
    assert not sv.halted
    assert sv.test(1e9) is True
    assert sv.halted and sv.positives == (1, 2) and sv.n_examined == 3
    with pytest.raises(BudgetExceededError, match="halted after cutoff=2"):
        sv.test(1e9)
    res = sv.result()
    assert res.positives == (1, 2) and res.halted and res.n_examined == 3
    assert res.values is not None and len(res.values) == 2
    assert res.cost == sv.cost() and res.epsilon_spent == 1.5
    assert "noisy" not in repr(sv) and "rho" not in repr(sv)


def test_interactive_instance_is_alg1_line_by_line() -> None:
    # Replay the same generator by hand: rho once, then nu per query, fresh value noise.
    cal = SVTCalibration(0.8, 2, 1.0, numeric_epsilon=0.6)
    stream = [0.2, 3.1, -0.7, 1.4, 2.2, 0.0, 5.0]
    sv = SparseVector(threshold=1.0, epsilon=0.8, cutoff=2, numeric_epsilon=0.6,
                      rng=np.random.default_rng(11))
    ref = np.random.default_rng(11)
    rho = ref.laplace(0.0, cal.threshold_scale)
    expected_pos: list[int] = []
    expected_val: list[float] = []
    assert cal.numeric_scale is not None
    for i, q in enumerate(stream):
        if len(expected_pos) == 2:
            break
        above = q + ref.laplace(0.0, cal.query_scale) >= 1.0 + rho
        if above:
            expected_pos.append(i)
            expected_val.append(q + ref.laplace(0.0, cal.numeric_scale))
        assert sv.test(q) is above
    assert sv.positives == tuple(expected_pos)
    assert sv.values == tuple(expected_val)


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("cutoff", [1, 2])
def test_transcript_frequencies_match_exact_probabilities(cutoff: int) -> None:
    cal = SVTCalibration(1.0, cutoff)
    probs = transcript_probabilities(ANSWERS, THRESHOLD, cal)
    runs = sparse_vector_runs(ANSWERS, 100_000, threshold=THRESHOLD, epsilon=1.0, cutoff=cutoff,
                              rng=np.random.default_rng(10 + cutoff))
    assert chi2_pattern_pvalue(encode(runs.positive, runs.n_examined), probs) > 1e-3


@pytest.mark.parametrize("cutoff", [1, 2])
def test_transcript_test_rejects_half_query_noise(cutoff: int) -> None:
    # Broken copy: the monotonic (half) query noise used for queries not declared monotonic.
    probs = transcript_probabilities(ANSWERS, THRESHOLD, SVTCalibration(1.0, cutoff))
    runs = sparse_vector_runs(ANSWERS, 100_000, threshold=THRESHOLD, epsilon=1.0, cutoff=cutoff,
                              monotonic=True, rng=np.random.default_rng(10 + cutoff))
    assert chi2_pattern_pvalue(encode(runs.positive, runs.n_examined), probs) < 1e-6


def test_transcript_test_rejects_threshold_noise_redrawn_per_query() -> None:
    # Broken copy: rho drawn afresh for every query (the answers lose their correlation).
    cal = SVTCalibration(1.0, 1)
    probs = transcript_probabilities(ANSWERS, THRESHOLD, cal)
    rng = np.random.default_rng(12)
    n, k = 100_000, len(ANSWERS)
    rho = rng.laplace(0.0, cal.threshold_scale, size=(n, k))
    above = np.greater_equal(np.asarray(ANSWERS) + rng.laplace(0.0, cal.query_scale, size=(n, k)),
                             THRESHOLD + rho)
    examined = (np.cumsum(above, axis=1) - above) < 1
    positive = above & examined
    assert chi2_pattern_pvalue(encode(positive, examined.sum(axis=1)), probs) < 1e-6


def test_interactive_instances_match_exact_probabilities() -> None:
    probs = transcript_probabilities(ANSWERS, THRESHOLD, SVTCalibration(1.0, 1))
    rng = np.random.default_rng(13)
    good: list[tuple[int, ...]] = []
    broken: list[tuple[int, ...]] = []
    for _ in range(20_000):
        for monotonic, sink in ((False, good), (True, broken)):
            sv = SparseVector(threshold=THRESHOLD, epsilon=1.0, monotonic=monotonic, rng=rng)
            out = []
            for q in ANSWERS:
                if sv.halted:
                    out.append(-1)
                else:
                    out.append(int(sv.test(q)))
            sink.append(tuple(out))
    assert chi2_pattern_pvalue(good, probs) > 1e-3
    assert chi2_pattern_pvalue(broken, probs) < 1e-6  # half the query noise: caught


def test_numeric_answers_use_fresh_unbiased_noise() -> None:
    # A query right at the threshold: its positives are selected on q + nu >= T + rho, so
    # re-using nu (Lyu Alg. 3) gives biased values; fresh noise is Lap(c Delta/eps3) exactly.
    cal = SVTCalibration(1.0, 2, numeric_epsilon=0.5)
    a = np.array([0.0, 0.0, 0.0])
    runs = sparse_vector_runs(a, 50_000, threshold=0.0, epsilon=1.0, cutoff=2,
                              numeric_epsilon=0.5, rng=np.random.default_rng(14))
    assert runs.values is not None
    noise = runs.values[runs.positive] - 0.0
    assert stats.kstest(noise, "laplace", args=(0.0, cal.numeric_scale)).pvalue > 1e-3

    # Broken copy: the released value is the comparison-noised q + nu.
    rng = np.random.default_rng(14)
    rho = rng.laplace(0.0, cal.threshold_scale, size=(50_000, 1))
    nu = rng.laplace(0.0, cal.query_scale, size=(50_000, 3))
    above = a + nu >= rho
    positive = above & ((np.cumsum(above, axis=1) - above) < 2)
    reused = (a + nu)[positive]
    assert stats.kstest(reused, "laplace", args=(0.0, cal.numeric_scale)).pvalue < 1e-6
