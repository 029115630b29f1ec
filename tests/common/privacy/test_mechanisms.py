"""Calibration and noise of the Gaussian/Laplace mechanisms (dpfed.common.privacy.mechanisms).

Three layers: validation, calibration arithmetic (no randomness), and seeded statistical
tests -- each statistical test is also run on a deliberately broken copy (half the noise)
and must catch it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
from scipy import stats

from dpfed.common.errors import ValidationError
from dpfed.common.privacy.mechanisms import (
    GaussianMechanism,
    LaplaceMechanism,
    SymmetricGaussianMechanism,
    classic_calibration_is_dp,
    classic_gaussian_sigma,
    gaussian_delta,
    gaussian_sigma,
    laplace_scale,
    symmetric_gaussian_noise,
)

EPSILONS = [0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0]
DELTAS = [1e-10, 1e-7, 1e-5, 1e-3, 0.01, 0.1]

# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1", None, True])
def test_epsilon_is_validated(bad: object) -> None:
    with pytest.raises(ValidationError, match="epsilon"):
        gaussian_sigma(bad, 1e-5)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="epsilon"):
        LaplaceMechanism(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, 1, -0.1, 1.5, float("nan"), "0.1"])
def test_delta_is_validated(bad: object) -> None:
    with pytest.raises(ValidationError, match="delta"):
        gaussian_sigma(1.0, bad)  # type: ignore[arg-type]


def test_sensitivity_and_calibration_are_validated() -> None:
    with pytest.raises(ValidationError, match="sensitivity"):
        gaussian_sigma(1.0, 1e-5, sensitivity=0)
    with pytest.raises(ValidationError, match="calibration must be one of"):
        gaussian_sigma(1.0, 1e-5, calibration="moments")
    with pytest.raises(ValidationError, match="sensitivity"):
        laplace_scale(1.0, -2.0)


def test_message_names_value_and_rule() -> None:
    with pytest.raises(ValidationError) as info:
        gaussian_sigma(-1.0, 1e-5)
    assert str(info.value) == "epsilon must be finite and > 0, got -1.0"

# ----------------------------------------------------------------------------- calibration


@pytest.mark.parametrize("epsilon", EPSILONS)
@pytest.mark.parametrize("delta", DELTAS)
def test_analytic_sigma_solves_balle_wang(epsilon: float, delta: float) -> None:
    sigma = gaussian_sigma(epsilon, delta)
    achieved = gaussian_delta(sigma, epsilon)
    assert achieved <= delta  # never optimistic
    assert abs(achieved - delta) <= 1e-9 * delta  # and tight
    # The smallest such sigma: 1e-9 less noise already breaks the guarantee.
    assert gaussian_delta(sigma * (1 - 1e-9), epsilon) > delta


@pytest.mark.parametrize("sensitivity", [1e-4, 0.5, 3.0])
def test_sigma_scales_linearly_with_sensitivity(sensitivity: float) -> None:
    assert gaussian_sigma(1.0, 1e-5, sensitivity) == pytest.approx(
        sensitivity * gaussian_sigma(1.0, 1e-5), rel=1e-12)


def test_reference_values() -> None:
    # Balle & Wang (2018) and docs/privacy.md: sigma ~= 3.73 at eps=1, delta=1e-5, 1.3x below
    # classic.
    sigma = gaussian_sigma(1.0, 1e-5)
    assert sigma == pytest.approx(3.7306, abs=1e-4)
    assert classic_gaussian_sigma(1.0, 1e-5) / sigma == pytest.approx(1.30, abs=0.01)


def test_classic_underestimates_noise_at_large_epsilon() -> None:
    # The regression case from reliability.md: classic sigma at eps=10, delta=1e-5 is 2.3e-5-DP.
    true_delta = gaussian_delta(classic_gaussian_sigma(10.0, 1e-5), 10.0)
    assert true_delta == pytest.approx(2.27e-5, rel=0.01)
    with pytest.raises(ValidationError,
                       match=r"not differentially private.*true delta of 2.27e-05"):
        gaussian_sigma(10.0, 1e-5, calibration="classic")


@pytest.mark.parametrize("epsilon, delta, valid", [
    (0.5, 1e-5, True), (0.99, 0.3, True),       # the theorem's range
    (5.0, 0.01, True), (10.0, 0.01, False),      # docs/privacy.md's boundary cases
    (1.0, 1e-5, True), (10.0, 1e-5, False), (20.0, 1e-7, False),
])
def test_classic_accepted_only_where_dp(epsilon: float, delta: float, valid: bool) -> None:
    assert classic_calibration_is_dp(epsilon, delta) is valid
    if valid:
        sigma = gaussian_sigma(epsilon, delta, calibration="classic")
        assert sigma == classic_gaussian_sigma(epsilon, delta)
        if epsilon >= 1:
            assert gaussian_delta(sigma, epsilon) <= delta
        # Analytic is never noisier than a valid classic.
        assert gaussian_sigma(epsilon, delta) <= sigma
    else:
        with pytest.raises(ValidationError, match="not differentially private"):
            gaussian_sigma(epsilon, delta, calibration="classic")


def test_mechanisms_state_their_cost() -> None:
    g = GaussianMechanism(1.0, 1e-5, sensitivity=2.0)
    c = g.cost()
    assert (c.epsilon, c.delta, c.sensitivity) == (1.0, 1e-5, 2.0)
    assert c.rho == pytest.approx(4.0 / (2 * g.sigma**2))
    lap = LaplaceMechanism(0.5, sensitivity=2.0)
    assert lap.scale == 4.0
    assert lap.cost().rho == pytest.approx(0.125) and lap.cost().delta == 0.0
    sym = SymmetricGaussianMechanism(1.0, 1e-5, sensitivity=1e-3)
    assert sym.sigma == pytest.approx(1e-3 * gaussian_sigma(1.0, 1e-5))
    assert sym.cost().mechanism == "symmetric-gaussian"

# ----------------------------------------------------------------------------- noise


def variance_within_tolerance(samples: np.ndarray, sigma: float) -> bool:
    """Two-sided chi-square test of Var = sigma^2 at level 1e-4 (false alarm rate 1e-4)."""
    m = samples.size
    statistic = float(np.sum(samples**2) / sigma**2)  # ~ chi2(m) when mean 0, Var sigma^2
    return bool(stats.chi2.ppf(5e-5, m) <= statistic <= stats.chi2.ppf(1 - 5e-5, m))


@dataclass(frozen=True)
class HalfNoiseSymmetric(SymmetricGaussianMechanism):
    """Planted bug: draws half the calibrated noise."""

    sigma: float = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "sigma", self.sigma / 2)


@pytest.mark.parametrize("mechanism_cls, should_pass", [
    (SymmetricGaussianMechanism, True), (HalfNoiseSymmetric, False)])
def test_symmetric_noise_variance_and_symmetry(mechanism_cls: type, should_pass: bool) -> None:
    calibrated = SymmetricGaussianMechanism(1.0, 1e-5, sensitivity=0.01)
    mech = mechanism_cls(1.0, 1e-5, sensitivity=0.01)
    rng = np.random.default_rng(1234)
    p = 40
    noise = np.stack([mech.release(np.zeros((p, p)), rng) for _ in range(50)])
    assert np.array_equal(noise, np.swapaxes(noise, 1, 2))  # exactly symmetric
    iu = np.triu_indices(p)
    upper = noise[:, iu[0], iu[1]]  # the independent entries (diagonal included)
    diag = noise[:, np.arange(p), np.arange(p)]
    # The test uses the *calibrated* sigma: a mechanism drawing less noise must fail it.
    assert variance_within_tolerance(upper, calibrated.sigma) is should_pass
    assert variance_within_tolerance(diag, calibrated.sigma) is should_pass
    assert abs(float(np.mean(upper))) < 5 * calibrated.sigma / math.sqrt(upper.size)


@dataclass(frozen=True)
class HalfScaleLaplace(LaplaceMechanism):
    """Planted bug: half the calibrated Laplace scale."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "scale", self.scale / 2)


