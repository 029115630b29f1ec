"""Missing values as a cell of their own: worst-case sensitivity through the real site code.

With ``missing_cells`` (new synth jobs) every ``missing = "category"`` column's releases carry
*missing* as one more cell (:mod:`dpfed.common.synth.missing_cells`). A row still falls in
exactly one cell of every column, so every round's stated sensitivity is unchanged. The
searches replace one row of a table by extreme schema-valid records -- every column missing,
at its bounds, inside, far outside; every level and category -- and measure how far the
released vector moves before noise through the rounds' own code path (the ``links`` round's
site-level statistic and its secure contribution, the ``pairs`` round's tables). Each also runs
against a planted broken copy (missing rows counted twice), which it must catch; the secure
sum's decoded-sum check accepts the honest counts and refuses a plan that leaves the missing
cell out of its column's group.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.schema import Schema
from dpfed.common.job_params import SynthParams
from dpfed.common.secagg.secure_sum import ImpossibleSumError, check_decoded
from dpfed.common.synth import link_release, pair_marginals
from dpfed.common.synth.column_cells import ColumnCells, schema_cells
from dpfed.common.synth.link_release import (
    link_histogram_sensitivity,
    links_digest,
    proportions_from_histograms,
    release_noise_sd,
    secure_link_groups,
)
from dpfed.common.synth.missing_cells import cells_schema
from dpfed.common.transport.protocol import Task
from tests.site_agent.test_secagg_synth import synth_counts_contribution
from tests.site_agent.test_synth_fine_release import largest_distance
from tests.site_agent.test_synth_handler import TableAccess, exact, neighbour

SCHEMA = Schema.from_toml("""
[[columns]]
name = "age"
type = "continuous"
min = 0
max = 100
integer = true
missing = "category"
[[columns]]
name = "lab"
type = "continuous"
min = -5
max = 5
missing = "category"
[[columns]]
name = "admitted"
type = "date"
min = 2020-01-01
max = 2020-12-31
missing = "category"
[[columns]]
name = "stage"
type = "ordinal"
levels = ["I", "II", "III"]
missing = "category"
[[columns]]
name = "ward"
type = "nominal"
categories = ["a", "b", "c"]
missing = "category"
[[columns]]
name = "sex"
type = "nominal"
categories = ["f", "m"]
""")
CELLS = cells_schema(SCHEMA)
N_BINS = 8
SITES = ["hospital-a", "hospital-b"]


def base_frame(n: int = 30, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({
        "age": rng.integers(0, 101, n).astype(float), "lab": rng.normal(0, 2, n).clip(-5, 5),
        "admitted": pd.Timestamp("2020-01-01") + pd.to_timedelta(rng.integers(0, 366, n), "D"),
        "stage": rng.choice(["I", "II", "III"], n), "ward": rng.choice(["a", "b", "c"], n),
        "sex": rng.choice(["f", "m"], n)}).astype(object)
    for name in ("age", "lab", "admitted", "stage", "ward"):  # some missing everywhere
        frame.loc[rng.random(n) < 0.2, name] = None
    return frame


#: Per column: missing, bounds (or far outside them), two interior values in different cells.
VALUES: dict[str, tuple[Any, ...]] = {
    "age": (None, 0.0, -1e9, 37.0, 64.0), "lab": (None, -5.0, 1e308, -2.5, 2.49),
    "admitted": (None, "2020-01-01", "2020-12-31", "2020-03-01", "2020-10-01"),
    "stage": (None, "I", "III", "II", "I"), "ward": (None, "a", "c", "b", "a"),
    "sex": ("f", "m", "f", "m", "f")}


def records() -> list[dict[str, Any]]:
    """Extreme records: every column's values in 25 combinations (each column shifted by its own
    step, so every pair of values of two columns meets), all missing and all interior among them.
    """
    k = len(VALUES["age"])
    return [{name: values[(i + step * j) % k] for j, (name, values) in enumerate(VALUES.items())}
            for i in range(k) for step in range(k)]


def job(**extra: object) -> dict[str, object]:
    return SynthParams.parse({"n_bins": N_BINS, "resolution": "fine", "missing_cells": True,
                              **extra}, SCHEMA).to_mapping()


def test_every_missing_category_column_gets_one_cell_and_no_other_column_does() -> None:
    plain = link_release.histogram_sizes(SCHEMA, N_BINS, "fine")
    cells = link_release.histogram_sizes(CELLS, N_BINS, "fine")
    assert [b - a for a, b in zip(plain, cells, strict=True)] == [1, 1, 1, 1, 1, 0]
    found = schema_cells(CELLS, N_BINS, "fine")
    assert found["age"].kind == "whole" and found["lab"].kind == "fine"
    assert found["admitted"].kind == "fine"
    for c in found.values():
        assert c.has_missing and np.isnan(c.lo[-1]) and c.coarse[-1] == c.n_coarse - 1
        assert c.codes(np.array([np.nan]))[0] == c.n_leaves - 1
        assert np.isnan(c.values(np.array([c.n_leaves - 1]), np.array([0.5]))[0])


# --------------------------------------------------------------------------- links, site level


def search_site_level() -> float:
    base = base_frame()
    task = Task("j/links", "j", "synth", 1.0, 1e-6,
                {**job(), "schema_digest": SCHEMA.digest(), "round": "links"})
    stats = [exact(task, TableAccess(neighbour(base, r), schema=SCHEMA))[3] for r in records()]
    weighted = [link_release.weighted_histograms(s, CELLS, N_BINS, "fine") for s in stats]
    return largest_distance(np.array(weighted))


def test_links_round_with_missing_cells_attains_and_never_exceeds_the_stated_sensitivity(
) -> None:
    stated = link_histogram_sensitivity(CELLS)
    assert stated == link_histogram_sensitivity(SCHEMA)  # one cell more, same sensitivity
    observed = search_site_level()
    assert observed <= stated * (1 + 1e-12)
    assert observed == pytest.approx(stated)  # a row moving from missing to a value, everywhere


def plant_missing_counted_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: a missing continuous value is also counted in its column's top cell."""
    real = link_release.release_counts

    def twice(cells: ColumnCells, leaves: np.ndarray) -> np.ndarray:
        out = real(cells, leaves)
        if cells.has_missing:
            out = out.copy()
            out[cells.n_value_coarse - 1] += leaves[-1]
        return out

    monkeypatch.setattr(link_release, "release_counts", twice)


