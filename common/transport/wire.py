"""The one place protobuf messages and domain types meet (``x_to_proto`` / ``x_from_proto``).

Past this module, code sees the dataclasses of ``dpfed.common.transport.protocol`` and ndarrays.
Arrays are
validated on decode (dtype whitelist, shape against byte length, finite values), and payloads
that may exceed one gRPC message are split into bounded :class:`Chunk` messages and
reassembled under a size limit (:class:`Reassembler`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from google.protobuf import struct_pb2

from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.pb.v1 import analyst_pb2, site_link_pb2, types_pb2
from dpfed.common.pb.v1.analyst_pb2 import JobInfo as ProtoJobInfo
from dpfed.common.pb.v1.types_pb2 import Chunk as ProtoChunk
from dpfed.common.pb.v1.types_pb2 import NDArray as ProtoNDArray
from dpfed.common.privacy.accounting import BudgetStatus, PrivacyCost, StudyStatus
from dpfed.common.transport.protocol import (
    JobEvent,
    JobInfo,
    JobSpec,
    JobState,
    Refusal,
    RefusalCode,
    SiteHello,
    SiteInfo,
    SiteOutcome,
    SiteStatus,
    Task,
    TaskResult,
)
from dpfed.common.validation import MIN_DELTA

#: dtypes allowed on the wire (little-endian numerics and booleans only: no objects, no strings).
ALLOWED_DTYPES = frozenset({"<f8", "<f4", "<i8", "<i4", "<i2", "|i1", "|u1", "<u2", "<u4",
                            "<u8", "|b1"})
MAX_NDIM = 4

# --------------------------------------------------------------------------- arrays


def array_to_proto(array: np.ndarray) -> ProtoNDArray:
    """Serialize an ndarray as dtype string, shape and C-order little-endian bytes."""
    a = np.asarray(array)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    a = np.require(a, requirements="C")  # (ascontiguousarray would turn 0-d into 1-d)
    if a.dtype.str not in ALLOWED_DTYPES:
        raise ProtocolError(
            f"dtype {a.dtype.str} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}")
    return ProtoNDArray(dtype=a.dtype.str, shape=list(a.shape), data=a.tobytes())


def array_from_proto(msg: ProtoNDArray, name: str = "array", *,
                     require_finite: bool = True) -> np.ndarray:
    """Decode and validate an array (raises :class:`ProtocolError` on any inconsistency)."""
    if msg.dtype not in ALLOWED_DTYPES:
        raise ProtocolError(f"{name}: dtype {msg.dtype!r} is not allowed on the wire")
    shape = tuple(int(s) for s in msg.shape)
    if len(shape) > MAX_NDIM or any(s < 0 for s in shape):
        raise ProtocolError(f"{name}: invalid shape {shape}")
    dtype = np.dtype(msg.dtype)
    expected = math.prod(shape) * dtype.itemsize
    if expected != len(msg.data):
        raise ProtocolError(
            f"{name}: shape {shape} of {msg.dtype} needs {expected} bytes, got {len(msg.data)}")
    a = np.frombuffer(msg.data, dtype=dtype).reshape(shape).copy()
    if require_finite and dtype.kind == "f" and not np.all(np.isfinite(a)):
        raise ProtocolError(f"{name}: contains NaN or infinite values")
    return a


def arrays_to_proto(arrays: Mapping[str, np.ndarray]) -> list[types_pb2.NamedArray]:
    """Serialize named arrays (sorted by name, so equal inputs give equal bytes)."""
    return [types_pb2.NamedArray(name=k, array=array_to_proto(arrays[k])) for k in sorted(arrays)]


def arrays_from_proto(items: Any) -> dict[str, np.ndarray]:
    """Decode named arrays; duplicate names are a protocol error."""
    out: dict[str, np.ndarray] = {}
    for item in items:
        if item.name in out:
            raise ProtocolError(f"duplicate array name {item.name!r}")
        out[item.name] = array_from_proto(item.array, item.name)
    return out


# --------------------------------------------------------------------------- JSON-like values


def _normalise(value: Any) -> Any:
    """Struct carries every number as a double: give integral values back as ints."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    return value


