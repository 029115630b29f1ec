"""A site answers every task it receives, never charges after the deadline, and sends a
committed result at once (issue 7, §2).

Real coordinator and site agent in one event loop (mTLS, SQLite ledger); malformed tasks are
put on the real stream through the coordinator's session, as a faulty or hostile coordinator
would send them.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from dpfed.common.jobs.contract import DataAccess, NewCharge, Release
from dpfed.common.pb.v1 import site_link_pb2, types_pb2
from dpfed.common.pb.v1.types_pb2 import Chunk
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.transport.protocol import Refusal, Task, TaskResult
from dpfed.common.transport.wire import struct_to_proto, task_to_bytes
from dpfed.site_agent.handlers import TaskHandler
from tests.aggregator.hardening_harness import harness

#: One-round pca tasks (the default job adds a DP mean and a norm round first).
ONE_ROUND = {"centering": "none", "clip_norm": "schema"}

pytestmark = pytest.mark.timeout(120)


class SlowHandler(TaskHandler):
    """A job kind whose exact computation takes ``params["seconds"]`` (like a big table)."""

    kind: ClassVar[str] = "slow"

    def prepare(self, task: Task, data: DataAccess) -> Release:
        time.sleep(float(task.params["seconds"]))
        cost = PrivacyCost(task.epsilon, task.delta, 0.01, "gaussian", 1.0, 1.0)
        return Release(NewCharge(cost), lambda rng: TaskResult(
            task.task_id, cost, {"x": rng.normal(size=2)}, {}))


def pca_task(task_id: str, **params: object) -> Task:
    return Task(task_id, task_id.split("/")[0], "pca", 1.0, 1e-5,
                {"n_components": 1, **ONE_ROUND, **params})


def raw_task(task_id: str, params: dict[str, object],
             arrays: list[types_pb2.NamedArray] | None = None) -> bytes:
    return types_pb2.TaskSpec(task_id=task_id, job_id="j", kind="pca", epsilon=1.0, delta=1e-5,
                              params=struct_to_proto(params),
                              arrays=arrays or []).SerializeToString()


async def test_every_malformed_task_gets_a_refusal_with_a_reason(tmp_path: Path) -> None:
    async with harness(tmp_path, honest=("hospital-1",), min_sites=1) as h:
        session = h.coordinator.registry.get("hospital-1")
        assert session is not None
        deadline = time.time() + 30
        bad_array = types_pb2.NamedArray(name="w", array=types_pb2.NDArray(
            dtype="<c16", shape=[2], data=b"\0" * 32))
        cases = {
            "nan param": (raw_task("j/nan", {"n_components": 1, "clip_norm": float("nan")}),
                          "clip_norm"),
            "long id": (task_to_bytes(pca_task("j/" + "x" * 400)), "task_id"),
            "nul id": (task_to_bytes(pca_task("j/a\x00b")), "task_id"),
            "bad array": (raw_task("j/arr", {"n_components": 1, **ONE_ROUND}, [bad_array]),
                          "decoded"),
            "not a task": (b"\xff\xfe garbage", "decoded"),
        }
        ids = {"nan param": "j/nan", "long id": "j/" + "x" * 400, "nul id": "j/a\x00b",
               "bad array": "j/arr", "not a task": "j/garbage"}

        async def ask(name: str) -> object:
            payload, _ = cases[name]
            return await asyncio.wait_for(session.submit(ids[name], payload, deadline), 10)

        answers = dict(zip(cases, await asyncio.gather(*(ask(n) for n in cases),
                                                       return_exceptions=True), strict=True))
        # A transfer that breaks the chunking rules is refused by its id too.
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        session.pending["j/chunks"] = fut  # type: ignore[assignment]
        session.outbox.put_nowait(site_link_pb2.CoordinatorMessage(task=site_link_pb2.TaskChunk(
            deadline_unix_ms=int(deadline * 1000),
            chunk=Chunk(transfer_id="j/chunks", index=3, last=True, data=b"x", total_size=1))))
        broken = await asyncio.wait_for(fut, 10)
        events = h.ledgers["hospital-1"].events()
    for name, (_, word) in cases.items():
        answer = answers[name]
        assert isinstance(answer, Refusal), (name, answer)
        assert answer.code == "invalid" and word in answer.reason, (name, answer)
    assert isinstance(broken, Refusal) and "chunk" in broken.reason
    assert events == []


async def test_a_task_whose_deadline_passes_during_its_computation_is_not_charged(
        tmp_path: Path) -> None:
    async with harness(tmp_path, honest=("hospital-1",), min_sites=1,
                       agent_handlers={"slow": SlowHandler()}, extra_kinds=("slow",)) as h:
        session = h.coordinator.registry.get("hospital-1")
        assert session is not None
        task = Task("j/slow", "j", "slow", 1.0, 1e-5, {"seconds": 1.5})
        answer = await asyncio.wait_for(
            session.submit(task.task_id, task_to_bytes(task), time.time() + 0.5), 10)
        events = h.ledgers["hospital-1"].events()
    assert isinstance(answer, Refusal) and answer.code == "deadline", answer
    assert events == []


async def test_a_committed_result_does_not_wait_behind_the_next_task(tmp_path: Path) -> None:
    async with harness(tmp_path, honest=("hospital-1",), min_sites=1,
                       agent_handlers={"slow": SlowHandler()}, extra_kinds=("slow",)) as h:
        session = h.coordinator.registry.get("hospital-1")
        assert session is not None
        deadline = time.time() + 30
        fast = pca_task("j/fast")
        slow = Task("j/slow", "j", "slow", 1.0, 1e-5, {"seconds": 3.0})
        t0 = time.monotonic()
        first = asyncio.ensure_future(session.submit(fast.task_id, task_to_bytes(fast),
                                                     deadline))
        second = asyncio.ensure_future(session.submit(slow.task_id, task_to_bytes(slow),
                                                      deadline))
        answer = await asyncio.wait_for(first, 10)
        latency = time.monotonic() - t0
        await asyncio.wait_for(second, 10)
    assert isinstance(answer, TaskResult) and np.all(np.isfinite(answer.arrays["factor"]))
    assert latency < 2.0, f"the result waited {latency:.2f}s behind a 3 s task"
