"""The link round under ``resolution="fine"``: worst-case sensitivity through the real site code.

The "fine" layout (:mod:`dpfed.common.synth.column_cells`) releases, per continuous column,
its coarse cells -- one per whole number for a small integer column; else the bounds as point
cells and the bins -- and the leaves inside the bins, each level with its own public weight.
The search replaces one row of a table by extreme schema-valid records (bounds, values just
inside them, interior values in different bins and in different leaves of one bin, values far
outside the bounds, every level and category) and measures how far the released vector moves
before noise, through the round's own code path (the ``links`` round's site-level statistic,
its secure contribution for the secure sum). Each search also runs against a
planted broken copy, which it must catch.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.encoding import EncodedTable, encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.job_params import SynthParams
from dpfed.common.synth import link_release
from dpfed.common.synth.column_cells import schema_cells
from dpfed.common.synth.link_release import LinkHistogramAccumulator, link_histogram_sensitivity
from dpfed.common.transport.protocol import Task
from tests.site_agent.test_secagg_synth import synth_counts_contribution
from tests.site_agent.test_synth_handler import TableAccess, exact, neighbour

SCHEMA = Schema.from_toml("""
[[columns]]
name = "age"
type = "continuous"
min = 0
max = 100
integer = true
[[columns]]
name = "visits"
type = "continuous"
min = 0
max = 300
integer = true
[[columns]]
name = "lab"
type = "continuous"
min = -5
max = 5
[[columns]]
name = "stage"
type = "ordinal"
levels = ["I", "II", "III", "IV"]
[[columns]]
name = "ward"
type = "nominal"
categories = ["a", "b", "c"]
""")
N_BINS = 8
SITES = ["hospital-a", "hospital-b"]


def base_frame(n: int = 30, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "age": rng.integers(0, 101, n).astype(float), "visits": rng.integers(0, 40, n) * 1.0,
        "lab": rng.normal(0, 2, n).clip(-5, 5), "stage": rng.choice(["I", "II", "III", "IV"], n),
        "ward": rng.choice(["a", "b", "c"], n)})


def records() -> list[dict[str, Any]]:
    """Extreme records: bounds, just inside, interior (other bins, other leaves), far outside."""
    ages = (0.0, 37.0, 100.0, -1e9)
    visits = (0.0, 1.0, 150.0, 299.0, 1e12)
    labs = (-5.0, -5.0 + 1e-9, -2.5, -2.49, 2.5, 1e308)
    out = []
    for age, v, lab, stage, ward in itertools.product(ages, visits, labs, ("I", "IV"),
                                                      ("a", "c")):
        out.append({"age": age, "visits": v, "lab": lab, "stage": stage, "ward": ward})
    return out


def job(**extra: object) -> dict[str, object]:
    return SynthParams.parse({"n_bins": N_BINS, "resolution": "fine", **extra},
                             SCHEMA).to_mapping()


def test_the_search_schema_has_every_kind_of_fine_column() -> None:
    cells = schema_cells(SCHEMA, N_BINS, "fine")
    assert cells["age"].kind == "whole" and not cells["age"].has_fine  # 101 whole numbers
    assert cells["visits"].kind == "fine" and cells["visits"].has_fine
    assert np.all(cells["visits"].lo == cells["visits"].hi)  # its leaves are whole numbers
    assert cells["lab"].kind == "fine" and np.any(cells["lab"].hi > cells["lab"].lo)


# --------------------------------------------------------------------------- site level


def search_site_level() -> float:
    base = base_frame()
    task = Task("j/links", "j", "synth", 1.0, 1e-6,
                {**job(), "schema_digest": SCHEMA.digest(), "round": "links"})
    stats = [exact(task, TableAccess(neighbour(base, r), schema=SCHEMA))[3]
             for r in records()]
    # The noise is added to the weighted vector: its change is what the sensitivity bounds.
    weighted = [link_release.weighted_histograms(s, SCHEMA, N_BINS, "fine") for s in stats]
    return largest_distance(np.array(weighted))


def largest_distance(rows: np.ndarray) -> float:
    """Largest L2 distance between two rows (every pair, through the Gram matrix)."""
    sq = np.einsum("ij,ij->i", rows, rows)
    d2 = sq[:, None] + sq[None, :] - 2.0 * rows @ rows.T
    return float(np.sqrt(max(float(d2.max()), 0.0)))


def test_fine_links_round_attains_and_never_exceeds_the_stated_sensitivity() -> None:
    stated = link_histogram_sensitivity(SCHEMA)
    observed = search_site_level()
    assert observed <= stated * (1 + 1e-12)
    assert observed == pytest.approx(stated)  # tight: every column changes both its levels


def test_fine_search_catches_leaves_weighted_like_coarse_cells(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Planted bug: the leaves get the column's whole weight instead of their share of it.
    def unsplit(schema: Schema, n_bins: int, resolution: str = "bins") -> np.ndarray:
        sizes = link_release.histogram_sizes(schema, n_bins, resolution)
        w = link_release.link_noise_weights(schema, n_bins, resolution)
        return np.repeat(w, sizes)

    monkeypatch.setattr(link_release, "cell_weights", unsplit)
    assert search_site_level() > link_histogram_sensitivity(SCHEMA) * 1.05


def test_fine_search_catches_double_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    real_add = LinkHistogramAccumulator.add

    def doubled(self: LinkHistogramAccumulator, table: EncodedTable) -> None:
        real_add(self, table)
        n = self.n_rows
        real_add(self, table)
        self.n_rows = n

    monkeypatch.setattr(LinkHistogramAccumulator, "add", doubled)
    assert search_site_level() > link_histogram_sensitivity(SCHEMA) * 1.5


# --------------------------------------------------------------------------- secure sum


def counts_task() -> Task:
    return Task("j/links-sum-1", "j", "secagg", 1.0, 1e-6,
                {"stage": "contribute", "source": "synth_counts",
                 "job": job(aggregation="secure"), "schema_digest": SCHEMA.digest(),
                 "statistic": "weighted_counts", "scale": 1.0})


def search_secure() -> tuple[float, float, Any]:
    base = base_frame()
    stats, plan = [], None
    for r in records():
        given = synth_counts_contribution(counts_task(),
                                          TableAccess(neighbour(base, r), schema=SCHEMA),
                                          SITES, 0)
        plan = given.plan
        stat, n_rows = given.compute(np.random.default_rng(0))
        assert stat.dtype == np.int64 and n_rows == len(base)
        # one row's contribution never exceeds the plan's row norm
        stats.append(stat.astype(np.float64))
    rows = np.array(stats)
    l1 = max(float(np.abs(rows - r).sum(axis=1).max()) for r in rows)
    return largest_distance(rows), l1, plan


def test_fine_secure_counts_stay_within_the_plans_bound() -> None:
    worst2, worst1, plan = search_secure()
    weights = link_release.secure_cell_weights(SCHEMA, N_BINS, "fine")
    assert weights.dtype == np.int64 and int(weights.min()) >= 1
    assert plan.bound == pytest.approx(link_release.secure_link_row_norm(SCHEMA, N_BINS,
                                                                         "fine"))
    assert worst2 <= plan.calibration.l2_sensitivity * (1 + 1e-12)
    assert worst2 == pytest.approx(plan.calibration.l2_sensitivity)
    assert worst1 <= plan.calibration.l1_sensitivity


def test_one_rows_secure_contribution_is_within_the_row_norm() -> None:
    norm = link_release.secure_link_row_norm(SCHEMA, N_BINS, "fine")
    weights = link_release.secure_cell_weights(SCHEMA, N_BINS, "fine")
    for r in records()[::37]:
        acc = LinkHistogramAccumulator(SCHEMA, N_BINS, "fine")
        acc.add(encode_table(SCHEMA, pd.DataFrame([r]))[0])
        assert float(np.linalg.norm(acc.counts * weights)) <= norm + 1e-12


def test_fine_secure_search_catches_leaf_weights_the_plan_does_not_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Planted bug: the row norm counts only the coarse cells' weights (as the "bins" layout).
    def coarse_only(schema: Schema, n_bins: int, resolution: str = "bins") -> float:
        m = link_release.secure_link_weights(schema, n_bins, resolution)
        return math.sqrt(float((m * m).sum()))

    from dpfed.common.jobs import synth_rounds

    monkeypatch.setattr(synth_rounds, "secure_link_row_norm", coarse_only)
    worst2, _, plan = search_secure()
    assert worst2 > plan.calibration.l2_sensitivity * 1.02


# --------------------------------------------------------------------------- decoded-sum check


def _exact_weighted_total(frame: pd.DataFrame) -> np.ndarray:
    acc = LinkHistogramAccumulator(SCHEMA, N_BINS, "fine")
    acc.add(encode_table(SCHEMA, frame)[0])
    return acc.counts * link_release.secure_cell_weights(SCHEMA, N_BINS, "fine")


def _links_check(total: np.ndarray, n_rows: int, *, groups: tuple[int, ...] | None = None,
                 weights: tuple[int, ...] | None = None) -> None:
    from dpfed.common.jobs.contract import Ask, Budget
    from dpfed.common.jobs.synth_rounds import LINKS
    from dpfed.common.secagg.secure_sum import check_decoded, plan_for

    params = SynthParams.parse({"n_bins": N_BINS, "resolution": "fine",
                                "aggregation": "secure"}, SCHEMA)
    enc = LINKS.encoding(Ask(params, SCHEMA, None, Budget(20.0, 1e-6)))
    plan = plan_for("weighted_counts", dim=enc.dim, total_rows=n_rows, epsilon=20.0,
                    delta=1e-6, participants=SITES, row_norm=enc.row_norm)
    check_decoded(total, plan, n_rows, groups=enc.groups if groups is None else groups,
                  weights=enc.weights if weights is None else weights,
                  partial=enc.partial if groups is None else ())


def test_an_honest_fine_links_sum_passes_the_decoded_sum_check() -> None:
    # rows on the bounds (point cells, no leaf) and inside bins: the leaves of a column sum
    # to less than N times their weight, the coarse cells to exactly N times theirs
    frame = base_frame(30_000)
    frame.loc[:9_999, "lab"] = 5.0  # a third of the rows on a bound
    frame.loc[5_000:14_999, "visits"] = 0.0
    total = _exact_weighted_total(frame)
    _links_check(total, len(frame))
    # planted broken copy: every column's block as one group at the coarse weight (the check
    # before the leaves had groups of their own) refuses the same honest sum
    from dpfed.common.errors import ImpossibleSumError

    with pytest.raises(ImpossibleSumError, match="group of cells"):
        _links_check(total, len(frame),
                     groups=link_release.histogram_sizes(SCHEMA, N_BINS, "fine"),
                     weights=tuple(int(w) for w in link_release.secure_link_weights(
                         SCHEMA, N_BINS, "fine")))


def test_a_fine_links_sum_with_inflated_leaves_is_refused() -> None:
    from dpfed.common.errors import ImpossibleSumError

    frame = base_frame(30_000)
    total = _exact_weighted_total(frame)
    groups, weights, partial = link_release.secure_link_groups(SCHEMA, N_BINS, "fine")
    k = partial.index(True)
    start = sum(groups[:k])
    inflated = total.copy()
    inflated[start] += len(frame) * weights[k]  # more leaf weight than N rows can add
    with pytest.raises(ImpossibleSumError, match="outside"):
        _links_check(inflated, len(frame))
