"""The ``synth`` site handler's pair rounds (``pair_scores``, ``pairs``).

Worst-case sensitivity search through the real site path (the rounds' exact statistics): one row
of the table is replaced by extreme schema-valid records (every continuous column at
min/mid/max, every level and category) under several pair grids; each search also runs
against a deliberately broken copy and must catch it. Refusals (links digest, bad edges, a
job without pair rounds) go through the real task runner and SQLite ledger and charge
nothing; the released noise matches the stated calibration.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpfed.common.jobs import synth_pairs as synth_handler
from dpfed.common.privacy.mechanisms import GaussianMechanism, gaussian_sigma
from dpfed.common.synth import pair_marginals
from dpfed.common.synth.pair_marginals import PairGrid
from dpfed.common.transport.protocol import Refusal, Task
from dpfed.common.transport.wire import result_from_bytes
from dpfed.site_agent.handlers.base import site_release
from tests.site_agent.test_synth_handler import (
    N_BINS,
    SCHEMA,
    TableAccess,
    base_frame,
    exact,
    link_task,
    make_runner,
    neighbour,
    params,
    public_proportions,
)
from tests.support.tables import produced

GROUPS = (2, 3, 6)
EDGES = [[2, 0], [2, 3], [0, 1]]


def extreme_records() -> list[dict[str, object]]:
    return [{"age": age, "lab": lab, "stage": stage, "ward": ward}
            for age, lab, stage, ward in itertools.product(
                (0.0, 50.0, 100.0), (-5.0, 0.0, 5.0), ("I", "II", "III", "IV"),
                ("a", "b", "c"))]


def pair_task(rnd: str, groups: int = 6, edges: object = None, **extra: object) -> Task:
    p = params(pair_groups=groups, **extra)
    task = link_task(p, public_proportions(), rnd)
    if edges is not None:
        task = Task(task.task_id, task.job_id, task.kind, task.epsilon, task.delta,
                    {**task.params, "pair_edges": edges}, task.arrays)
    return task


def neighbours_stats(task: Task, frame: pd.DataFrame) -> list[np.ndarray]:
    out = []
    for x in extreme_records():
        stat = exact(task, TableAccess(neighbour(frame, x)))[3]
        out.append(np.asarray(stat[0] if isinstance(stat, tuple) else stat, dtype=np.float64))
    return out


def search(rnd: str, groups: int) -> tuple[float, float, int]:
    """Largest (per-entry change, L2 change) over neighbouring tables, and the entries."""
    task = pair_task(rnd, groups, EDGES if rnd == "pairs" else None)
    stats = neighbours_stats(task, base_frame())
    worst_entry = worst_l2 = 0.0
    for a, b in itertools.combinations(stats, 2):
        d = a - b
        worst_entry = max(worst_entry, float(np.abs(d).max()))
        worst_l2 = max(worst_l2, float(np.linalg.norm(d)))
    return worst_entry, worst_l2, stats[0].shape[0]


@pytest.mark.parametrize("groups", GROUPS)
def test_pair_scores_sensitivity_search_attains_the_stated_bound(groups: int) -> None:
    worst_entry, worst_l2, n_pairs = search("pair_scores", groups)
    grid = PairGrid.from_proportions(SCHEMA, public_proportions(), N_BINS, groups)
    assert n_pairs == len(grid.candidate_pairs()) == 6
    assert worst_entry <= pair_marginals.SCORE_SENSITIVITY + 1e-9
    assert worst_entry == pytest.approx(pair_marginals.SCORE_SENSITIVITY)  # tight
    assert worst_l2 <= pair_marginals.SCORE_SENSITIVITY * math.sqrt(n_pairs) + 1e-9


@pytest.mark.parametrize("groups", GROUPS)
def test_pair_tables_sensitivity_search_attains_the_stated_bound(groups: int) -> None:
    worst_entry, worst_l2, _cells = search("pairs", groups)
    stated = pair_marginals.pair_table_mechanism(len(EDGES), 1.0, 1e-6).sensitivity
    assert stated == pytest.approx(math.sqrt(2 * len(EDGES)))
    assert worst_entry <= 1.0
    assert worst_l2 <= stated + 1e-9
    assert worst_l2 == pytest.approx(stated)  # every table moves one count down, one up


def test_pair_searches_catch_a_broken_accumulator(monkeypatch: pytest.MonkeyPatch) -> None:
    # Broken copy: every chunk is counted twice (a planted bug): both searches must exceed.
    real_add = pair_marginals.PairTableAccumulator.add

    def doubled(self: pair_marginals.PairTableAccumulator, table: object) -> None:
        real_add(self, table)  # type: ignore[arg-type]
        real_add(self, table)  # type: ignore[arg-type]

    monkeypatch.setattr(pair_marginals.PairTableAccumulator, "add", doubled)
    worst_entry, _, _ = search("pair_scores", 6)
    assert worst_entry > pair_marginals.SCORE_SENSITIVITY * 1.5
    _, worst_l2, _ = search("pairs", 6)
    assert worst_l2 > math.sqrt(2 * len(EDGES)) * 1.5


def test_pair_scores_search_catches_an_independence_table_from_the_data(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Broken copy: the independence table uses the site's exact margins instead of the public
    # DP proportions, so replacing a row moves it too; the per-score bound 2 no longer holds.
    def data_margins(counts: np.ndarray, grid: PairGrid, pairs: list[tuple[int, int]],
                     proportions: np.ndarray, n_rows: int) -> np.ndarray:
        tables = pair_marginals.split_tables(counts, [grid.cells(p) for p in pairs])
        sizes = grid.sizes
        out = []
        for (a, b), t in zip(pairs, tables, strict=True):
            m = t.reshape(sizes[a], sizes[b]).astype(np.float64)
            indep = np.outer(m.sum(axis=1), m.sum(axis=0)) / max(n_rows, 1)
            out.append(float(np.abs(m - indep).sum()))
        return np.array(out)

    monkeypatch.setattr(synth_handler, "dependence_scores", data_margins)
    worst_entry, _, _ = search("pair_scores", 6)
    assert worst_entry > pair_marginals.SCORE_SENSITIVITY * 1.05


# --------------------------------------------------------------------------- refusals


def test_pair_rounds_refuse_a_links_digest_mismatch_and_charge_nothing(tmp_path: Path) -> None:
    runner = make_runner(tmp_path)
    for rnd, edges in (("pair_scores", None), ("pairs", EDGES)):
        task = pair_task(rnd, edges=edges)
        tampered = task.arrays["link_proportions"].copy()
        tampered[0], tampered[1] = tampered[1] + 0.01, tampered[0] - 0.01
        bad = Task(task.task_id, task.job_id, task.kind, task.epsilon, task.delta,
                   task.params, {"link_proportions": tampered})
        refusal = runner.run(bad)
        assert isinstance(refusal, Refusal) and refusal.code == "invalid"
        assert "link digest mismatch" in refusal.reason
    assert runner.ledger.events() == []


@pytest.mark.parametrize("edges, match", [
    (None, "pair_edges"),
    ([], "pair_edges"),
    ("0,1", "pair_edges"),
    ([[0, 1], [2]], "two indices"),
    ([[0, 9]], "pair column"),
    ([[0, -1]], "pair column"),
    ([[1, 1]], "distinct"),
    ([[0, 1], [1, 0]], "distinct"),
    ([[0, 1.5]], "integer"),
    ([[0, 1], [0, 2], [0, 3], [1, 2]], "at most 3"),
    ([{"a": 0}], "pair_edges"),
])
def test_bad_edges_are_refused_and_charge_nothing(tmp_path: Path, edges: object,
                                                  match: str) -> None:
    runner = make_runner(tmp_path)
    refusal = runner.run(pair_task("pairs", edges=edges))  # None: no pair_edges at all
    assert isinstance(refusal, Refusal) and refusal.code == "invalid", refusal
    assert match in refusal.reason, refusal.reason
    assert runner.ledger.events() == []


def test_more_edges_than_the_job_asked_for_are_refused(tmp_path: Path) -> None:
    runner = make_runner(tmp_path)
    refusal = runner.run(pair_task("pairs", edges=EDGES[:2], pairs=1))
    assert isinstance(refusal, Refusal) and "at most 1" in refusal.reason
    assert runner.ledger.events() == []


def test_a_job_without_pair_rounds_refuses_them(tmp_path: Path) -> None:
    runner = make_runner(tmp_path)
    refusal = runner.run(pair_task("pair_scores", pairs=0))
    assert isinstance(refusal, Refusal) and "round must be one of" in refusal.reason
    assert runner.ledger.events() == []


def test_pair_rounds_release_noisy_vectors_charged_once_and_replayed(tmp_path: Path) -> None:
    runner = make_runner(tmp_path)
    scores_task = pair_task("pair_scores")
    first = runner.run(scores_task)
    assert isinstance(first, bytes)
    scores = result_from_bytes(first)
    assert scores.arrays["pair_scores"].shape == (6,)
    assert scores.metadata["n_rows"] == 60
    assert scores.spend.epsilon == 1.0 and scores.spend.delta == 1e-6
    assert runner.run(scores_task) == first  # replay: the stored bytes, no second charge
    tables_task = pair_task("pairs", edges=EDGES)
    out = runner.run(tables_task)
    assert isinstance(out, bytes)
    grid = PairGrid.from_proportions(SCHEMA, public_proportions(), N_BINS, 6)
    cells = sum(grid.cells((a, b)) for a, b in EDGES)
    tables = result_from_bytes(out)
    assert tables.arrays["pair_tables"].shape == (cells,)
    assert tables.metadata["n_rows"] == 60
    assert [e.task_id for e in runner.ledger.events()] == ["j/pair_scores", "j/pairs"]


@pytest.mark.parametrize("rnd", ["pair_scores", "pairs"])
def test_released_noise_matches_the_stated_calibration(monkeypatch: pytest.MonkeyPatch,
                                                       rnd: str) -> None:
    task = pair_task(rnd, edges=EDGES if rnd == "pairs" else None)
    data = TableAccess(base_frame(40))
    sens = 2.0 * math.sqrt(6) if rnd == "pair_scores" else math.sqrt(2.0 * len(EDGES))
    stated = gaussian_sigma(task.epsilon, task.delta, sens)

    def noise_sd() -> float:
        stat = exact(task, data)[3]
        stat = np.asarray(stat[0] if isinstance(stat, tuple) else stat, dtype=np.float64)
        prepared = site_release(task, data)
        rng = np.random.default_rng(11)
        name = "pair_scores" if rnd == "pair_scores" else "pair_tables"
        noise = np.concatenate([produced(prepared, rng).arrays[name] - stat
                                for _ in range(300)])
        return float(noise.std())

    assert noise_sd() == pytest.approx(stated, rel=0.05)
    # Broken copy: a mechanism calibrated to half the sensitivity must be caught.
    # (scores: the L2 sensitivity of one score instead of all P; tables: sqrt(K) / 2)
    monkeypatch.setattr(synth_handler, "score_mechanism",
                        lambda p, e, d: GaussianMechanism(e, d, 2.0))
    monkeypatch.setattr(synth_handler, "pair_table_mechanism",
                        lambda k, e, d: GaussianMechanism(e, d, math.sqrt(k) / 2))
    assert noise_sd() < stated * 0.8
