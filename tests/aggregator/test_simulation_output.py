"""The spend lines ``dpfed simulate`` prints after a job (aggregator/simulation_output.py)."""

from __future__ import annotations

import pytest

from dpfed.aggregator.simulation_output import print_budgets
from dpfed.common.privacy.accounting import BudgetStatus


def test_a_tight_spend_is_an_epsilon_at_the_delta_cap_not_a_delta_used_up(
        capsys: pytest.CaptureFixture[str]) -> None:
    print_budgets([
        ("hospital-1", True, BudgetStatus("pld", 10.0, 1e-4, 0.8366, 1e-4, 0.0, 3)),
        ("hospital-2", True, BudgetStatus("basic", 10.0, 1e-4, 1.0, 1e-5, 0.0, 3)),
        ("hospital-3", False, None),
    ])
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "  hospital-1: spent epsilon 0.8366 of 10 at delta 0.0001 (pld accountant) "
        "(3 release(s))",
        "  hospital-2: spent epsilon 1 of 10, delta 1e-05 of 0.0001 (3 release(s))",
    ]
