"""The ``synth`` site handler: worst-case sensitivity search through the real site path,
digest and schema refusals through the real task runner and SQLite ledger.

The sensitivity search replaces one row of a table by extreme schema-valid records (every
continuous column at min/mid/max, every level and category) and measures how far each
round's exact statistic moves -- computed by the rounds' own code path
(:func:`exact`), with the links' latent draws coupled between the two neighbouring
tables. Each search also runs against a deliberately broken copy and must catch it.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.encoding import EncodedTable, encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.job_params import SynthParams
from dpfed.common.jobs import synth_rounds
from dpfed.common.jobs.contract import DataAccess, Site
from dpfed.common.jobs.synth_pairs import exact_scores, exact_tables
from dpfed.common.jobs.synth_rounds import factor_rows, latent_gram, link_counts, site_params
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.synth import link_release
from dpfed.common.synth.link_release import (
    link_histogram_sensitivity,
    links_digest,
    proportions_from_histograms,
)
from dpfed.common.synth.links import latent_dim
from dpfed.common.synth.quantile_link import bin_codes
from dpfed.common.transport.protocol import Refusal, Task
from dpfed.common.transport.wire import result_from_bytes
from dpfed.site_agent.handlers.base import RoundsHandler
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner
from tests.support.schemas import SYNTH as SCHEMA
from tests.support.tables import FrameData

N_BINS = 8


class TableAccess(FrameData):
    """The site's rows as the rounds see them (schema + chunked pass), from a DataFrame."""

    def __init__(self, frame: pd.DataFrame, chunk: int = 7, schema: Schema = SCHEMA) -> None:
        super().__init__(schema, frame, chunk)


class SiteRounds:
    """The synth rounds' exact statistics at a site (bound to a ledger's directory, or not)."""

    def __init__(self, ledger_path: Path | None = None) -> None:
        self.ledger_path = ledger_path

    def exact(self, task: Task, data: DataAccess, latent_rng: np.random.Generator | None = None
              ) -> tuple[str, SynthParams, int, Any]:
        """A site-level synth task's exact statistic, through the rounds' own code path.

        (round, params, N_s, statistic): the histograms (links), the Gram matrix of the
        unit-ball latent rows (pca), (latent rows, loadings) (factors), the scores
        (pair_scores) or (the edges' tables, edges) (pairs). ``latent_rng`` couples the links'
        latent draws.
        """
        site = Site(data, self.ledger_path)
        extra, p = site_params(task, site)
        rnd = str(extra["round"])
        if rnd == "links":
            acc = link_counts(synth_rounds.training_rows(task, site, p), p)
            return rnd, p, acc.n_rows, acc.counts
        if rnd == "pca":
            n, gram = latent_gram(task, site, p, extra.get("links_digest"), latent_rng)
            return rnd, p, n, gram
        if rnd == "factors":
            unit, v = factor_rows(task, site, p, extra.get("links_digest"), latent_rng)
            return rnd, p, unit.shape[0], (unit, v)
        if rnd == "pair_scores":
            n, scores = exact_scores(task, site, p, extra.get("links_digest"))
            return rnd, p, n, scores
        n, tables, edges = exact_tables(task, site, p, extra)
        return rnd, p, n, (tables, edges)


exact = SiteRounds().exact


def base_frame(n: int = 25, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "age": rng.uniform(0, 100, n), "lab": rng.normal(0, 2, n).clip(-5, 5),
        "stage": rng.choice(["I", "II", "III", "IV"], n), "ward": rng.choice(["a", "b", "c"], n)})


def extreme_records() -> list[dict[str, object]]:
    records = []
    for age, lab, stage, ward in itertools.product((0.0, 50.0, 100.0), (-5.0, 0.0, 5.0),
                                                   ("I", "IV"), ("a", "b", "c")):
        records.append({"age": age, "lab": lab, "stage": stage, "ward": ward})
    return records


def neighbour(frame: pd.DataFrame, record: dict[str, object]) -> pd.DataFrame:
    out = frame.copy()
    for k, v in record.items():
        out.loc[0, k] = v
    return out


def params(**extra: object) -> dict[str, object]:
    p = SynthParams.parse({"n_bins": N_BINS, **extra}, SCHEMA).to_mapping()
    return {**p, "schema_digest": SCHEMA.digest()}


def link_task(p: dict[str, object], props: np.ndarray, rnd: str,
              arrays: dict[str, np.ndarray] | None = None) -> Task:
    digest = links_digest(SCHEMA, props, N_BINS, str(p["continuous_link"]))
    kind = "synth_rows" if rnd == "factors" else "synth"
    return Task(f"j/{rnd}", "j", kind, 1.0, 1e-6 if rnd != "factors" else 0.0,
                {**p, "round": rnd, "links_digest": digest},
                {"link_proportions": props, **(arrays or {})})


def public_proportions() -> np.ndarray:
    sizes = link_release.histogram_sizes(SCHEMA, N_BINS)
    return proportions_from_histograms(np.ones(sum(sizes)) * 10, SCHEMA, N_BINS)


