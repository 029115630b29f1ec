"""The evaluation holdout at a site: its secret, the training-rows view, and the rounds.

Through the real round code path (bound to a site directory): a job
that evaluates reads only its training rows; a replaced held-out row moves no round's
statistic, a replaced training row moves it by at most the round's stated sensitivity, and
the local evaluation compares the same training rows with the same holdout.
"""

from __future__ import annotations

import itertools
import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.encoding import EncodedTable, EncodingReport
from dpfed.common.errors import DataError, ValidationError
from dpfed.common.evaluation.holdout import (
    holdout_positions,
    holdout_size,
    job_key,
    training_count,
)
from dpfed.common.evaluation.site_holdout import KEY_FILE, TrainingRows, site_secret, split_rows
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.synth.link_release import (
    LinkHistogramAccumulator,
    link_histogram_sensitivity,
    weighted_histograms,
)
from dpfed.common.transport.protocol import Task
from dpfed.common.transport.wire import result_from_bytes
from dpfed.site_agent.handlers.base import RoundsHandler
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner
from tests.site_agent.test_synth_handler import (
    N_BINS,
    SCHEMA,
    SiteRounds,
    TableAccess,
    base_frame,
    eval_arrays,
    extreme_records,
    link_task,
    params,
    public_proportions,
    upper_l2,
)

N = 60


def replaced(frame: pd.DataFrame, position: int, record: dict[str, object]) -> pd.DataFrame:
    out = frame.copy()
    for k, v in record.items():
        out.loc[position, k] = v
    return out


def bound(tmp_path: Path) -> SiteRounds:
    return SiteRounds(tmp_path / "ledger.sqlite")


def test_site_secret_is_created_once_private_and_checked(tmp_path: Path) -> None:
    first = site_secret(tmp_path)
    assert len(first) == 32 and site_secret(tmp_path) == first
    assert stat.S_IMODE(os.stat(tmp_path / KEY_FILE).st_mode) == 0o600
    (tmp_path / KEY_FILE).write_bytes(b"not a key")
    with pytest.raises(ValidationError, match="remove it"):
        site_secret(tmp_path)
    with pytest.raises(ValidationError, match="cannot keep its evaluation holdout secret"):
        site_secret(tmp_path / "missing-directory")


def test_training_rows_leave_out_the_same_positions_whatever_the_chunking(
        tmp_path: Path) -> None:
    frame = base_frame(N)
    key = job_key(site_secret(tmp_path), "j")
    (ta, ha), (tb, hb) = (split_rows(TableAccess(frame, chunk=c), key) for c in (7, 100))
    assert ha.n_rows == hb.n_rows == holdout_size(N) == 12 and ta.n_rows == tb.n_rows == 48
    for name in SCHEMA.names:
        assert np.array_equal(ta.columns[name], tb.columns[name])
        assert np.array_equal(ha.columns[name], hb.columns[name])
    whole = next(TableAccess(frame, chunk=N).iter_chunks())[0]
    held = holdout_positions(key, N)
    assert np.array_equal(ha.columns["age"], whole.columns["age"][held])
    # Another job holds out other rows.
    _, other = split_rows(TableAccess(frame), job_key(site_secret(tmp_path), "j2"))
    assert not np.array_equal(other.columns["age"], ha.columns["age"])


class ShrinkingData(TableAccess):
    """A table that loses rows between passes (the data changed during a task)."""

    def __init__(self, frame: pd.DataFrame) -> None:
        super().__init__(frame)
        self.passes = 0

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        self.passes += 1
        for i, part in enumerate(super().iter_chunks()):
            if self.passes > 1 and i == 0:
                continue
            yield part


def test_data_that_changes_during_a_task_is_a_data_error(tmp_path: Path) -> None:
    view = TrainingRows(ShrinkingData(base_frame(N)), job_key(site_secret(tmp_path), "j"))
    with pytest.raises(DataError, match="changed during the task"):
        list(view.iter_chunks())


def test_rounds_of_an_evaluating_job_read_only_the_training_rows(tmp_path: Path) -> None:
    frame = base_frame(N)
    task = Task("j/links", "j", "synth", 1.0, 1e-6,
                {**params(evaluate_rows=100), "round": "links"})
    _, _, n, counts = bound(tmp_path).exact(task, TableAccess(frame))
    train, _ = split_rows(TableAccess(frame), job_key(site_secret(tmp_path), "j"))
    acc = LinkHistogramAccumulator(SCHEMA, N_BINS)
    acc.add(train)
    assert n == training_count(N) == 48 and np.array_equal(counts, acc.counts)
    plain = Task("j/links", "j", "synth", 1.0, 1e-6, {**params(), "round": "links"})
    assert bound(tmp_path).exact(plain, TableAccess(frame))[2] == N
    with pytest.raises(ValidationError, match="not bound"):
        SiteRounds().exact(task, TableAccess(frame))


def test_a_replaced_held_out_row_moves_no_round_statistic(tmp_path: Path) -> None:
    handler = bound(tmp_path)
    frame = base_frame(N)
    held = holdout_positions(job_key(site_secret(tmp_path), "j"), N)
    trained = next(p for p in range(N) if p not in set(held.tolist()))
    links = Task("j/links", "j", "synth", 1.0, 1e-6,
                 {**params(evaluate_rows=100), "round": "links"})
    pca = link_task(params(evaluate_rows=100), public_proportions(), "pca")
    for position, moves in ((int(held[0]), False), (trained, True)):
        hists = [handler.exact(links, TableAccess(replaced(frame, position, x)))[3]
                 for x in extreme_records()]
        grams = [handler.exact(pca, TableAccess(replaced(frame, position, x)),
                               np.random.default_rng(7))[3] for x in extreme_records()]
        worst_h = max(float(np.linalg.norm(weighted_histograms(a - b, SCHEMA, N_BINS)))
                      for a, b in itertools.combinations(hists, 2))
        worst_g = max(upper_l2(a - b) for a, b in itertools.combinations(grams, 2)) / 48
        if moves:
            assert worst_h == pytest.approx(link_histogram_sensitivity(SCHEMA))
            assert 0 < worst_g <= math.sqrt(2.0) / 48 + 1e-12
        else:
            assert worst_h == 0.0 and worst_g == 0.0


def test_local_evaluation_compares_the_training_rows_with_the_holdout(tmp_path: Path) -> None:
    csv = tmp_path / "data.csv"
    base_frame(200).to_csv(csv, index=False)
    runner = TaskRunner(open_data_source(spec_from_path(csv), SCHEMA),
                        Ledger(tmp_path / "ledger.sqlite", BudgetPolicy(10.0, 1e-3)),
                        ("synth_eval",), handlers={"synth_eval": RoundsHandler()})
    out = runner.run(Task("j/evaluate", "j", "synth_eval", 0.0, 0.0,
                          {"schema_digest": SCHEMA.digest()}, eval_arrays()))
    assert isinstance(out, bytes) and result_from_bytes(out).arrays == {}
    html = (tmp_path / "evaluations" / "j" / "synth_evaluation.html").read_text()
    assert "160 / 40 / 40" in html  # training / holdout (min(200 // 5, 20000)) / synthetic
    assert (tmp_path / KEY_FILE).exists() and runner.ledger.events() == []

