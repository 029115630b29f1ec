"""The output directory of ``dpfed simulate`` (every job kind) and its progress lines."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from dpfed.common.errors import ConfigError

if TYPE_CHECKING:
    from dpfed.common.privacy.accounting import BudgetStatus


def say(step: str, text: str) -> None:
    """Print one progress line of a simulation."""
    print(f"[simulate] {step:<12} {text}", flush=True)


MARKER = ".dpfed-simulation"


def prepare_output(out: Path) -> None:
    """Create ``out``, or empty it if it holds an earlier simulation (never anything else).

    A fresh directory each run keeps a demo from inheriting the previous run's spent budget.
    """
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise ConfigError(f"--out {out} exists and is not an earlier dpfed simulation; "
                              "choose an empty or new directory")
        say("output", f"replacing the earlier simulation in {out}")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by dpfed simulate; the directory is replaced on re-run\n")


def print_budgets(budgets: Iterable[tuple[str, bool, BudgetStatus | None]]) -> None:
    """Print each site's spend after a simulated job.

    Under the basic accountant both sums; under ``pld`` and ``zcdp`` the spend is an epsilon
    read at the site's delta cap (not a delta used up), which the line says.
    """
    for site_id, _connected, b in budgets:
        if b is None:
            continue
        if b.accountant == "basic":
            spent = (f"epsilon {b.epsilon_spent:.4g} of {b.epsilon_cap:g}, delta "
                     f"{b.delta_spent:.3g} of {b.delta_cap:g}")
        else:
            spent = (f"epsilon {b.epsilon_spent:.4g} of {b.epsilon_cap:g} at delta "
                     f"{b.delta_cap:g} ({b.accountant} accountant)")
        print(f"  {site_id}: spent {spent} ({b.events} release(s))")
