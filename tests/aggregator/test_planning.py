"""The planner: analysts' specs are decoded and validated in bounded worker processes.

Real worker processes (forked from the planner's fork server). A request that needs more
memory or time than allowed, or whose worker dies (here: SIGSEGV sent to it mid-request, as a
crash in a native library would), is refused with a ValidationError naming what happened, and
the next request is served by a fresh worker.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from pathlib import Path

import pytest

from dpfed.aggregator.federation import Federation
from dpfed.aggregator.planning import Planner
from dpfed.common.data.demo_data import write_demo
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.transport.protocol import JobSpec
from dpfed.common.transport.wire import job_spec_to_proto

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    schema_path, _ = write_demo(tmp_path_factory.mktemp("demo"), 1, 10, 5, seed=0, mixed=True)
    return Federation(Schema.load(Path(schema_path)))


def wire(spec: JobSpec) -> bytes:
    return job_spec_to_proto(spec).SerializeToString()


def query(bins: int, workload: str = "all_range") -> bytes:
    return wire(JobSpec("query", 1.0, 0.0, {"domain": {"columns": ["age"],
                                                       "bins": {"age": bins}},
                                            "workload": {"kind": workload}}))


def heavy_svt(n: int = 120) -> bytes:
    """``n`` predicate queries of 82 nodes (120: about the most work a query set may hold)."""
    queries = [{"name": f"q{i}", "where": {"any": [
        {"column": col, "op": ">=", "value": lo + (hi - lo) * (j + 1 + (i % 7) / 100) / 28}
        for col, lo, hi in (("age", 0, 110), ("bmi", 10, 70), ("systolic_bp", 60, 250))
        for j in range(27)]}} for i in range(n)]
    return wire(JobSpec("svt", 1.0, 0.0, {"queries": queries, "threshold": 5.0}))


async def test_a_valid_spec_comes_back_canonical_and_an_invalid_one_names_its_field(
        federation: Federation) -> None:
    planner = Planner(federation)
    try:
        spec = await planner.plan(query(8))
        assert spec.kind == "query" and spec.params["strategy"] == "auto"
        with pytest.raises(ValidationError, match="epsilon"):
            await planner.plan(wire(JobSpec("query", -1.0, 0.0, {})))
        with pytest.raises(ValidationError, match="cannot be decoded"):
            await planner.plan(b"\xff\xff\xff")
    finally:
        planner.close()


async def test_a_request_over_the_memory_limit_is_refused_and_the_worker_survives(
        federation: Federation) -> None:
    planner = Planner(federation, memory_bytes=64 << 20)
    try:
        # A 16 MB message decodes to a few hundred MB of Python objects.
        with pytest.raises(ValidationError, match="needs more than 0.0625 GiB to validate"):
            await planner.plan(heavy_svt(3300))
        assert (await planner.plan(query(4))).kind == "query"
    finally:
        planner.close()


async def test_a_request_over_the_time_limit_is_refused(federation: Federation) -> None:
    planner = Planner(federation, timeout_s=0.01)
    try:
        with pytest.raises(ValidationError, match="took longer than 0.01s"):
            await planner.plan(heavy_svt())
    finally:
        planner.close()


async def test_a_crashed_worker_refuses_its_request_and_is_replaced(
        federation: Federation) -> None:
    # a busy worker of an earlier test's planner may still be finishing its request (close()
    # leaves it to end on its own): on a loaded machine it is alive here too
    earlier = {p.pid for p in multiprocessing.active_children() if p.name == "dpfed-planner"}
    planner = Planner(federation, workers=1)
    try:
        await planner.plan(query(4))  # the worker is up
        (worker,) = [p for p in multiprocessing.active_children()
                     if p.name == "dpfed-planner" and p.pid not in earlier]
        pending = asyncio.ensure_future(planner.plan(heavy_svt()))
        await asyncio.sleep(0.2)
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGSEGV)
        with pytest.raises(ValidationError, match=r"crashed its worker process \(exit code -11\)"):
            await pending
        assert (await planner.plan(query(4))).kind == "query"  # a fresh worker
    finally:
        planner.close()