def struct_to_proto(data: Mapping[str, Any]) -> struct_pb2.Struct:
    """Serialize a JSON-compatible mapping."""
    s = struct_pb2.Struct()
    try:
        s.update(dict(data))
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"parameters must be JSON-compatible: {exc}") from None
    return s


def _value_from_proto(value: struct_pb2.Value) -> Any:
    which = value.WhichOneof("kind")
    if which == "number_value":
        return _normalise(value.number_value)
    if which == "string_value":
        return value.string_value
    if which == "bool_value":
        return value.bool_value
    if which == "struct_value":
        return {k: _value_from_proto(v) for k, v in value.struct_value.fields.items()}
    if which == "list_value":
        return [_value_from_proto(v) for v in value.list_value.values]
    return None


def struct_from_proto(msg: struct_pb2.Struct) -> dict[str, Any]:
    """Decode a Struct to plain Python values (integral numbers as ints).

    Walks the message itself instead of ``json_format.MessageToDict``, which raises on a NaN
    or infinite number: a peer's non-finite value decodes to a float NaN/inf here and is then
    rejected by the validator of the field it sits in, with that field's name.
    """
    return {k: _value_from_proto(v) for k, v in msg.fields.items()}


# --------------------------------------------------------------------------- privacy


def cost_to_proto(cost: PrivacyCost) -> types_pb2.PrivacySpend:
    """Serialize a privacy cost."""
    return types_pb2.PrivacySpend(epsilon=cost.epsilon, delta=cost.delta, rho=cost.rho,
                                  mechanism=cost.mechanism, sensitivity=cost.sensitivity,
                                  noise_scale=cost.noise_scale)


def cost_from_proto(msg: types_pb2.PrivacySpend) -> PrivacyCost:
    """Decode a privacy cost."""
    try:
        return PrivacyCost(msg.epsilon, msg.delta, msg.rho, msg.mechanism, msg.sensitivity,
                           msg.noise_scale)
    except ValueError as exc:
        raise ProtocolError(f"invalid privacy spend: {exc}") from None


def budget_to_proto(status: BudgetStatus) -> types_pb2.BudgetSummary:
    """Serialize a budget status."""
    return types_pb2.BudgetSummary(
        accountant=status.accountant, epsilon_cap=status.epsilon_cap, delta_cap=status.delta_cap,
        epsilon_spent=status.epsilon_spent, delta_spent=status.delta_spent,
        rho_spent=status.rho_spent, events=status.events,
        studies=[types_pb2.StudyBudget(name=s.name, budget=budget_to_proto(s.status),
                                       expires=s.expires) for s in status.studies])


def budget_from_proto(msg: types_pb2.BudgetSummary) -> BudgetStatus | None:
    """Decode a budget status (None when the message is empty)."""
    if not msg.accountant:
        return None
    studies = []
    for s in msg.studies:
        status = budget_from_proto(s.budget)
        if status is not None:
            studies.append(StudyStatus(s.name, s.expires, status))
    return BudgetStatus(msg.accountant, msg.epsilon_cap, msg.delta_cap, msg.epsilon_spent,
                        msg.delta_spent, msg.rho_spent, msg.events, tuple(studies))


# --------------------------------------------------------------------------- tasks


def task_to_bytes(task: Task) -> bytes:
    """Serialize a task to the bytes that travel in chunks."""
    msg = types_pb2.TaskSpec(task_id=task.task_id, job_id=task.job_id, kind=task.kind,
                             epsilon=task.epsilon, delta=task.delta,
                             params=struct_to_proto(task.params),
                             arrays=arrays_to_proto(task.arrays), analyst_id=task.analyst_id,
                             study=task.study)
    return msg.SerializeToString(deterministic=True)


def task_from_bytes(data: bytes) -> Task:
    """Decode a task."""
    msg = types_pb2.TaskSpec()
    try:
        msg.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError (no stable public base class)
        raise ProtocolError(f"task payload is not a TaskSpec: {exc}") from None
    if not msg.task_id or not msg.kind:
        raise ProtocolError("task payload lacks task_id or kind")
    check_task_privacy(msg.epsilon, msg.delta)
    return Task(msg.task_id, msg.job_id, msg.kind, msg.epsilon, msg.delta,
                struct_from_proto(msg.params), arrays_from_proto(msg.arrays), msg.analyst_id,
                msg.study)


