"""What the end-to-end tests share: a running local federation and a look at a site's ledger."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.site_agent.ledger import Ledger, LedgerEvent


def roomy_settings(**overrides: Any) -> SiteSettings:
    """Site settings whose budget no test runs out of, with ``overrides`` applied."""
    return replace(SiteSettings(budget_epsilon=1e4, budget_delta=0.1, connect_timeout_s=30),
                   **overrides)


def running(federation: LocalFederation) -> Iterator[LocalFederation]:
    """Start the coordinator and every site, wait until they are connected; stop all after.

    For fixtures: ``yield from running(LocalFederation.create(...))``.
    """
    federation.start_coordinator()
    federation.start_sites()
    try:
        federation.wait_for_sites()
        yield federation
    finally:
        federation.stop_all()


def charged_events(fed: LocalFederation, site_id: str) -> list[LedgerEvent]:
    """Every event in a site's ledger, in the order it was charged (read-only look)."""
    with Ledger(fed.ledger_path(site_id), BudgetPolicy(1e6, 0.5)) as ledger:
        return list(ledger.events())