def upper_l2(a: np.ndarray) -> float:
    return float(np.linalg.norm(a[np.triu_indices(a.shape[0])]))


# --------------------------------------------------------------------------- links round


def search_links() -> float:
    base = base_frame()
    task = Task("j/links", "j", "synth", 1.0, 1e-6, {**params(), "round": "links"})
    stats = [exact(task, TableAccess(neighbour(base, x)))[3] for x in extreme_records()]
    # The noise is added to the weighted vector (less noise on columns with more cells):
    # that vector's change is what the stated sensitivity bounds.
    return max(float(np.linalg.norm(link_release.weighted_histograms(a - b, SCHEMA, N_BINS)))
               for a, b in itertools.combinations(stats, 2))


def test_links_round_sensitivity_search_attains_the_stated_bound() -> None:
    stated = link_histogram_sensitivity(SCHEMA)
    observed = search_links()
    assert observed <= stated + 1e-12
    assert observed == pytest.approx(stated)  # tight: every column changes cell


def test_links_search_catches_a_broken_histogram(monkeypatch: pytest.MonkeyPatch) -> None:
    # Broken copy: the accumulator counts every continuous row twice (a planted bug).
    real_add = link_release.LinkHistogramAccumulator.add

    def doubled(self: link_release.LinkHistogramAccumulator, table: EncodedTable) -> None:
        real_add(self, table)
        start = 0
        for col, size in zip(self.schema.columns, self.sizes, strict=True):
            if col.type == "continuous":
                codes = bin_codes(col, table.columns[col.name], self.n_bins)
                self.counts[start:start + size] += np.bincount(codes, minlength=size)
            start += size

    monkeypatch.setattr(link_release.LinkHistogramAccumulator, "add", doubled)
    assert search_links() > link_histogram_sensitivity(SCHEMA) * 1.05


