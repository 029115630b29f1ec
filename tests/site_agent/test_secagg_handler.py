"""The site's secure-aggregation step through the real runner and ledger: the key exchange
charges nothing, an honest contribution is charged once with the mode recorded, and a key
substituted by the coordinator (or replayed from another round) is refused before anything is
charged. Certificates come from the project's own CA tool."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.secagg.dropouts import RoundKeys
from dpfed.common.secagg.messages import plan_params
from dpfed.common.secagg.policy import SecureAggregationPolicy
from dpfed.common.secagg.secure_sum import plan_gram
from dpfed.common.transport.certs import init_federation
from dpfed.common.transport.protocol import Refusal, Task
from dpfed.common.transport.wire import result_from_bytes
from dpfed.site_agent.handlers import default_handlers
from dpfed.site_agent.handlers.secagg import SecureAggregationHandler, SiteIdentity
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner
from tests.support.schemas import AGE_BMI as SCHEMA
from tests.support.secure_driver import dealt

SITES = ("hospital-a", "hospital-b", "hospital-c")
JOB = "job-9"
SUM = "pca-sum-1"


def _runner(tmp_path: Path, site: str, fed: Path) -> TaskRunner:
    csv = tmp_path / f"{site}.csv"
    rng = np.random.default_rng(len(site))
    pd.DataFrame({"age": rng.uniform(0, 100, 200), "bmi": rng.uniform(10, 60, 200)}).to_csv(
        csv, index=False)
    source = open_data_source(spec_from_path(csv), SCHEMA)
    kit = fed / "sites" / site
    handler = SecureAggregationHandler(
        SiteIdentity.load(kit / "ca.pem", kit / "site.pem", kit / "site.key"),
        SecureAggregationPolicy(min_participants=2, tolerated=1,
                                federation_list=kit / "revoked.toml"))
    ledger = Ledger(tmp_path / f"{site}.sqlite", BudgetPolicy(10.0, 1e-3))
    return TaskRunner(source, ledger, ("pca", "secagg"),
                      handlers={**default_handlers(), "secagg": handler})


@pytest.fixture
def runners(tmp_path: Path) -> dict[str, TaskRunner]:
    fed = tmp_path / "fed"
    init_federation(fed, coordinator_hosts=["localhost"], sites=list(SITES), analysts=[])
    return {s: _runner(tmp_path, s, fed) for s in SITES}


def _keys(runners: dict[str, TaskRunner]) -> dict[str, dict[str, np.ndarray]]:
    task = Task(f"{JOB}/pca-keys-1", JOB, "secagg", 0.0, 0.0,
                {"stage": "keys", "job_id": JOB, "sum_round": SUM,
                 "sum_task_id": f"{JOB}/{SUM}"})
    out = {}
    for s, r in runners.items():
        answer = r.run(task)
        assert isinstance(answer, bytes)
        result = result_from_bytes(answer)
        assert result.metadata["tolerated"] == 1 and result.spend.epsilon == 0.0
        out[s] = result.arrays
        assert r.run(task) == answer  # a retried keys task gets the same key back
    return out


def _contribute(arrays: dict[str, np.ndarray]) -> Task:
    plan = plan_gram(dim=2, total_rows=600, epsilon=1.0, delta=1e-5, participants=SITES,
                     tolerated=1)
    params = {"stage": "contribute", "sum_round": SUM, **plan_params(plan, row_norm=1.0)}
    return Task(f"{JOB}/{SUM}", JOB, "secagg", 1.0, 1e-5, params, arrays)


def test_keys_are_free_and_an_honest_contribution_is_charged_once(
        runners: dict[str, TaskRunner]) -> None:
    _keys(runners)  # free, and the same keys on a retry
    arrays = dealt(runners, job_id=JOB, sum_round=SUM)
    for s, r in runners.items():
        assert r.ledger.events() == []  # keys and shares are free
        answer = r.run(_contribute(arrays[s]))
        assert isinstance(answer, bytes), answer
        masked = result_from_bytes(answer).arrays["masked"]
        assert masked.dtype == np.uint64 and masked.shape == (3,)
        (event,) = r.ledger.events()
        assert event.mechanism == "secure-skellam[n=3,t=1]"
        assert event.epsilon == 1.0


def test_a_substituted_key_is_refused_and_nothing_is_charged(
        runners: dict[str, TaskRunner]) -> None:
    keys = _keys(runners)
    relayed = {k: v for arrays in keys.values() for k, v in arrays.items()}
    evil = RoundKeys.generate().public  # the coordinator's own keys in place of hospital-b's
    relayed["public_key/hospital-b"] = np.frombuffer(evil, np.uint8).copy()
    answer = runners["hospital-a"].run(Task(
        f"{JOB}/pca-shares-1", JOB, "secagg", 0.0, 0.0,
        {"stage": "shares", "job_id": JOB, "sum_round": SUM, "sum_task_id": f"{JOB}/{SUM}",
         "participants": list(SITES), "tolerated": 1}, relayed))
    assert isinstance(answer, Refusal) and answer.code == "invalid"
    assert "substituted or replayed" in answer.reason
    # no shares dealt, so no contribution either
    answer = runners["hospital-a"].run(_contribute(relayed))
    assert isinstance(answer, Refusal) and "dealt no shares" in answer.reason
    assert runners["hospital-a"].ledger.events() == []


def test_a_round_below_the_site_policy_is_refused(runners: dict[str, TaskRunner]) -> None:
    arrays = dealt(runners, job_id=JOB, sum_round=SUM)
    task = _contribute(arrays["hospital-a"])
    weak = Task(task.task_id, task.job_id, task.kind, task.epsilon, task.delta,
                {**task.params, "tolerated": 0}, task.arrays)
    answer = runners["hospital-a"].run(weak)
    assert isinstance(answer, Refusal) and "t differs" in answer.reason
    assert runners["hospital-a"].ledger.events() == []


def test_a_site_that_requires_secure_aggregation_refuses_site_level_pca(
        tmp_path: Path, runners: dict[str, TaskRunner]) -> None:
    r = runners["hospital-a"]
    strict = TaskRunner(r.data, r.ledger, r.allowed_kinds, handlers=r.handlers,
                        secure_required_kinds=("pca",))
    answer = strict.run(Task("job-1/pca", "job-1", "pca", 1.0, 1e-5,
                             {"n_components": 1, "rank": 2}))
    assert isinstance(answer, Refusal) and "requires secure aggregation" in answer.reason
    assert r.ledger.events() == []