def check_task_privacy(epsilon: float, delta: float) -> None:
    """Refuse a task's (epsilon, delta) that no mechanism can be calibrated to.

    Raises ValidationError (the site refuses the task as ``invalid``): epsilon must be finite
    and >= 0; delta 0 or in [MIN_DELTA, 1) -- a subnormal delta such as 1e-320 would overflow
    the Gaussian calibrations.
    """
    if not math.isfinite(epsilon) or epsilon < 0.0:
        raise ValidationError(f"the task's epsilon must be finite and >= 0, got {epsilon!r}")
    if not (delta == 0.0 or MIN_DELTA <= delta < 1.0):
        raise ValidationError(f"the task's delta must be 0 or in [{MIN_DELTA:g}, 1), got "
                              f"{delta!r}")


def result_to_bytes(result: TaskResult) -> bytes:
    """Serialize a site's result (these are the bytes stored in the ledger)."""
    msg = types_pb2.TaskResult(task_id=result.task_id, arrays=arrays_to_proto(result.arrays),
                               metadata=struct_to_proto(result.metadata),
                               spend=cost_to_proto(result.spend))
    return msg.SerializeToString(deterministic=True)


def result_from_bytes(data: bytes) -> TaskResult:
    """Decode a site's result."""
    msg = types_pb2.TaskResult()
    try:
        msg.ParseFromString(data)
    except Exception as exc:  # protobuf DecodeError
        raise ProtocolError(f"result payload is not a TaskResult: {exc}") from None
    return TaskResult(msg.task_id, cost_from_proto(msg.spend), arrays_from_proto(msg.arrays),
                      struct_from_proto(msg.metadata))


# --------------------------------------------------------------------------- chunking


def iter_chunks(transfer_id: str, payload: bytes, chunk_size: int) -> Iterator[ProtoChunk]:
    """Split ``payload`` into ordered chunks of at most ``chunk_size`` bytes."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    total = len(payload)
    n = max(1, -(-total // chunk_size))
    view = memoryview(payload)
    for i in range(n):
        yield ProtoChunk(transfer_id=transfer_id, index=i, last=i == n - 1,
                         data=bytes(view[i * chunk_size:(i + 1) * chunk_size]), total_size=total)


class Reassembler:
    """Collect the chunks of concurrent transfers; enforce order and a size limit.

    Parameters
    ----------
    max_bytes : int
        Largest payload accepted; a transfer declaring or reaching more is a ProtocolError.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._parts: dict[str, list[bytes]] = {}
        self._sizes: dict[str, int] = {}

    def add(self, chunk: ProtoChunk, limit: int | None = None) -> bytes | None:
        """Add one chunk; return the whole payload when its last chunk arrives.

        ``limit`` (optional) lowers the size limit for this transfer, e.g. to what the
        receiver expects for the task the transfer answers.
        """
        tid = chunk.transfer_id
        if not tid:
            raise ProtocolError("chunk without transfer_id")
        cap = self.max_bytes if limit is None else min(limit, self.max_bytes)
        if chunk.total_size > cap:
            self.discard(tid)
            raise ProtocolError(
                f"transfer {tid!r} declares {chunk.total_size} bytes; the limit is {cap}")
        parts = self._parts.setdefault(tid, [])
        if chunk.index != len(parts):
            self.discard(tid)
            raise ProtocolError(f"transfer {tid!r}: chunk {chunk.index} out of order "
                                f"(expected {len(parts)})")
        size = self._sizes.get(tid, 0) + len(chunk.data)
        if size > chunk.total_size:
            self.discard(tid)
            raise ProtocolError(f"transfer {tid!r} is larger than its declared size")
        parts.append(chunk.data)
        self._sizes[tid] = size
        if not chunk.last:
            return None
        self.discard(tid)
        if size != chunk.total_size:
            raise ProtocolError(f"transfer {tid!r}: got {size} bytes, declared {chunk.total_size}")
        return b"".join(parts)

    def discard(self, transfer_id: str) -> None:
        """Forget a partial transfer."""
        self._parts.pop(transfer_id, None)
        self._sizes.pop(transfer_id, None)

    @property
    def pending(self) -> int:
        """Number of transfers in progress."""
        return len(self._parts)

    def in_progress(self) -> list[str]:
        """Ids of the transfers in progress."""
        return list(self._parts)