def test_links_search_catches_unnormalised_noise_weights(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    # Broken copy: the per-column weights without their normalisation (sum w^2 = columns),
    # which the stated sensitivity relies on.
    def unnormalised(schema: Schema, n_bins: int, resolution: str = "bins") -> np.ndarray:
        return np.cbrt(np.asarray(link_release.histogram_sizes(schema, n_bins, resolution),
                                  dtype=float))

    monkeypatch.setattr(link_release, "link_noise_weights", unnormalised)
    assert search_links() > link_histogram_sensitivity(SCHEMA) * 1.05


# --------------------------------------------------------------------------- pca round


def search_pca(clip_norm: float | None) -> tuple[float, int]:
    base = base_frame()
    props = public_proportions()
    extra = {} if clip_norm is None else {"clip_norm": clip_norm}
    task = link_task(params(**extra), props, "pca")
    # The same generator seed for every neighbour couples the links' latent draws: only the
    # replaced row's latent values differ.
    runs = [exact(task, TableAccess(neighbour(base, x)), np.random.default_rng(7))
            for x in extreme_records()]
    n = runs[0][2]
    return max(upper_l2((a[3] - b[3]) / n) for a, b in itertools.combinations(runs, 2)), n


@pytest.mark.parametrize("clip_norm", [0.5, 1.0, None, 10.0])
def test_pca_round_gram_sensitivity_within_replace_one_bound(clip_norm: float | None) -> None:
    worst, n = search_pca(clip_norm)
    assert 0 < worst <= math.sqrt(2.0) / n + 1e-12


def test_pca_search_catches_missing_clipping(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_clip(latent: np.ndarray, clip_norm: float) -> tuple[np.ndarray, int]:
        return np.asarray(latent, dtype=np.float64) / clip_norm, 0  # planted bug: no clip

    monkeypatch.setattr(synth_rounds, "clip_to_unit_ball", no_clip)
    worst, n = search_pca(0.5)
    assert worst > math.sqrt(2.0) / n * 1.5


# --------------------------------------------------------------------------- factors round


def test_factors_round_row_sensitivity_within_bounds() -> None:
    base = base_frame()
    props = public_proportions()
    dim = latent_dim(SCHEMA)
    for r in (1, 3, dim):
        v = np.linalg.qr(np.random.default_rng(r).standard_normal((dim, r)))[0]
        task = link_task(params(mode="row_aligned"), props, "factors", {"loadings": v})
        worst_l2 = worst_l1 = 0.0
        units = [exact(task, TableAccess(neighbour(base, x)), np.random.default_rng(3))[3][0]
                 for x in extreme_records()]
        for ua, ub in itertools.combinations(units, 2):
            d = (ua - ub) @ v
            assert np.count_nonzero(np.abs(d).sum(axis=1) > 1e-12) <= 1  # one row moves
            worst_l2 = max(worst_l2, float(np.linalg.norm(d)))
            worst_l1 = max(worst_l1, float(np.abs(d).sum()))
        assert worst_l2 <= 2.0 + 1e-12
        assert worst_l1 <= 2.0 * math.sqrt(r) + 1e-12


# --------------------------------------------------------------------------- refusals


def make_runner(tmp_path: Path) -> TaskRunner:
    csv = tmp_path / "data.csv"
    base_frame(60).to_csv(csv, index=False)
    source = open_data_source(spec_from_path(csv), SCHEMA)
    return TaskRunner(source, Ledger(tmp_path / "ledger.sqlite", BudgetPolicy(10.0, 1e-3)),
                      ("synth",))


def test_link_digest_mismatch_is_refused_with_a_clear_reason(tmp_path: Path) -> None:
    runner = make_runner(tmp_path)
    props = public_proportions()
    task = link_task(params(), props, "pca")
    tampered = props.copy()
    tampered[0], tampered[1] = tampered[1] + 0.01, tampered[0] - 0.01
    bad = Task(task.task_id, task.job_id, task.kind, task.epsilon, task.delta, task.params,
               {"link_proportions": tampered})
    refusal = runner.run(bad)
    assert isinstance(refusal, Refusal) and refusal.code == "invalid"
    assert "link digest mismatch" in refusal.reason
    assert runner.ledger.events() == []
    ok = runner.run(task)
    assert isinstance(ok, bytes)
    dim = latent_dim(SCHEMA)
    assert result_from_bytes(ok).arrays["factor"].shape == (dim, dim)
    assert len(runner.ledger.events()) == 1


def test_schema_mismatch_is_refused(tmp_path: Path) -> None:
    runner = make_runner(tmp_path)
    p = {**params(), "schema_digest": "0" * 64, "round": "links"}
    refusal = runner.run(Task("j/links", "j", "synth", 1.0, 1e-6, p))
    assert isinstance(refusal, Refusal) and "schema digest mismatch" in refusal.reason
    assert runner.ledger.events() == []


def test_links_round_releases_noisy_histograms_and_replays(tmp_path: Path) -> None:
    runner = make_runner(tmp_path)
    task = Task("j/links", "j", "synth", 1.0, 1e-6, {**params(), "round": "links"})
    first = runner.run(task)
    assert isinstance(first, bytes)
    h = result_from_bytes(first).arrays["histograms"]
    assert h.shape == (sum(link_release.histogram_sizes(SCHEMA, N_BINS)),)
    assert runner.run(task) == first and len(runner.ledger.events()) == 1
    wrong_round = runner.run(Task("j/x", "j", "synth", 1.0, 1e-6,
                                  {**params(), "round": "factors"}))
    assert isinstance(wrong_round, Refusal) and "synth_rows" in wrong_round.reason
    # A site that does not list synth_rows never runs the row-aligned round.
    rows_task = link_task(params(mode="row_aligned"), public_proportions(), "factors",
                          {"loadings": np.eye(latent_dim(SCHEMA))[:, :2]})
    refused = runner.run(rows_task)
    assert isinstance(refused, Refusal) and refused.code == "not_allowed"
    assert len(runner.ledger.events()) == 1


# --------------------------------------------------------------------------- evaluation


def eval_arrays(n: int = 40) -> dict[str, np.ndarray]:
    table, _ = encode_table(SCHEMA, base_frame(n, seed=9))
    return {f"col:{k}": v for k, v in table.columns.items()}


def test_site_local_evaluation_writes_a_report_and_charges_nothing(tmp_path: Path) -> None:
    csv = tmp_path / "data.csv"
    base_frame(200).to_csv(csv, index=False)
    source = open_data_source(spec_from_path(csv), SCHEMA)
    runner = TaskRunner(source, Ledger(tmp_path / "ledger.sqlite", BudgetPolicy(10.0, 1e-3)),
                        ("synth_eval",), handlers={"synth_eval": RoundsHandler()})
    task = Task("j/evaluate", "j", "synth_eval", 0.0, 0.0,
                {"schema_digest": SCHEMA.digest()}, eval_arrays())
    out = runner.run(task)
    assert isinstance(out, bytes)
    result = result_from_bytes(out)
    assert result.arrays == {} and result.spend.epsilon == 0.0
    assert (tmp_path / "evaluations" / "j" / "synth_evaluation.html").exists()
    assert runner.ledger.events() == []
    # Hostile samples are refused with a reason; so is a task that asks for budget.
    for name, bad in (("age", np.full(40, 1e308)), ("stage", np.full(40, 9, dtype=np.int32)),
                      ("lab", np.full(40, np.nan))):
        arrays = {**eval_arrays(), f"col:{name}": bad}
        refusal = runner.run(Task(f"j/e-{name}", "j", "synth_eval", 0.0, 0.0,
                                  {"schema_digest": SCHEMA.digest()}, arrays))
        assert isinstance(refusal, Refusal) and name in refusal.reason
    charged = runner.run(Task("j/e2", "j", "synth_eval", 1.0, 0.0,
                              {"schema_digest": SCHEMA.digest()}, eval_arrays()))
    assert isinstance(charged, Refusal) and "no budget" in charged.reason
