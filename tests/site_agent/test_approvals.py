"""Approval at the site: the policy's rules, the runner's gate and the steward's queue.

The gate sits before anything reads the site's rows: a held task is answered from the queue
alone (the data source below fails the test if it is read).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Any

import pytest

from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.errors import ConfigError, NotFoundError, ValidationError
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.transport.protocol import Refusal, RefusalCode, Task
from dpfed.site_agent import approvals
from dpfed.site_agent.approvals import ApprovalPolicy, ApprovalQueue
from dpfed.site_agent.config import load_site_config
from dpfed.site_agent.ledger import Ledger, StudyBudget
from dpfed.site_agent.runner import TaskRunner
from tests.common.test_config import SITE, write
from tests.support.schemas import AGE_BMI as SCHEMA

ONE_ROUND = {"n_components": 1, "rank": 2, "centering": "none", "clip_norm": "schema"}


class CountingData:
    """The site's table, counting the passes made over it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.passes = 0

    @property
    def schema(self) -> Any:
        return self.inner.schema

    def iter_chunks(self) -> Iterator[Any]:
        self.passes += 1
        return self.inner.iter_chunks()


@pytest.fixture
def data(tmp_path: Path) -> CountingData:
    csv = tmp_path / "data.csv"
    csv.write_text("age,bmi\n" + "".join(f"{20 + i % 60},{15 + i % 40}\n" for i in range(200)))
    return CountingData(open_data_source(spec_from_path(csv), SCHEMA))


def runner(tmp_path: Path, data: CountingData, policy: ApprovalPolicy) -> TaskRunner:
    ledger = Ledger(tmp_path / "ledger.sqlite", BudgetPolicy(5.0, 1e-4, accountant="basic"),
                    studies={"trial": StudyBudget(5.0, date(2099, 12, 31))})
    return TaskRunner(data, ledger, ("pca", "svt"), approval=policy)


def task(job: str = "job-1", analyst: str = "alice", epsilon: float = 1.0) -> Task:
    return Task(f"{job}/pca", job, "pca", epsilon, 1e-5, ONE_ROUND, analyst_id=analyst)


def test_rules_analyst_over_kind_over_default() -> None:
    policy = ApprovalPolicy("manual", {"svt": "auto"}, {"alice": "auto", "bob": "manual"})
    assert policy.manual("pca", "carol") and not policy.manual("svt", "carol")
    assert not policy.manual("pca", "alice") and policy.manual("svt", "bob")
    assert policy.manual("pca", "")  # an unattributed task follows the kind and the default
    assert not ApprovalPolicy().any_manual and ApprovalPolicy("auto", {"pca": "manual"}).any_manual


def test_held_until_approved_then_charged_once(tmp_path: Path, data: CountingData) -> None:
    r = runner(tmp_path, data, ApprovalPolicy("manual"))
    for _ in range(3):  # the coordinator's resends: one request, nothing read or charged
        held = r.run(task())
        assert isinstance(held, Refusal) and held.code is RefusalCode.AWAITING_APPROVAL
        assert "request 1" in held.reason
    assert data.passes == 0 and r.ledger.events() == []
    assert r.approvals is not None
    [request] = r.approvals.requests(pending_only=True)
    assert (request.job_id, request.analyst, request.kind, request.epsilon) == (
        "job-1", "alice", "pca", 1.0)
    assert '"n_components": 1' in request.params and request.payload_digest == task().digest()

    r.approvals.decide(request.id, "approved", decided_by="steward")
    first = r.run(task())
    assert isinstance(first, bytes) and len(r.ledger.events()) == 1
    assert r.run(task()) == first and len(r.ledger.events()) == 1  # a resend replays
    # A later task of the approved job runs without a new request.
    later = Task("job-1/pca-2", "job-1", "pca", 0.5, 1e-5, ONE_ROUND, analyst_id="alice")
    assert isinstance(r.run(later), bytes) and len(r.ledger.events()) == 2
    assert r.approvals.requests(pending_only=True) == []
    with pytest.raises(ValidationError, match="a decision is final"):
        r.approvals.decide(request.id, "denied")


def test_denied_refuses_with_the_reason_and_charges_nothing(tmp_path: Path,
                                                            data: CountingData) -> None:
    r = runner(tmp_path, data, ApprovalPolicy("manual"))
    r.run(task())
    assert r.approvals is not None
    r.approvals.decide(1, "denied", "outside the study protocol", decided_by="steward")
    refused = r.run(task())
    assert isinstance(refused, Refusal) and refused.code is RefusalCode.DENIED
    assert "outside the study protocol" in refused.reason
    assert data.passes == 0 and r.ledger.events() == []


