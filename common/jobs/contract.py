"""The contract of a job kind: rounds shared by both sides, charges, plans, pooled records.

A :class:`Round` is one release. At a site it validates a task, computes the exact statistic
and returns a :class:`Release`: one of three charges and the function that draws the noise.
At the coordinator it builds the task, checks every answer and pools the answers into the
round's value. A :class:`SumRound` is a sum over rows that can also travel as a secure sum
of the integer encoding of the same statistic; the dispatcher chooses, and a job's code gets
a :class:`Pooled` record either way. A :class:`JobKind` ties a params class, its rounds and
its coordinator run together (docs/architecture.md, "Adding a job kind").
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.transport.protocol import Task, TaskResult

if TYPE_CHECKING:
    from dpfed.common.data.encoding import EncodedTable, EncodingReport
    from dpfed.common.data.schema import Schema
    from dpfed.common.jobs.params import ConnectedSite, Params, RoundShare
    from dpfed.common.secagg.secure_sum import SecureSumPlan

P = TypeVar("P", bound="Params")
I = TypeVar("I")  # noqa: E741 -- the round's inputs (what earlier releases decided)
V = TypeVar("V")
T = TypeVar("T")

#: Default cap on one site's answer to one task when the round does not give a tighter one.
DEFAULT_MAX_RESULT_BYTES = 64 << 20


# --------------------------------------------------------------------------- the site side


class DataAccess(Protocol):
    """The site's table as rounds see it: the schema and a fresh chunked pass over the rows."""

    @property
    def schema(self) -> Schema:
        """The federation schema the rows were validated against."""

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        """Stream validated chunks (memory bounded by the chunk size)."""


@dataclass(frozen=True)
class Site:
    """What a round may use at a site: its table, and where its ledger lives (None: unbound).

    Rounds that keep site state (SVT sessions, the evaluation holdout's secret) keep it
    beside the ledger; an object they keep open (a store) lives in ``kept`` for as long as
    the site's handler does.
    """

    data: DataAccess
    ledger_path: Path | None = None
    kept: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def state_dir(self) -> Path | None:
        """The site's state directory (the ledger's), None when unbound."""
        return None if self.ledger_path is None else self.ledger_path.parent

    def keep(self, name: str, make: Callable[[], T]) -> T:
        """Return the object kept under ``name``, made by ``make()`` the first time."""
        if name not in self.kept:
            self.kept[name] = make()
        found: T = self.kept[name]
        return found


@dataclass(frozen=True)
class NewCharge:
    """A release the ledger charges ``cost`` for, in the transaction that stores its bytes."""

    cost: PrivacyCost


@dataclass(frozen=True)
class CoveredBy:
    """A release that an earlier charged task paid for (e.g. the next batch of an SVT session).

    The runner refuses it unless the site's ledger holds the charge of ``task_id``; the
    release keeps its own durable record and replays it.
    """

    task_id: str


@dataclass(frozen=True)
class Free:
    """A release of nothing computed from the site's rows: nothing to charge.

    ``local_output`` (a site-local result, e.g. an evaluation report) writes into the site's
    directory and returns where; the answer then carries no arrays and no spend.
    """

    local_output: Callable[[Path], str] | None = None


Charge = NewCharge | CoveredBy | Free


@dataclass(frozen=True)
class Release:
    """A release ready to happen: its charge, and the function that draws noise and builds it.

    ``produce`` runs at most once, after the charge was accepted (a new charge: inside the
    ledger transaction that records it and stores the result). It returns the answer, or its
    serialized bytes when the release keeps them itself (a covered release replays them).
    """

    charge: Charge
    produce: Callable[[np.random.Generator], TaskResult | bytes]


