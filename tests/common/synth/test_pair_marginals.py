"""DP 2-way marginals of chosen pairs: sensitivities searched, noise measured, forest, correction.

Layers:

1. Worst-case searches (the method of ``tests/common/privacy/test_sensitivity_search.py``, whose
   record and pair helpers are reused): every extreme schema-valid record -- continuous
   columns at their bounds, quarter points and outside them (clipped by the encoding), every
   level and category -- through the site's own code (``PairGrid.fine_codes``/``group_codes``
   inside ``PairTableAccumulator``, ``dependence_scores``), for several ``pair_groups`` and
   schemas; the worst pairs are pushed as full neighbouring tables (same ``N_s``, one row
   replaced) through the real accumulation and the real mechanism with same-seed noise.
   Planted copies with the add/remove-style constants (1 per score, ``sqrt(K)`` per table set)
   must be caught.
2. The noise the two mechanisms add, tested against the replace-one sigma, and against a
   broken copy the same test must reject.
3. Post-processing: the forest is a maximum-weight forest (brute force), the raked tables are
   distributions with the DP margins, the correction makes a model sample's pair tables match
   their targets while keeping every value schema-valid, and its persisted form is checked.
4. The central API (``FactorModelSynthesizer``) runs the job's two pair releases.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import ContinuousColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.privacy.mechanisms import GaussianMechanism
from dpfed.common.synth import factor_model as fm
from dpfed.common.synth import pair_marginals as pm
from dpfed.common.synth.link_release import (
    LinkHistogramAccumulator,
    histogram_sizes,
    proportions_from_histograms,
)
from tests.common.privacy.test_sensitivity_search import REL, encoded, random_pairs, worst_pair
from tests.support.records import extreme_records
from tests.support.records import random_rows as base_rows
from tests.support.schemas import CONT_ORD, MIXED

BINS = 16
#: Rows of the adversarial neighbouring tables: enough that every cell of a 16 x 16 table
#: expects more than one row, so a record can move every score by the full 2.
N_ADVERSARIAL = 1000
N_RANDOM = 30
GROUPS = (2, pm.DEFAULT_GROUPS, pm.MAX_GROUPS)

WIDE = Schema.from_toml("""
[[columns]]
name = "dose"
type = "continuous"
min = 0
max = 5
[[columns]]
name = "stage"
type = "ordinal"
levels = ["1", "2", "3", "4", "5", "6", "7", "8", "9"]
[[columns]]
name = "site"
type = "nominal"
categories = ["lung", "liver", "skin", "bone", "brain"]
""")
SCHEMAS = {"cont_ord": CONT_ORD, "mixed": MIXED, "wide": WIDE}


# --------------------------------------------------------------------------- helpers


def public_proportions(schema: Schema, seed: int = 7) -> np.ndarray:
    """Link proportions standing in for the DP ones (public: fixed for both neighbours)."""
    table = encoded(schema, base_rows(schema, 400, seed))
    acc = LinkHistogramAccumulator(schema, BINS)
    acc.add(table)
    return proportions_from_histograms(acc.counts.astype(float), schema, BINS,
                                       n_rows=table.n_rows)


def site_counts(grid: pm.PairGrid, pairs: list[pm.Pair],
                frame: pd.DataFrame) -> tuple[np.ndarray, int]:
    """The site's exact tables of ``frame``: encoded and accumulated in chunks of 251 rows."""
    acc = pm.PairTableAccumulator(grid, pairs)
    for start in range(0, len(frame), 251):
        acc.add(encoded(grid.schema, frame.iloc[start:start + 251]))
    return acc.counts.copy(), acc.n_rows


def one_row_tables(grid: pm.PairGrid, pairs: list[pm.Pair], table: EncodedTable) -> np.ndarray:
    """Every record's own contribution to the tables (one accumulator per 1-row table)."""
    out = []
    for r in range(table.n_rows):
        acc = pm.PairTableAccumulator(grid, pairs)
        acc.add(EncodedTable(table.schema, {k: v[r:r + 1] for k, v in table.columns.items()}, 1))
        out.append(acc.counts.copy())
    return np.array(out)


def with_record(base: pd.DataFrame, records: pd.DataFrame, i: int) -> pd.DataFrame:
    return pd.concat([base, records.iloc[[i]]], ignore_index=True)


def tvd(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(np.asarray(a, float).ravel() - np.asarray(b, float).ravel()).sum())


# --------------------------------------------------------------------------- score search


class ScoreSearch(NamedTuple):
    worst: float  # largest change of one pair's score (L-infinity over pairs)
    worst_l2: float  # largest L2 change of the score vector
    worst_floored: float  # the same for the floored scores (the secure statistic)
    largest: float  # largest score seen (the secure bound is 2 N_s)
    n_rows: int
    n_pairs: int
    stated: float  # the L2 sensitivity the mechanism is calibrated to


