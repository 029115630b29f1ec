"""The synth job's secure sums at the site: the ``synth_counts`` and ``synth_latent`` sources.

Worst-case sensitivity searches run extreme records (every continuous column at min/mid/max
and far outside its bounds, every level and category) through the real source code path and
compare with the plan the contribute stage builds; each search also runs against a planted
broken copy. Through the real runner and SQLite ledger with real certificates: honest
contributions decode to the pooled statistic and are charged once with the mode recorded; a
tampered links digest is refused before anything is charged; a site that requires secure
aggregation refuses the site-level synth rounds, and no site runs a site-level round of a
secure job.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.encoding import EncodedTable
from dpfed.common.jobs import synth_rounds as synth_secure
from dpfed.common.jobs.contract import Contribution, DataAccess, Site
from dpfed.common.jobs.registry import secure_round, sum_kinds
from dpfed.common.jobs.synth_rounds import LATENT, LINKS
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.secagg import secure_sum
from dpfed.common.secagg.policy import SecureAggregationPolicy
from dpfed.common.secagg.secure_sum import SecureSumPlan, plan_for
from dpfed.common.synth import link_release
from dpfed.common.synth.link_release import LinkHistogramAccumulator, links_digest
from dpfed.common.synth.links import latent_dim
from dpfed.common.transport.certs import init_federation
from dpfed.common.transport.protocol import Refusal, Task
from dpfed.common.transport.wire import result_from_bytes
from dpfed.site_agent.handlers import default_handlers
from dpfed.site_agent.handlers.secagg import SecureAggregationHandler, SiteIdentity
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner
from tests.site_agent.test_synth_handler import (
    N_BINS,
    SCHEMA,
    TableAccess,
    base_frame,
    extreme_records,
    neighbour,
    params,
    public_proportions,
)
from tests.support.secure_driver import run_sum

SITES = ("hospital-a", "hospital-b", "hospital-c")
C = len(SCHEMA.columns)


def synth_counts_contribution(task: Task, data: DataAccess, participants: list[str],
                              tolerated: int, *, site_dir: Path | None = None) -> Contribution:
    """The ``links`` round's secure contribution at a site (bound to ``site_dir`` if given)."""
    return LINKS.contribution(task, Site(data, None if site_dir is None
                                         else site_dir / "ledger.sqlite"), participants, tolerated)


def synth_latent_contribution(task: Task, data: DataAccess, participants: list[str],
                              tolerated: int) -> Contribution:
    """The ``pca`` round's secure contribution at a site."""
    return LATENT.contribution(task, Site(data), participants, tolerated)


def search_records() -> list[dict[str, object]]:
    """Every extreme schema-valid record, plus continuous values far outside the bounds (the
    encoder clips them to the bounds, so they must land in the edge bins)."""
    far = [{"age": age, "lab": lab, "stage": "II", "ward": "b"}
           for age, lab in ((1e6, -1e9), (-1e308, 1e308), (100.0 + 1e-9, -5.0 - 1e-9))]
    return extreme_records() + far


def job_params(**extra: object) -> dict[str, object]:
    p = dict(params(aggregation="secure", **extra))
    p.pop("schema_digest")
    return p


def counts_task() -> Task:
    return Task("j/links-sum-1", "j", "secagg", 1.0, 1e-6,
                {"stage": "contribute", "source": "synth_counts", "job": job_params(),
                 "schema_digest": SCHEMA.digest()})


def latent_task(clip_norm: float | None = None) -> Task:
    props = public_proportions()
    extra = {} if clip_norm is None else {"clip_norm": clip_norm}
    return Task("j/pca-sum-1", "j", "secagg", 1.0, 1e-6,
                {"stage": "contribute", "source": "synth_latent", "job": job_params(**extra),
                 "schema_digest": SCHEMA.digest(),
                 "links_digest": links_digest(SCHEMA, props, N_BINS, "quantile")},
                {"link_proportions": props})


def planned(task: Task, statistic: str, scale: float) -> Task:
    """The contribute task as the site sees it: the statistic and scale of the plan added."""
    return Task(task.task_id, task.job_id, task.kind, task.epsilon, task.delta,
                {**task.params, "statistic": statistic, "scale": scale}, task.arrays)


# --------------------------------------------------------------------------- counts