@dataclass(frozen=True)
class Contribution:
    """A site's part of a secure sum before noise and masks (see :meth:`SumRound.contribution`).

    ``compute(rng) -> (statistic, n_rows)``: the exact int64 statistic of length
    ``plan.n_values`` and the number of rows it came from; it runs inside the ledger's
    transaction (a raised error charges nothing). ``metadata`` holds extra public fields of the
    answer.
    """

    plan: SecureSumPlan
    compute: Callable[[np.random.Generator], tuple[np.ndarray, int]]
    metadata: Mapping[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- the coordinator side


@dataclass(frozen=True)
class Budget:
    """What one round's task carries: its (epsilon, delta), and its rho share under zCDP."""

    epsilon: float
    delta: float
    rho: float | None = None


@dataclass(frozen=True)
class Ask(Generic[P, I]):
    """What the coordinator asks a round with.

    The job's params, the federation schema, the inputs earlier releases decided, and the
    round's budget.
    """

    params: P
    schema: Schema
    inputs: I
    budget: Budget


@dataclass(frozen=True)
class Request:
    """A round's site-level task: parameters, arrays, and the largest answer accepted."""

    params: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES


@dataclass(frozen=True)
class PlannedSum:
    """A secure sum's public plan, and what its planner worked out beside it."""

    plan: SecureSumPlan
    detail: object = None


#: ``planner(participants, tolerated, total_rows)`` of a sum whose plan is not one of
#: :data:`dpfed.common.secagg.secure_sum.PLANNERS` (heavy planning belongs in a worker thread).
Planner = Callable[[list[str], int, int], Awaitable[PlannedSum]]


@dataclass(frozen=True)
class SumEncoding:
    """How the coordinator asks for a sum round as a secure sum.

    ``params`` and ``arrays`` go to every participant with the plan's public part; ``groups``
    (counts statistics) are the number of cells of each group, every row adding ``weights``
    (default 1) to one cell of each, which the decoded sum's check uses; a ``partial`` group
    gets it only from the rows that fall in one of its cells.
    """

    dim: int
    row_norm: float = 1.0
    params: Mapping[str, Any] = field(default_factory=dict)
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)
    planner: Planner | None = None
    groups: tuple[int, ...] = ()
    weights: tuple[int, ...] = ()
    partial: tuple[bool, ...] = ()


@dataclass(frozen=True)
class SecureSum:
    """A decoded secure sum in the units of the rows, and what it was computed from."""

    value: np.ndarray
    plan: SecureSumPlan
    rows: Mapping[str, int]
    attempts: int
    detail: object = None
    releases: str = ""
    #: How many other participants each one masked with and dealt shares to (the sum's
    #: neighbour graph; ``len(rows) - 1`` when complete; 0 when not recorded).
    neighbours: int = 0

    @property
    def n_rows_total(self) -> int:
        """Public number of pooled rows."""
        return sum(self.rows.values())


@dataclass(frozen=True)
class Pooled(Generic[V]):
    """One round's released value, whether it travelled as site releases or a secure sum.

    ``rows`` are the participants' public row counts, ``spend`` what each was charged for the
    round; ``results`` are the site releases (empty for a secure sum), ``secure`` the secure
    sum (None at site level).
    """

    name: str
    value: V
    budget: Budget
    rows: Mapping[str, int]
    spend: Mapping[str, PrivacyCost]
    results: Mapping[str, TaskResult] = field(default_factory=dict)
    secure: SecureSum | None = None

    @property
    def participants(self) -> list[str]:
        """The sites whose releases the value is made of, sorted."""
        return sorted(self.rows)

    @property
    def n_rows_total(self) -> int:
        """Their public number of rows."""
        return sum(self.rows.values())


