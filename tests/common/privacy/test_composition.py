"""Splitting a job's budget between its Gaussian rounds: basic and zCDP composition."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpfed.common.errors import ValidationError
from dpfed.common.job_params import SYNTH_PAIRS_DEFAULT_SPLIT, SynthParams
from dpfed.common.privacy.accounting import rho_for_epsilon, zcdp_to_epsilon
from dpfed.common.privacy.composition import epsilon_for_rho, round_rho, split_budget
from dpfed.common.privacy.mechanisms import GaussianMechanism, gaussian_sigma

SHARES = [(name, e, d) for name, (e, d) in SYNTH_PAIRS_DEFAULT_SPLIT.items()]


def test_basic_composition_is_the_shares_of_epsilon_and_delta() -> None:
    plan = split_budget(2.0, 1e-6, SHARES)
    assert plan == [(n, 2.0 * e, 1e-6 * d) for n, e, d in SHARES]


@pytest.mark.parametrize("epsilon", [0.05, 0.5, 1.0, 3.0, 10.0, 50.0])
@pytest.mark.parametrize("delta", [1e-9, 1e-6, 1e-3])
def test_zcdp_rounds_add_up_to_the_jobs_rho_and_never_more(epsilon: float, delta: float
                                                           ) -> None:
    """Every round's analytic Gaussian costs at most its rho share; together the job's rho.

    What a site's zcdp ledger adds up is ``sensitivity^2 / (2 sigma^2)`` of the sigma the
    analytic calibration gives at the round's (epsilon_i, delta_i); that total must convert
    back to at most the job's (epsilon, delta), and waste almost nothing of it.
    """
    plan = split_budget(epsilon, delta, SHARES, "zcdp")
    rho = rho_for_epsilon(epsilon, delta)
    total = 0.0
    for (name, e_share, d_share), (name2, eps_i, delta_i) in zip(SHARES, plan, strict=True):
        assert name == name2 and delta_i == pytest.approx(delta * d_share)
        charged = round_rho(eps_i, delta_i)
        assert charged <= e_share * rho
        assert charged == pytest.approx(e_share * rho, rel=1e-6)
        # The same through a mechanism with another sensitivity (sigma scales with it).
        mech = GaussianMechanism(eps_i, delta_i, sensitivity=7.3)
        assert mech.cost().rho <= e_share * rho * (1 + 1e-12)
        total += charged
    assert total <= rho
    assert zcdp_to_epsilon(total, delta) <= epsilon
    assert zcdp_to_epsilon(total, delta) == pytest.approx(epsilon, rel=1e-5)
    # Each round's own epsilon is larger than its basic share: the sum exceeds epsilon.
    assert sum(e for _, e, _ in plan) > epsilon


def test_zcdp_gives_much_less_noise_to_small_rounds() -> None:
    basic = split_budget(1.0, 1e-6, SHARES)
    zcdp = split_budget(1.0, 1e-6, SHARES, "zcdp")
    ratio = {n: gaussian_sigma(eb, db) / gaussian_sigma(ez, dz)
             for (n, eb, db), (_, ez, dz) in zip(basic, zcdp, strict=True)}
    assert 1.1 < ratio["links"] < 1.4 and ratio["pair_scores"] > 4.0, ratio


def test_epsilon_for_rho_is_the_root_from_below() -> None:
    for rho, delta in [(1e-4, 1e-6), (0.02, 1e-7), (0.5, 1e-5), (3.0, 1e-9)]:
        eps = epsilon_for_rho(rho, delta)
        assert gaussian_sigma(eps, delta) >= 1.0 / math.sqrt(2.0 * rho)
        assert gaussian_sigma(eps * (1 + 1e-9), delta) < 1.0 / math.sqrt(2.0 * rho) * (
            1 + 1e-6)


@pytest.mark.parametrize("broken, should_pass", [(False, True), (True, False)])
def test_released_noise_has_the_rho_split_sigma_and_a_broken_split_is_caught(
        broken: bool, should_pass: bool) -> None:
    """Draw the pair_scores round's noise at the plan's (epsilon_i, delta_i).

    Its standard deviation must be ``1 / sqrt(2 rho_i)`` (rho_i = 3 % of the job's rho); the
    broken copy reads the epsilon share as the round's epsilon under zCDP (the basic split
    mislabelled), which a chi-square test on the sample variance rejects.
    """
    eps, delta = 1.0, 1e-6
    plan = {n: (e, d) for n, e, d in (split_budget(eps, delta, SHARES) if broken
                                      else split_budget(eps, delta, SHARES, "zcdp"))}
    e_i, d_i = plan["pair_scores"]
    expected_sd = 1.0 / math.sqrt(2.0 * 0.03 * rho_for_epsilon(eps, delta))
    mech = GaussianMechanism(e_i, d_i, sensitivity=1.0)
    draws = mech.release(np.zeros(20_000), np.random.default_rng(11))
    n = draws.size
    statistic = float(np.sum(draws ** 2) / expected_sd ** 2)  # chi2 with n dof if right
    p = 2 * min(stats.chi2.cdf(statistic, n), stats.chi2.sf(statistic, n))
    assert bool(p > 1e-4) is should_pass, (statistic / n, p)


def test_zcdp_split_validation() -> None:
    with pytest.raises(ValidationError, match="composition"):
        split_budget(1.0, 1e-6, SHARES, "renyi")
    with pytest.raises(ValidationError, match="positive epsilon and delta shares"):
        split_budget(1.0, 1e-6, [("links", 0.5, 0.0), ("pca", 0.5, 1.0)], "zcdp")
    with pytest.raises(ValidationError):
        split_budget(0.0, 1e-6, SHARES, "zcdp")


@pytest.mark.parametrize("params, match", [
    ({"composition": "zcdp", "mode": "row_aligned"}, "--mode generative"),
    ({"composition": "zcdp", "calibration": "classic"}, "--calibration analytic"),
    ({"composition": "rdp"}, "--composition"),
])
def test_synth_params_refuse_what_zcdp_composition_cannot_run(params: dict[str, object],
                                                              match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        SynthParams.parse(params, None)


def test_synth_params_plan_and_mapping() -> None:
    basic = SynthParams.parse({}, None)
    zcdp = SynthParams.parse({"composition": "zcdp"}, None)
    assert "composition" not in basic.to_mapping()  # older jobs resume with the same payload
    assert zcdp.to_mapping()["composition"] == "zcdp"
    again = SynthParams.parse(zcdp.to_mapping(), None)
    assert again == zcdp and again.plan(1.0, 1e-6) == zcdp.plan(1.0, 1e-6)
    assert basic.plan(1.0, 1e-6) == split_budget(1.0, 1e-6, basic.split)
    assert zcdp.plan(1.0, 1e-6) == split_budget(1.0, 1e-6, zcdp.split, "zcdp")
    zcdp.check_privacy(1.0, 1e-6)


def test_central_synthesizer_composes_its_releases_in_rho() -> None:
    """``FactorModelSynthesizer(composition="zcdp")``: the job's split of rho, centrally."""
    import pandas as pd

    from dpfed.common.data.schema import ContinuousColumn, NominalColumn, Schema
    from dpfed.common.synth.factor_model import FactorModelSynthesizer

    schema = Schema((ContinuousColumn("x", 0.0, 10.0), NominalColumn("g", ("a", "b", "c")),
                     ContinuousColumn("y", 0.0, 10.0)))
    r = np.random.default_rng(3)
    x = r.uniform(0, 10, 3000)
    frame = pd.DataFrame({"x": x, "g": r.choice(["a", "b", "c"], 3000),
                          "y": np.clip(x + r.normal(0, 1, 3000), 0, 10)})
    eps, delta = 1.0, 1e-6
    synth = FactorModelSynthesizer(schema, epsilon=eps, delta=delta, composition="zcdp",
                                   rng=np.random.default_rng(4)).fit(frame)
    rho = rho_for_epsilon(eps, delta)
    cost = synth.privacy_cost_
    assert cost.mechanism == "composed-zcdp" and cost.delta == delta
    assert rho * (1 - 1e-6) <= cost.rho <= rho and cost.epsilon <= eps
    assert sum(c.rho for c in synth.privacy_costs_.values()) == pytest.approx(cost.rho)
    assert set(synth.privacy_costs_) == {"marginals", "pca", "pair_scores", "pairs"}
    basic = FactorModelSynthesizer(schema, epsilon=eps, delta=delta,
                                   rng=np.random.default_rng(4)).fit(frame)
    assert basic.privacy_cost_.rho < 0.6 * rho  # basic composition leaves rho unused
    assert len(synth.sample(20)) == 20
    for bad in ({"mode": "row_aligned"}, {"pca_calibration": "classic"}):
        with pytest.raises(ValidationError, match="composition='zcdp'"):
            FactorModelSynthesizer(schema, epsilon=eps, composition="zcdp", **bad)
