"""Cost arithmetic and budget policies (dpfed.common.privacy.accounting): no randomness."""

from __future__ import annotations

import math

import pytest

from dpfed.common.errors import BudgetExceededError, ValidationError
from dpfed.common.privacy.accounting import (
    BudgetPolicy,
    PrivacyCost,
    rho_for_epsilon,
    zcdp_to_epsilon,
)
from dpfed.common.privacy.spent import Spent


def test_costs_compose_by_addition() -> None:
    a = PrivacyCost.pure(0.5)
    b = PrivacyCost.gaussian(1.0, 1e-5, sigma=3.7306, sensitivity=1.0)
    total = PrivacyCost.total([a, b, a])
    assert total.epsilon == pytest.approx(2.0)
    assert total.delta == pytest.approx(1e-5)
    assert total.rho == pytest.approx(2 * 0.125 + 1 / (2 * 3.7306**2))
    assert PrivacyCost.total([]).epsilon == 0.0
    assert (a + b).rho == pytest.approx(a.rho + b.rho)


def test_cost_fields_are_validated() -> None:
    with pytest.raises(ValidationError):
        PrivacyCost(-1.0, 0.0, 0.0)
    with pytest.raises(ValidationError):
        PrivacyCost(1.0, 1.0, 0.0)
    with pytest.raises(ValidationError):
        PrivacyCost.gaussian(1.0, 1e-5, sigma=0.0, sensitivity=1.0)


def test_zcdp_conversion_matches_reference_and_is_tighter_than_standard() -> None:
    # reliability.md: sigma=3.731 (eps=1, delta=1e-5) -> rho=0.0359 -> standard bound 1.32.
    rho = 1 / (2 * 3.731**2)
    assert rho == pytest.approx(0.0359, abs=1e-4)
    standard = rho + 2 * math.sqrt(rho * math.log(1e5))
    assert standard == pytest.approx(1.32, abs=0.01)
    eps = zcdp_to_epsilon(rho, 1e-5)
    assert eps < standard
    assert zcdp_to_epsilon(0.0, 1e-5) == 0.0
    for r in (1e-4, 0.01, 0.5, 3.0):
        assert zcdp_to_epsilon(r, 1e-6) <= r + 2 * math.sqrt(r * math.log(1e6)) + 1e-12
    assert zcdp_to_epsilon(rho_for_epsilon(2.0, 1e-6), 1e-6) == pytest.approx(2.0, rel=1e-9)


def test_basic_policy_caps_epsilon_and_delta() -> None:
    policy = BudgetPolicy(epsilon=2.0, delta=1e-5, accountant="basic")
    spent = Spent.of([PrivacyCost.pure(1.5)])
    policy.check(spent, PrivacyCost.pure(0.5))  # exactly at the cap is allowed
    with pytest.raises(BudgetExceededError, match="epsilon budget exceeded"):
        policy.check(spent, PrivacyCost.pure(0.51))
    g = PrivacyCost.gaussian(0.1, 6e-6, sigma=10.0, sensitivity=1.0)
    policy.check(Spent(), g)
    with pytest.raises(BudgetExceededError, match="delta budget exceeded"):
        policy.check(Spent.of([g]), g)


def test_zcdp_policy_allows_more_gaussian_releases_than_basic() -> None:
    g = PrivacyCost.gaussian(1.0, 1e-6, sigma=4.3, sensitivity=1.0)
    basic = BudgetPolicy(epsilon=5.0, delta=1e-5, accountant="basic")
    zcdp = BudgetPolicy(epsilon=5.0, delta=1e-5, accountant="zcdp")

    def count(policy: BudgetPolicy) -> int:
        events: list[PrivacyCost] = []
        while True:
            try:
                policy.check(Spent.of(events), g)
            except BudgetExceededError:
                return len(events)
            events.append(g)

    assert count(basic) == 5
    assert count(zcdp) > 2 * count(basic)
    status = zcdp.status(Spent.of([g] * 3))
    assert status.rho_spent == pytest.approx(3 * g.rho, rel=1e-12)
    assert status.epsilon_spent == pytest.approx(zcdp_to_epsilon(3 * g.rho, 1e-5))


def test_per_task_limit_and_policy_validation() -> None:
    policy = BudgetPolicy(epsilon=10.0, delta=1e-5, max_epsilon_per_task=1.0)
    with pytest.raises(BudgetExceededError, match="max_epsilon_per_task"):
        policy.check(Spent(), PrivacyCost.pure(1.5))
    with pytest.raises(ValidationError, match="budget.accountant"):
        BudgetPolicy(1.0, 1e-5, accountant="rdp")
    with pytest.raises(ValidationError, match="budget.delta"):
        BudgetPolicy(1.0, 0.0)


def test_status_remaining() -> None:
    s = BudgetPolicy(3.0, 1e-5, accountant="basic").status(Spent.of([PrivacyCost.pure(1.0)]))
    assert s.epsilon_remaining == pytest.approx(2.0) and s.delta_remaining == pytest.approx(1e-5)