class Round(ABC, Generic[P, I, V]):
    """One release of a job kind, as both sides see it (module docstring)."""

    #: The round's name: its task id is ``<job id>/<name>``.
    name: ClassVar[str]
    #: The kind of the round's site-level task: the kind a site must allow.
    task_kind: ClassVar[str]
    #: True when a site runs the round only if its policy names the task kind explicitly.
    opt_in: ClassVar[bool] = False

    def answers(self, task: Task) -> bool:
        """Whether this round answers ``task``, a site-level task of :attr:`task_kind`."""
        del task
        return True

    def unanswered(self, task: Task) -> ValidationError:
        """Why no round of :attr:`task_kind` answers ``task`` (the error the site refuses with)."""
        return ValidationError(f"no round of a {task.kind!r} job answers this task")

    def task_budget(self, budget: Budget, inputs: I) -> Budget:
        """Return what the round's task carries, within its planned budget (default: all of it)."""
        del inputs
        return budget

    # ------------------------------------------------------------------ site
    @abstractmethod
    def prepare(self, task: Task, site: Site) -> Release:
        """Validate ``task``, compute the exact statistic and return the pending release.

        Raises
        ------
        dpfed.common.errors.ValidationError
            For invalid parameters (the site refuses; nothing is charged).
        """

    # ------------------------------------------------------------------ coordinator
    @abstractmethod
    def request(self, ask: Ask[P, I]) -> Request:
        """Return the site-level task of this round."""

    def check(self, result: TaskResult, ask: Ask[P, I]) -> None:
        """Raise ProtocolError for a release no honest site could have sent."""
        del result, ask

    @abstractmethod
    def pool(self, results: Mapping[str, TaskResult], ask: Ask[P, I]) -> V:
        """Combine the sites' checked releases into the round's value (post-processing)."""


class SumRound(Round[P, I, V]):
    """A release that is a sum over rows: per-site noisy sums, or one secure sum.

    The secure form encodes the *same* exact statistic as integers (``statistic``, one of
    :data:`dpfed.common.secagg.secure_sum.STATISTICS`); the site's ``secagg`` handler finds
    the round by its task parameter ``source``.
    """

    #: The ``source`` parameter of this round's secure contributions.
    source: ClassVar[str]
    #: The secure statistic (``gram``, ``row_sum``, ``counts``, ``weighted_counts``,
    #: ``scores`` or ``linear``).
    statistic: ClassVar[str]
    #: What the secure form releases, in words (result metadata and reports).
    secure_releases: ClassVar[str] = ""

    @abstractmethod
    def contribution(self, task: Task, site: Site, participants: list[str],
                     tolerated: int) -> Contribution:
        """Validate a secure contribute task, recompute its plan, bind the exact statistic."""

    @abstractmethod
    def encoding(self, ask: Ask[P, I]) -> SumEncoding:
        """Return what the secure sum of this round sends and how its plan is made."""

    @abstractmethod
    def pool_secure(self, summed: SecureSum, ask: Ask[P, I]) -> V:
        """Turn the decoded secure sum into the round's value (post-processing)."""

    def check_sum(self, total: np.ndarray, summed: PlannedSum, n_rows_total: int,
                  encoding: SumEncoding) -> None:
        """Raise ImpossibleSumError if the decoded integer sum cannot come from honest sites.

        The default checks the bounds the statistic, the public row count and ``groups``
        imply (:func:`dpfed.common.secagg.secure_sum.check_decoded`).
        """
        from dpfed.common.secagg.secure_sum import check_decoded

        check_decoded(total, summed.plan, n_rows_total, groups=encoding.groups,
                      weights=encoding.weights, partial=encoding.partial)


# --------------------------------------------------------------------------- job kinds


@dataclass(frozen=True)
class PlannedRound:
    """One round of a job's plan: what its task asks of every site, before anything runs.

    ``epsilon``/``delta`` are what the task carries; ``charged`` is False for a round covered
    by an earlier charge or free; a site that cannot take an ``optional`` round is simply not
    asked it (the job goes on). ``rho`` is what a ``zcdp`` ledger is charged at most; ``secure``
    says that the round travels as a secure sum (task kind ``secagg``).
    """

    name: str
    task_kind: str
    epsilon: float
    delta: float
    rho: float
    charged: bool = True
    optional: bool = False
    secure: bool = False


def resolve(ref: str | Callable[..., Any]) -> Callable[..., Any]:
    """Return the callable a descriptor names as ``"package.module:attribute"`` (or itself)."""
    if callable(ref):
        return ref
    module, _sep, attribute = ref.partition(":")
    target = getattr(importlib.import_module(module), attribute)
    if not callable(target):
        raise TypeError(f"{ref} is not callable")
    return target  # type: ignore[no-any-return]