def test_another_analyst_or_study_cannot_ride_on_an_approval(tmp_path: Path,
                                                              data: CountingData) -> None:
    r = runner(tmp_path, data, ApprovalPolicy("manual"))
    r.run(task())
    assert r.approvals is not None
    r.approvals.decide(1, "approved")
    other = r.run(Task("job-1/pca-b", "job-1", "pca", 1.0, 1e-5, ONE_ROUND, analyst_id="bob"))
    assert isinstance(other, Refusal) and other.code is RefusalCode.NOT_ALLOWED
    elsewhere = r.run(Task("job-1/pca-c", "job-1", "pca", 1.0, 1e-5, ONE_ROUND,
                           analyst_id="alice", study="trial"))
    assert isinstance(elsewhere, Refusal) and elsewhere.code is RefusalCode.NOT_ALLOWED
    assert r.ledger.events() == []


def test_auto_tasks_and_replays_pass_the_gate(tmp_path: Path, data: CountingData) -> None:
    r = runner(tmp_path, data, ApprovalPolicy("manual", analysts={"alice": "auto"}))
    assert isinstance(r.run(task()), bytes)
    assert r.approvals is not None and r.approvals.requests() == []
    assert r.ledger.lookup("job-1/pca") is not None


def test_the_queue_is_durable_and_decisions_are_append_only(tmp_path: Path,
                                                            data: CountingData) -> None:
    r = runner(tmp_path, data, ApprovalPolicy("manual"))
    r.run(task())
    reopened = ApprovalQueue(Ledger(tmp_path / "ledger.sqlite", BudgetPolicy(5.0, 1e-4)))
    assert [q.job_id for q in reopened.requests(pending_only=True)] == ["job-1"]
    reopened.decide(1, "denied")
    with sqlite3.connect(tmp_path / "ledger.sqlite") as conn, pytest.raises(
            sqlite3.IntegrityError, match="final"):
        conn.execute("UPDATE approval_decisions SET decision = 'approved'")
    with pytest.raises(NotFoundError, match="no approval request 7"):
        reopened.decide(7, "approved")
    with pytest.raises(ValidationError, match="--reason must be at most"):
        reopened.decide(1, "denied", "x" * 501)


def test_a_flood_of_jobs_is_bounded(tmp_path: Path, data: CountingData,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(approvals, "MAX_PENDING", 3)
    r = runner(tmp_path, data, ApprovalPolicy("manual"))
    codes = [r.run(task(job=f"job-{i}")) for i in range(4)]
    assert [c.code for c in codes if isinstance(c, Refusal)] == [
        RefusalCode.AWAITING_APPROVAL] * 3 + [RefusalCode.NOT_ALLOWED]
    assert r.approvals is not None and len(r.approvals.requests()) == 3


def test_policy_from_site_toml(tmp_path: Path) -> None:
    text = SITE.replace("[policy]\n", "[policy]\napproval = \"manual\"\n") + (
        "\n[policy.approval_kinds]\nsecagg = \"auto\"\n"
        "\n[policy.approval_analysts]\nalice = \"auto\"\n")
    cfg = load_site_config(write(tmp_path, text))
    assert cfg.approval == ApprovalPolicy("manual", {"secagg": "auto"}, {"alice": "auto"})
    assert load_site_config(write(tmp_path, SITE)).approval == ApprovalPolicy()


@pytest.mark.parametrize("extra, match", [
    ("[policy]\napproval = \"yes\"\n", "policy.approval must be one of auto, manual, got 'yes'"),
    ("[policy.approval_kinds]\nkmeans = \"manual\"\n",
     "policy.approval_kinds.kmeans: unknown task kind 'kmeans'"),
    ("[policy.approval_kinds]\npca = \"ask\"\n",
     "policy.approval_kinds.pca must be one of auto, manual, got 'ask'"),
    ("[policy.approval_analysts]\n\"a b\" = \"auto\"\n", "policy.approval_analysts.a b: "),
    ("[policy.approval_analysts]\nalice = 1\n",
     "policy.approval_analysts.alice must be one of auto, manual, got 1"),
])
def test_bad_approval_values_name_the_key(tmp_path: Path, extra: str, match: str) -> None:
    if extra.startswith("[policy]\n"):
        text = SITE.replace("[policy]\n", extra)
    else:
        text = SITE + "\n" + extra
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=match) as info:
        load_site_config(path)
    assert str(path) in str(info.value)