def search_counts() -> tuple[float, float, SecureSumPlan]:
    """Largest L2 / L1 change of the exact weighted count vector over extreme neighbours."""
    base = base_frame()
    stats = []
    plan = None
    for record in search_records():
        given = synth_counts_contribution(planned(counts_task(), "weighted_counts", 1.0),
                                          TableAccess(neighbour(base, record)),
                                          list(SITES[:2]), 0)
        plan = given.plan
        stat, n_rows = given.compute(np.random.default_rng(0))
        assert stat.dtype == np.int64 and n_rows == len(base)
        stats.append(stat.astype(np.float64))
    assert plan is not None
    pairs = list(itertools.combinations(stats, 2))
    return (max(float(np.linalg.norm(a - b)) for a, b in pairs),
            max(float(np.abs(a - b).sum()) for a, b in pairs), plan)


def test_counts_sensitivity_search_attains_the_plans_bound() -> None:
    worst2, worst1, plan = search_counts()
    m = link_release.secure_link_weights(SCHEMA, N_BINS)
    assert m.dtype == np.int64 and int(m.min()) >= 1 and len(set(m.tolist())) > 1
    assert plan.statistic == "weighted_counts" and plan.scale == 1.0
    assert plan.bound == pytest.approx(math.sqrt(float((m * m).sum())))
    assert plan.calibration.l2_sensitivity == pytest.approx(math.sqrt(2.0) * plan.bound)
    # the plan's L1 is the conservative 2 sum m^2 >= the true 2 sum m
    assert plan.calibration.l1_sensitivity == pytest.approx(2.0 * plan.bound ** 2)
    # tight in L2, and the true L1: the extreme records change the cell of every column
    assert worst2 == pytest.approx(plan.calibration.l2_sensitivity)
    assert worst1 == pytest.approx(2.0 * float(m.sum()))
    assert worst1 <= plan.calibration.l1_sensitivity


def plant_double_counting(monkeypatch: pytest.MonkeyPatch, accumulator: type) -> None:
    """Planted bug: ``accumulator.add`` counts every row twice in its cells (not in n_rows)."""
    real_add = accumulator.add

    def doubled(self: Any, table: EncodedTable) -> None:
        real_add(self, table)
        n_rows = self.n_rows
        real_add(self, table)
        self.n_rows = n_rows

    monkeypatch.setattr(accumulator, "add", doubled)


def test_counts_search_catches_a_broken_accumulator(monkeypatch: pytest.MonkeyPatch) -> None:
    plant_double_counting(monkeypatch, LinkHistogramAccumulator)
    worst2, worst1, plan = search_counts()
    assert worst2 > plan.calibration.l2_sensitivity * 1.4
    assert worst1 > 2.0 * float(link_release.secure_link_weights(SCHEMA, N_BINS).sum()) * 1.4


