"""What a job's result file records of its releases, the same for every kind and either mode."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dpfed.common.jobs.contract import Pooled, SecureSum

if TYPE_CHECKING:
    from dpfed.aggregator.jobs.job import Job


def round_log(released: Sequence[Pooled[Any]]) -> list[dict[str, Any]]:
    """Each round's budget and the sites whose releases it used, in order."""
    return [{"round": p.name, "epsilon": p.budget.epsilon, "delta": p.budget.delta,
             "sites": p.participants} for p in released]


def site_spend(released: Sequence[Pooled[Any]], site_id: str) -> dict[str, float]:
    """Return what ``site_id`` was charged over the rounds whose releases the result used."""
    return {"epsilon": sum(p.budget.epsilon for p in released if site_id in p.rows),
            "delta": sum(p.budget.delta for p in released if site_id in p.rows)}


def sum_record(summed: SecureSum) -> dict[str, Any]:
    """Return the public facts of one secure sum: its plan, its participants, its noise."""
    plan = summed.plan
    cal = plan.calibration
    return {"statistic": plan.statistic, "participants": list(plan.participants),
            "survivors": sorted(summed.rows), "tolerated_dropouts": plan.dropouts,
            "tolerated_colluders": plan.tolerated, "attempts": summed.attempts,
            "neighbours": summed.neighbours,
            "epsilon": cal.epsilon, "delta": cal.delta, "achieved_epsilon": cal.achieved_epsilon,
            "scale": plan.scale, "noise_variance_integer": plan.mu_total,
            "pooled_variance_integer": plan.pooled_variance,
            "pooled_noise_sigma": math.sqrt(plan.pooled_variance) / plan.scale ** plan.degree,
            "l2_sensitivity_integer": cal.l2_sensitivity,
            "l1_sensitivity_integer": cal.l1_sensitivity,
            "n_rows_total": summed.n_rows_total, "releases": summed.releases}


def secure_record(*released: Pooled[Any]) -> dict[str, Any]:
    """``{"secure": ...}`` for a job whose rounds were secure sums, ``{}`` otherwise.

    The record holds every sum under ``rounds`` and, at its top, the last sum's facts (the
    one the result was computed from), the largest ``t`` and the guarantee in words.
    """
    sums = {p.name: p.secure for p in released if p.secure is not None}
    if not sums:
        return {}
    records = {name: sum_record(s) for name, s in sums.items()}
    last = records[list(records)[-1]]
    tolerated = max(r["tolerated_colluders"] for r in records.values())
    noise = list(sums.values())[-1].plan.noise
    pair = "epsilon" if noise == "dlaplace" else "epsilon, delta"
    return {"secure": {
        **last, "mechanism": noise, "rounds": records, "tolerated_colluders": tolerated,
        "guarantee": (
            f"every row at every participating site has the ({pair})-DP guarantee each "
            "round charged (replace-one) against the coordinator, which saw only the noisy "
            f"pooled sums, and against up to {tolerated} colluding part(ies) (the coordinator "
            "included); the noise is calibrated to one row of the pooled data")}}


def mode_record(job: Job[Any], pooled: Pooled[Any]) -> dict[str, Any]:
    """Return the expected secure / site-level noise for the sites of ``pooled`` (reports).

    ``t``: the secure sum's, or the strictest secure policy among them at site level
    (:func:`dpfed.common.jobs.modes.compare_modes`).
    """
    from dpfed.common.jobs.eligibility import secure_policy
    from dpfed.common.jobs.modes import compare_modes, secure_limits

    n = len(pooled.participants)
    if pooled.secure is not None:
        tolerated, dropouts = pooled.secure.plan.tolerated, pooled.secure.plan.dropouts
    else:
        sessions = [job.registry.get(s) for s in pooled.participants]
        on = [p for p in (secure_policy(s.hello) for s in sessions if s is not None)
              if p.mode != "off"]
        if not on:
            return {}
        tolerated, dropouts = secure_limits(n, [p.tolerated for p in on],
                                            [p.tolerated_dropouts for p in on])
    ratio, sentence = compare_modes(n, tolerated, dropouts=dropouts)
    return {"n_sites": n, "tolerated": tolerated, "dropouts": dropouts,
            "secure_over_site_noise": ratio if math.isfinite(ratio) else None,
            "sentence": sentence}