def score_search(schema: Schema, groups: int, *, adversarial: bool,
                 verify: int = 2) -> ScoreSearch:
    props = public_proportions(schema)
    grid = pm.PairGrid.from_proportions(schema, props, BINS, groups)
    pairs = grid.candidate_pairs()
    records = extreme_records(schema)
    per_record = one_row_tables(grid, pairs, encoded(schema, records))
    if adversarial:
        # Every base row is record 0 (each column at its minimum / first level): its cell is
        # far above what independence expects, every other cell at or below it.
        n = N_ADVERSARIAL
        base = records.iloc[[0] * (n - 1)].reset_index(drop=True)
    else:
        n = N_RANDOM
        base = base_rows(schema, n - 1, seed=groups)
    base_counts, _ = site_counts(grid, pairs, base)
    scores = np.array([pm.dependence_scores(base_counts + c, grid, pairs, props, n)
                       for c in per_record])
    worst, i, j = worst_pair(scores, np.inf)
    worst_l2, k, m = worst_pair(scores, 2)
    worst_floored, _, _ = worst_pair(np.floor(scores), np.inf)
    mech = pm.score_mechanism(len(pairs), 1.0, 1e-6)
    for a, b in [(i, j), (k, m), *random_pairs(len(records), verify, seed=len(records))]:
        c1, n1 = site_counts(grid, pairs, with_record(base, records, a))
        c2, n2 = site_counts(grid, pairs, with_record(base, records, b))
        assert n1 == n2 == n  # N_s is the same for neighbours
        s1 = pm.dependence_scores(c1, grid, pairs, props, n1)
        s2 = pm.dependence_scores(c2, grid, pairs, props, n2)
        np.testing.assert_allclose(s1, scores[a], atol=1e-9)
        np.testing.assert_allclose(s2, scores[b], atol=1e-9)
        # The real release with same-seed noise: the difference is the statistic's.
        r1 = mech.release(s1, np.random.default_rng(5))
        r2 = mech.release(s2, np.random.default_rng(5))
        assert float(np.linalg.norm(r1 - r2)) == pytest.approx(
            float(np.linalg.norm(s1 - s2)), abs=1e-9)
    return ScoreSearch(worst, worst_l2, worst_floored, float(scores.max()), n, len(pairs),
                       mech.sensitivity)


@pytest.mark.parametrize("adversarial", [False, True])
@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("schema_name", sorted(SCHEMAS))
def test_score_change_never_exceeds_two_per_pair(schema_name: str, groups: int,
                                                 adversarial: bool) -> None:
    found = score_search(SCHEMAS[schema_name], groups, adversarial=adversarial)
    assert pm.SCORE_SENSITIVITY == 2.0
    assert found.stated == pytest.approx(2.0 * math.sqrt(found.n_pairs))
    assert found.worst <= 2.0 * (1 + REL)
    assert found.worst_l2 <= found.stated * (1 + REL)
    assert found.worst_floored <= 2.0  # flooring (secure sums) keeps the per-pair bound
    assert 0.0 <= found.largest <= 2.0 * found.n_rows  # the secure statistic's range
    if adversarial:
        # Tight: one record adds to the over-full cell of every pair, another, different in
        # every column's group, to a cell that expects more than one row and has none.
        assert found.worst == pytest.approx(2.0, rel=1e-9)
        assert found.worst_l2 == pytest.approx(found.stated, rel=1e-9)
        assert found.worst_floored == 2.0
    else:
        assert found.worst > 1.0  # a random table already moves a score by more than 1


