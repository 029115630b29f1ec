"""Wire round-trips and decode-time validation (dpfed.common.transport.wire)."""

from __future__ import annotations

import numpy as np
import pytest

from dpfed.common.errors import ProtocolError
from dpfed.common.pb.v1.types_pb2 import NDArray
from dpfed.common.privacy.accounting import BudgetStatus, PrivacyCost
from dpfed.common.transport.protocol import (
    JobEvent,
    JobInfo,
    JobSpec,
    Refusal,
    SiteHello,
    SiteInfo,
    SiteOutcome,
    Task,
    TaskResult,
)
from dpfed.common.transport.wire import (
    Reassembler,
    array_from_proto,
    array_to_proto,
    hello_from_proto,
    hello_to_proto,
    iter_chunks,
    job_event_from_proto,
    job_event_to_proto,
    job_info_from_proto,
    job_info_to_proto,
    refusal_from_proto,
    refusal_to_proto,
    result_from_bytes,
    result_to_bytes,
    site_info_from_proto,
    site_info_to_proto,
    task_from_bytes,
    task_to_bytes,
)


@pytest.mark.parametrize("dtype", ["<f8", "<f4", "<i8", "<i4", "|u1", "|b1"])
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 5), (2, 3, 4)])
def test_array_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(shape) * 10).astype(dtype)
    b = array_from_proto(array_to_proto(a))
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(a, b)


def test_big_endian_and_fortran_arrays_are_normalised() -> None:
    a = np.asfortranarray(np.arange(12, dtype=">f8").reshape(3, 4))
    b = array_from_proto(array_to_proto(a))
    assert b.dtype.str == "<f8"
    np.testing.assert_array_equal(a, b)


def test_object_and_string_arrays_are_refused() -> None:
    with pytest.raises(ProtocolError, match="cannot be sent"):
        array_to_proto(np.array(["a", "b"]))


@pytest.mark.parametrize("msg, match", [
    (NDArray(dtype="|O", shape=[1], data=b"\0" * 8), "not allowed"),
    (NDArray(dtype="<f8", shape=[3], data=b"\0" * 16), "needs 24 bytes"),
    (NDArray(dtype="<f8", shape=[-1], data=b""), "invalid shape"),
    (NDArray(dtype="<f8", shape=[1] * 5, data=b"\0" * 8), "invalid shape"),
    (NDArray(dtype="<f8", shape=[1], data=np.array([np.nan]).tobytes()), "NaN"),
    (NDArray(dtype="<f8", shape=[1], data=np.array([np.inf]).tobytes()), "NaN or infinite"),
])
def test_invalid_arrays_are_rejected(msg: NDArray, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        array_from_proto(msg, "factor")


def test_task_round_trip_and_digest_stability() -> None:
    task = Task("job-1/pca", "job-1", "pca", 1.0, 1e-5,
                {"n_components": 3, "calibration": "analytic", "clip_norm": 2.5},
                {"v": np.eye(3)})
    back = task_from_bytes(task_to_bytes(task))
    assert back.params == task.params and back.kind == "pca"
    np.testing.assert_array_equal(back.arrays["v"], np.eye(3))
    assert back.digest() == task.digest()
    assert isinstance(back.params["n_components"], int)  # Struct doubles come back as ints
    changed = Task(task.task_id, task.job_id, task.kind, 2.0, task.delta, task.params, task.arrays)
    assert changed.digest() != task.digest()


def test_task_bytes_are_deterministic() -> None:
    task = Task("t", "j", "pca", 1.0, 1e-5, {"b": 1, "a": 2}, {"y": np.ones(2), "x": np.zeros(2)})
    assert task_to_bytes(task) == task_to_bytes(task)


def test_result_round_trip() -> None:
    cost = PrivacyCost.gaussian(1.0, 1e-5, sigma=0.01, sensitivity=0.001)
    r = TaskResult("t", cost, {"factor": np.ones((4, 2))}, {"n_rows": 10})
    back = result_from_bytes(result_to_bytes(r))
    assert back.spend == cost and back.metadata == {"n_rows": 10}
    np.testing.assert_array_equal(back.arrays["factor"], np.ones((4, 2)))


def test_garbage_payloads_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError):
        task_from_bytes(b"\xff\xff\xff")
    with pytest.raises(ProtocolError, match="lacks task_id"):
        task_from_bytes(b"")


def test_chunking_round_trip_interleaved() -> None:
    payloads = {"a": bytes(range(256)) * 40, "b": b"x" * 10_000, "c": b""}
    r = Reassembler(max_bytes=1 << 20)
    streams = {k: list(iter_chunks(k, v, 1000)) for k, v in payloads.items()}
    assert len(streams["c"]) == 1
    done = {}
    while any(streams.values()):
        for k, chunks in streams.items():
            if chunks:
                out = r.add(chunks.pop(0))
                if out is not None:
                    done[k] = out
    assert done == payloads and r.pending == 0


def test_reassembler_limits_and_order() -> None:
    r = Reassembler(max_bytes=100)
    with pytest.raises(ProtocolError, match="limit is 100"):
        r.add(next(iter_chunks("t", b"x" * 101, 10)))
    chunks = list(iter_chunks("u", b"y" * 30, 10))
    r.add(chunks[0])
    with pytest.raises(ProtocolError, match="out of order"):
        r.add(chunks[2])
    assert r.pending == 0
    lying = list(iter_chunks("v", b"z" * 30, 10))
    lying[0].total_size = 5
    with pytest.raises(ProtocolError, match="larger than its declared size"):
        r.add(lying[0])


def test_site_and_job_messages_round_trip() -> None:
    budget = BudgetStatus("basic", 10.0, 1e-4, 1.5, 2e-5, 0.3, 2)
    hello = SiteHello("0.1.0", 1, "ab" * 32, 1000, ("pca",), 2.0, budget)
    assert hello_from_proto(hello_to_proto(hello)) == hello
    info = SiteInfo("a", True, 10, "d", "v", ("pca",), None, budget, "t0", "t1")
    assert site_info_from_proto(site_info_to_proto(info)) == info
    spec = JobSpec("pca", 1.0, 1e-5, {"n_components": 2}, 2, 30.0, ("a", "b"))
    outcome = SiteOutcome("a", "ok", "", PrivacyCost.pure(1.0), 10)
    job = JobInfo("j", spec, "succeeded", "t0", "t1", "", (outcome,), {"k": 1.5}, "analyst/x", 99)
    assert job_info_from_proto(job_info_to_proto(job)) == job
    event = JobEvent("j", "t", "done", "ok", 1.0, "succeeded", job)
    assert job_event_from_proto(job_event_to_proto(event)) == event
    refusal = Refusal("t", "budget_exceeded", "over")
    assert refusal_from_proto(refusal_to_proto(refusal)) == refusal


def test_the_secure_policy_summary_travels_and_is_sanitised() -> None:
    hello = SiteHello("0.1.0", 1, "ab" * 32, 10, ("pca", "secagg"), None, None,
                      "allowed, min 2 sites, t=1")
    assert hello_from_proto(hello_to_proto(hello)).secure_policy == "allowed, min 2 sites, t=1"
    hostile = SiteHello("0.1.0", 1, "ab" * 32, 10, ("pca",), None, None, "x\n\x1b[2J" + "y" * 500)
    shown = hello_from_proto(hello_to_proto(hostile)).secure_policy
    assert len(shown) <= 120 and shown.isprintable()