# --------------------------------------------------------------------------- site link


def _policy_text(text: str) -> str:
    """Return a peer's policy summary, bounded and printable (it is only displayed)."""
    return "".join(c for c in text[:120] if c.isprintable())


def hello_to_proto(hello: SiteHello) -> site_link_pb2.Hello:
    """Serialize a site's Hello."""
    policy = types_pb2.SitePolicy(allowed_kinds=list(hello.allowed_kinds),
                                  max_epsilon_per_task=hello.max_epsilon_per_task or 0.0,
                                  secure_aggregation=hello.secure_policy)
    if hello.budget is not None:
        policy.budget.CopyFrom(budget_to_proto(hello.budget))
    return site_link_pb2.Hello(software_version=hello.software_version,
                               protocol_version=hello.protocol_version,
                               schema_digest=hello.schema_digest, row_count=hello.row_count,
                               policy=policy)


def hello_from_proto(msg: site_link_pb2.Hello) -> SiteHello:
    """Decode a site's Hello."""
    if msg.row_count < 0:
        raise ProtocolError(f"row_count must be >= 0, got {msg.row_count}")
    return SiteHello(msg.software_version, msg.protocol_version, msg.schema_digest, msg.row_count,
                     tuple(msg.policy.allowed_kinds), msg.policy.max_epsilon_per_task or None,
                     budget_from_proto(msg.policy.budget),
                     _policy_text(msg.policy.secure_aggregation))


def refusal_to_proto(refusal: Refusal) -> site_link_pb2.Refusal:
    """Serialize a refusal."""
    return site_link_pb2.Refusal(task_id=refusal.task_id, code=refusal.code, reason=refusal.reason)


def refusal_from_proto(msg: site_link_pb2.Refusal) -> Refusal:
    """Decode a refusal."""
    try:
        code = RefusalCode(msg.code)
    except ValueError:  # a newer site's code: the task is refused all the same
        code = RefusalCode.OTHER
    return Refusal(msg.task_id, code, msg.reason)


# --------------------------------------------------------------------------- analyst

_STATE_TO_PROTO = {
    JobState.PENDING: analyst_pb2.JOB_STATE_PENDING,
    JobState.RUNNING: analyst_pb2.JOB_STATE_RUNNING,
    JobState.SUCCEEDED: analyst_pb2.JOB_STATE_SUCCEEDED,
    JobState.FAILED: analyst_pb2.JOB_STATE_FAILED,
    JobState.CANCELLED: analyst_pb2.JOB_STATE_CANCELLED,
}
_STATE_FROM_PROTO = {v: k for k, v in _STATE_TO_PROTO.items()}


def state_to_proto(state: str) -> analyst_pb2.JobState.ValueType:
    """Map a job state to its enum value."""
    try:
        return _STATE_TO_PROTO[JobState(state)]
    except ValueError:
        raise ProtocolError(f"unknown job state {state!r}") from None


def state_from_proto(value: int) -> JobState:
    """Map a job state enum value to its name."""
    try:
        return _STATE_FROM_PROTO[value]  # type: ignore[index]
    except KeyError:
        raise ProtocolError(f"unknown job state {value}") from None


def job_spec_to_proto(spec: JobSpec) -> analyst_pb2.JobSpec:
    """Serialize a job spec."""
    return analyst_pb2.JobSpec(kind=spec.kind, epsilon=spec.epsilon, delta=spec.delta,
                               params=struct_to_proto(spec.params), min_sites=spec.min_sites,
                               deadline_seconds=spec.deadline_seconds, sites=list(spec.sites),
                               study=spec.study)


def job_spec_from_proto(msg: analyst_pb2.JobSpec) -> JobSpec:
    """Decode a job spec (values are validated by the job type, not here)."""
    return JobSpec(msg.kind, msg.epsilon, msg.delta, struct_from_proto(msg.params), msg.min_sites,
                   msg.deadline_seconds, tuple(msg.sites), msg.study)


