"""The empirical-epsilon audit: it passes correct mechanisms and flags broken copies.

Every audited mechanism is paired with a deliberately broken copy that the same audit must
flag (epsilon_lcb clearly above the claimed epsilon). The broken SVT copies live here, in the
test, as instances of one small vectorised template; they never enter production code.
bench/privacy_audit.py runs the longer version (10^6 samples, Lyu's SVT2-6, StatDP iSVT1-4).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from scipy import stats

from dpfed.common.errors import ValidationError
from dpfed.common.privacy.audit import (
    Event,
    additive_noise_sampler,
    audit,
    clopper_pearson,
    quantile_thresholds,
    threshold_events,
    top_events,
)
from dpfed.common.privacy.mechanisms import GaussianMechanism, LaplaceMechanism
from dpfed.common.queries.svt import SVTCalibration, svt_budget_split
from dpfed.common.queries.svt_audit import (
    svt_outputs,
    svt_pattern_codes,
    svt_pattern_events,
    svt_sampler,
    svt_value_events,
)

N = 200_000  # test draws per input (each audit takes well under a second)
N_SELECT = 50_000

# --------------------------------------------------------------------------- helpers

K = 10  # queries per SVT run
H = K // 2
# StatDP-style neighbour pairs around T = 0: each query moves by at most Delta = 1.
SVT_PAIRS: dict[str, tuple[np.ndarray, np.ndarray]] = {
    # half above, half below, the neighbour moves them in opposite directions
    "x-shape": (np.r_[np.ones(H), np.zeros(K - H)], np.r_[np.zeros(H), np.ones(K - H)]),
    "above-below": (np.r_[np.ones(H), -np.ones(K - H)], np.zeros(K)),
    # StatDP's "half half": all at the threshold vs half up, half down
    "half-half": (np.zeros(K), np.r_[np.ones(H), -np.ones(K - H)]),
}


def svt_copy(answers: Any, n: int, rng: np.random.Generator, *, rho_scale: float,
             nu_scale: float, cutoff: int | None, values: str = "none",
             value_scale: float = 1.0) -> np.ndarray:
    """A test-only SVT template (threshold 0) for building broken copies.

    nu_scale = 0 drops the query noise; cutoff None never halts; values "nu" releases the
    comparison-noised q + nu, "fresh" releases q + fresh Lap(value_scale).
    """
    a = np.asarray(answers, dtype=np.float64)
    rho = rng.laplace(0.0, rho_scale, size=(n, 1))
    nu = rng.laplace(0.0, nu_scale, size=(n, a.size)) if nu_scale > 0 else np.zeros((n, a.size))
    above = np.greater_equal(a + nu, rho)
    if cutoff is None:
        positive, n_examined = above, np.full(n, a.size)
    else:
        examined = (np.cumsum(above, axis=1) - above) < cutoff
        positive, n_examined = above & examined, examined.sum(axis=1)
    if values == "nu":
        return svt_outputs(positive, n_examined, a + nu)
    if values == "fresh":
        return svt_outputs(positive, n_examined,
                           a + rng.laplace(0.0, value_scale, size=(n, a.size)))
    return svt_outputs(positive, n_examined)


def worst_pair_lcb(sampler: Any, *, numeric: bool = False, n: int = N, seed: int = 0,
                   pairs: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> float:
    """Largest epsilon lower bound over the neighbour pairs (events selected per pair)."""
    rng = np.random.default_rng(seed)
    best = 0.0
    for x1, x2 in (pairs or SVT_PAIRS).values():
        family = svt_value_events(K, n_thresholds=12) if numeric else svt_pattern_events(K)
        result = audit(sampler, (x1, x2), top_events(family, 10), n_samples=n,
                       selection_samples=N_SELECT, rng=rng)
        best = max(best, result.epsilon_lcb)
    return best


def randomized_response(epsilon: float) -> Any:
    p = math.exp(epsilon) / (1.0 + math.exp(epsilon))

    def sample(x: Any, n: int, rng: np.random.Generator) -> np.ndarray:
        keep = rng.random(n) < p
        return np.where(keep, float(x), 1.0 - float(x))

    return sample


# --------------------------------------------------------------------------- validation


def _one_event() -> tuple[Event, ...]:
    return threshold_events([0.0])


def test_audit_validates_its_arguments() -> None:
    sampler = additive_noise_sampler(LaplaceMechanism(1.0))
    rng = np.random.default_rng(0)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"n_samples": 0}, "n_samples"),
        ({"n_samples": 10, "confidence": 1.0}, "confidence"),
        ({"n_samples": 10, "confidence": 0.0}, "confidence"),
        ({"n_samples": 10, "delta": -0.1}, "delta"),
        ({"n_samples": 10, "delta": 1.0}, "delta"),
        ({"n_samples": 10, "delta": math.nan}, "delta"),
        ({"n_samples": 10, "batch_size": 0}, "batch_size"),
        ({"n_samples": 10, "selection_samples": 5}, "selection_samples must be 0"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValidationError, match=match):
            audit(sampler, (0.0, 1.0), _one_event(), rng=rng, **kwargs)
    with pytest.raises(ValidationError, match="selection_samples must be > 0"):
        audit(sampler, (0.0, 1.0), quantile_thresholds(5), n_samples=10, rng=rng)
    with pytest.raises(ValidationError, match="neighbour_pair"):
        audit(sampler, [0.0, 1.0], _one_event(), n_samples=10, rng=rng)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="at least one Event"):
        audit(sampler, (0.0, 1.0), (), n_samples=10, rng=rng)


def test_audit_rejects_malformed_samplers_and_events() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValidationError, match="sampler must return n=10"):
        audit(lambda x, n, r: np.zeros(n + 1), (0, 1), _one_event(), n_samples=10, rng=rng)
    bad_event = Event("float mask", lambda y: np.zeros(y.shape[0]))
    with pytest.raises(ValidationError, match="must return a bool array"):
        audit(lambda x, n, r: np.zeros(n), (0, 1), (bad_event,), n_samples=10, rng=rng)
    with pytest.raises(ValidationError, match="thresholds"):
        threshold_events([math.inf])
    with pytest.raises(ValidationError, match="n_queries"):
        svt_pattern_events(40)


# --------------------------------------------------------------------------- statistics pieces


@pytest.mark.parametrize(("k", "n"), [(0, 100), (3, 100), (50, 100), (100, 100), (7, 1000)])
def test_clopper_pearson_matches_scipy_exact_interval(k: int, n: int) -> None:
    alpha = 0.005
    lower, upper = clopper_pearson(np.array([k]), n, alpha)
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=1 - 2 * alpha, method="exact")
    assert lower[0] == pytest.approx(ci.low, abs=1e-12)
    assert upper[0] == pytest.approx(ci.high, abs=1e-12)


def test_pattern_codes_distinguish_transcripts() -> None:
    positive = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=bool)
    out = svt_outputs(positive, np.array([1, 2, 3, 3]))
    codes = svt_pattern_codes(out, 3)
    assert len(set(codes.tolist())) == 4  # "T--" differs from "TFF"
    assert out[0].tolist() == [1.0, -1.0, -1.0]


# --------------------------------------------------------------------------- exact ratio


def test_randomized_response_audit_is_tight_and_flags_a_broken_copy() -> None:
    events = (Event("y = 1", lambda y: y == 1.0), Event("y = 0", lambda y: y == 0.0))
    good = audit(randomized_response(1.0), (0, 1), events, n_samples=N,
                 rng=np.random.default_rng(1))
    assert 0.9 <= good.epsilon_lcb <= 1.0
    assert good.epsilon_point == pytest.approx(1.0, abs=0.05)
    broken = audit(randomized_response(2.0), (0, 1), events, n_samples=N,
                   rng=np.random.default_rng(1))
    assert broken.epsilon_lcb >= 1.5


# --------------------------------------------------------------------------- Laplace, Gaussian


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0])
def test_laplace_passes_and_half_scale_copy_is_flagged(epsilon: float) -> None:
    scale = 1.0 / epsilon
    # A fixed family chosen a priori from the *claimed* scale: thresholds from -4b to 4b + 1.
    events = threshold_events(np.linspace(-4 * scale, 4 * scale + 1.0, 25))
    rng = np.random.default_rng(2)
    good = audit(additive_noise_sampler(LaplaceMechanism(epsilon)), (0.0, 1.0), events,
                 n_samples=N, rng=rng)
    assert good.epsilon_lcb <= 1.05 * epsilon
    assert good.epsilon_lcb >= 0.9 * epsilon  # the audit has power: it gets close
    # Broken copy: scale Delta/(2 epsilon), i.e. half the noise, still claiming epsilon.
    broken = audit(additive_noise_sampler(LaplaceMechanism(2 * epsilon)), (0.0, 1.0), events,
                   n_samples=N, rng=rng)
    assert broken.epsilon_lcb >= 1.5 * epsilon


def test_laplace_with_events_selected_on_a_first_batch() -> None:
    rng = np.random.default_rng(3)
    good = audit(additive_noise_sampler(LaplaceMechanism(1.0)), (0.0, 1.0),
                 quantile_thresholds(50), n_samples=N, selection_samples=N_SELECT, rng=rng)
    assert good.selection_samples == N_SELECT and good.n_events <= 100
    assert 0.9 <= good.epsilon_lcb <= 1.05
    broken = audit(additive_noise_sampler(LaplaceMechanism(2.0)), (0.0, 1.0),
                   quantile_thresholds(50), n_samples=N, selection_samples=N_SELECT, rng=rng)
    assert broken.epsilon_lcb >= 1.5


def test_gaussian_passes_delta_aware_and_half_sigma_copy_is_flagged() -> None:
    epsilon, delta = 1.0, 1e-3
    selector = top_events(quantile_thresholds(200, lower=1e-4, upper=1 - 1e-4), 20, delta=delta)
    rng = np.random.default_rng(4)
    good = audit(additive_noise_sampler(GaussianMechanism(epsilon, delta)), (0.0, 1.0),
                 selector, n_samples=N, selection_samples=100_000, delta=delta, rng=rng)
    assert good.epsilon_lcb <= 1.05 * epsilon
    # Broken copy: sigma calibrated for sensitivity 1/2, i.e. half the noise.
    broken = audit(additive_noise_sampler(GaussianMechanism(epsilon, delta, 0.5)), (0.0, 1.0),
                   selector, n_samples=N, selection_samples=100_000, delta=delta, rng=rng)
    assert broken.epsilon_lcb >= 1.5 * epsilon


# --------------------------------------------------------------------------- SVT


@pytest.mark.parametrize("cutoff", [1, 2])
def test_our_svt_passes(cutoff: int) -> None:
    lcb = worst_pair_lcb(svt_sampler(threshold=0.0, epsilon=1.0, cutoff=cutoff), seed=cutoff)
    assert lcb <= 1.05


def test_our_svt_with_numeric_answers_passes() -> None:
    sampler = svt_sampler(threshold=0.0, epsilon=0.5, cutoff=1, numeric_epsilon=0.5)
    assert worst_pair_lcb(sampler, numeric=True, seed=5) <= 1.05  # claim: 0.5 + 0.5


def test_the_seed_claim_that_yes_no_costs_only_epsilon1_is_refuted() -> None:
    # Seed 001: "if only Yes/No is returned, only epsilon_1 is spent". Audit our SVT (which
    # spends epsilon_1 + epsilon_2 = 1) against that claim: it is exceeded.
    eps1, _ = svt_budget_split(1.0, 1)
    lcb = worst_pair_lcb(svt_sampler(threshold=0.0, epsilon=1.0, cutoff=1), seed=6)
    assert lcb >= 1.5 * eps1


def test_svt_without_query_noise_is_flagged() -> None:
    # Lyu Alg. 5 / StatDP iSVT1 with our cut-off: nu = 0.
    cal = SVTCalibration(1.0, 1)
    lcb = worst_pair_lcb(lambda x, n, r: svt_copy(x, n, r, rho_scale=cal.threshold_scale,
                                                   nu_scale=0.0, cutoff=1), seed=7)
    assert lcb >= 1.5


def test_svt_without_cutoff_is_flagged() -> None:
    # Our noise scales, but it never halts (Lyu Alg. 6 / StatDP iSVT2 in spirit).
    cal = SVTCalibration(1.0, 1)
    lcb = worst_pair_lcb(lambda x, n, r: svt_copy(x, n, r, rho_scale=cal.threshold_scale,
                                                   nu_scale=cal.query_scale, cutoff=None),
                         seed=8)
    assert lcb >= 1.5


def test_svt_releasing_comparison_noised_values_is_flagged() -> None:
    # Lyu Alg. 3's bug on our SVT: positives are released as q + nu for free (as in seed
    # 001's worked example). Leak: a run of "below" answers before the positive pins rho
    # under the released value, so the shift of rho that pays for them is no longer
    # available. Largest with many "below" queries near the positive one: all queries at
    # T, the neighbour moves the first K-1 up and the last one down. Needs 10^6 draws.
    cal = SVTCalibration(1.0, 1)
    pair = {"below-run": (np.zeros(K), np.r_[np.ones(K - 1), -1.0])}

    def broken(x: Any, n: int, r: np.random.Generator) -> np.ndarray:
        return svt_copy(x, n, r, rho_scale=cal.threshold_scale, nu_scale=cal.query_scale,
                        cutoff=1, values="nu")

    assert worst_pair_lcb(broken, numeric=True, n=1_000_000, pairs=pair, seed=9) >= 1.2
    # The same audit of the correct release (fresh noise, eps3 = 0.5 paid on top) passes.
    good = svt_sampler(threshold=0.0, epsilon=1.0, cutoff=1, numeric_epsilon=0.5)
    assert worst_pair_lcb(good, numeric=True, n=1_000_000, pairs=pair, seed=9) <= 1.05 * 1.5
