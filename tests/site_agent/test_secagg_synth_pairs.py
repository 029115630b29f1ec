"""The synth job's pair rounds under secure aggregation at the site: the ``synth_pair_scores``
and ``synth_pairs`` sources.

Worst-case sensitivity searches replace one row by extreme records (every continuous column at
min/mid/max and far outside its bounds, every level and category) and run both neighbours
through the real source code path (links check, pair grid, exact tables over the training
rows, dependence scores, flooring): the floored scores move by at most 2 per entry (and reach
2), within the plan's ``2 sqrt(P)``; the pair tables reach ``sqrt(2 K)`` exactly. Each search
also runs against planted broken copies (a plan with ``b = 1``, a score or table that double
counts). Through the real runner and SQLite ledger with real certificates: honest
contributions decode to the pooled statistics in candidate-pair and edge order and are charged
once; a tampered links digest, invalid edges and invalid grid parameters are refused before
anything is charged.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dpfed.common.data.encoding import EncodedTable, EncodingReport
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.jobs import synth_pairs as synth_secure
from dpfed.common.jobs.contract import Contribution, DataAccess, Site
from dpfed.common.jobs.registry import secure_round
from dpfed.common.jobs.synth_pairs import PAIR_SCORES, PAIRS, SCORE_BOUND, floored_scores
from dpfed.common.secagg import secure_sum
from dpfed.common.secagg.secure_sum import SecureSumPlan
from dpfed.common.synth import link_release
from dpfed.common.synth.link_release import links_digest, proportions_from_histograms
from dpfed.common.synth.pair_marginals import (
    PairGrid,
    PairTableAccumulator,
    dependence_scores,
)
from dpfed.common.transport.protocol import Refusal, Task
from dpfed.common.transport.wire import result_from_bytes
from dpfed.site_agent.runner import TaskRunner
from tests.site_agent.test_secagg_synth import (
    SITES,
    _secure_round,
    job_params,
    planned,
    plant_double_counting,
    runners,
    search_records,
)
from tests.site_agent.test_synth_handler import (
    N_BINS,
    SCHEMA,
    TableAccess,
    base_frame,
    neighbour,
)

__all__ = ["runners"]  # the shared fixture of the real runners

#: Edges as the coordinator sends them: [parent, child], either orientation.
EDGES = [[0, 1], [2, 0], [3, 2]]


def uneven_proportions(seed: int = 4) -> np.ndarray:
    """DP-like proportions far from uniform, so the independence tables are fractional."""
    sizes = link_release.histogram_sizes(SCHEMA, N_BINS)
    counts = np.random.default_rng(seed).integers(3, 40, sum(sizes)).astype(np.float64)
    return proportions_from_histograms(counts, SCHEMA, N_BINS)


def pair_task(source: str, *, groups: object = 4, edges: object = None,
              props: np.ndarray | None = None, digest: str | None = None,
              task_id: str | None = None) -> Task:
    p = uneven_proportions() if props is None else props
    # The job carries the same pair_groups as the task (a site refuses a mismatch); an
    # invalid value stays only in the task, where the site's own check names it.
    valid = isinstance(groups, int) and 2 <= groups <= 64
    params: dict[str, object] = {
        "stage": "contribute", "source": source,
        "job": job_params(pair_groups=groups) if valid else job_params(),
        "schema_digest": SCHEMA.digest(), "pair_groups": groups,
        "links_digest": digest if digest is not None else links_digest(SCHEMA, p, N_BINS,
                                                                       "quantile")}
    if edges is not None:
        params["pair_edges"] = edges
    name = "pair_scores" if source == "synth_pair_scores" else "pairs"
    return Task(task_id or f"j/{name}-sum-1", "j", "secagg", 1.0, 1e-6, params,
                {"link_proportions": p})


def grid(groups: int = 4) -> PairGrid:
    return PairGrid.from_proportions(SCHEMA, uneven_proportions(), N_BINS, groups)


def synth_pair_scores_contribution(task: Task, data: DataAccess, participants: list[str],
                                   tolerated: int, *,
                                   site_dir: Path | None = None) -> Contribution:
    """The ``pair_scores`` round's secure contribution (bound to ``site_dir`` if given)."""
    return PAIR_SCORES.contribution(task, Site(data, None if site_dir is None
                                               else site_dir / "ledger.sqlite"),
                                    participants, tolerated)


