"""The clip-radius-first centring library: the clipped mean's sensitivity, searched over extreme
schema-valid records through the library path (a planted add/remove constant is caught), the
coordinator's projection, and the round split (public, and charged exactly the job's budget
by the tight accountant)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpfed.common.errors import ValidationError
from dpfed.common.pca.centring import (
    SUM_SENSITIVITY,
    centred_round_split,
    clip_to_radius,
    clipped_mean,
    clipped_mean_sum_mechanism,
)
from dpfed.common.pca.features import UnitBallMap
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.composition import gdp_split
from dpfed.common.privacy.mechanisms import gaussian_sigma
from dpfed.common.privacy.spent import Spent
from tests.common.privacy.test_sensitivity_search import (
    CONT_ORD,
    MIXED,
    REL,
    encoded,
    extreme_records,
    worst_pair,
)


def clipped_rows(schema: object, clip: float) -> np.ndarray:
    records = extreme_records(schema)  # type: ignore[arg-type]
    u = UnitBallMap(schema).scaled(encoded(schema, records))  # type: ignore[arg-type]
    return clip_to_radius(u, clip)[0]


@pytest.mark.parametrize("clip", [0.05, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("schema", [CONT_ORD, MIXED], ids=["cont_ord", "mixed"])
def test_the_clipped_sum_never_moves_more_than_its_sensitivity(schema: object,
                                                               clip: float) -> None:
    rows = clipped_rows(schema, clip)
    assert np.all(np.linalg.norm(rows, axis=1) <= clip * (1 + REL))
    worst, _, _ = worst_pair(rows, 2)  # one row replaced: the sum moves by the difference
    stated = clipped_mean_sum_mechanism(clip, 1.0, 1e-5).sensitivity
    assert stated == SUM_SENSITIVITY * clip
    assert worst <= stated * (1 + REL)
    if clip <= 0.5:  # small radii are reached in (nearly) opposite directions
        assert worst > clip * 1.5  # the add/remove constant c would under-noise: caught
        if schema is CONT_ORD:  # x = -y exists: 2c is attained
            assert worst == pytest.approx(stated, rel=1e-9)


def test_the_mechanism_and_the_coordinator_step() -> None:
    mech = clipped_mean_sum_mechanism(0.8, 0.5, 1e-6)
    assert mech.sigma == pytest.approx(gaussian_sigma(0.5, 1e-6, 1.6))
    cost = mech.cost()
    assert (cost.mechanism, cost.sensitivity) == ("gaussian", 1.6)
    with pytest.raises(ValidationError, match="clip_norm"):
        clipped_mean_sum_mechanism(0.0, 1.0, 1e-5)
    x, n_clipped = clip_to_radius(np.array([[3.0, 4.0], [0.3, 0.4]]), 1.0)
    np.testing.assert_allclose(x, [[0.6, 0.8], [0.3, 0.4]])
    assert n_clipped == 1
    # the mean of rows in the ball of radius c lies in it: the projection moves towards it
    mu = clipped_mean([np.array([30.0, 40.0]), np.array([0.0, 0.0])], 10, 1.0)
    np.testing.assert_allclose(mu, [0.6, 0.8])
    inside = clipped_mean([np.array([1.0, 2.0])], 10, 1.0)
    np.testing.assert_allclose(inside, [0.1, 0.2])
    with pytest.raises(ValidationError):
        clipped_mean([np.array([np.nan, 1.0])], 10, 1.0)


@pytest.mark.parametrize("epsilon", [0.1, 0.5, 1.0, 5.0, 20.0])
def test_the_split_is_public_and_charged_exactly_the_job_budget(epsilon: float) -> None:
    delta = 0.01
    split = centred_round_split(200, 10_000, epsilon, delta)
    assert split == centred_round_split(200, 10_000, epsilon, delta)  # public, deterministic
    assert [name for name, _, _ in split] == ["norms", "mean", "pca"]
    assert math.fsum(e for _, e, _ in split) == pytest.approx(1.0)
    assert all(0.005 <= e <= 0.25 for name, e, _ in split if name != "pca")
    rounds = gdp_split(epsilon, delta, split)
    costs = [PrivacyCost.gaussian(e, d, sigma=gaussian_sigma(e, d, 1.0), sensitivity=1.0)
             for _, e, d in rounds]
    spent = Spent.of(costs).epsilon(delta)
    assert epsilon * (1 - 1e-6) <= spent <= epsilon
    # more rows or a smaller dimension need less for the auxiliary rounds
    bigger = centred_round_split(200, 100_000, epsilon, delta)
    assert bigger[2][1] >= split[2][1]