def test_planted_add_remove_score_constant_fails_the_search(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # One per score (the add/remove figure): the search must find a change beyond it.
    monkeypatch.setattr(pm, "SCORE_SENSITIVITY", 1.0)
    found = score_search(MIXED, pm.DEFAULT_GROUPS, adversarial=True, verify=0)
    assert found.stated == pytest.approx(math.sqrt(found.n_pairs))
    assert found.worst_l2 > found.stated * 1.9


# --------------------------------------------------------------------------- table search


def table_search(schema: Schema, groups: int, which: str,
                 verify: int = 2) -> tuple[float, float, float, int]:
    """Return (worst L2 change of the K tables, worst L1 change, stated L2, K)."""
    props = public_proportions(schema)
    grid = pm.PairGrid.from_proportions(schema, props, BINS, groups)
    candidates = grid.candidate_pairs()
    if which == "candidates":
        pairs = candidates
    else:  # a forest as the coordinator picks it: (parent, child), parents first
        scores = np.random.default_rng(groups).uniform(0, 10, len(candidates))
        pairs = pm.choose_forest(scores, candidates, len(schema.columns), len(schema.columns))
    records = extreme_records(schema)
    per_record = one_row_tables(grid, pairs, encoded(schema, records))
    assert np.all((per_record == 0) | (per_record == 1))
    assert np.all(per_record.sum(axis=1) == len(pairs))  # one cell per table per row
    # One-hot blocks: ||c_i - c_j||^2 = |c_i|^2 + |c_j|^2 - 2 c_i.c_j, exact in integers, and
    # the L1 change equals it (every entry of c_i - c_j is -1, 0 or 1).
    gram = per_record @ per_record.T
    squared = np.diag(gram)[:, None] + np.diag(gram)[None, :] - 2 * gram
    i, j = divmod(int(np.argmax(squared)), squared.shape[1])
    worst_l2, worst_l1 = math.sqrt(float(squared[i, j])), float(squared[i, j])
    mech = pm.pair_table_mechanism(len(pairs), 1.0, 1e-6)
    base = base_rows(schema, N_RANDOM - 1, seed=3)
    for a, b in [(i, j), *random_pairs(len(records), verify, seed=len(records))]:
        c1, n1 = site_counts(grid, pairs, with_record(base, records, a))
        c2, n2 = site_counts(grid, pairs, with_record(base, records, b))
        assert n1 == n2 == N_RANDOM
        np.testing.assert_array_equal(c1 - c2, per_record[a] - per_record[b])
        assert float(np.abs(c1 - c2).sum()) == squared[a, b]
        r1 = mech.release(c1, np.random.default_rng(6))
        r2 = mech.release(c2, np.random.default_rng(6))
        assert float(np.linalg.norm(r1 - r2)) == pytest.approx(math.sqrt(squared[a, b]),
                                                               abs=1e-9)
    return worst_l2, worst_l1, mech.sensitivity, len(pairs)


@pytest.mark.parametrize("which", ["candidates", "forest"])
@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("schema_name", sorted(SCHEMAS))
def test_pair_tables_change_attains_and_never_exceeds_sqrt_2k(schema_name: str, groups: int,
                                                              which: str) -> None:
    worst_l2, worst_l1, stated, k = table_search(SCHEMAS[schema_name], groups, which)
    assert stated == pytest.approx(math.sqrt(2 * k))
    assert worst_l2 <= stated * (1 + REL)
    # Tight: a record at every minimum vs one at every maximum differ in every table's cell.
    assert worst_l2 == pytest.approx(stated, rel=1e-12)
    assert worst_l1 == 2 * k  # L1 2K, the counts statistic of secure aggregation with C = K
    assert worst_l2 > math.sqrt(k) * 1.4  # the add/remove figure sqrt(K) is exceeded


def test_planted_add_remove_table_calibration_fails_the_search(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def add_remove(n_pairs: int, epsilon: float, delta: float) -> GaussianMechanism:
        return GaussianMechanism(epsilon, delta, math.sqrt(n_pairs))  # one row added

    monkeypatch.setattr(pm, "pair_table_mechanism", add_remove)
    worst_l2, _, stated, k = table_search(MIXED, pm.DEFAULT_GROUPS, "candidates", verify=0)
    assert stated == pytest.approx(math.sqrt(k))
    assert worst_l2 > stated * 1.4


# --------------------------------------------------------------------------- noise


def noise_matches(noise: np.ndarray, sigma: float) -> bool:
    """Two-sided chi-square test of the pooled variance and a z-test of the mean."""
    dof = noise.size
    stat = float((noise ** 2).sum()) / sigma ** 2
    z = float(noise.mean()) / (sigma / math.sqrt(dof))
    return bool(stats.chi2.sf(stat, dof) > 1e-4 and stats.chi2.cdf(stat, dof) > 1e-4
                and abs(z) < 4.0)


def exact_scores_and_tables() -> tuple[np.ndarray, np.ndarray, int, int]:
    """Real scores (P candidate pairs) and tables (a forest of K pairs) of a random table."""
    props = public_proportions(MIXED)
    grid = pm.PairGrid.from_proportions(MIXED, props, BINS, pm.DEFAULT_GROUPS)
    pairs = grid.candidate_pairs()
    frame = base_rows(MIXED, 500, seed=4)
    counts, n = site_counts(grid, pairs, frame)
    scores = pm.dependence_scores(counts, grid, pairs, props, n)
    edges = pm.choose_forest(scores, pairs, len(MIXED.columns), 3)
    tables, _ = site_counts(grid, edges, frame)
    return scores, tables.astype(float), len(pairs), len(edges)


def test_score_noise_has_the_replace_one_sigma_and_a_broken_copy_is_caught() -> None:
    scores, _, p, _ = exact_scores_and_tables()
    eps, delta = 0.5, 1e-6
    # The sigma of the replace-one sensitivity, computed here from its derivation.
    sigma = GaussianMechanism(eps, delta, 2.0 * math.sqrt(p)).sigma
    mech = pm.score_mechanism(p, eps, delta)
    rng = np.random.default_rng(21)
    noise = np.stack([mech.release(scores, rng) for _ in range(500)]) - scores
    assert noise_matches(noise, sigma)
    assert mech.cost().sensitivity == pytest.approx(2.0 * math.sqrt(p))
    # Broken copy: 1 per score (sensitivity sqrt(P)), half the noise: the test rejects it.
    broken = GaussianMechanism(eps, delta, math.sqrt(p))
    assert not noise_matches(np.stack([broken.release(scores, rng) for _ in range(500)])
                             - scores, sigma)


def test_table_noise_has_the_replace_one_sigma_and_a_broken_copy_is_caught() -> None:
    _, tables, _, k = exact_scores_and_tables()
    eps, delta = 0.8, 1e-6
    sigma = GaussianMechanism(eps, delta, math.sqrt(2.0 * k)).sigma
    mech = pm.pair_table_mechanism(k, eps, delta)
    rng = np.random.default_rng(22)
    noise = np.stack([mech.release(tables, rng) for _ in range(200)]) - tables
    assert noise_matches(noise, sigma)
    # Broken copy: sqrt(K) (one count up per table, the add/remove figure).
    broken = GaussianMechanism(eps, delta, math.sqrt(k))
    assert not noise_matches(np.stack([broken.release(tables, rng) for _ in range(200)])
                             - tables, sigma)


def test_mechanisms_validate_their_pair_counts() -> None:
    for make in (pm.score_mechanism, pm.pair_table_mechanism):
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValidationError, match="number of pairs"):
                make(bad, 1.0, 1e-6)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- forest


def is_forest(edges: list[pm.Pair], d: int) -> bool:
    parent = list(range(d))

    def root(x: int) -> int:
        while parent[x] != x:
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = root(a), root(b)
        if ra == rb:
            return False
        parent[ra] = rb
    return True


def brute_force_forest(scores: np.ndarray, pairs: list[pm.Pair], d: int,
                       k: int) -> tuple[float, set[frozenset[int]]]:
    """Best total score over the forests of min(k, largest forest) candidate edges."""
    largest = max(m for m in range(len(pairs) + 1)
                  for combo in itertools.combinations(range(len(pairs)), m)
                  if is_forest([pairs[i] for i in combo], d)) if len(pairs) <= 10 else d - 1
    size = min(k, largest)
    best, chosen = -math.inf, set()
    for combo in itertools.combinations(range(len(pairs)), size):
        if is_forest([pairs[i] for i in combo], d):
            total = float(scores[list(combo)].sum())
            if total > best:
                best, chosen = total, {frozenset(pairs[i]) for i in combo}
    return best, chosen


def check_orientation(edges: list[pm.Pair]) -> None:
    """Each column child at most once, every parent a root or an earlier edge's child."""
    children = [b for _, b in edges]
    assert len(set(children)) == len(children)
    for i, (a, _) in enumerate(edges):
        assert a not in children[i:]
    if edges:
        assert pm.check_edges(edges, 1 + max(max(e) for e in edges)) == edges


@pytest.mark.parametrize("seed", range(6))
def test_choose_forest_is_a_maximum_weight_forest(seed: int) -> None:
    rng = np.random.default_rng(seed)
    d = 5 if seed % 2 else 6
    pairs = list(itertools.combinations(range(d), 2))
    if seed >= 3:  # a sparser candidate set (some tables too large to be candidates)
        keep = rng.random(len(pairs)) < 0.6
        pairs = [p for p, kept in zip(pairs, keep, strict=True) if kept]
    # Noisy scores can be negative: a spanning forest still takes the best edges.
    scores = rng.normal(5.0, 4.0, len(pairs))
    index = {frozenset(p): i for i, p in enumerate(pairs)}
    for k in range(d + 1):
        edges = pm.choose_forest(scores, pairs, d, k)
        assert len(edges) <= k and is_forest(edges, d)
        assert all(frozenset(e) in index for e in edges)
        check_orientation(edges)
        best, chosen = brute_force_forest(scores, pairs, d, k)
        total = float(sum(scores[index[frozenset(e)]] for e in edges))
        assert total == pytest.approx(best, abs=1e-9)
        assert {frozenset(e) for e in edges} == chosen  # continuous scores: a unique optimum


def test_choose_forest_orients_trees_from_their_hub() -> None:
    # A star around column 2 plus an edge 0-4: 2 is the parent of its three leaves, first.
    pairs = [(0, 2), (1, 2), (2, 3), (0, 4), (1, 4)]
    edges = pm.choose_forest(np.array([9.0, 8.0, 7.0, 6.0, -1.0]), pairs, 5, 10)
    assert edges[:3] == [(2, 0), (2, 1), (2, 3)]
    assert edges[3] == (0, 4)
    check_orientation(edges)
    assert pm.choose_forest(np.array([9.0, 8.0, 7.0, 6.0, -1.0]), pairs, 5, 0) == []


@pytest.mark.parametrize("kwargs, match", [
    ({"scores": np.ones(2)}, "3 pair scores"),
    ({"scores": np.array([1.0, np.nan, 2.0])}, "pair scores"),
    ({"scores": np.array([1.0, np.inf, 2.0])}, "pair scores"),
    ({"scores": np.ones((3, 1))}, "pair scores"),
    ({"pairs": [(0, 1), (1, 0), (1, 2)]}, "distinct"),
    ({"pairs": [(0, 0), (0, 1), (1, 2)]}, "distinct"),
    ({"pairs": [(0, 1), (0, 3), (1, 2)]}, "pair column"),
    ({"pairs": [(0, 1), (0, -1), (1, 2)]}, "pair column"),
    ({"pairs": [(0, 1), (0, 1.5), (1, 2)]}, "pair column"),
    ({"pairs": [(0, 1, 2), (0, 2), (1, 2)]}, "two indices"),
    ({"pairs": [5, (0, 2), (1, 2)]}, "two indices"),
    ({"n_columns": 1}, "number of columns"),
    ({"max_pairs": -1}, "pairs"),
    ({"max_pairs": True}, "pairs"),
])
def test_choose_forest_rejects_bad_input(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"scores": np.array([3.0, 2.0, 1.0]),
                            "pairs": [(0, 1), (0, 2), (1, 2)], "n_columns": 3, "max_pairs": 2}
    args.update(kwargs)
    with pytest.raises(ValidationError, match=match):
        pm.choose_forest(**args)


def test_check_edges_refuses_a_second_parent_and_children_first() -> None:
    assert pm.check_edges([(0, 1), (1, 2), (0, 3)], 4) == [(0, 1), (1, 2), (0, 3)]
    with pytest.raises(ValidationError, match="child of two"):
        pm.check_edges([(0, 2), (1, 2)], 3)
    with pytest.raises(ValidationError, match="parents first"):
        pm.check_edges([(1, 2), (0, 1)], 3)


# --------------------------------------------------------------------------- fit_pair_tables


def grid_and_edges(schema: Schema = MIXED,
                   groups: int = pm.DEFAULT_GROUPS) -> tuple[np.ndarray, pm.PairGrid,
                                                             list[pm.Pair]]:
    props = public_proportions(schema)
    grid = pm.PairGrid.from_proportions(schema, props, BINS, groups)
    cands = grid.candidate_pairs()
    scores = np.arange(len(cands), dtype=float)
    return props, grid, pm.choose_forest(scores, cands, len(schema.columns), len(cands))


def check_fitted(joints: list[np.ndarray], grid: pm.PairGrid, edges: list[pm.Pair],
                 props: np.ndarray, atol: float = 1e-9) -> None:
    marg = grid.group_proportions(props)
    for (a, b), joint in zip(edges, joints, strict=True):
        assert joint.shape == (grid.sizes[a], grid.sizes[b])
        assert joint.min() >= 0.0
        assert float(joint.sum()) == pytest.approx(1.0, abs=1e-12)
        np.testing.assert_allclose(joint.sum(axis=1), marg[a], atol=atol)
        np.testing.assert_allclose(joint.sum(axis=0), marg[b], atol=atol)


@pytest.mark.parametrize("sigma", [0.0, 5.0, 60.0, 600.0])
def test_fit_pair_tables_projects_and_rakes_to_the_dp_margins(sigma: float) -> None:
    props, grid, edges = grid_and_edges()
    frame = base_rows(MIXED, 600, seed=8)
    exact, n = site_counts(grid, edges, frame)
    for seed in range(5):
        noisy = exact + np.random.default_rng(seed).normal(0.0, sigma, exact.size)
        if sigma > 0:
            assert noisy.min() < 0 or sigma < 10  # large noise: negative counts to project
        check_fitted(pm.fit_pair_tables(noisy, grid, edges, props, n), grid, edges, props)


def test_fit_pair_tables_keeps_the_data_when_the_margins_agree() -> None:
    # Noise-free tables and the table's own proportions: raking has nothing to change.
    frame = base_rows(MIXED, 3000, seed=9)
    table = encoded(MIXED, frame)
    acc = LinkHistogramAccumulator(MIXED, BINS)
    acc.add(table)
    props = proportions_from_histograms(acc.counts.astype(float), MIXED, BINS,
                                        n_rows=table.n_rows)
    grid = pm.PairGrid.from_proportions(MIXED, props, BINS, pm.DEFAULT_GROUPS)
    edges = [(0, 1), (0, 3), (1, 2)]
    exact, n = site_counts(grid, edges, frame)
    joints = pm.fit_pair_tables(exact.astype(float), grid, edges, props, n)
    for joint, counts in zip(joints, pm.split_tables(exact, [grid.cells(e) for e in edges]),
                             strict=True):
        np.testing.assert_allclose(joint.ravel(), counts / n, atol=1e-3)


def test_fit_pair_tables_reaches_margins_the_projection_emptied(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # One huge cell, every other one negative: the projection leaves a point mass, whose
    # other rows and columns raking alone can never fill.
    props, grid, edges = grid_and_edges()
    cells = [grid.cells(e) for e in edges]
    noisy = np.full(sum(cells), -40.0)
    noisy[np.cumsum([0, *cells[:-1]])] = 500.0
    check_fitted(pm.fit_pair_tables(noisy, grid, edges, props, 500), grid, edges, props)
    # The broken copy (no independence mass before raking) misses the margins.
    monkeypatch.setattr(pm, "INDEPENDENCE_WEIGHT", 0.0)
    with pytest.raises(AssertionError):
        check_fitted(pm.fit_pair_tables(noisy, grid, edges, props, 500), grid, edges, props)


def test_fit_pair_tables_rejects_bad_input() -> None:
    props, grid, edges = grid_and_edges()
    size = sum(grid.cells(e) for e in edges)
    good = np.ones(size)
    for bad in (np.ones(size - 1), np.ones(size + 1), np.ones((size, 1))):
        with pytest.raises(ValidationError, match="pair tables"):
            pm.fit_pair_tables(bad, grid, edges, props, 100)
    for value in (np.nan, np.inf, -np.inf):
        poisoned = good.copy()
        poisoned[3] = value
        with pytest.raises(ValidationError, match="pair tables"):
            pm.fit_pair_tables(poisoned, grid, edges, props, 100)
    with pytest.raises(ValidationError, match="distinct"):
        pm.fit_pair_tables(good, grid, [*edges[:-1], edges[0]], props, 100)
    with pytest.raises(ValidationError):
        pm.fit_pair_tables(good, grid, edges, props, 0)
    with pytest.raises(ValidationError):
        pm.fit_pair_tables(good, grid, edges, props[:-1], 100)


def test_grid_groups_are_about_equally_likely_and_validated() -> None:
    props = public_proportions(WIDE)
    for groups in GROUPS:
        grid = pm.PairGrid.from_proportions(WIDE, props, BINS, groups)
        assert grid.sizes[0] == min(groups, BINS) and grid.sizes[2] == 5  # nominal: kept
        assert grid.sizes[1] == min(groups, 9)
        for m in grid.groups[:2]:  # ordered columns: groups are contiguous runs
            assert np.all(np.diff(m) >= 0) and m[0] == 0
        marg = grid.group_proportions(props)
        assert all(float(p.sum()) == pytest.approx(1.0) for p in marg)
        if groups == 2:
            assert marg[0].max() < 0.7  # the cut is at the DP median, not mid-range
    for bad in (1, 65, 2.5, True):
        with pytest.raises(ValidationError, match="pair_groups"):
            pm.PairGrid.from_proportions(WIDE, props, BINS, bad)  # type: ignore[arg-type]
    other = pm.PairGrid.from_proportions(MIXED, public_proportions(MIXED), BINS)
    with pytest.raises(ValidationError, match="different schema"):
        other.fine_codes(encoded(WIDE, base_rows(WIDE, 3, 0)))


def test_candidate_pairs_leave_out_tables_over_the_cell_limit() -> None:
    wide_nominal = Schema.from_dict({"columns": [
        {"name": "a", "type": "nominal", "categories": [f"a{i}" for i in range(70)]},
        {"name": "b", "type": "nominal", "categories": [f"b{i}" for i in range(70)]},
        {"name": "c", "type": "ordinal", "levels": ["x", "y", "z"]}]})
    props = np.concatenate([np.full(70, 1 / 70), np.full(70, 1 / 70), np.full(3, 1 / 3)])
    grid = pm.PairGrid.from_proportions(wide_nominal, props, BINS)
    assert grid.cells((0, 1)) == 4900 > pm.MAX_PAIR_CELLS
    assert grid.candidate_pairs() == [(0, 2), (1, 2)]


# --------------------------------------------------------------------------- correction

CAUSE = Schema.from_dict({"columns": [
    {"name": "year", "type": "continuous", "min": 0, "max": 10},
    {"name": "futime", "type": "continuous", "min": 0, "max": 20},
    {"name": "death", "type": "nominal", "categories": ["0", "1"]},
    {"name": "chapter", "type": "nominal", "categories": ["none", "circ", "neo", "resp"]},
    {"name": "grade", "type": "ordinal", "levels": ["1", "2", "3", "4", "5", "6", "7", "8"]},
]})


def cause_frame(n: int, seed: int) -> pd.DataFrame:
    """Pairs a Gaussian copula cannot hold: a cause only for the dead, futime <= 20 - 2 year."""
    r = np.random.default_rng(seed)
    year = r.uniform(0, 10, n)
    death = (r.random(n) < 0.25 + 0.04 * year).astype(int)
    chapter = np.where(death == 1, r.choice([1, 2, 3], n, p=[0.5, 0.3, 0.2]), 0)
    grade = np.clip(np.round(0.7 * year + r.normal(0, 1, n)), 0, 7).astype(int)
    return pd.DataFrame({
        "year": year, "futime": (20 - 2 * year) * r.beta(2, 1, n),
        "death": np.array(["0", "1"])[death],
        "chapter": np.array(["none", "circ", "neo", "resp"])[chapter],
        "grade": np.array(list("12345678"))[grade]})


class Fitted(NamedTuple):
    synth: fm.FactorModelSynthesizer  # the factor model alone (pairs=0)
    props: np.ndarray
    grid: pm.PairGrid
    edges: list[pm.Pair]
    tables: list[np.ndarray]  # the real data's pair tables (noise-free targets)


@pytest.fixture(scope="module")
def fitted() -> Fitted:
    real = cause_frame(20_000, 1)
    synth = fm.FactorModelSynthesizer(CAUSE, epsilon=1e3, n_bins=BINS, pairs=0,
                                      rng=np.random.default_rng(2)).fit(real)
    assert synth.proportions_ is not None
    props = synth.proportions_
    grid = pm.PairGrid.from_proportions(CAUSE, props, BINS, resolution=synth.resolution)
    cands = grid.candidate_pairs()
    counts, n = site_counts(grid, cands, real)
    scores = pm.dependence_scores(counts, grid, cands, props, n)
    edges = pm.choose_forest(scores, cands, len(CAUSE.columns), len(CAUSE.columns) - 1)
    exact, _ = site_counts(grid, edges, real)
    tables = pm.fit_pair_tables(exact.astype(float), grid, edges, props, n)
    return Fitted(synth, props, grid, edges, tables)


def model_rows(f: Fitted, n: int) -> EncodedTable:
    return f.synth.sample_encoded(n)


def pair_tvds(f: Fitted, table: EncodedTable) -> list[float]:
    acc = pm.PairTableAccumulator(f.grid, f.edges)
    acc.add(table)
    return [tvd(t / table.n_rows, target) for t, target in zip(acc.tables(), f.tables,
                                                               strict=True)]


def test_correction_makes_a_model_sample_match_the_pair_tables(fitted: Fitted) -> None:
    f = fitted
    assert len(f.edges) == len(CAUSE.columns) - 1
    correction = pm.PairCorrection.fit(f.grid, f.edges, f.tables, model_rows(f, 200_000),
                                       f.props, np.random.default_rng(3))
    assert correction.edges == f.edges
    fresh = model_rows(f, 200_000)
    before = pair_tvds(f, fresh)
    out = correction.apply(fresh, np.random.default_rng(4))
    after = pair_tvds(f, out)
    # The factor model misses some of these pairs badly; the corrected rows match every
    # pair table up to sampling error (a few thousandths on 200 000 rows).
    assert max(before) > 0.1, before
    assert max(after) < 0.012, after
    # Structural zero: no cause of death for the living, although the model invents some.
    died = out.columns["death"] == 1
    assert (fresh.columns["chapter"][~(fresh.columns["death"] == 1)] > 0).mean() > 0.05
    assert (out.columns["chapter"][~died] > 0).mean() < 0.01
    # Every value stays schema-valid; a column no edge has as child is never touched.
    children = {b for _, b in f.edges}
    for j, col in enumerate(CAUSE.columns):
        values = out.columns[col.name]
        assert values.dtype == fresh.columns[col.name].dtype
        if isinstance(col, ContinuousColumn):
            assert np.all((values >= col.min) & (values <= col.max))
        else:
            size = histogram_sizes(CAUSE, BINS)[j]
            assert values.min() >= 0 and values.max() < size
        if j not in children:
            np.testing.assert_array_equal(values, fresh.columns[col.name])
    # Rows whose child cell is already right are kept: most rows keep most of their values.
    changed = np.zeros(out.n_rows, dtype=bool)
    for j in children:
        changed |= out.columns[CAUSE.columns[j].name] != fresh.columns[CAUSE.columns[j].name]
    assert changed.mean() < 0.7


def test_correction_is_deterministic_and_its_arrays_round_trip(fitted: Fitted) -> None:
    f = fitted
    calibration = model_rows(f, 20_000)
    correction = pm.PairCorrection.fit(f.grid, f.edges, f.tables, calibration, f.props,
                                       np.random.default_rng(5))
    again = pm.PairCorrection.fit(f.grid, f.edges, f.tables, calibration, f.props,
                                  np.random.default_rng(5))
    sample = model_rows(f, 5000)
    a = correction.apply(sample, np.random.default_rng(6))
    b = correction.apply(sample, np.random.default_rng(6))
    for name in CAUSE.names:
        np.testing.assert_array_equal(a.columns[name], b.columns[name])
    arrays = correction.arrays()
    assert set(arrays) == {"pair_edges", "pair_move", "pair_dest"}
    assert np.all((arrays["pair_move"] >= 0) & (arrays["pair_move"] <= 1))
    back = pm.PairCorrection.from_arrays(f.grid, arrays, f.props)
    assert back.edges == correction.edges
    for name, value in back.arrays().items():
        np.testing.assert_array_equal(value, arrays[name])
    c = back.apply(sample, np.random.default_rng(6))
    for name in CAUSE.names:
        np.testing.assert_array_equal(a.columns[name], c.columns[name])
    # The same generator: the same steps (the fit is a function of the rng and the model).
    for name, value in again.arrays().items():
        np.testing.assert_array_equal(value, arrays[name])
    # No steps: the table comes back as it was, and so do the arrays.
    empty = pm.PairCorrection.from_arrays(f.grid, {}, f.props)
    assert empty.apply(sample, np.random.default_rng(0)) is sample
    assert empty.arrays()["pair_edges"].shape == (0, 2)


def tampered(arrays: dict[str, np.ndarray], key: str, value: Any) -> dict[str, np.ndarray]:
    out = {k: v.copy() for k, v in arrays.items()}
    if value is None:
        del out[key]
    else:
        out[key] = value
    return out


def test_correction_arrays_from_a_file_are_checked(fitted: Fitted) -> None:
    f = fitted
    arrays = pm.PairCorrection.fit(f.grid, f.edges, f.tables, model_rows(f, 5000), f.props,
                                   np.random.default_rng(7)).arrays()
    move, dest, edges = arrays["pair_move"], arrays["pair_dest"], arrays["pair_edges"]

    def poked(a: np.ndarray, i: int, v: float) -> np.ndarray:
        b = a.copy()
        b[i] = v
        return b

    bad = [
        ("pair_move", poked(move, 0, 1.5), "out of range"),
        ("pair_move", poked(move, 2, -0.1), "out of range"),
        ("pair_move", poked(move, 1, np.nan), "pair_move"),
        ("pair_move", move[:-1], "cells"),
        ("pair_move", np.concatenate([move, [0.0]]), "cells"),
        ("pair_move", move.reshape(1, -1), "pair_move"),
        ("pair_move", None, "pair_move"),
        ("pair_dest", poked(dest, 0, -1.0), "out of range"),
        ("pair_dest", poked(dest, 0, np.inf), "pair_dest"),
        ("pair_dest", dest[1:], "cells"),
        ("pair_edges", edges[::-1].copy(), "parents first|child of two"),
        ("pair_edges", np.array([[0, 1], [2, 1], [1, 3], [1, 4]]), "child of two"),
        ("pair_edges", np.array([[0, 9], [0, 2], [0, 3], [0, 4]]), "pair column"),
        ("pair_edges", np.array([[0, 0], [0, 2], [0, 3], [0, 4]]), "distinct"),
        ("pair_edges", edges.ravel(), "shape"),
        ("pair_edges", edges[:, :1].copy(), "shape"),
    ]
    for key, value, match in bad:
        with pytest.raises(ValidationError, match=match):
            pm.PairCorrection.from_arrays(f.grid, tampered(arrays, key, value), f.props)


def test_correction_fit_rejects_bad_targets(fitted: Fitted) -> None:
    f = fitted
    cal = model_rows(f, 2000)
    rng = np.random.default_rng(8)
    with pytest.raises(ValidationError, match="edges but"):
        pm.PairCorrection.fit(f.grid, f.edges, f.tables[:-1], cal, f.props, rng)
    with pytest.raises(ValidationError, match="shape"):
        pm.PairCorrection.fit(f.grid, f.edges, [t.T for t in f.tables], cal, f.props, rng)
    with pytest.raises(ValidationError, match="child of two"):
        pm.PairCorrection.fit(f.grid, [(0, 1), (2, 1)], f.tables[:2], cal, f.props, rng)
    with pytest.raises(ValidationError, match="different schema"):
        pm.PairCorrection.fit(f.grid, f.edges, f.tables, encoded(WIDE, base_rows(WIDE, 5, 0)),
                              f.props, rng)


# --------------------------------------------------------------------------- central API


def test_central_synthesizer_makes_the_two_pair_releases(fitted: Fitted) -> None:
    real = cause_frame(20_000, 1)
    with_pairs = fm.FactorModelSynthesizer(CAUSE, epsilon=1e3, n_bins=BINS,
                                           rng=np.random.default_rng(2)).fit(real)
    d = len(CAUSE.columns)
    assert with_pairs.pairs == d - 1 and with_pairs.pair_groups == pm.DEFAULT_GROUPS
    grid = with_pairs.pair_grid_
    assert grid is not None and with_pairs.pair_correction_ is not None
    p, k = len(grid.candidate_pairs()), len(with_pairs.pair_edges_)
    assert k == d - 1 and pm.check_edges(with_pairs.pair_edges_, d)
    costs = with_pairs.privacy_costs_
    assert costs["pair_scores"].sensitivity == pytest.approx(2 * math.sqrt(p))
    assert costs["pairs"].sensitivity == pytest.approx(math.sqrt(2 * k))
    assert costs["pair_scores"].epsilon == pytest.approx(0.03e3)
    assert costs["pairs"].epsilon == pytest.approx(0.12e3)
    assert with_pairs.privacy_cost_.epsilon == pytest.approx(1e3)
    assert with_pairs.privacy_cost_.delta == pytest.approx(1e-6)
    # The sample carries the pair tables the factor model alone misses.
    f = fitted._replace(grid=grid, edges=with_pairs.pair_edges_)
    exact, n = site_counts(grid, f.edges, real)
    f = f._replace(tables=pm.fit_pair_tables(exact.astype(float), grid, f.edges, f.props, n))
    mine = pair_tvds(f, with_pairs.sample_encoded(100_000))
    plain = pair_tvds(f, fitted.synth.sample_encoded(100_000))
    assert max(mine) < 0.03 and max(plain) > 0.1, (mine, plain)
    # Sampling stays post-processing.
    before = with_pairs.privacy_cost_
    with_pairs.sample(10)
    assert with_pairs.privacy_cost_ == before


def test_central_pairs_parameters_are_validated() -> None:
    with pytest.raises(ValidationError, match="pairs=2"):
        fm.FactorModelSynthesizer(CAUSE, epsilon=1.0, mode="row_aligned", pairs=2)
    assert fm.FactorModelSynthesizer(CAUSE, epsilon=1.0, mode="row_aligned").pairs == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValidationError, match="pairs"):
            fm.FactorModelSynthesizer(CAUSE, epsilon=1.0, pairs=bad)  # type: ignore[arg-type]
    for bad in (1, 65):
        with pytest.raises(ValidationError, match="pair_groups"):
            fm.FactorModelSynthesizer(CAUSE, epsilon=1.0, pair_groups=bad)
    # A split written before the pair rounds keeps its meaning; naming them turns them on.
    old = fm.FactorModelSynthesizer(CAUSE, epsilon=1.0, budget_split={"marginals": 0.8,
                                                                      "pca": 0.2})
    assert old.pairs == 0
    named = fm.FactorModelSynthesizer(CAUSE, epsilon=1.0, budget_split={
        "marginals": 0.5, "pca": 0.2, "pair_scores": 0.1, "pairs": 0.2})
    assert named.pairs == len(CAUSE.columns) - 1
    with pytest.raises(ValidationError, match="pair_scores"):
        fm.FactorModelSynthesizer(CAUSE, epsilon=1.0, pairs=2,
                                  budget_split={"marginals": 0.8, "pca": 0.2}).fit(
            cause_frame(300, 0))
    one = Schema.from_dict({"columns": [{"name": "x", "type": "continuous", "min": 0,
                                         "max": 1}]})
    assert fm.FactorModelSynthesizer(one, epsilon=1.0).pairs == 0
    with pytest.raises(ValidationError, match="two"):
        fm.FactorModelSynthesizer(one, epsilon=1.0, pairs=1)
    assert fm.PAIRS_BUDGET_SPLIT == {"marginals": 0.6, "pca": 0.25, "pair_scores": 0.03,
                                     "pairs": 0.12}


# --------------------------------------------------------------------------- shrinkage


def noisy_copy(table: np.ndarray, sd: float, seed: int) -> np.ndarray:
    return table + np.random.default_rng(seed).normal(0.0, sd, table.shape)


def test_shrunk_target_keeps_real_differences_and_drops_noise() -> None:
    rng = np.random.default_rng(30)
    model = rng.dirichlet(np.ones(24)).reshape(4, 6)
    far = rng.dirichlet(np.ones(24)).reshape(4, 6)  # a pair the model misses
    sd = 0.002
    np.testing.assert_array_equal(pm.shrunk_target(far, model, 0.0), far)
    kept_noise, raw_noise = [], []
    for seed in range(40):
        # The model already right: only noise differs, and the target returns to the model
        # (all the way whenever the difference is within what the noise explains).
        same = pm.shrunk_target(noisy_copy(model, sd, seed), model, sd)
        assert same.min() >= 0 and float(same.sum()) == pytest.approx(1.0)
        kept_noise.append(tvd(same, model))
        raw_noise.append(tvd(noisy_copy(model, sd, seed), model))
        # A real difference far above the noise is kept.
        released = noisy_copy(far, sd, seed)
        kept = pm.shrunk_target(released, model, sd)
        clipped = np.clip(released, 0.0, None)
        assert tvd(kept, clipped / clipped.sum()) < 0.002
        assert tvd(kept, model) > 0.8 * tvd(far, model)
    assert np.mean(kept_noise) < 0.3 * np.mean(raw_noise)
    assert np.mean(np.array(kept_noise) == 0.0) > 0.3


def test_shrinkage_lowers_the_error_where_the_difference_is_near_the_noise() -> None:
    rng = np.random.default_rng(31)
    model = rng.dirichlet(np.full(36, 5.0)).reshape(6, 6)
    other = rng.dirichlet(np.full(36, 5.0)).reshape(6, 6)
    sd = 0.004

    def mse(truth: np.ndarray, noise_sd: float) -> float:
        return float(np.mean([((pm.shrunk_target(noisy_copy(truth, sd, s), model, noise_sd)
                                - truth) ** 2).sum() for s in range(200)]))

    # James-Stein regime: the truth close to the model, the released table noisy.
    near = 0.9 * model + 0.1 * other
    assert mse(near, sd) < 0.8 * mse(near, 0.0)
    # A pair the model misses: the released table is kept (within a tenth of its error).
    assert mse(other, sd) < 1.1 * mse(other, 0.0)
    # Broken copy: a noise level overstated tenfold shrinks the real difference away too.
    assert mse(other, 10 * sd) > 5 * mse(other, sd)


def test_shrunk_target_rejects_bad_noise_levels() -> None:
    table = np.full((2, 2), 0.25)
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValidationError, match="noise_sd"):
            pm.shrunk_target(table, table, bad)