def site_outcome_to_proto(o: SiteOutcome) -> analyst_pb2.SiteOutcome:
    """Serialize a site's outcome in a job."""
    msg = analyst_pb2.SiteOutcome(site_id=o.site_id, status=o.status, reason=o.reason,
                                  row_count=o.row_count, code=o.code or "",
                                  left_out=o.left_out)
    if o.spend is not None:
        msg.spend.CopyFrom(cost_to_proto(o.spend))
    return msg


def site_outcome_from_proto(msg: analyst_pb2.SiteOutcome) -> SiteOutcome:
    """Decode a site's outcome in a job."""
    spend = cost_from_proto(msg.spend) if msg.HasField("spend") else None
    try:
        status = SiteStatus(msg.status)
        code = RefusalCode(msg.code) if msg.code else None
    except ValueError:
        raise ProtocolError(f"unknown site status {msg.status[:40]!r} or code "
                            f"{msg.code[:40]!r}") from None
    return SiteOutcome(msg.site_id, status, msg.reason, spend, msg.row_count, code,
                       msg.left_out)


def job_info_to_proto(job: JobInfo) -> ProtoJobInfo:
    """Serialize a job's state."""
    return ProtoJobInfo(job_id=job.job_id, spec=job_spec_to_proto(job.spec),
                        state=state_to_proto(job.state), created=job.created,
                        updated=job.updated, error=job.error,
                        sites=[site_outcome_to_proto(s) for s in job.sites],
                        summary=struct_to_proto(job.summary), submitted_by=job.submitted_by,
                        result_size=job.result_size)


def job_info_from_proto(msg: ProtoJobInfo) -> JobInfo:
    """Decode a job's state."""
    return JobInfo(msg.job_id, job_spec_from_proto(msg.spec), state_from_proto(msg.state),
                   msg.created, msg.updated, msg.error,
                   tuple(site_outcome_from_proto(s) for s in msg.sites),
                   struct_from_proto(msg.summary), msg.submitted_by, msg.result_size)


def job_event_to_proto(event: JobEvent) -> analyst_pb2.JobEvent:
    """Serialize a progress event."""
    msg = analyst_pb2.JobEvent(job_id=event.job_id, time=event.time, stage=event.stage,
                               message=event.message, progress=event.progress,
                               state=state_to_proto(event.state))
    if event.job is not None:
        msg.job.CopyFrom(job_info_to_proto(event.job))
    return msg


def job_event_from_proto(msg: analyst_pb2.JobEvent) -> JobEvent:
    """Decode a progress event."""
    job = job_info_from_proto(msg.job) if msg.HasField("job") else None
    return JobEvent(msg.job_id, msg.time, msg.stage, msg.message, msg.progress,
                    state_from_proto(msg.state), job)


def site_info_to_proto(info: SiteInfo) -> analyst_pb2.SiteInfo:
    """Serialize the coordinator's view of a site."""
    policy = types_pb2.SitePolicy(allowed_kinds=list(info.allowed_kinds),
                                  max_epsilon_per_task=info.max_epsilon_per_task or 0.0,
                                  secure_aggregation=info.secure_policy)
    if info.budget is not None:
        policy.budget.CopyFrom(budget_to_proto(info.budget))
    return analyst_pb2.SiteInfo(site_id=info.site_id, connected=info.connected,
                                row_count=info.row_count, schema_digest=info.schema_digest,
                                software_version=info.software_version, policy=policy,
                                first_seen=info.first_seen, last_seen=info.last_seen)


def site_info_from_proto(msg: analyst_pb2.SiteInfo) -> SiteInfo:
    """Decode the coordinator's view of a site."""
    return SiteInfo(msg.site_id, msg.connected, msg.row_count, msg.schema_digest,
                    msg.software_version, tuple(msg.policy.allowed_kinds),
                    msg.policy.max_epsilon_per_task or None, budget_from_proto(msg.policy.budget),
                    msg.first_seen, msg.last_seen,
                    _policy_text(msg.policy.secure_aggregation))