def synth_pairs_contribution(task: Task, data: DataAccess, participants: list[str],
                             tolerated: int) -> Contribution:
    """The ``pairs`` round's secure contribution at a site."""
    return PAIRS.contribution(task, Site(data), participants, tolerated)


# --------------------------------------------------------------------------- scores


def search_scores(groups: int, seeds: tuple[int, ...] = (0, 1)
                  ) -> tuple[float, float, float, SecureSumPlan]:
    """Largest per-entry, L2 and L1 change of the floored scores over extreme neighbours."""
    worst_inf = worst2 = worst1 = 0.0
    plan = None
    for seed in seeds:
        base = base_frame(25, seed=seed)
        stats = []
        for record in search_records():
            given = synth_pair_scores_contribution(
                planned(pair_task("synth_pair_scores", groups=groups), "scores", 1.0),
                TableAccess(neighbour(base, record)), list(SITES[:2]), 0)
            plan = given.plan
            stat, n_rows = given.compute(np.random.default_rng(0))
            assert stat.dtype == np.int64 and n_rows == len(base)
            assert stat.min() >= 0 and stat.max() <= SCORE_BOUND * n_rows  # the public range
            stats.append(stat.astype(np.float64))
        for a, b in itertools.combinations(stats, 2):
            worst_inf = max(worst_inf, float(np.abs(a - b).max()))
            worst2 = max(worst2, float(np.linalg.norm(a - b)))
            worst1 = max(worst1, float(np.abs(a - b).sum()))
    assert plan is not None
    return worst_inf, worst2, worst1, plan


@pytest.mark.parametrize(("groups", "seeds"), [(2, (1,)), (4, (0, 1))])
def test_scores_sensitivity_search_within_and_attaining_the_per_entry_bound(
        groups: int, seeds: tuple[int, ...]) -> None:
    worst_inf, worst2, worst1, plan = search_scores(groups, seeds)
    n_pairs = len(grid(groups).candidate_pairs())
    assert plan.statistic == "scores" and plan.dim == n_pairs == 6 and plan.scale == 1.0
    assert plan.bound == SCORE_BOUND == 2
    assert plan.calibration.l2_sensitivity == pytest.approx(2 * math.sqrt(n_pairs))
    assert plan.calibration.l1_sensitivity == pytest.approx(2 * n_pairs)
    assert worst_inf == 2.0  # attained, never exceeded
    assert worst2 <= plan.calibration.l2_sensitivity + 1e-12
    assert worst1 <= plan.calibration.l1_sensitivity + 1e-12


def test_scores_search_catches_a_plan_calibrated_for_b_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = secure_sum._sensitivities

    def unit_bound(statistic: str, dim: int, bound: float) -> tuple[float, float]:
        if statistic == "scores":  # planted bug: each score moving by 1 (a plain count)
            return math.sqrt(dim), float(dim)
        return real(statistic, dim, bound)

    monkeypatch.setattr(secure_sum, "_sensitivities", unit_bound)
    _, worst2, worst1, plan = search_scores(4, seeds=(0,))
    assert worst2 > plan.calibration.l2_sensitivity * 1.2
    assert worst1 > plan.calibration.l1_sensitivity


def test_scores_search_catches_a_double_counting_score(monkeypatch: pytest.MonkeyPatch) -> None:
    def doubled(counts: np.ndarray, g: PairGrid, pairs: list[tuple[int, int]],
                proportions: np.ndarray, n_rows: int) -> np.ndarray:
        # planted bug: every pair's distance counted twice
        return 2.0 * dependence_scores(counts, g, pairs, proportions, n_rows)

    monkeypatch.setattr(synth_secure, "dependence_scores", doubled)
    worst_inf, worst2, _, plan = search_scores(4, seeds=(0,))
    assert worst_inf > plan.bound
    assert worst2 > plan.calibration.l2_sensitivity


