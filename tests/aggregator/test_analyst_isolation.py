"""Jobs, SVT sessions, request ids and results belong to the analyst who made them (issue 19).

A real coordinator (grpc.aio on loopback, mTLS with certificates from ``dpfed certs``, SQLite
store) with real site agents and ledgers, and two analysts with their own certificates:
``analyst`` (the federation's) and ``mallory`` (issued with ``dpfed certs issue``). The site's
own check -- a continuation's analyst must be the opener's -- runs on the real task runner,
ledger and SVT session store.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import numpy as np
import pandas as pd
import pytest

from dpfed.aggregator.config import load_aggregator_config
from dpfed.aggregator.store import JobStore
from dpfed.common.data.encoding import encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.pb.v1 import analyst_pb2, analyst_pb2_grpc
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.transport.certs import issue_certificate
from dpfed.common.transport.grpc_options import channel_options
from dpfed.common.transport.protocol import JobInfo, JobSpec, Refusal, Task
from dpfed.common.transport.wire import job_event_from_proto, job_info_from_proto, job_spec_to_proto
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner
from tests.aggregator.hardening_harness import Harness, creds, harness

pytestmark = pytest.mark.timeout(180)

QUERIES = [{"name": "everybody"}]
OPEN = JobSpec("svt", 1.0, 0.0, {"queries": QUERIES, "threshold": 10.0, "cutoff": 1},
               min_sites=2, deadline_seconds=20.0)


class Analyst:
    """An analyst's mTLS channel to the harness coordinator."""

    def __init__(self, h: Harness, name: str) -> None:
        if name != "analyst":
            issue_certificate(h.fed.certs, role="analyst", name=name)  # also admits it
        kit = h.fed.certs / "analysts" / name
        self.channel = grpc.aio.secure_channel(h.fed.address, creds(kit, "analyst"),
                                               options=channel_options())
        self.stub = analyst_pb2_grpc.AnalystStub(self.channel)

    async def submit(self, spec: JobSpec, request_id: str = "") -> JobInfo:
        final = None
        async for msg in self.stub.SubmitJob(analyst_pb2.SubmitJobRequest(
                spec=job_spec_to_proto(spec), request_id=request_id), timeout=60):
            event = job_event_from_proto(msg)
            final = event.job or final
        assert final is not None
        return final

    async def job(self, job_id: str) -> JobInfo:
        return job_info_from_proto(await self.stub.GetJob(
            analyst_pb2.GetJobRequest(job_id=job_id), timeout=10))

    async def job_ids(self) -> set[str]:
        resp = await self.stub.ListJobs(analyst_pb2.ListJobsRequest(limit=100), timeout=10)
        return {j.job_id for j in resp.jobs}

    async def fetch(self, job_id: str) -> int:
        size = 0
        async for chunk in self.stub.FetchResult(analyst_pb2.FetchResultRequest(job_id=job_id),
                                                 timeout=10):
            size += len(chunk.data)
        return size

    async def cancel(self, job_id: str) -> JobInfo:
        return job_info_from_proto(await self.stub.CancelJob(
            analyst_pb2.CancelJobRequest(job_id=job_id), timeout=20))


async def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code()


