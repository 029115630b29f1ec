"""Per-analyst budget shares: enforced in the site's ledger, atomically, end to end.

Real SQLite ledgers (several processes at once), and a real coordinator + site over mTLS with
certificates from the project's certs tool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import multiprocessing
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from dpfed import __version__
from dpfed.aggregator.config import load_aggregator_config
from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.aggregator.server import RunningCoordinator, start_coordinator
from dpfed.common.data.data_sources import open_data_source, scan, spec_from_path
from dpfed.common.data.schema import Schema
from dpfed.common.errors import BudgetExceededError, ConfigError, ValidationError
from dpfed.common.pb.v1 import analyst_pb2, analyst_pb2_grpc
from dpfed.common.privacy.accounting import BudgetPolicy, PrivacyCost
from dpfed.common.transport import certs
from dpfed.common.transport.grpc_options import channel_options
from dpfed.common.transport.protocol import PROTOCOL_VERSION, JobInfo, JobSpec, SiteHello
from dpfed.common.transport.tls import load_channel_credentials
from dpfed.common.transport.wire import job_info_from_proto, job_spec_to_proto
from dpfed.site_agent.agent import SiteAgent
from dpfed.site_agent.config import load_site_config
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner

POLICY = BudgetPolicy(epsilon=10.0, delta=1e-4, accountant="basic")
TIMEOUT = 30.0


def _cost(eps: float) -> PrivacyCost:
    return PrivacyCost(eps, 1e-6, eps * eps / 2, "gaussian", 1.0, 1.0)


def _charge(ledger: Ledger, task: str, eps: float, analyst: str) -> bool:
    try:
        ledger.charge_and_release(task_id=task, job_id="j", kind="pca",
                                  payload_digest=hashlib.sha256(task.encode()).hexdigest(),
                                  cost=_cost(eps), release=lambda: b"noisy",
                                  analyst=analyst)
    except BudgetExceededError:
        return False
    return True


def test_an_analyst_share_caps_their_tasks_and_only_theirs(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.sqlite", POLICY, analyst_budgets={"alice": 2.0})
    assert _charge(ledger, "t1", 1.5, "alice")
    with pytest.raises(BudgetExceededError, match=r"analyst 'alice'.*epsilon 2 of 10"):
        ledger.charge_and_release(task_id="t2", job_id="j", kind="pca",
                                  payload_digest="ab" * 32, cost=_cost(1.0),
                                  release=lambda: pytest.fail("noise drawn"), analyst="alice")
    assert _charge(ledger, "t3", 0.5, "alice")  # exactly the share is allowed
    assert _charge(ledger, "t4", 5.0, "bob")  # no share for bob: the total only
    assert not _charge(ledger, "t5", 4.0, "bob")  # 2 + 5 + 4 > 10
    assert [e.task_id for e in ledger.events()] == ["t1", "t3", "t4"]
    assert [r.task_id for r in ledger.refusals()] == ["t2", "t5"]
    status = ledger.analyst_status("alice")
    assert status is not None and status.epsilon_spent == pytest.approx(2.0)
    assert ledger.analyst_of("t4") == "bob" and ledger.analyst_of("t1") == "alice"
    # A ledger opened later with a share for bob counts bob's past spend against it.
    again = Ledger(tmp_path / "l.sqlite", POLICY, analyst_budgets={"bob": 5.5})
    assert not _charge(again, "t6", 1.0, "bob")
    assert _charge(again, "t7", 0.5, "bob")


def test_zcdp_share_uses_the_same_accountant(tmp_path: Path) -> None:
    policy = BudgetPolicy(epsilon=10.0, delta=1e-5, accountant="zcdp")
    ledger = Ledger(tmp_path / "l.sqlite", policy, analyst_budgets={"alice": 1.0})
    assert not _charge(ledger, "big", 1.0, "alice")  # rho 0.5 alone exceeds epsilon 1
    assert _charge(ledger, "small", 0.05, "alice")


def test_analyst_attribution_is_validated_and_append_only(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="analyst_budgets"):
        Ledger(tmp_path / "l.sqlite", POLICY, analyst_budgets={"alice": float("nan")})
    ledger = Ledger(tmp_path / "l.sqlite", POLICY)
    with pytest.raises(ValidationError, match="analyst"):
        _charge(ledger, "t", 0.1, "x" * 500)
    assert _charge(ledger, "t", 0.1, "alice")
    conn = sqlite3.connect(tmp_path / "l.sqlite")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("UPDATE ledger_task_analysts SET analyst = 'bob'")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("DELETE FROM ledger_task_analysts")
    conn.close()


def _race_worker(db: str, task: str, go: multiprocessing.synchronize.Event,
                 out: multiprocessing.queues.Queue[bool]) -> None:
    ledger = Ledger(db, POLICY, analyst_budgets={"alice": 3.0})
    go.wait()
    out.put(_charge(ledger, task, 1.0, "alice"))


def test_concurrent_processes_never_exceed_an_analyst_share(tmp_path: Path) -> None:
    db = str(tmp_path / "l.sqlite")
    Ledger(db, POLICY)  # create the file once
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    out: multiprocessing.queues.Queue[bool] = ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(db, f"t{i}", go, out)) for i in range(8)]
    for p in procs:
        p.start()
    go.set()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    # Each alone fits the share; together exactly three may be charged (3 x 1.0 = 3.0).
    assert sorted(results) == [False] * 5 + [True] * 3
    assert len(Ledger(db, POLICY).events()) == 3


def test_site_config_reads_analyst_shares_and_refuses_bad_ones(tmp_path: Path) -> None:
    fed = LocalFederation.create(tmp_path / "fed", n_sites=1, rows=20, features=3, seed=2,
                                 settings=SiteSettings(analyst_budgets=(("alice", 2.0),)))
    path = fed.site_config("hospital-1")
    assert load_site_config(path).analyst_budgets == {"alice": 2.0}
    text = path.read_text()
    for bad, match in (("alice = 20.0", "exceeds budget.epsilon"), ("alice = -1.0", "alice"),
                       ("Alice = 1.0", "analyst id")):
        path.write_text(text.replace("alice = 2.0", bad))
        with pytest.raises(ConfigError, match=match):
            load_site_config(path)


# ------------------------------------------------------------------ through the coordinator


@pytest.fixture
async def federation(tmp_path: Path) -> AsyncIterator[tuple[LocalFederation, RunningCoordinator,
                                                            Ledger]]:
    fed = LocalFederation.create(
        tmp_path / "fed", n_sites=1, rows=200, features=4, seed=3,
        # basic accountant: two jobs of 0.8 then add up to 1.6 > the share (under the default
        # pld accountant their Gaussian rounds compose to less than 1)
        settings=SiteSettings(connect_timeout_s=10, analyst_budgets=(("analyst", 1.0),),
                              accountant="basic"))
    certs.issue_certificate(fed.certs, role="analyst", name="bob")
    config = dataclasses.replace(load_aggregator_config(fed.aggregator_config),
                                 listen="127.0.0.1:0")
    coordinator = await start_coordinator(config)
    fed.port = coordinator.port
    site_cfg = load_site_config(fed.site_config("hospital-1"), {"coordinator": fed.address})
    schema = Schema.load(site_cfg.data.schema)
    source = open_data_source(spec_from_path(site_cfg.data.path), schema)
    rows = scan(source).rows_kept
    ledger = Ledger(site_cfg.ledger_path, site_cfg.budget,
                    analyst_budgets=site_cfg.analyst_budgets)
    assert site_cfg.tls is not None
    agent = SiteAgent(
        address=fed.address,
        credentials=load_channel_credentials(site_cfg.tls.ca, site_cfg.tls.cert,
                                             site_cfg.tls.key, role="site"),
        runner=TaskRunner(source, ledger, site_cfg.allowed_jobs), connect_timeout_s=10,
        hello=lambda: SiteHello(__version__, PROTOCOL_VERSION, schema.digest(), rows,
                                site_cfg.allowed_jobs, None, ledger.status()))
    task = asyncio.create_task(agent.run())
    for _ in range(200):
        if coordinator.registry.get("hospital-1") is not None:
            break
        await asyncio.sleep(0.05)
    try:
        yield fed, coordinator, ledger
    finally:
        agent.stop()
        await coordinator.stop(grace=0.5)
        await asyncio.wait_for(task, 15)


async def _run_job(fed: LocalFederation, analyst: str, eps: float) -> JobInfo:
    kit = fed.certs / "analysts" / analyst
    creds = load_channel_credentials(kit / "ca.pem", kit / "analyst.pem", kit / "analyst.key")
    async with grpc.aio.secure_channel(fed.address, creds, options=channel_options()) as ch:
        one_round = {"n_components": 2, "centering": "none", "clip_norm": "schema"}
        spec = JobSpec("pca", eps, 1e-6, one_round, min_sites=1)
        last = None
        async for event in analyst_pb2_grpc.AnalystStub(ch).SubmitJob(
                analyst_pb2.SubmitJobRequest(spec=job_spec_to_proto(spec)), timeout=TIMEOUT):
            last = event
        assert last is not None and last.HasField("job")
        return job_info_from_proto(last.job)


async def test_the_coordinator_attributes_tasks_and_the_site_enforces_the_share(
        federation: tuple[LocalFederation, RunningCoordinator, Ledger]) -> None:
    fed, _, ledger = federation
    first = await _run_job(fed, "analyst", 0.8)
    assert first.state == "succeeded", first.error
    second = await _run_job(fed, "analyst", 0.8)  # 1.6 > the site's share of 1.0
    assert second.state == "failed"
    assert any("analyst 'analyst'" in s.reason for s in second.sites), second.sites
    other = await _run_job(fed, "bob", 0.8)  # another analyst: only the total applies
    assert other.state == "succeeded", other.error
    events = ledger.events()
    assert len(events) == 2
    assert [ledger.analyst_of(e.task_id) for e in events] == ["analyst", "bob"]
    refused = ledger.refusals()
    assert len(refused) == 1 and "analyst 'analyst'" in refused[0].message


def test_the_analyst_id_travels_with_the_task_and_leaves_the_digest_alone() -> None:
    from dpfed.common.transport.protocol import Task
    from dpfed.common.transport.wire import task_from_bytes, task_to_bytes

    task = Task("j/r", "j", "pca", 1.0, 1e-6, {"n_components": 2}, {}, "alice")
    decoded = task_from_bytes(task_to_bytes(task))
    assert decoded.analyst_id == "alice"
    assert decoded.digest() == dataclasses.replace(task, analyst_id="").digest()