def test_floored_scores_stay_integers_in_the_public_range() -> None:
    out = floored_scores(np.array([0.0, 0.99, 3.5, 20.0 + 1e-9]), 10)
    assert out.dtype == np.int64 and out.tolist() == [0, 0, 3, 20]
    with pytest.raises(ValidationError, match="outside their range"):
        floored_scores(np.array([25.0]), 10)
    with pytest.raises(ValidationError, match="finite"):
        floored_scores(np.array([math.nan]), 10)


# --------------------------------------------------------------------------- pair tables


def search_tables(edges: list[list[int]], *, one_count_per_row: bool = True
                  ) -> tuple[float, float, SecureSumPlan]:
    base = base_frame(25, seed=2)
    stats = []
    plan = None
    for record in search_records():
        given = synth_pairs_contribution(
            planned(pair_task("synth_pairs", edges=edges), "counts", 1.0),
            TableAccess(neighbour(base, record)), list(SITES[:2]), 0)
        plan = given.plan
        stat, n_rows = given.compute(np.random.default_rng(0))
        assert stat.dtype == np.int64
        if one_count_per_row:
            assert int(stat.sum()) == len(edges) * n_rows
        stats.append(stat.astype(np.float64))
    assert plan is not None
    pairs = list(itertools.combinations(stats, 2))
    return (max(float(np.linalg.norm(a - b)) for a, b in pairs),
            max(float(np.abs(a - b).sum()) for a, b in pairs), plan)


def test_tables_sensitivity_search_attains_the_plans_bound() -> None:
    worst2, worst1, plan = search_tables(EDGES)
    k = len(EDGES)
    g = grid()
    assert plan.statistic == "counts" and plan.bound == pytest.approx(math.sqrt(k))
    assert plan.dim == sum(g.cells((a, b)) for a, b in EDGES)
    assert plan.calibration.l2_sensitivity == pytest.approx(math.sqrt(2 * k))
    assert worst2 == pytest.approx(plan.calibration.l2_sensitivity)  # tight
    assert worst1 == pytest.approx(plan.calibration.l1_sensitivity)


def test_tables_search_catches_a_double_counting_accumulator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plant_double_counting(monkeypatch, PairTableAccumulator)
    worst2, worst1, plan = search_tables(EDGES, one_count_per_row=False)
    assert worst2 > plan.calibration.l2_sensitivity * 1.4
    assert worst1 > plan.calibration.l1_sensitivity * 1.4


# --------------------------------------------------------------------------- refusals

#: A schema with one pair too large to be a candidate (70 x 70 > 4096 cells).
_WIDE = Schema.from_toml("\n".join(
    ['[[columns]]\nname = "age"\ntype = "continuous"\nmin = 0\nmax = 100']
    + [f'[[columns]]\nname = "{n}"\ntype = "nominal"\ncategories = '
       f'[{", ".join(repr(str(i)) for i in range(70))}]' for n in ("code", "code2")]))


class WideAccess:
    """Rows of the wide schema (one chunk)."""

    def __init__(self, n: int = 30) -> None:
        rng = np.random.default_rng(0)
        self._table = EncodedTable(_WIDE, {
            "age": rng.uniform(0, 100, n), "code": rng.integers(0, 70, n).astype(np.int32),
            "code2": rng.integers(0, 70, n).astype(np.int32)}, n)

    @property
    def schema(self) -> Schema:
        return _WIDE

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        yield self._table, EncodingReport()