def test_counts_search_catches_weights_the_plan_does_not_know(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Planted bug: the site multiplies by twice the weights its row_norm states.
    real = link_release.secure_cell_weights
    monkeypatch.setattr(synth_secure, "secure_cell_weights",
                        lambda schema, n_bins, resolution="bins": 2 * real(schema, n_bins,
                                                                            resolution))
    worst2, _, plan = search_counts()
    assert worst2 > plan.calibration.l2_sensitivity * 1.9


def test_counts_search_catches_a_plan_with_one_histograms_sensitivity(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = secure_sum._sensitivities

    def per_histogram(statistic: str, dim: int, bound: float) -> tuple[float, float]:
        if statistic == "weighted_counts":  # planted bug: the sensitivity of ONE histogram
            return math.sqrt(2.0), 2.0
        return real(statistic, dim, bound)

    monkeypatch.setattr(secure_sum, "_sensitivities", per_histogram)
    worst2, worst1, plan = search_counts()
    assert worst2 > plan.calibration.l2_sensitivity * 1.5


# --------------------------------------------------------------------------- latent Gram


def search_latent(clip_norm: float | None, scale: float = 64.0) -> tuple[float, SecureSumPlan]:
    base = base_frame()
    stats = []
    plan = None
    for record in search_records():
        given = synth_latent_contribution(planned(latent_task(clip_norm), "gram", scale),
                                          TableAccess(neighbour(base, record)),
                                          list(SITES[:2]), 0)
        plan = given.plan
        # one generator seed for every neighbour couples the latent draws and the rounding
        stat, _ = given.compute(np.random.default_rng(7))
        stats.append(stat.astype(np.float64))
    assert plan is not None
    return max(float(np.linalg.norm(a - b)) for a, b in itertools.combinations(stats, 2)), plan


@pytest.mark.parametrize("clip_norm", [0.5, None, 10.0])
def test_latent_gram_sensitivity_within_the_plans_bound(clip_norm: float | None) -> None:
    worst, plan = search_latent(clip_norm)
    assert plan.dim == latent_dim(SCHEMA)
    assert 0 < worst <= plan.calibration.l2_sensitivity * (1 + 1e-12)


def test_latent_rows_outside_the_ball_are_refused_not_summed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dpfed.common.errors import ValidationError

    def no_clip(latent: np.ndarray, clip_norm: float) -> tuple[np.ndarray, int]:
        return np.asarray(latent, dtype=np.float64) / clip_norm, 0  # planted bug: no clip

    monkeypatch.setattr(synth_secure, "clip_to_unit_ball", no_clip)
    with pytest.raises(ValidationError, match="within the public bound"):
        search_latent(0.5)


# --------------------------------------------------------------------------- real runner


def _runner(tmp_path: Path, site: str, fed: Path, seed: int) -> TaskRunner:
    csv = tmp_path / f"{site}.csv"
    base_frame(80, seed=seed).to_csv(csv, index=False)
    source = open_data_source(spec_from_path(csv), SCHEMA)
    kit = fed / "sites" / site
    handler = SecureAggregationHandler(
        SiteIdentity.load(kit / "ca.pem", kit / "site.pem", kit / "site.key"),
        SecureAggregationPolicy(min_participants=2, tolerated=1,
                                federation_list=kit / "revoked.toml"))
    ledger = Ledger(tmp_path / f"{site}.sqlite", BudgetPolicy(1e4, 0.1))
    return TaskRunner(source, ledger, ("synth", "synth_eval", "secagg"),
                      handlers={**default_handlers(), "secagg": handler})


@pytest.fixture
def runners(tmp_path: Path) -> dict[str, TaskRunner]:
    fed = tmp_path / "fed"
    init_federation(fed, coordinator_hosts=["localhost"], sites=list(SITES), analysts=[])
    return {s: _runner(tmp_path, s, fed, i) for i, s in enumerate(SITES)}


def _secure_round(runners: dict[str, TaskRunner], task: Task, statistic: str, dim: int,
                  row_norm: float, epsilon: float
                  ) -> tuple[dict[str, bytes | Refusal], SecureSumPlan, np.ndarray | None]:
    plan = plan_for(statistic, dim=dim, total_rows=240, epsilon=epsilon, delta=1e-6,
                    participants=SITES, tolerated=1, row_norm=row_norm)
    contribute = Task(task.task_id, "j", "secagg", epsilon, 1e-6, task.params, task.arrays)
    answers, total = run_sum(runners, contribute, plan, row_norm)
    return answers, plan, total


def test_secure_synth_rounds_decode_to_the_pooled_statistics(
        runners: dict[str, TaskRunner]) -> None:
    size = sum(link_release.histogram_sizes(SCHEMA, N_BINS))
    answers, plan, total = _secure_round(
        runners, counts_task(), "weighted_counts", size,
        link_release.secure_link_row_norm(SCHEMA, N_BINS), 200.0)
    for s, answer in answers.items():
        assert isinstance(answer, bytes), answer
        result = result_from_bytes(answer)
        assert result.metadata["source"] == "synth_counts"
        (event,) = runners[s].ledger.events()
        assert event.mechanism == "secure-skellam[n=3,t=1]" and event.epsilon == 200.0
    pooled = np.zeros(size)
    for i in range(len(SITES)):
        acc = LinkHistogramAccumulator(SCHEMA, N_BINS)
        for table, _ in TableAccess(base_frame(80, seed=i)).iter_chunks():
            acc.add(table)
        pooled += acc.counts
    weights = link_release.secure_cell_weights(SCHEMA, N_BINS)
    assert total is not None
    decoded = total.astype(np.float64) / plan.scale / weights
    assert np.max(np.abs(decoded - pooled)) <= 3.0  # epsilon 200: noise sd ~ 0.1 count

    # the latent Gram: every site clips its latent rows into the unit ball
    dim = latent_dim(SCHEMA)
    answers, plan, total = _secure_round(runners, latent_task(), "gram", dim, 1.0, 200.0)
    assert total is not None and all(isinstance(a, bytes) for a in answers.values())
    gram = total.astype(np.float64) / plan.scale ** 2
    diag = gram[[i * dim - i * (i - 1) // 2 for i in range(dim)]]  # the upper triangle's diagonal
    assert 0 < diag.sum() <= 240 * (1 + 1e-3)  # trace = sum of squared norms <= N
    assert [len(r.ledger.events()) for r in runners.values()] == [2, 2, 2]


def test_a_tampered_links_digest_is_refused_before_any_charge(
        runners: dict[str, TaskRunner]) -> None:
    task = latent_task()
    tampered = task.arrays["link_proportions"].copy()
    tampered[0], tampered[1] = tampered[1] + 0.01, tampered[0] - 0.01
    bad = Task(task.task_id, task.job_id, task.kind, task.epsilon, task.delta, task.params,
               {"link_proportions": tampered})
    answers, _, _ = _secure_round(runners, bad, "gram", latent_dim(SCHEMA), 1.0, 1.0)
    for s, answer in answers.items():
        assert isinstance(answer, Refusal) and "link digest mismatch" in answer.reason
        assert runners[s].ledger.events() == []
    # a plan whose row bound is not the source's is refused too
    answers, _, _ = _secure_round(runners, latent_task(), "gram", latent_dim(SCHEMA), 2.0,
                                  1.0)
    assert all(isinstance(a, Refusal) and "row_norm" in a.reason for a in answers.values())


def test_required_sites_refuse_site_level_synth_and_no_site_runs_a_secure_jobs_round(
        runners: dict[str, TaskRunner]) -> None:
    assert "synth" in sum_kinds() and "synth_eval" not in sum_kinds()
    for source, statistic in (("pca", "gram"), ("query", "linear"),
                              ("synth_counts", "weighted_counts"), ("synth_latent", "gram")):
        kind, _round = secure_round(source, statistic)
        assert kind.name == source.split("_")[0]
    r = runners["hospital-a"]
    strict = TaskRunner(r.data, r.ledger, r.allowed_kinds, handlers=r.handlers,
                        secure_required_kinds=sum_kinds())
    links = Task("j/links", "j", "synth", 1.0, 1e-6, {**params(), "round": "links"})
    answer = strict.run(links)
    assert isinstance(answer, Refusal) and answer.code == "not_allowed"
    assert "requires secure aggregation for 'synth'" in answer.reason
    # a site-level round labelled as belonging to a secure job is refused by the handler
    labelled = Task("j/links", "j", "synth", 1.0, 1e-6,
                    {**params(aggregation="secure"), "round": "links"})
    for runner in (strict, r):
        answer = runner.run(labelled)
        assert isinstance(answer, Refusal) and "--aggregation secure" in answer.reason
    assert r.ledger.events() == []



def test_secure_synth_sources_leave_the_evaluation_holdout_out(tmp_path: Path) -> None:
    from dpfed.common.errors import ValidationError
    from dpfed.common.evaluation.holdout import training_count

    frame = base_frame(500, seed=3)
    task = Task("j/links-sum-1", "j", "secagg", 1.0, 1e-6,
                {"stage": "contribute", "source": "synth_counts",
                 "job": job_params(evaluate_rows=100), "schema_digest": SCHEMA.digest(),
                 "statistic": "weighted_counts", "scale": 1.0})
    given = synth_counts_contribution(task, TableAccess(frame), list(SITES[:2]), 0,
                                      site_dir=tmp_path)
    stat, n_rows = given.compute(np.random.default_rng(0))
    assert n_rows == training_count(len(frame)) < len(frame)
    # every row adds its column's weight once per column
    m = link_release.secure_link_weights(SCHEMA, N_BINS)
    assert int(stat.sum()) == n_rows * int(m.sum())
    # the same task twice reads the same training rows (the split is keyed, not random)
    again, _ = synth_counts_contribution(task, TableAccess(frame), list(SITES[:2]), 0,
                                         site_dir=tmp_path).compute(np.random.default_rng(1))
    assert np.array_equal(stat, again)
    # unbound (no site directory for the secret): refused, never computed on every row
    with pytest.raises(ValidationError, match="holdout needs the site's secret"):
        synth_counts_contribution(task, TableAccess(frame), list(SITES[:2]), 0)