def test_correction_leaves_a_pair_the_model_gets_right(fitted: Fitted) -> None:
    # Targets equal to the model's own tables up to the released noise: nothing moves.
    f = fitted
    calibration = model_rows(f, 200_000)
    acc = pm.PairTableAccumulator(f.grid, f.edges)
    acc.add(calibration)
    own = [t.reshape(f.grid.sizes[a], f.grid.sizes[b]) / calibration.n_rows
           for (a, b), t in zip(f.edges, acc.tables(), strict=True)]
    sd = 0.002
    noisy = [np.clip(noisy_copy(t, sd, i), 0, None) for i, t in enumerate(own)]
    shrunk = pm.PairCorrection.fit(f.grid, f.edges, [t / t.sum() for t in noisy], calibration,
                                   f.props, np.random.default_rng(9), noise_sd=sd)
    plain = pm.PairCorrection.fit(f.grid, f.edges, [t / t.sum() for t in noisy], calibration,
                                  f.props, np.random.default_rng(9))
    # Rows moved on a fresh model sample: almost none with the noise level, many without.
    fresh = model_rows(f, 50_000)

    def moved(correction: pm.PairCorrection) -> float:
        out = correction.apply(fresh, np.random.default_rng(10))
        return float(np.mean([np.mean(out.columns[n] != fresh.columns[n])
                              for n in CAUSE.names]))

    assert moved(shrunk) < 0.002
    assert moved(plain) > 5 * moved(shrunk)