def test_an_edge_outside_the_candidate_pairs_is_refused() -> None:
    sizes = link_release.histogram_sizes(_WIDE, N_BINS)
    props = proportions_from_histograms(np.full(sum(sizes), 5.0), _WIDE, N_BINS)
    job = {**job_params()}
    digest = links_digest(_WIDE, props, N_BINS, "quantile")

    def task(edges: list[list[int]]) -> Task:
        return Task("j/pairs-sum-1", "j", "secagg", 1.0, 1e-6,
                    {"stage": "contribute", "source": "synth_pairs", "job": job,
                     "schema_digest": _WIDE.digest(), "links_digest": digest,
                     "pair_groups": 6, "pair_edges": edges, "statistic": "counts",
                     "scale": 1.0}, {"link_proportions": props})

    g = PairGrid.from_proportions(_WIDE, props, N_BINS, 6)
    assert g.candidate_pairs() == [(0, 1), (0, 2)]
    with pytest.raises(ValidationError, match=r"\(2, 1\), which is not a candidate pair"):
        synth_pairs_contribution(task([[0, 1], [2, 1]]), WideAccess(), list(SITES[:2]), 0)
    given = synth_pairs_contribution(task([[1, 0], [0, 2]]), WideAccess(), list(SITES[:2]), 0)
    assert given.plan.dim == 2 * 70 * 6
    # the scores cover the candidates only
    scores = synth_pair_scores_contribution(
        Task("j/pair_scores-sum-1", "j", "secagg", 1.0, 1e-6,
             {**task([]).params, "source": "synth_pair_scores", "statistic": "scores"},
             {"link_proportions": props}), WideAccess(), list(SITES[:2]), 0)
    assert scores.plan.dim == 2


def _no_charges(runners: dict[str, TaskRunner]) -> bool:
    return all(r.ledger.events() == [] for r in runners.values())


def test_a_tampered_links_digest_is_refused_before_any_charge(
        runners: dict[str, TaskRunner]) -> None:
    tampered = uneven_proportions()
    tampered[0], tampered[1] = tampered[1] + 0.01, tampered[0] - 0.01
    honest = links_digest(SCHEMA, uneven_proportions(), N_BINS, "quantile")
    g = grid()
    n_cells = sum(g.cells((a, b)) for a, b in EDGES)
    for task, statistic, dim, row_norm in (
            (pair_task("synth_pair_scores", props=tampered, digest=honest), "scores", 6, 2.0),
            (pair_task("synth_pairs", props=tampered, digest=honest, edges=EDGES), "counts",
             n_cells, math.sqrt(len(EDGES)))):
        answers, _, _ = _secure_round(runners, task, statistic, dim, row_norm, 1.0)
        for answer in answers.values():
            assert isinstance(answer, Refusal) and "link digest mismatch" in answer.reason
    assert _no_charges(runners)


@pytest.mark.parametrize(("edges", "reason"), [
    ([[0, 0]], "distinct columns"),
    ([[0, 1], [1, 0]], "twice"),
    ([[0, 4]], "pair column must be <= 3"),
    ([[0, -1]], "pair column must be >= 0"),
    ([[0, 1, 2]], "two indices"),
    ([[0.5, 1]], "pair column must be an integer"),
    ([], "needs pair_edges"),
    ("0,1", "needs pair_edges"),
    ([[0, 1]] * 7, "measures at most 3"),
    (["01"], "pair_edges must be a list of [parent, child]"),
])
def test_invalid_edges_are_refused_before_any_charge(
        runners: dict[str, TaskRunner], edges: object, reason: str) -> None:
    task = pair_task("synth_pairs", edges=edges)
    answers, _, _ = _secure_round(runners, task, "counts", 4 * 4, 1.0, 1.0)
    for answer in answers.values():
        assert isinstance(answer, Refusal) and reason in answer.reason, answer
    assert _no_charges(runners)


@pytest.mark.parametrize(("groups", "reason"), [(1, "pair_groups must be >= 2"),
                                                (65, "pair_groups must be <= 64"),
                                                ("6", "pair_groups must be an integer")])