async def test_another_analyst_cannot_see_continue_or_close_a_session(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        alice, mallory = Analyst(h, "analyst"), Analyst(h, "mallory")
        opened = await alice.submit(OPEN, request_id="req-1")
        assert opened.state == "succeeded", opened.error
        charged = {s: len(h.ledgers[s].events()) for s in h.ledgers}
        jobs_before = len(h.coordinator.store.list_jobs(100))

        # Continue and close with the opener's session id: refused as if it did not exist.
        for params in ({"session": opened.job_id, "queries": QUERIES},
                       {"session": opened.job_id, "close": True}):
            spec = JobSpec("svt", 1.0, 0.0, params, min_sites=2, deadline_seconds=20.0)
            assert await code_of(mallory.submit(spec)) == grpc.StatusCode.NOT_FOUND
        assert len(h.coordinator.store.list_jobs(100)) == jobs_before  # nothing dispatched
        # Nor can mallory read, list, watch or fetch it.
        assert await code_of(mallory.job(opened.job_id)) == grpc.StatusCode.NOT_FOUND
        assert await code_of(mallory.fetch(opened.job_id)) == grpc.StatusCode.NOT_FOUND
        assert await code_of(mallory.cancel(opened.job_id)) == grpc.StatusCode.NOT_FOUND
        assert opened.job_id not in await mallory.job_ids()

        # The same request id from mallory is a new job of mallory's, not alice's.
        own = await mallory.submit(OPEN, request_id="req-1")
        assert own.job_id != opened.job_id and own.submitted_by == "analyst/mallory"
        assert await mallory.job_ids() == {own.job_id}
        assert await alice.job_ids() == {opened.job_id}
        # The opener continues her own session at no charge.
        batch = await alice.submit(JobSpec("svt", 1.0, 0.0, {"session": opened.job_id,
                                                              "queries": QUERIES},
                                           min_sites=2, deadline_seconds=20.0))
        assert batch.state == "succeeded", batch.error
        assert {s: len(h.ledgers[s].events()) for s in h.ledgers} == {
            s: n + 1 for s, n in charged.items()}  # mallory's own opening, nothing else
        await alice.channel.close()
        await mallory.channel.close()


async def test_a_group_reads_each_others_jobs_but_never_continues_or_cancels(
        tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await h.coordinator.stop(grace=0.1)  # restart with [access] groups and an admin
        from dpfed.aggregator.server import start_coordinator

        config = dataclasses.replace(load_aggregator_config(h.fed.aggregator_config),
                                     listen=f"127.0.0.1:{h.fed.port}",
                                     read_groups={"team": ("analyst", "mallory")},
                                     admins=("ops",))
        h.coordinator = await start_coordinator(config)
        for site_id in h.agents:
            await h.wait_connected(site_id)
        alice, mallory, ops = (Analyst(h, n) for n in ("analyst", "mallory", "ops"))
        opened = await alice.submit(OPEN)
        assert (await mallory.job(opened.job_id)).job_id == opened.job_id
        assert await mallory.fetch(opened.job_id) > 0
        assert opened.job_id in await mallory.job_ids()
        spec = JobSpec("svt", 1.0, 0.0, {"session": opened.job_id, "close": True},
                       min_sites=2, deadline_seconds=20.0)
        assert await code_of(mallory.submit(spec)) == grpc.StatusCode.PERMISSION_DENIED
        assert await code_of(ops.submit(spec)) == grpc.StatusCode.PERMISSION_DENIED
        assert await code_of(mallory.cancel(opened.job_id)) == grpc.StatusCode.PERMISSION_DENIED
        assert (await ops.cancel(opened.job_id)).state == "succeeded"  # finished: unchanged
        assert opened.job_id in await ops.job_ids()
        for a in (alice, mallory, ops):
            await a.channel.close()


SCHEMA = Schema.from_toml('[[columns]]\nname = "age"\ntype = "continuous"\nmin = 0\n'
                          'max = 100\n')


class Rows:
    """A site's rows in memory (the DataAccess the handlers read)."""

    encoded = encode_table(SCHEMA, pd.DataFrame({"age": np.linspace(1, 99, 50)}))

    @property
    def schema(self) -> Schema:
        return SCHEMA

    def iter_chunks(self):  # type: ignore[no-untyped-def]
        yield self.encoded


def test_a_site_refuses_a_continuation_by_another_analyst(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite", BudgetPolicy(10.0, 1e-3))
    runner = TaskRunner(Rows(), ledger, ("svt",))
    canonical = [{"name": "everybody", "where": {"true": True}}]
    opened = runner.run(Task("job-a/svt", "job-a", "svt", 1.0, 0.0,
                             {"session": "job-a", "action": "open", "queries": canonical,
                              "threshold": 10.0, "cutoff": 1}, analyst_id="alice"))
    assert isinstance(opened, bytes)
    for action, params in (("batch", {"queries": canonical}), ("close", {})):
        answer = runner.run(Task(f"job-m{action}/svt", f"job-m{action}", "svt", 0.0, 0.0,
                                 {"session": "job-a", "action": action, **params},
                                 analyst_id="mallory"))
        assert isinstance(answer, Refusal) and answer.code == "not_allowed", answer
        assert "another analyst opened" in answer.reason
    assert len(ledger.events()) == 1
    mine = runner.run(Task("job-b/svt", "job-b", "svt", 0.0, 0.0,
                           {"session": "job-a", "action": "batch", "queries": canonical},
                           analyst_id="alice"))
    assert isinstance(mine, bytes)
    ledger.close()


def test_request_ids_of_a_version_1_store_are_scoped_after_the_upgrade(tmp_path: Path) -> None:
    import sqlite3

    store = JobStore(tmp_path)
    job, _ = store.create_job(OPEN, submitted_by="analyst/a", request_id="r")
    store.close()
    db = sqlite3.connect(tmp_path / "jobs.sqlite")  # what version 1 wrote: one namespace
    db.executescript("""
        CREATE TABLE old AS SELECT * FROM jobs; DROP TABLE jobs;
        CREATE TABLE jobs (job_id TEXT PRIMARY KEY, request_id TEXT UNIQUE, kind TEXT NOT NULL,
          spec_json TEXT NOT NULL, state TEXT NOT NULL, created TEXT NOT NULL,
          updated TEXT NOT NULL, error TEXT NOT NULL DEFAULT '',
          sites_json TEXT NOT NULL DEFAULT '[]', summary_json TEXT NOT NULL DEFAULT '{}',
          submitted_by TEXT NOT NULL DEFAULT '', result_file TEXT NOT NULL DEFAULT '',
          result_size INTEGER NOT NULL DEFAULT 0);
        INSERT INTO jobs SELECT * FROM old; DROP TABLE old;
        UPDATE meta SET value = '1' WHERE key = 'schema_version';""")
    db.close()
    store = JobStore(tmp_path)
    assert store.create_job(OPEN, submitted_by="analyst/a", request_id="r") == (job, False)
    other, created = store.create_job(OPEN, submitted_by="analyst/b", request_id="r")
    assert created and other.job_id != job.job_id
    assert store.list_jobs(10, submitted_by=["analyst/b"]) == [other]
    store.close()
