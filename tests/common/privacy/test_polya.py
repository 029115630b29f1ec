"""Distributed discrete Laplace from Pólya shares (fixed seeds, deterministic).

The honest survivors' shares of a real secure linear plan (``n - t - d`` of them, drawn by the
plan's own sampler) are distributed exactly as ``DLap(alpha)``: pmf and variance match, and the
same check catches planted copies that size shares ``r = 1/n`` ignoring ``t`` or calibrate
``alpha`` to ``Δ1/2``; the pooled noise of all ``n`` shares has the stated answer variance; the
Chernoff tail bound holds against the exact negative binomial tail (the Skellam bound at the
same variance does not); the ledgers price ``secure-dlaplace[...]`` as pure epsilon, never
below an exact oracle of the discrete Laplace's privacy loss (composed too), and a planted
copy priced with the continuous Laplace pair is caught under-counting."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import numpy as np
import pytest
from scipy import stats

from dpfed.common.privacy import pld, polya
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.privacy.spent import Spent, event_loss
from dpfed.common.secagg import secure_sum
from dpfed.common.secagg.fixed_point import skellam_tail
from dpfed.common.secagg.linear_sum import LinearSumPlan, plan_linear

EPS = 1.0
CELLS = 64
DRAWS = 2500  # x 64 answers: 160,000 honest sums per setting


def _plan(n: int, t: int, d: int) -> LinearSumPlan:
    """Identity over 64 cells at scale 2: Ã = 2 I, Δ1 = 4, alpha = exp(-1/4)."""
    linear = plan_linear(np.eye(CELLS), scale=2, epsilon=EPS, delta=0.0,
                         participants=[f"s{i}" for i in range(n)], tolerated=t,
                         noise="dlaplace")
    return dataclasses.replace(linear, plan=dataclasses.replace(linear.plan, dropouts=d))


def _honest_sums(plan: secure_sum.SecureSumPlan, survivors: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([sum(plan.noise_share(rng) for _ in range(survivors))
                           for _ in range(DRAWS)])


def _dlap_pmf(k: np.ndarray, alpha: float) -> np.ndarray:
    return (1 - alpha) / (1 + alpha) * alpha ** np.abs(k)


def _distance(x: np.ndarray, alpha: float) -> tuple[float, float]:
    """(total variation to DLap(alpha) on |k| <= 60 plus the tail, variance ratio)."""
    k = np.arange(-60, 61)
    counts = np.array([np.count_nonzero(x == v) for v in k]) / x.size
    expected = _dlap_pmf(k, alpha)
    tv = 0.5 * (float(np.abs(counts - expected).sum())
                + abs((1 - counts.sum()) - (1 - expected.sum())))
    return tv, float(np.var(x)) / polya.dlaplace_variance(alpha)


def _matches(x: np.ndarray, alpha: float) -> bool:
    tv, ratio = _distance(x, alpha)
    return tv < 0.01 and abs(ratio - 1.0) < 0.03


@pytest.mark.parametrize(("n", "t", "d"), [(3, 1, 0), (4, 1, 1), (5, 0, 0), (5, 2, 1)])
def test_honest_survivors_carry_exactly_the_discrete_laplace(n: int, t: int, d: int) -> None:
    linear = _plan(n, t, d)
    plan = linear.plan
    cal = plan.calibration
    assert isinstance(cal, polya.DLaplaceCalibration)
    assert cal.l1_sensitivity == 4.0 and cal.alpha == math.exp(-EPS / 4.0)
    assert (n - t - d) * polya.polya_shape(n, t, d) == pytest.approx(1.0)  # honest shape 1
    x = _honest_sums(plan, n - t - d, seed=n * 100 + t * 10 + d)
    assert _matches(x, cal.alpha), _distance(x, cal.alpha)
    # all n shares: the stated pooled variance n * 2 r alpha / (1 - alpha)^2, in answer units
    pooled = _honest_sums(plan, n, seed=7 + n)
    assert np.var(pooled) / plan.scale ** 2 == pytest.approx(linear.answer_variance, rel=0.03)
    assert linear.answer_variance * plan.scale ** 2 == pytest.approx(
        n / (n - t - d) * polya.dlaplace_variance(cal.alpha))


def test_planted_shares_ignoring_t_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(secure_sum, "polya_shape", lambda n, t, d=0: 1.0 / n)
    plan = _plan(3, 1, 0).plan
    x = _honest_sums(plan, 2, seed=310)  # the two honest shares: shape 2/3 < 1
    tv, ratio = _distance(x, plan.calibration.alpha)  # type: ignore[union-attr]
    assert not _matches(x, plan.calibration.alpha)  # type: ignore[union-attr]
    assert ratio < 0.75  # 2/3 of the variance


def test_planted_half_sensitivity_alpha_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    honest_alpha = math.exp(-EPS / 4.0)
    monkeypatch.setattr(polya, "dlaplace_alpha", lambda eps, l1: math.exp(-eps / (l1 / 2)))
    plan = _plan(3, 1, 0).plan
    x = _honest_sums(plan, 2, seed=311)
    assert not _matches(x, honest_alpha)
    assert _distance(x, honest_alpha)[1] < 0.35


@pytest.mark.parametrize(("shape", "alpha", "m"), [(1.0, 0.5, 1), (1.5, 0.9, 64),
                                                    (5.0, 0.999, 1000), (1.0, 1 - 1e-6, 8)])
def test_the_chernoff_tail_holds_against_the_exact_tail(shape: float, alpha: float,
                                                        m: int) -> None:
    failure = 2.0 ** -60
    tail = polya.polya_tail(shape, alpha, m, failure)
    exact = float(stats.nbinom.sf(math.floor(tail), shape, 1 - alpha))  # P(X > floor(T))
    assert exact <= failure / (2 * m)
    # not loose: the exact quantile is at least 70 % of the bound
    q = float(stats.nbinom.isf(failure / (2 * m), shape, 1 - alpha))
    assert q >= 0.7 * tail
    # the Skellam bound at the same variance is too small for these heavier tails
    variance = shape * 2 * alpha / (1 - alpha) ** 2
    if alpha >= 0.9:
        short = skellam_tail(variance, m, failure)
        assert float(stats.nbinom.sf(math.floor(short), shape, 1 - alpha)) > failure / (2 * m)


# --------------------------------------------------------------------------- accounting


def _dlap_loss(shift: int, alpha: float) -> dict[float, float]:
    """Exact privacy-loss distribution of DLap(alpha) against DLap(alpha) + shift (1-D)."""
    a = -math.log(alpha)
    out: dict[float, float] = defaultdict(float)
    # loss (|x - shift| - |x|) a is constant beyond [min(0, shift), max(0, shift)]
    lo, hi = min(0, shift), max(0, shift)
    for x in range(lo, hi + 1):
        out[round((abs(x - shift) - abs(x)) * a, 12)] += float(_dlap_pmf(np.array(x), alpha))
    below = (alpha ** (-lo + 1)) * (1 - alpha) / (1 + alpha) / (1 - alpha)  # x < lo
    above = (alpha ** (hi + 1)) * (1 - alpha) / (1 + alpha) / (1 - alpha)  # x > hi
    out[round(abs(shift) * a, 12) * (1 if shift > 0 else -1)] += below
    out[round(-abs(shift) * a, 12) * (1 if shift > 0 else -1)] += above
    return dict(out)


def _convolve(p: dict[float, float], q: dict[float, float]) -> dict[float, float]:
    out: dict[float, float] = defaultdict(float)
    for lp, mp in p.items():
        for lq, mq in q.items():
            out[round(lp + lq, 12)] += mp * mq
    return dict(out)


def _oracle_delta(loss: dict[float, float], epsilon: float) -> float:
    return sum(m * (1 - math.exp(epsilon - lo)) for lo, m in loss.items() if lo > epsilon)


def _cost(epsilon: float, l1: float) -> PrivacyCost:
    plan = plan_linear(np.eye(8), scale=1, epsilon=epsilon, delta=0.0,
                       participants=["a", "b", "c"], tolerated=1, noise="dlaplace").plan
    cost = plan.cost()
    assert cost.mechanism == "secure-dlaplace[n=3,t=1]" and cost.delta == 0.0
    return dataclasses.replace(cost, sensitivity=l1)


@pytest.mark.parametrize(("shifts", "events"), [((1,), 1), ((1,), 3), ((1, 2), 1), ((3,), 2),
                                                ((1, 1, 1, 1), 1)])
def test_ledgers_price_the_discrete_laplace_at_least_as_its_exact_loss(
        shifts: tuple[int, ...], events: int) -> None:
    l1 = sum(shifts)
    alpha = math.exp(-EPS / l1)
    single: dict[float, float] = {0.0: 1.0}
    for v in shifts:  # one release: independent coordinates moved by the integer shifts
        single = _convolve(single, _dlap_loss(v, alpha))
    loss = single
    for _ in range(events - 1):
        loss = _convolve(loss, single)
    assert sum(loss.values()) == pytest.approx(1.0, abs=1e-12)
    cost = _cost(EPS, l1)
    assert event_loss(cost).method == "pure"
    spent = Spent.of([cost] * events)
    # basic and zCDP readings: pure epsilon
    assert spent.basic.epsilon == pytest.approx(EPS * events) and spent.basic.delta == 0.0
    assert spent.rho_sum == pytest.approx(events * EPS ** 2 / 2)
    for e in np.linspace(0.0, EPS * events, 41):
        oracle = _oracle_delta(loss, float(e))
        assert spent.pairs_delta(float(e)) >= oracle * (1 - 1e-9) - 1e-15, (e, oracle)
    for delta in (1e-6, 1e-3, 0.05):
        claimed = spent.epsilon(delta)
        assert _oracle_delta(loss, claimed) <= delta * (1 + 1e-9)


def test_a_planted_continuous_laplace_pricing_under_counts_and_is_caught() -> None:
    alpha = math.exp(-EPS)  # Δ1 = 1: the discrete Laplace is randomized response exactly
    loss = _dlap_loss(1, alpha)
    planted = pld.laplace_loss(EPS)  # the continuous Laplace pair at the same epsilon
    under = [e for e in np.linspace(0.0, EPS, 21)
             if pld.delta_at(float(e), mu=0.0, loss=planted, infinity=0.0)
             < _oracle_delta(loss, float(e)) * (1 - 1e-6)]
    assert under  # it claims less than the discrete Laplace really loses
    honest = Spent.of([_cost(EPS, 1.0)])
    assert all(honest.pairs_delta(float(e)) >= _oracle_delta(loss, float(e)) * (1 - 1e-9)
               for e in np.linspace(0.0, EPS, 21))


@pytest.mark.parametrize(("l1", "events"), [(1, 1), (3, 1), (1, 4), (5, 2)])
def test_the_ledger_figure_covers_dp_accountings_discrete_laplace(l1: int, events: int) -> None:
    """A second, independent oracle: Google's dp_accounting PLD of the discrete Laplace
    (``P(x) ∝ exp(-(ε/Δ1)|x|)`` at sensitivity ``Δ1``), composed; it agrees with the exact
    loss above and never exceeds the ledger's figure."""
    from dp_accounting.pld import privacy_loss_distribution as dpa

    oracle = dpa.from_discrete_laplace_mechanism(EPS / l1, sensitivity=l1)
    exact = _dlap_loss(l1, math.exp(-EPS / l1))
    composed = exact
    for _ in range(events - 1):
        oracle = oracle.compose(dpa.from_discrete_laplace_mechanism(EPS / l1, sensitivity=l1))
        composed = _convolve(composed, exact)
    spent = Spent.of([_cost(EPS, float(l1))] * events)
    for e in np.linspace(0.0, EPS * events, 21):
        theirs = float(oracle.get_delta_for_epsilon(float(e)))
        assert theirs == pytest.approx(_oracle_delta(composed, float(e)), abs=2e-3)
        assert spent.pairs_delta(float(e)) >= theirs - 2e-3
