"""``--plan``: what a job would charge every site, and which sites would take part.

The same check the coordinator runs before a job's first charge
(:mod:`dpfed.common.jobs.eligibility`) on what ``dpfed sites`` reports, so a plan never lists
a site whose policy, per-task cap, accountant or remaining budget would keep it out; those
are listed apart, with the reason. Nothing is submitted or charged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dpfed.common.jobs.contract import JobKind, PlannedRound
from dpfed.common.jobs.eligibility import Exclusion, exclusion
from dpfed.common.jobs.params import Params
from dpfed.common.transport.protocol import SiteInfo

if TYPE_CHECKING:
    from dpfed.common.data.schema import Schema


def who_takes_part(kind: JobKind[Any], params: Params, plan: Sequence[PlannedRound],
                   sites: Sequence[SiteInfo], epsilon: float, delta: float
                   ) -> tuple[list[SiteInfo], list[tuple[SiteInfo, Exclusion]]]:
    """Split the connected ``sites`` into those that would take part and those left out."""
    taking: list[SiteInfo] = []
    left_out: list[tuple[SiteInfo, Exclusion]] = []
    for site in sites:
        if not site.connected:
            continue
        found = exclusion(site, kind.name, plan, sums=kind.sums,
                          accountant=params.required_accountant(epsilon, delta))
        if found is None:
            taking.append(site)
        else:
            left_out.append((site, found))
    return taking, left_out


def print_plan(kind: JobKind[Any], params: Params, epsilon: float, delta: float,
               sites: Sequence[SiteInfo], schema: Schema | None = None) -> None:
    """Print every round's charge at every site that would take part, then the others."""
    plan = kind.plan(params, epsilon, delta)
    taking, left_out = who_takes_part(kind, params, plan, sites, epsilon, delta)
    print(f"{kind.name} plan (aggregation {params.aggregation_mode()}): every site taking part "
          "is charged, per round:")
    print_rounds(plan, taking)
    print_left_out(left_out)
    charged = [r for r in plan if r.charged and not r.optional]
    print(f"total per site: epsilon {sum(r.epsilon for r in charged):.4g}, delta "
          f"{sum(r.delta for r in charged):.3g}")
    if kind.sums and taking:
        print(mode_comparison(taking, params, epsilon, delta, schema))


def mode_comparison(sites: Sequence[SiteInfo], params: Params | None = None,
                    epsilon: float = 1.0, delta: float = 0.0,
                    schema: Schema | None = None) -> str:
    """Compare secure and site-level error for ``sites`` (t, d: the strictest policies).

    With the schema, the job's own expected errors where its kind has them
    (:meth:`~dpfed.common.jobs.params.Params.mode_errors`); else the pooled noise ratio.
    """
    from dpfed.common.jobs.eligibility import secure_policy
    from dpfed.common.jobs.modes import compare_modes, secure_limits, secure_pooled_factor

    on = [p for p in (secure_policy(s) for s in sites) if p.mode != "off"]
    if not on:
        return "secure aggregation: off at the sites taking part (site-level only)"
    n = len(sites)
    t, d = secure_limits(n, [p.tolerated for p in on], [p.tolerated_dropouts for p in on])
    factor = secure_pooled_factor(n, t, d)
    errors = None
    if params is not None and schema is not None and math.isfinite(factor):
        found = params.mode_errors(epsilon, delta, schema, n, factor)
        if isinstance(found, str):
            return found
        errors = found
    return compare_modes(n, t, dropouts=d, errors=errors)[1]


def print_rounds(plan: Sequence[PlannedRound], sites: Sequence[SiteInfo]) -> None:
    """One line per site and charged round (``(every site)`` when none is connected)."""
    print(f"{'site':<16} {'round':<11} {'epsilon':>10} {'delta':>10} {'eps left now':>13}")
    rounds = [r for r in plan if r.charged and not r.optional]
    for site in sites:
        left = f"{site.budget.epsilon_remaining:.4g}" if site.budget else "?"
        for r in rounds:
            print(f"{site.site_id:<16} {r.name:<11} {r.epsilon:>10.4g} {r.delta:>10.3g} "
                  f"{left:>13}")
    if not sites:
        for r in rounds:
            print(f"{'(every site)':<16} {r.name:<11} {r.epsilon:>10.4g} {r.delta:>10.3g} "
                  f"{'?':>13}")


def print_left_out(left_out: Sequence[tuple[SiteInfo, Exclusion]]) -> None:
    """Return the connected sites that would not take part, each with its reason."""
    for site, why in left_out:
        print(f"not taking part: {site.site_id} -- {why.reason} (nothing would be charged "
              "there)")


def print_kind_plan(kind_name: str, raw: dict[str, Any], epsilon: float, delta: float,
                    sites: Sequence[SiteInfo], schema: Schema | None = None) -> None:
    """Validate a job's parameters and print its plan, settled as the coordinator would.

    With the federation's ``schema`` (from the coordinator), the parameters are checked
    against it and settled on the connected sites' public facts
    (:meth:`dpfed.common.jobs.contract.JobKind.settle`: e.g. a pca job's budget split), so
    the plan is the one a submission now would run.
    """
    from dpfed.common.jobs.eligibility import connected_facts
    from dpfed.common.jobs.registry import job_kind

    kind = job_kind(kind_name)
    params = kind.parse(kind.params.submitted(raw), schema)  # as a new job would run
    params.check_privacy(epsilon, delta)
    if schema is not None and kind.params.settles:
        facts = connected_facts([(s.site_id, s, s.row_count) for s in sites if s.connected],
                                kind_name)
        params = kind.parse(kind.settle(params.to_mapping(), epsilon, delta, schema, facts),
                            schema)
    print_plan(kind, params, epsilon, delta, sites, schema)
    note = params.plan_note(epsilon, delta)
    if note:
        print(note)