def test_integer_columns_stay_whole_numbers_through_the_correction() -> None:
    """An ``integer`` column is whole numbers in every sample, rows the correction moved too."""
    raw = CAUSE.to_dict()
    for col in raw["columns"]:
        if col["name"] in ("year", "futime"):
            col["integer"] = True
    schema = Schema.from_dict(raw)
    real = cause_frame(20_000, 1)
    real["year"], real["futime"] = np.floor(real["year"]), np.floor(real["futime"])
    synth = fm.FactorModelSynthesizer(schema, epsilon=1e3, n_bins=BINS,
                                      rng=np.random.default_rng(2)).fit(real)
    correction = synth.pair_correction_
    assert correction is not None
    moved = {schema.columns[b].name for _, b in correction.edges} & {"year", "futime"}
    assert moved, "no integer column is a child: the test would not reach the correction"
    out = synth.sample(50_000)
    for name in ("year", "futime"):
        v = out[name].to_numpy()
        assert np.array_equal(v, np.rint(v)), name
        col = schema.column(name)
        assert isinstance(col, ContinuousColumn) and col.min <= v.min() <= v.max() <= col.max
        # The whole-number frequencies follow the data's (noise is negligible at eps 1e3).
        r = np.bincount(real[name].astype(int), minlength=21) / len(real)
        s = np.bincount(v.astype(int), minlength=21) / len(v)
        assert 0.5 * np.abs(r - s).sum() < 0.05, name
