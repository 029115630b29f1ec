"""The JSON shapes of ``dpfed sites|budgets|jobs|job --json`` (documented in docs/cli.md).

Field names are part of the CLI's contract: scripts parse them, so a field is only ever
added, never renamed or removed. Every value is plain JSON (numbers, strings, booleans,
null, lists, objects); absent values are ``null``, never omitted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpfed.common.privacy.accounting import BudgetStatus, PrivacyCost
    from dpfed.common.transport.protocol import JobInfo, SiteInfo


def budget_json(b: BudgetStatus | None) -> dict[str, Any] | None:
    """Return a site's budget: caps, spent, remaining, events (null when none was reported)."""
    if b is None:
        return None
    return {"accountant": b.accountant, "epsilon_cap": b.epsilon_cap,
            "epsilon_spent": b.epsilon_spent, "epsilon_remaining": b.epsilon_remaining,
            "delta_cap": b.delta_cap, "delta_spent": b.delta_spent,
            "delta_remaining": b.delta_remaining, "rho_spent": b.rho_spent,
            "events": b.events}


def site_json(s: SiteInfo) -> dict[str, Any]:
    """Return one element of ``dpfed sites --json``."""
    return {"site_id": s.site_id, "connected": s.connected, "row_count": s.row_count,
            "allowed_kinds": list(s.allowed_kinds),
            "max_epsilon_per_task": s.max_epsilon_per_task,
            "software_version": s.software_version, "schema_digest": s.schema_digest,
            "first_seen": s.first_seen, "last_seen": s.last_seen,
            "budget": budget_json(s.budget), "secure_aggregation": s.secure_policy or "off",
            "evaluation_summary": evaluation_summary_policy(s)}


def evaluation_summary_policy(s: SiteInfo) -> str:
    """Return a site's ``policy.evaluation_summary``: "dp" when it advertises the DP summary."""
    return "dp" if "synth_eval_dp" in s.allowed_kinds else "none"


def budget_row_json(site_id: str, connected: bool, b: BudgetStatus | None) -> dict[str, Any]:
    """Return one element of ``dpfed budgets --json``."""
    return {"site_id": site_id, "connected": connected, "budget": budget_json(b)}


def _spend_json(c: PrivacyCost | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {"epsilon": c.epsilon, "delta": c.delta, "rho": c.rho, "mechanism": c.mechanism,
            "noise_scale": c.noise_scale}


def job_json(j: JobInfo) -> dict[str, Any]:
    """Return ``dpfed job --json`` (also one element of ``dpfed jobs --json``)."""
    sites_ok = sum(1 for s in j.sites if s.status == "ok")
    return {"job_id": j.job_id, "kind": j.spec.kind, "state": j.state,
            "epsilon": j.spec.epsilon, "delta": j.spec.delta, "params": dict(j.spec.params),
            "min_sites": j.spec.min_sites, "deadline_seconds": j.spec.deadline_seconds,
            "requested_sites": list(j.spec.sites), "study": j.spec.study,
            "submitted_by": j.submitted_by,
            "created": j.created, "updated": j.updated, "error": j.error,
            "sites_ok": sites_ok, "sites_total": len(j.sites),
            "sites": [{"site_id": s.site_id, "status": s.status, "reason": s.reason,
                       "row_count": s.row_count, "spend": _spend_json(s.spend)}
                      for s in j.sites],
            "summary": dict(j.summary), "result_size": j.result_size}
