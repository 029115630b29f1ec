"""Which sites can take part in a job: every limit a site advertises, against every round.

A site's hello advertises the task kinds it allows, its per-task epsilon cap, its secure
aggregation policy, its accountant and its remaining budget. The coordinator checks all of
them against every round of a job's plan before the first charge, so that a site that would
refuse a later round is left out before it pays for an earlier one; ``dpfed <kind> --plan``
runs the same check on what ``dpfed sites`` reports, so the plan lists only the sites that
would take part. The site's ledger stays the authority.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from dpfed.common.errors import ValidationError
from dpfed.common.jobs.contract import PlannedRound
from dpfed.common.jobs.params import ConnectedSite
from dpfed.common.jobs.registry import SECURE_TASK_KIND
from dpfed.common.privacy.accounting import BudgetStatus, zcdp_to_epsilon
from dpfed.common.secagg.policy import SecureAggregationPolicy
from dpfed.common.transport.protocol import RefusalCode

#: Relative slack on budget comparisons (the site's ledger decides at the margin).
_SLACK = 1e-9


class SiteView(Protocol):
    """What a site advertises (a :class:`SiteHello` or a :class:`SiteInfo` reads as one)."""

    @property
    def allowed_kinds(self) -> tuple[str, ...]:
        """Task kinds the site runs."""

    @property
    def max_epsilon_per_task(self) -> float | None:
        """Its per-task epsilon cap."""

    @property
    def budget(self) -> BudgetStatus | None:
        """Its last reported budget."""

    @property
    def secure_policy(self) -> str:
        """Its secure-aggregation policy summary ("" for none)."""


@dataclass(frozen=True)
class Exclusion:
    """Why a site cannot take part; ``reason`` reads ``"<code>: <explanation>"``."""

    code: RefusalCode
    reason: str


def _excluded(code: RefusalCode, text: str) -> Exclusion:
    return Exclusion(code, f"{code}: {text}")


def secure_policy(site: SiteView) -> SecureAggregationPolicy:
    """Return the site's secure-aggregation policy: ``off`` unless it runs ``secagg`` tasks.

    A site that runs them without saying more (an older site's hello) is taken as
    ``allowed`` with the least strict limits: its key exchange states its real ones.
    """
    if SECURE_TASK_KIND not in site.allowed_kinds:
        return SecureAggregationPolicy("off")
    try:
        if site.secure_policy:
            return SecureAggregationPolicy.from_summary(site.secure_policy)
    except ValidationError:
        pass
    return SecureAggregationPolicy("allowed", 2, 0)


def exclusion(site: SiteView, kind: str, plan: Sequence[PlannedRound], *, sums: bool,
              accountant: tuple[str, str] | None = None,
              whole_budget: bool = True, study: str = "") -> Exclusion | None:
    """Return why ``site`` cannot take part in every round of a ``kind`` job, or None.

    ``sums``: the kind has a secure mode (a site whose policy requires secure aggregation
    refuses its site-level releases). ``accountant`` = (name, why): the job needs sites whose
    ledger uses that accountant. ``whole_budget``: check that the remaining budget covers the
    charged rounds together (a job with one charged round leaves that to the site's ledger,
    which refuses it without spending anything). ``study``: the job spends from that study's
    budget, which the site must report (a site that does not could not enforce its cap), not
    expired, with room for the charged rounds together.
    """
    budget = site.budget
    if study and budget is not None:
        found_study = _study_exclusion(budget, study, plan, whole_budget)
        if found_study is not None:
            return found_study
    if accountant is not None:
        name, why = accountant
        if budget is None or budget.accountant != name:
            reported = "no budget" if budget is None else f"a {budget.accountant!r} accountant"
            return _excluded(RefusalCode.NOT_ALLOWED,
                             f"this job needs sites whose ledger uses the {name!r} accountant "
                             f"({why}); the site reports {reported}")
    policy = secure_policy(site)
    for r in plan:
        if r.optional:
            continue
        found = _round_exclusion(site, kind, r, policy, sums)
        if found is not None:
            return found
    charged = [r for r in plan if r.charged and not r.optional]
    if whole_budget and len(charged) > 1 and budget is not None:
        return _budget_exclusion(budget, charged)
    return None


def _round_exclusion(site: SiteView, kind: str, r: PlannedRound,
                     policy: SecureAggregationPolicy, sums: bool) -> Exclusion | None:
    if r.secure:
        if policy.mode == "off":
            return _excluded(RefusalCode.NOT_ALLOWED, "the site does not take part in secure "
                             "aggregation (its policy is off)")
        if kind not in site.allowed_kinds:
            return _excluded(RefusalCode.NOT_ALLOWED,
                             f"the site's policy does not allow {kind!r} jobs")
    else:
        if r.task_kind not in site.allowed_kinds:
            return _excluded(RefusalCode.NOT_ALLOWED,
                             f"the site's policy does not allow {r.task_kind!r} jobs")
        if sums and policy.mode == "required":
            return _excluded(RefusalCode.NOT_ALLOWED,
                             f"this site's policy requires secure aggregation for {kind!r} "
                             "jobs (--aggregation secure)")
    cap = site.max_epsilon_per_task
    if r.charged and cap is not None and r.epsilon > cap * (1 + _SLACK):
        return _excluded(RefusalCode.BUDGET_EXCEEDED,
                         f"round {r.name!r} asks epsilon={r.epsilon:g}; the site's policy "
                         f"allows at most {cap:g} per task")
    return None


def _study_exclusion(budget: BudgetStatus, study: str, plan: Sequence[PlannedRound],
                     whole_budget: bool) -> Exclusion | None:
    held = next((s for s in budget.studies if s.name == study), None)
    if held is None:
        return _excluded(RefusalCode.NOT_ALLOWED,
                         f"the site holds no budget for study {study!r}")
    if held.expires < datetime.now(UTC).date().isoformat():
        return _excluded(RefusalCode.BUDGET_EXCEEDED,
                         f"study {study!r} expired at the site on {held.expires}")
    charged = [r for r in plan if r.charged and not r.optional]
    found = (_budget_exclusion(held.status, charged) if whole_budget and len(charged) > 1
             else None)
    if found is not None:
        return _excluded(found.code, f"study {study!r}: {found.reason.partition(': ')[2]}")
    return None


def _budget_exclusion(b: BudgetStatus, charged: Sequence[PlannedRound]) -> Exclusion | None:
    if b.accountant == "zcdp":
        rho = sum(r.rho for r in charged)
        after = zcdp_to_epsilon(b.rho_spent + rho, b.delta_cap)
        if after > b.epsilon_cap * (1 + _SLACK):
            return _excluded(RefusalCode.BUDGET_EXCEEDED,
                             f"the job needs rho={rho:.4g} over all its rounds; with the "
                             f"site's rho {b.rho_spent:.4g} already spent that is epsilon "
                             f"{after:.4g} at delta {b.delta_cap:g}, above its cap "
                             f"{b.epsilon_cap:g}")
        return None
    eps = sum(r.epsilon for r in charged)
    delta = sum(r.delta for r in charged)
    if b.accountant == "pld":  # spend is measured at the delta cap: only epsilon is left
        eps = min(eps, gaussian_rounds_epsilon([(r.epsilon, r.delta) for r in charged]))
        delta = 0.0
    if eps > b.epsilon_remaining * (1 + _SLACK) or delta > b.delta_remaining * (1 + _SLACK):
        return _excluded(RefusalCode.BUDGET_EXCEEDED,
                         f"the job needs epsilon={eps:g}, delta={delta:g} over all its rounds; "
                         f"the site reports {b.epsilon_remaining:g}, {b.delta_remaining:g} "
                         "left")
    return None


def connected_facts(sites: Sequence[tuple[str, SiteView, int]], kind: str,
                    named: Sequence[str] = ()) -> list[ConnectedSite]:
    """Return the public facts a new job's plan may settle on: its candidate sites' rows.

    ``sites`` are ``(site id, what it advertises, its public row count)``; sites that do not
    allow ``kind``, or are not among ``named`` when a job names its sites, are no candidates.
    Each fact carries the site's accountant and secure-aggregation policy (t and d).
    """
    out = []
    for site_id, view, rows in sites:
        if kind not in view.allowed_kinds or (named and site_id not in named):
            continue
        policy = secure_policy(view)
        on = policy.mode != "off"
        out.append(ConnectedSite(int(rows), None if view.budget is None
                                 else view.budget.accountant,
                                 policy.tolerated if on else None,
                                 policy.tolerated_dropouts if on else 0))
    return out


def gaussian_rounds_epsilon(rounds: Sequence[tuple[float, float]]) -> float:
    """Return what rounds ``(epsilon, delta)`` cost together, those with delta > 0 Gaussian.

    Each such round is ``mu_i``-GDP with ``mu_i = 1 / gaussian_sigma(epsilon_i, delta_i)``;
    together ``sqrt(sum mu_i^2)``-GDP, read at the rounds' total delta; pure rounds add their
    epsilon. The estimate a ``pld`` ledger's budget is checked with before a job (a pca
    job's GDP split adds its per-round epsilons to more than it costs); the ledger decides.
    """
    from dpfed.common.privacy.mechanisms import gaussian_sigma
    from dpfed.common.privacy.pld import gaussian_epsilon

    gaussian = [(e, d) for e, d in rounds if d > 0.0]
    pure = sum(e for e, d in rounds if d <= 0.0)
    if not gaussian:
        return pure
    mu = math.sqrt(sum(gaussian_sigma(e, d, 1.0) ** -2 for e, d in gaussian))
    return pure + gaussian_epsilon(mu, sum(d for _, d in gaussian))


def secure_quorum(policies: Sequence[SecureAggregationPolicy], min_sites: int) -> int:
    """Return the fewest participants a secure sum among sites with these policies can have."""
    return max([min_sites, 2] + [p.min_participants for p in policies]
               + [p.tolerated + 1 for p in policies])