@pytest.mark.parametrize("mechanism_cls, should_pass", [
    (LaplaceMechanism, True), (HalfScaleLaplace, False)])
def test_laplace_noise_distribution(mechanism_cls: type, should_pass: bool) -> None:
    mech = mechanism_cls(0.5, sensitivity=2.0)
    rng = np.random.default_rng(7)
    noise = mech.release(np.zeros(20_000), rng)
    # KS test against the calibrated Laplace(0, 2/0.5).
    p_value = stats.kstest(noise, stats.laplace(scale=4.0).cdf).pvalue
    assert bool(p_value > 1e-3) is should_pass


@dataclass(frozen=True)
class HalfSigmaGaussian(GaussianMechanism):
    """Planted bug: half the calibrated sigma."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "sigma", self.sigma / 2)


@pytest.mark.parametrize("mechanism_cls, should_pass", [
    (GaussianMechanism, True), (HalfSigmaGaussian, False)])
def test_gaussian_noise_variance(mechanism_cls: type, should_pass: bool) -> None:
    mech = mechanism_cls(1.0, 1e-5, sensitivity=1.0)
    noise = mech.release(np.zeros(20_000), np.random.default_rng(99))
    assert variance_within_tolerance(noise, gaussian_sigma(1.0, 1e-5)) is should_pass


def test_symmetric_noise_shape_checks() -> None:
    with pytest.raises(ValidationError, match="square"):
        SymmetricGaussianMechanism(1.0, 1e-5, 0.1).release(np.zeros((2, 3)),
                                                           np.random.default_rng(0))
    with pytest.raises(ValidationError, match="p must be"):
        symmetric_gaussian_noise(0, 1.0, np.random.default_rng(0))
