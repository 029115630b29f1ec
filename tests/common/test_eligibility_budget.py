"""The coordinator's pre-charge budget check, per accountant (``common.jobs.eligibility``)."""

from __future__ import annotations

from dataclasses import dataclass

from dpfed.common.jobs.contract import PlannedRound
from dpfed.common.jobs.eligibility import exclusion
from dpfed.common.privacy.accounting import BudgetStatus
from dpfed.common.transport.protocol import RefusalCode


@dataclass(frozen=True)
class Site:
    budget: BudgetStatus | None
    allowed_kinds: tuple[str, ...] = ("pca",)
    max_epsilon_per_task: float | None = None
    secure_policy: str = ""


def plan(eps: float, delta: float) -> list[PlannedRound]:
    return [PlannedRound("mean", "pca", eps / 2, delta / 2, 0.0),
            PlannedRound("pca", "pca", eps / 2, delta / 2, 0.0)]


def pld(eps_spent: float) -> BudgetStatus:
    # A tight ledger reports its whole delta cap as spent once it holds an event.
    return BudgetStatus("pld", 10.0, 0.1, eps_spent, 0.1, 0.0, 3)


def test_a_tight_ledger_with_events_still_takes_a_job_that_fits() -> None:
    """Its delta is held at the cap, not consumed: only epsilon decides."""
    assert exclusion(Site(pld(0.5)), "pca", plan(1.0, 1e-5), sums=True) is None


def test_a_tight_ledger_near_its_cap_is_left_out_before_any_charge() -> None:
    found = exclusion(Site(pld(9.5)), "pca", plan(1.0, 1e-5), sums=True)
    assert found is not None and found.code == RefusalCode.BUDGET_EXCEEDED
    assert "reports 0.5" in found.reason


def test_a_basic_ledger_still_counts_delta() -> None:
    spent = BudgetStatus("basic", 10.0, 1e-4, 1.0, 1e-4, 0.0, 3)
    found = exclusion(Site(spent), "pca", plan(1.0, 1e-5), sums=True)
    assert found is not None and found.code == RefusalCode.BUDGET_EXCEEDED
