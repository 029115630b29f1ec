"""Automatic clipping under secure aggregation, through the sites' real contribution code.

A secure pca job with ``clip_norm="auto"`` runs clip first: a secure sum of every site's
exact histogram of its (uncentred) row norms (``counts``, one group), whose DP quantile is the
radius; the secure mean of the rows clipped to it; then the secure Gram of the rows centred at
the DP mean and clipped (the sites centre, as at site level). The exact integer statistic each
site contributes is read from the round's ``contribution`` and searched over replace-one
neighbours with every extreme schema-valid row: its change stays within the plan's
sensitivity, and planted copies (a double-counting histogram, an unclipped centring) are
caught.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest

from dpfed.common.errors import ValidationError
from dpfed.common.jobs import pca as handler_module
from dpfed.common.jobs.registry import job_kind
from dpfed.common.pca.clipping import norm_bound, norm_grid
from dpfed.common.secagg.messages import plan_params
from dpfed.common.secagg.secure_sum import SecureSumPlan, plan_for
from dpfed.common.transport.protocol import Task
from tests.site_agent.test_pca_rounds import CENTRES, SCHEMA, P, base_frame, extreme_rows
from tests.support.tables import site

SITES = ["h1", "h2", "h3"]


def contribute_task(plan: SecureSumPlan, **params: Any) -> Task:
    arrays = {k: params.pop(k) for k in list(params) if isinstance(params[k], np.ndarray)}
    return Task("j/x-sum-1", "j", "secagg", 1.0, 1e-5,
                {"stage": "contribute", "sum_round": "x-sum-1", "source": "pca", **params,
                 **plan_params(plan, row_norm=1.0)}, arrays)


def search(rnd: Any, t: Task, plan: SecureSumPlan) -> float:
    """Largest L2 change of the contributed integer statistic over replace-one neighbours."""
    rng = np.random.default_rng(3)
    stats = []
    for row in extreme_rows():
        frame = pd.concat([base_frame(), pd.DataFrame([row])], ignore_index=True)
        given = rnd.contribution(t, site(SCHEMA, frame), SITES, 0)
        assert given.plan == plan  # the site recomputed the coordinator's plan
        for _ in range(2 if plan.statistic == "gram" else 1):  # the rounding is random
            stats.append(given.compute(rng)[0].astype(np.float64))
    m = np.array(stats)
    sq = np.sum(m * m, axis=1)
    return float(np.sqrt(max(float((sq[:, None] + sq[None, :] - 2 * m @ m.T).max()), 0.0)))


def norms_plan() -> SecureSumPlan:
    bins = len(norm_grid(norm_bound(SCHEMA, centred=False)))
    return plan_for("counts", dim=bins, total_rows=63, epsilon=1.0, delta=1e-5,
                    participants=SITES)


def test_secure_norm_histogram_sensitivity_search() -> None:
    plan = norms_plan()
    worst = search(handler_module.NORMS, contribute_task(plan), plan)
    assert worst == pytest.approx(np.sqrt(2))  # attained: rows in two different bins
    assert worst <= plan.calibration.l2_sensitivity * (1 + 1e-12)


def test_planted_double_counting_histogram_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = handler_module.norm_histogram
    monkeypatch.setattr(handler_module, "norm_histogram", lambda n, e: 2 * real(n, e))
    plan = norms_plan()
    assert search(handler_module.NORMS, contribute_task(plan), plan) > \
        plan.calibration.l2_sensitivity * 1.2


def gram_plan() -> SecureSumPlan:
    return plan_for("gram", dim=P, total_rows=63, epsilon=1.0, delta=1e-5, participants=SITES)


@pytest.mark.parametrize("clip", [0.25, 1.0])
@pytest.mark.parametrize("centre", [1, 2])
def test_secure_centred_gram_sensitivity_search(clip: float, centre: int) -> None:
    plan = gram_plan()
    t = contribute_task(plan, statistic="gram", clip_norm=clip, center=CENTRES[centre])
    assert search(handler_module.MOMENT, t, plan) <= plan.calibration.l2_sensitivity * (1 + 1e-12)


def test_planted_unclipped_secure_centring_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def unclipped(u: np.ndarray, center: np.ndarray, unit_ball: Any) -> tuple[np.ndarray, int]:
        return (u - center) / unit_ball.norm, 0  # forgets the clip: rows up to 2B / c

    real = handler_module.rows_statistic
    monkeypatch.setattr(handler_module, "centre_rows", unclipped)
    plan = gram_plan()
    t = contribute_task(plan, statistic="gram", clip_norm=0.25, center=CENTRES[1])
    # the secure path clips every row to the unit ball once more: the planted centring alone
    # changes nothing
    assert search(handler_module.MOMENT, t, plan) <= plan.calibration.l2_sensitivity
    # without that second clip, the rounding refuses a row outside the plan's bound
    monkeypatch.setattr(handler_module, "rows_statistic", lambda rows, _norm: real(rows))
    with pytest.raises(ValidationError, match="within the public bound"):
        search(handler_module.MOMENT, t, plan)


def test_a_hostile_centre_is_refused_by_the_secure_gram() -> None:
    plan = gram_plan()
    t = contribute_task(plan, statistic="gram", clip_norm=1.0, center=np.full(P, 3.0))
    with pytest.raises(ValidationError, match=r"\[-1, 1\]"):
        handler_module.MOMENT.contribution(t, site(SCHEMA, base_frame()), SITES, 0)


def test_secure_auto_is_the_default_and_runs_clip_first() -> None:
    kind = job_kind("pca")
    canonical = kind.canonical({"n_components": 2, "aggregation": "secure"}, 1.0, 1e-3, SCHEMA)
    assert canonical["clip_norm"] == "auto" and "split" not in canonical
    params = kind.parse(canonical, SCHEMA)
    assert params.clip_first
    plan = kind.plan(params, 1.0, 1e-3)
    assert [(r.name, r.secure) for r in plan] == [("norms", True), ("mean", True), ("pca", True)]
    assert sum(r.epsilon for r in plan) == pytest.approx(1.0)
    # a secure job made before (clip_norm schema) keeps its rounds
    old = kind.parse({**canonical, "clip_norm": "schema"}, SCHEMA)
    assert not old.clip_first
    assert [r.name for r in kind.plan(old, 1.0, 1e-3)] == ["mean", "pca"]


def test_the_modes_comparison_warns_when_secure_adds_as_much_noise() -> None:
    from dpfed.common.jobs.modes import compare_modes

    ratio, text = compare_modes(4, 1)  # 1 / sqrt(3), times the Skellam slack
    assert ratio == pytest.approx(1.01 / np.sqrt(3)) and "more accurate" in text
    for n, t in ((2, 1), (3, 2)):
        ratio, text = compare_modes(n, t)
        assert ratio >= 1.0 and "WARNING" in text and "--aggregation site" in text
    ratio, text = compare_modes(1, 1)
    assert ratio == np.inf and "cannot run" in text