def test_links_search_catches_missing_rows_counted_twice(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    plant_missing_counted_twice(monkeypatch)
    assert search_site_level() > link_histogram_sensitivity(CELLS) * 1.05


# --------------------------------------------------------------------------- links, secure sum


def counts_task() -> Task:
    return Task("j/links-sum-1", "j", "secagg", 1.0, 1e-6,
                {"stage": "contribute", "source": "synth_counts",
                 "job": job(aggregation="secure"), "schema_digest": SCHEMA.digest(),
                 "statistic": "weighted_counts", "scale": 1.0})


def secure_stats(frames: list[pd.DataFrame]) -> tuple[list[np.ndarray], Any]:
    stats, plan = [], None
    for frame in frames:
        given = synth_counts_contribution(counts_task(), TableAccess(frame, schema=SCHEMA),
                                          SITES, 0)
        plan = given.plan
        stat, n_rows = given.compute(np.random.default_rng(0))
        assert stat.dtype == np.int64 and n_rows == len(frame)
        stats.append(stat.astype(np.float64))
    return stats, plan


def test_secure_counts_with_missing_cells_attain_the_plans_bound() -> None:
    base = base_frame()
    stats, plan = secure_stats([neighbour(base, r) for r in records()])
    rows = np.array(stats)
    assert plan.dim == rows.shape[1] == sum(link_release.histogram_sizes(CELLS, N_BINS, "fine"))
    assert largest_distance(rows) == pytest.approx(plan.calibration.l2_sensitivity)
    assert largest_distance(rows) <= plan.calibration.l2_sensitivity * (1 + 1e-12)


def test_the_decoded_sum_check_accepts_missing_cells_and_catches_a_group_without_them() -> None:
    frames = [base_frame(seed=1), base_frame(seed=2)]
    stats, plan = secure_stats(frames)
    total = np.sum(stats, axis=0)
    n_rows = sum(len(f) for f in frames)
    groups, weights, partial = secure_link_groups(CELLS, N_BINS, "fine")
    check_decoded(total, plan, n_rows, groups=groups, weights=weights, partial=partial)
    # Planted bug: a plan whose coarse groups leave the missing cell out (the layout without
    # missing cells): the decoded sum is then refused, nothing published.
    plain_groups, plain_weights, plain_partial = secure_link_groups(SCHEMA, N_BINS, "fine")
    with pytest.raises(ImpossibleSumError):
        check_decoded(total, plan, n_rows, groups=plain_groups, weights=plain_weights,
                      partial=plain_partial)


# --------------------------------------------------------------------------- pair tables


def public_proportions() -> np.ndarray:
    sizes = link_release.histogram_sizes(CELLS, N_BINS, "fine")
    counts = np.full(sum(sizes), 30.0)
    sd = release_noise_sd(CELLS, N_BINS, 1.0, "fine")
    return proportions_from_histograms(counts, CELLS, N_BINS, n_rows=30.0 * 40,
                                       resolution="fine", noise_sd=sd)


EDGES = [[0, 1], [1, 2], [3, 4], [4, 5]]


def pair_tables_search() -> tuple[float, float]:
    props = public_proportions()
    p = {**job(), "schema_digest": SCHEMA.digest()}
    digest = links_digest(CELLS, props, N_BINS, "quantile", "fine")
    task = Task("j/pairs", "j", "synth", 1.0, 1e-6,
                {**p, "round": "pairs", "links_digest": digest, "pair_edges": EDGES},
                {"link_proportions": props})
    base = base_frame()
    stats = [np.asarray(exact(task, TableAccess(neighbour(base, r), schema=SCHEMA))[3][0],
                        dtype=np.float64) for r in records()]
    rows = np.array(stats)
    worst_entry = max(float(np.abs(rows - r).max()) for r in rows)
    return worst_entry, largest_distance(rows)


def test_pair_tables_with_missing_groups_attain_the_stated_bound() -> None:
    grid = pair_marginals.PairGrid.from_proportions(CELLS, public_proportions(), N_BINS, 6,
                                                    "fine")
    for j, col in enumerate(CELLS.columns):  # the missing cell is a group of its own
        if col.missing_cell:
            assert int((grid.groups[j] == grid.sizes[j] - 1).sum()) == 1
    worst_entry, worst_l2 = pair_tables_search()
    stated = pair_marginals.pair_table_mechanism(len(EDGES), 1.0, 1e-6).sensitivity
    assert stated == pytest.approx(math.sqrt(2 * len(EDGES)))
    assert worst_entry <= 1.0 and worst_l2 <= stated + 1e-9
    assert worst_l2 == pytest.approx(stated)


def test_pair_tables_search_catches_missing_rows_counted_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Planted bug: a missing value's row is counted in the missing group and in group 0.
    real_add = pair_marginals.PairTableAccumulator.add

    def twice(self: pair_marginals.PairTableAccumulator, table: Any) -> None:
        real_add(self, table)
        absent = np.zeros(table.n_rows, dtype=bool)
        for col in table.schema.columns:
            values = np.asarray(table.columns[col.name], dtype=np.float64)
            if col.missing_cell and col.type in ("continuous", "date"):
                absent |= np.isnan(values)
        if absent.any():
            n = self.n_rows
            filled = {k: np.where(np.isnan(v), 0.0, v) if v.dtype.kind == "f" else v
                      for k, v in table.columns.items()}
            real_add(self, type(table)(table.schema, {k: v[absent] for k, v in filled.items()},
                                       int(absent.sum())))
            self.n_rows = n

    monkeypatch.setattr(pair_marginals.PairTableAccumulator, "add", twice)
    _, worst_l2 = pair_tables_search()
    assert worst_l2 > math.sqrt(2 * len(EDGES)) * 1.05