def test_invalid_pair_groups_and_a_foreign_bound_are_refused(
        runners: dict[str, TaskRunner], groups: object, reason: str) -> None:
    answers, _, _ = _secure_round(runners, pair_task("synth_pair_scores", groups=groups),
                               "scores", 6, 2.0, 1.0)
    assert all(isinstance(a, Refusal) and reason in a.reason for a in answers.values())
    # a plan whose per-entry bound is not the source's (b = 1 would halve the noise)
    answers, _, _ = _secure_round(runners, pair_task("synth_pair_scores"), "scores", 6, 1.0, 1.0)
    assert all(isinstance(a, Refusal) and "row_norm" in a.reason for a in answers.values())
    # a task whose pair_groups is not the job's (the grid, hence the cells, would differ)
    mismatched = pair_task("synth_pair_scores")
    mismatched = Task(mismatched.task_id, mismatched.job_id, mismatched.kind,
                      mismatched.epsilon, mismatched.delta,
                      {**mismatched.params, "job": job_params(pair_groups=6)},
                      mismatched.arrays)
    answers, _, _ = _secure_round(runners, mismatched, "scores", 6, 2.0, 1.0)
    assert all(isinstance(a, Refusal) and "differs from the job's" in a.reason
               for a in answers.values())
    assert _no_charges(runners)


# --------------------------------------------------------------------------- real runner


def _exact(seed: int, edges: list[tuple[int, int]] | None) -> np.ndarray:
    g = grid()
    pairs = g.candidate_pairs() if edges is None else edges
    acc = PairTableAccumulator(g, pairs)
    for table, _ in TableAccess(base_frame(80, seed=seed)).iter_chunks():
        acc.add(table)
    if edges is not None:
        return acc.counts
    return np.floor(dependence_scores(acc.counts, g, pairs, uneven_proportions(), acc.n_rows))


def test_secure_pair_rounds_decode_to_the_pooled_statistics(
        runners: dict[str, TaskRunner]) -> None:
    assert secure_round("synth_pair_scores", "scores")[0].name == "synth"
    assert secure_round("synth_pairs", "counts")[0].name == "synth"
    answers, plan, total = _secure_round(runners, pair_task("synth_pair_scores"), "scores", 6,
                                         float(SCORE_BOUND), 200.0)
    for s, answer in answers.items():
        assert isinstance(answer, bytes), answer
        result = result_from_bytes(answer)
        assert result.metadata["source"] == "synth_pair_scores"
        assert result.metadata["statistic"] == "scores"
        (event,) = runners[s].ledger.events()
        assert event.mechanism == "secure-skellam[n=3,t=1]" and event.epsilon == 200.0
    assert total is not None
    decoded = total.astype(np.float64) / plan.scale
    pooled = sum(_exact(i, None) for i in range(len(SITES)))
    assert np.max(np.abs(decoded - pooled)) <= 3.0  # epsilon 200: noise sd ~ 0.1

    edges = [(a, b) for a, b in EDGES]
    dim = sum(grid().cells(e) for e in edges)
    answers, plan, total = _secure_round(runners, pair_task("synth_pairs", edges=EDGES),
                                         "counts", dim, math.sqrt(len(EDGES)), 200.0)
    assert total is not None and all(isinstance(a, bytes) for a in answers.values())
    decoded = total.astype(np.float64)
    pooled = sum(_exact(i, edges) for i in range(len(SITES)))
    assert np.max(np.abs(decoded - pooled)) <= 3.0
    assert [len(r.ledger.events()) for r in runners.values()] == [2, 2, 2]


def test_pair_sources_leave_the_evaluation_holdout_out(tmp_path: Path) -> None:
    from dpfed.common.evaluation.holdout import training_count

    frame = base_frame(500, seed=3)
    task = pair_task("synth_pair_scores")
    task = Task(task.task_id, "j", "secagg", 1.0, 1e-6,
                {**task.params, "job": job_params(evaluate_rows=100, pair_groups=4),
                 "statistic": "scores", "scale": 1.0}, task.arrays)
    given = synth_pair_scores_contribution(task, TableAccess(frame), list(SITES[:2]), 0,
                                           site_dir=tmp_path)
    stat, n_rows = given.compute(np.random.default_rng(0))
    assert n_rows == training_count(len(frame)) < len(frame)
    assert stat.max() <= SCORE_BOUND * n_rows
    with pytest.raises(ValidationError, match="holdout needs the site's secret"):
        synth_pair_scores_contribution(task, TableAccess(frame), list(SITES[:2]), 0)
