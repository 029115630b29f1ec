"""The pca handler's three rounds through the real site code path.

Sensitivity is SEARCHED, not assumed: tables that differ in one row (replace-one), the row
taken from every combination of extreme schema-valid values (each continuous column at
min/mid/max, every ordinal level, every category), under several clip norms and centres. The
round's statistic is read by releasing it with a zero-noise generator (the real
``Release.produce``, whose noise term is then exactly 0), and the largest change found
must stay within the sensitivity the release's charge claims -- and a planted
copy that under-states it must be caught by the same search.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.encoding import encode_table
from dpfed.common.errors import ValidationError
from dpfed.common.jobs import pca as handler_module
from dpfed.common.pca import centring
from dpfed.common.pca.clipping import norm_grid
from dpfed.common.pca.features import max_feature_norm
from dpfed.common.privacy.mechanisms import SymmetricGaussianMechanism, gaussian_sigma
from dpfed.common.transport.protocol import Task
from dpfed.site_agent.handlers.base import site_release
from tests.support.records import extreme_records
from tests.support.schemas import MIXED as SCHEMA
from tests.support.tables import FrameData, ZeroNoise, cost_of, produced

P = 6  # a, b, lvl, cat=p, cat=q, cat=r
B = max_feature_norm(SCHEMA)


def extreme_rows() -> list[dict[str, Any]]:
    """Every combination of extreme schema-valid values (bounds and midpoints)."""
    return list(extreme_records(SCHEMA, quarters=False, outside=False).to_dict("records"))


def base_frame(n: int = 20) -> pd.DataFrame:
    rng = np.random.default_rng(5)
    return pd.DataFrame({"a": rng.uniform(-10, 10, n), "b": rng.uniform(0, 4, n),
                         "lvl": rng.choice(["x", "y", "z"], n),
                         "cat": rng.choice(["p", "q", "r"], n)})


def task(stage: str, *, clip: float | str = "schema", centering: str = "mean",
         center: np.ndarray | None = None, epsilon: float = 1.0) -> Task:
    params = {"n_components": 2, "rank": P, "clip_norm": clip, "centering": centering,
              "stage": stage}
    arrays = {} if center is None else {"center": center}
    return Task(f"j/{stage}", "j", "pca", epsilon, 1e-5, params, arrays)


def statistic(t: Task, frame: pd.DataFrame) -> tuple[np.ndarray, float]:
    """The exact released statistic (zero noise) and the sensitivity the handler claims."""
    prepared = site_release(t, FrameData(SCHEMA, frame))
    result = produced(prepared, ZeroNoise())
    n = len(frame)
    if "factor" in result.arrays:
        f = result.arrays["factor"]  # rank = p and PSD statistic: P P^T = G / N exactly
        stat = (f @ f.T)[np.triu_indices(P)]
    else:
        stat = next(iter(result.arrays.values()))
    assert result.metadata["n_rows"] == n
    return stat, cost_of(prepared).sensitivity


def search(t: Task) -> tuple[float, float]:
    """Largest L2 change over replace-one neighbours (slot row = every extreme row)."""
    base = base_frame()
    stats = []
    claimed = 0.0
    for row in extreme_rows():
        frame = pd.concat([base, pd.DataFrame([row])], ignore_index=True)
        s, claimed = statistic(t, frame)
        stats.append(s)
    m = np.array(stats)
    sq = np.sum(m * m, axis=1)
    d2 = sq[:, None] + sq[None, :] - 2 * m @ m.T
    return float(np.sqrt(max(float(d2.max()), 0.0))), claimed


CENTRES = [np.zeros(P),
           np.array([1.0, -1.0, 1.0, 0.0, 0.0, 0.0]),  # a corner of the box (norm sqrt(3) < B)
           np.array([0.2, 0.1, -0.3, 0.5, 0.3, 0.2])]


@pytest.mark.parametrize("clip", [0.25, 1.0, 2.5, "schema"])
@pytest.mark.parametrize("centre", range(len(CENTRES)))
def test_centred_pca_round_sensitivity_search(clip: float | str, centre: int) -> None:
    observed, claimed = search(task("pca", clip=clip, center=CENTRES[centre]))
    assert claimed == pytest.approx(np.sqrt(2) / 21)
    assert observed <= claimed * (1 + 1e-9)
    if isinstance(clip, float) and clip <= 1.0:  # extreme rows clipped to norm 1: ~attained
        assert observed >= 0.7 * claimed


def test_planted_understated_centred_sensitivity_is_caught(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    def planted(n_rows: int, epsilon: float, delta: float,
                calibration: str = "analytic") -> SymmetricGaussianMechanism:
        return SymmetricGaussianMechanism(epsilon, delta, 1.0 / n_rows, calibration)

    monkeypatch.setattr(handler_module, "centred_pca_mechanism", planted)
    observed, claimed = search(task("pca", clip=1.0, center=CENTRES[1]))
    assert observed > claimed * 1.2  # the search exposes the under-stated bound


def test_planted_unclipped_centring_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def unclipped(u: np.ndarray, center: np.ndarray, unit_ball: Any) -> tuple[np.ndarray, int]:
        return (u - center) / unit_ball.norm, 0  # forgets the clip: rows up to 2B / c

    monkeypatch.setattr(handler_module, "centre_rows", unclipped)
    observed, claimed = search(task("pca", clip=1.0, center=CENTRES[1]))
    assert observed > claimed * 1.2


@pytest.mark.parametrize("centre", range(len(CENTRES)))
def test_mean_and_norms_round_sensitivity_search(centre: int) -> None:
    observed, claimed = search(task("mean"))
    assert claimed == 2.0 and observed <= 2.0 + 1e-12 and observed >= 1.5
    observed, claimed = search(task("norms", clip="auto", center=CENTRES[centre]))
    assert claimed == pytest.approx(np.sqrt(2))
    assert observed == pytest.approx(np.sqrt(2))  # attained: rows in two different bins


def test_planted_wrong_histogram_sensitivity_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpfed.common.privacy.mechanisms import GaussianMechanism

    monkeypatch.setattr(handler_module, "norm_histogram_mechanism",
                        lambda e, d, c="analytic": GaussianMechanism(e, d, 1.0, c))
    observed, claimed = search(task("norms", clip="auto", center=CENTRES[0]))
    assert observed > claimed * 1.2


def test_round_statistics_and_costs_are_what_the_docs_say() -> None:
    frame = base_frame(40)
    # mean: sum of u / B, cost calibrated to sensitivity 2 at the task's own (eps, delta)
    prepared = site_release(task("mean", epsilon=0.1), FrameData(SCHEMA, frame))
    assert cost_of(prepared).epsilon == 0.1
    assert cost_of(prepared).noise_scale == pytest.approx(gaussian_sigma(0.1, 1e-5, 2.0))
    s, _ = statistic(task("mean"), frame)
    enc, _ = encode_table(SCHEMA, frame)
    from dpfed.common.pca.features import UnitBallMap

    u = UnitBallMap(SCHEMA).scaled(enc)
    np.testing.assert_allclose(s, u.sum(axis=0) / B)
    # norms: counts on the public grid, total = N
    h, _ = statistic(task("norms", clip="auto", center=CENTRES[2]), frame)
    assert h.sum() == 40 and len(h) == len(norm_grid(2 * B))
    # pca: centred at the given centre, clipped to c, over N
    c = 1.5
    g, _ = statistic(task("pca", clip=c, center=CENTRES[2]), frame)
    z, _ = centring.centre_rows(u.copy(), CENTRES[2], UnitBallMap(SCHEMA, clip_norm=c))
    np.testing.assert_allclose(g, (z.T @ z / 40)[np.triu_indices(P)], atol=1e-12)


@pytest.mark.parametrize(("bad", "match"), [
    (None, "needs the array 'center'"),
    (np.zeros(P - 1), "shape"),
    (np.full(P, np.nan), "finite"),
    (np.full(P, 1e308), r"\[-1, 1\]"),
    (np.ones(P), "norm"),
])
def test_hostile_centre_is_refused(bad: np.ndarray | None, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        site_release(task("pca", clip=1.0, center=bad), FrameData(SCHEMA, base_frame()))


def test_pca_round_refuses_an_unresolved_auto_clip_and_unknown_stage() -> None:
    with pytest.raises(ValidationError, match="resolved clip_norm"):
        site_release(task("pca", clip="auto", center=np.zeros(P)),
                     FrameData(SCHEMA, base_frame()))
    with pytest.raises(ValidationError, match="stage"):
        site_release(task("everything"), FrameData(SCHEMA, base_frame()))



def test_rank_is_post_processing_it_does_not_change_the_cost() -> None:
    """R (--rank) only sets how many eigenpairs of the noisy matrix leave the site."""
    frame = base_frame(40)
    costs = []
    for rank in (2, 4, P):
        t = task("pca", clip=1.0, center=CENTRES[2])
        t = Task(t.task_id, t.job_id, t.kind, t.epsilon, t.delta, {**t.params, "rank": rank},
                 t.arrays)
        prepared = site_release(t, FrameData(SCHEMA, frame))
        assert produced(prepared, np.random.default_rng(0)).arrays["factor"].shape == (P, rank)
        costs.append(cost_of(prepared))
    assert len(set(costs)) == 1
