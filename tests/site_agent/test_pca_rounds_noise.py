"""Statistical tests of the noise the pca handler's rounds add, each with a planted wrong copy.

The releases go through the real site path (the round's ``prepare`` then
``Release.produce`` with a real generator). For the centred ``pca`` round the table's
rows all equal the centre, so the exact statistic is 0 and the released factor is the positive
part of the noise matrix; its energy is compared with the same quantity sampled from noise of
the calibrated scale ``gaussian_sigma(eps, delta, sqrt(2)) / N``. A copy calibrated to the old
``1 / N`` (add/remove) sensitivity must be rejected by the same comparison.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dpfed.common.jobs import pca as handler_module
from dpfed.common.privacy.mechanisms import (
    GaussianMechanism,
    SymmetricGaussianMechanism,
    gaussian_sigma,
    symmetric_gaussian_noise,
)
from dpfed.site_agent.handlers.base import site_release
from tests.site_agent.test_pca_rounds import SCHEMA, P, task
from tests.support.tables import FrameData, produced

N = 50
EPS, DELTA = 1.0, 1e-5
REPS = 400
ROW = {"a": 0.0, "b": 2.0, "lvl": "y", "cat": "p"}  # u = (0, 0, 0, 1, 0, 0)
CENTRE = np.array([0.0, 0.0, 0.0, 1.0, 0.0, 0.0])


def positive_energy(m: np.ndarray) -> float:
    values = np.linalg.eigvalsh(m)
    return float(np.sum(np.clip(values, 0, None)))


def handler_energy(seed: int) -> np.ndarray:
    frame = pd.DataFrame([ROW] * N)
    prepared = site_release(task("pca", clip=1.0, center=CENTRE), FrameData(SCHEMA, frame))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(REPS):
        f = produced(prepared, rng).arrays["factor"]
        out.append(float(np.sum(f * f)))  # tr(P P^T) = sum of the positive eigenvalues
    return np.array(out)


def reference_energy(sigma: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([positive_energy(symmetric_gaussian_noise(P, sigma, rng))
                     for _ in range(REPS)])


def scale_matches(observed: np.ndarray, reference: np.ndarray) -> bool:
    """Means agree within 4 standard errors (the energy is linear in sigma)."""
    se = np.hypot(observed.std(), reference.std()) / np.sqrt(REPS)
    return bool(abs(observed.mean() - reference.mean()) < 4 * se)


def test_centred_release_noise_scale_is_sqrt2_over_n() -> None:
    sigma = gaussian_sigma(EPS, DELTA, np.sqrt(2)) / N
    observed = handler_energy(1)
    assert scale_matches(observed, reference_energy(sigma, 2))
    assert not scale_matches(observed, reference_energy(sigma / np.sqrt(2), 3))


def test_planted_add_remove_calibration_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handler_module, "centred_pca_mechanism",
                        lambda n, e, d, c="analytic": SymmetricGaussianMechanism(e, d, 1.0 / n, c))
    sigma = gaussian_sigma(EPS, DELTA, np.sqrt(2)) / N
    assert not scale_matches(handler_energy(4), reference_energy(sigma, 5))


def vector_noise(stage: str, clip: float | str, centre: np.ndarray | None) -> np.ndarray:
    """Released minus exact, over many releases of one prepared task."""
    frame = pd.DataFrame([ROW] * N)
    prepared = site_release(task(stage, clip=clip, center=centre), FrameData(SCHEMA, frame))
    exact = next(iter(produced(prepared, _Zero()).arrays.values()))
    rng = np.random.default_rng(7)
    return np.concatenate([next(iter(produced(prepared, rng).arrays.values())) - exact
                           for _ in range(REPS // 4)])


class _Zero:
    def standard_normal(self, size: object = None) -> np.ndarray:
        return np.zeros(size)  # type: ignore[call-overload]


def sd_matches(noise: np.ndarray, sigma: float) -> bool:
    """Sample sd within 4 standard errors of sigma (se of an sd ~ sigma / sqrt(2 n))."""
    return abs(noise.std() - sigma) < 4 * sigma / np.sqrt(2 * noise.size)


@pytest.mark.parametrize(("stage", "clip", "centre", "sensitivity"), [
    ("mean", "schema", None, 2.0),
    ("norms", "auto", CENTRE, np.sqrt(2)),
])
def test_mean_and_histogram_noise_scale(stage: str, clip: str, centre: np.ndarray | None,
                                        sensitivity: float,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    sigma = gaussian_sigma(EPS, DELTA, sensitivity)
    assert sd_matches(vector_noise(stage, clip, centre), sigma)
    name = "mean_sum_mechanism" if stage == "mean" else "norm_histogram_mechanism"
    monkeypatch.setattr(handler_module, name,
                        lambda e, d, c="analytic": GaussianMechanism(e, d, 1.0, c))
    assert not sd_matches(vector_noise(stage, clip, centre), sigma)  # planted: sensitivity 1