@dataclass(frozen=True)
class JobKind(Generic[P]):
    """One job kind: its params class, its rounds and its coordinator side.

    ``run`` is the coordinator's run (``async run(job) -> JobOutput``) and ``report`` the
    report builder of a result file (``report(bytes) -> Report``), each a callable or named
    as ``"package.module:attribute"`` (the coordinator's code is not importable from here).
    """

    name: str
    params: type[P]
    rounds: tuple[Round[P, Any, Any], ...]
    run: str | Callable[..., Awaitable[Any]]
    report: str | Callable[[bytes], Any] | None = None
    summary: str = ""
    #: True when the job may run with delta = 0 (pure epsilon-DP releases only).
    pure_epsilon: bool = False

    @property
    def task_kinds(self) -> tuple[str, ...]:
        """The site-level task kinds of the rounds, in order (the kind's name first)."""
        kinds = [self.name] + [r.task_kind for r in self.rounds]
        return tuple(dict.fromkeys(kinds))

    @property
    def sums(self) -> bool:
        """Whether some round can travel as a secure sum."""
        return any(isinstance(r, SumRound) for r in self.rounds)

    def round(self, name: str) -> Round[P, Any, Any]:
        """Return the round called ``name``."""
        for r in self.rounds:
            if r.name == name:
                return r
        raise KeyError(name)

    def parse(self, raw: Mapping[str, Any], schema: Schema | None) -> P:
        """Validate raw parameters (``schema`` None: the checks that need it are skipped)."""
        return self.params.parse(raw, schema)

    def canonical(self, raw: Mapping[str, Any], epsilon: float, delta: float,
                  schema: Schema) -> dict[str, Any]:
        """Validate an analyst's parameters and budget; return the canonical parameters.

        Everything is checked before anything is sent or charged: the parameters, that every
        round can be calibrated at its share of (epsilon, delta), and the plan. Keys the
        analyst left out take the kind's defaults for new jobs
        (:attr:`~dpfed.common.jobs.params.Params.new_job_defaults`); the mapping returned is
        what the job stores and every site parses.
        """
        params = self.parse(self.params.submitted(raw), schema)
        params.check_privacy(epsilon, delta)
        self.plan(params, epsilon, delta)
        return params.to_mapping()

    def settle(self, canonical: Mapping[str, Any], epsilon: float, delta: float,
               schema: Schema, sites: Sequence[ConnectedSite]) -> dict[str, Any]:
        """Return a new job's canonical parameters with what the connected sites decide.

        :meth:`Params.settle` (e.g. a pca job's budget split from the sites' public row
        counts), checked again as :meth:`canonical` does; unchanged for kinds that settle
        nothing (they are not even parsed again).
        """
        if not self.params.settles:
            return dict(canonical)
        params = self.parse(canonical, schema).settle(epsilon, delta, schema, sites)
        params.check_privacy(epsilon, delta)
        self.plan(params, epsilon, delta)
        return params.to_mapping()

    def plan(self, params: P, epsilon: float, delta: float) -> tuple[PlannedRound, ...]:
        """Return the job's rounds in order with what each task asks (module docstring)."""
        secure = params.secure
        out = []
        for share in params.shares(epsilon, delta):
            rnd = self.round(share.name)
            travels_secure = secure and isinstance(rnd, SumRound)
            if secure and not travels_secure and share.charged:
                raise ValidationError(
                    f"{self.name}: round {share.name!r} is a site-level release and cannot "
                    "run with --aggregation secure")
            out.append(_planned(rnd.task_kind, share, travels_secure))
        return tuple(out)


def _planned(task_kind: str, share: RoundShare, secure: bool) -> PlannedRound:
    from dpfed.common.privacy.composition import rounds_rho

    rho = rounds_rho([(share.name, share.epsilon, share.delta)]) if share.charged else 0.0
    return PlannedRound(share.name, "secagg" if secure else task_kind, share.epsilon,
                        share.delta, rho, share.charged, share.optional, secure)
