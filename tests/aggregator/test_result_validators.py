"""The release bounds of ``dpfed.common.jobs.results`` on real site releases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpfed.common.errors import ProtocolError
from dpfed.common.jobs.results import (
    check_finite_values,
    check_gram_factor,
    symmetric_gaussian_norm_bound,
)
from dpfed.common.pca.dppca import pca_mechanism, site_release
from dpfed.common.privacy.mechanisms import symmetric_gaussian_noise
from dpfed.common.privacy.rng import production_rng


def test_honest_releases_pass_the_bound_and_a_scaled_copy_does_not() -> None:
    """No false positives where noise dominates (small N), and the bound is tight enough."""
    rng = production_rng()
    p, rank = 12, 6
    for n_rows, eps in [(5, 0.1), (50, 1.0), (5000, 10.0)]:
        sigma = pca_mechanism(n_rows, eps, 1e-5).sigma
        bound = symmetric_gaussian_norm_bound(sigma, p)
        for _ in range(60):
            x = rng.normal(size=(n_rows, p))
            x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
            out = site_release(x.T @ x, n_rows, epsilon=eps, delta=1e-5, rank=rank, rng=rng)
            check_gram_factor(out.factor, "P_s", trace_bound=1.0, noise_norm_bound=bound)
        # A factor inflated beyond the honest maximum is caught.
        with pytest.raises(ProtocolError, match="exceeds"):
            check_gram_factor(out.factor / np.linalg.norm(out.factor, 2)
                              * math.sqrt(1.0 + bound) * 1.01, "P_s", trace_bound=1.0,
                              noise_norm_bound=bound)



def test_the_noise_bound_holds_with_room_to_spare() -> None:
    rng = production_rng()
    for p in (1, 2, 8, 40):
        norms = [np.linalg.norm(symmetric_gaussian_noise(p, 1.0, rng), 2) for _ in range(300)]
        assert max(norms) < symmetric_gaussian_norm_bound(1.0, p)
        # ...and it is not vacuous: for larger p the typical norm is near 2 sqrt(p).
        if p >= 8:
            assert np.median(norms) > 0.6 * symmetric_gaussian_norm_bound(1.0, p, t=0.0)


def test_finite_value_check_walks_nested_values() -> None:
    check_finite_values({"a": [1, 2.5, {"b": None, "c": "x"}]}, "summary")
    with pytest.raises(ValueError, match=r"summary\.a\[1\]\.b"):
        check_finite_values({"a": [1, {"b": float("nan")}]}, "summary")
    with pytest.raises(ValueError, match="inf"):
        check_finite_values([np.float64("inf")], "x")
