"""The one registry of job kinds; every other list of kinds is derived from it.

Adding a job kind is one line in :data:`JOB_KINDS`: its name, the module holding its
:class:`~dpfed.common.jobs.contract.JobKind` descriptor (as ``KIND``), and the line
``dpfed --help`` shows. Modules load on first use, so naming the kinds imports nothing heavy.
A kind kept outside the package is named in the environment variable ``DPFED_JOB_KINDS``
(comma-separated modules, each with a ``KIND``), read by every program that starts.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpfed.common.errors import ValidationError

if TYPE_CHECKING:
    from dpfed.common.jobs.contract import JobKind, Round, SumRound
    from dpfed.common.transport.protocol import Task


@dataclass(frozen=True)
class Entry:
    """A registered kind: where its descriptor lives and its one-line description."""

    module: str
    summary: str


#: name -> entry. The order is the order kinds are listed in.
JOB_KINDS: dict[str, Entry] = {
    "pca": Entry("dpfed.common.jobs.pca", "DP-PCA (DPdisPCA): a DP principal subspace"),
    "svt": Entry("dpfed.common.jobs.svt", "sparse vector technique over a query stream"),
    "query": Entry("dpfed.common.jobs.query", "linear queries with the matrix mechanism"),
    "synth": Entry("dpfed.common.jobs.synth", "DP synthetic data from a latent factor model"),
    "profile": Entry("dpfed.common.jobs.profile",
                     "what each site's row policy did, and DP means to impute with"),
}

#: Kinds registered at run time (a test's toy kind): name -> descriptor.
_ADDED: dict[str, JobKind[Any]] = {}
#: The task kind of a secure sum's rounds (every summing kind's secure rounds use it).
SECURE_TASK_KIND = "secagg"


def add(kind: JobKind[Any]) -> None:
    """Register a descriptor at run time (in-tree kinds are listed in :data:`JOB_KINDS`)."""
    if kind.name in JOB_KINDS or kind.name == SECURE_TASK_KIND:
        raise ValueError(f"job kind {kind.name!r} is already registered")
    _ADDED[kind.name] = kind


def remove(name: str) -> None:
    """Forget a kind registered with :func:`add`."""
    _ADDED.pop(name, None)


#: The environment variable naming modules of kinds kept outside the package.
ENVIRONMENT = "DPFED_JOB_KINDS"


def _from_environment() -> None:
    for module in filter(None, (m.strip() for m in os.environ.get(ENVIRONMENT, "").split(","))):
        kind: JobKind[Any] = importlib.import_module(module).KIND
        if kind.name not in _ADDED:
            add(kind)


def names() -> tuple[str, ...]:
    """Every registered kind's name."""
    _from_environment()
    return (*JOB_KINDS, *_ADDED)


def job_kind(name: str) -> JobKind[Any]:
    """Return the descriptor of ``name`` (ValidationError naming the known kinds)."""
    _from_environment()
    if name in _ADDED:
        return _ADDED[name]
    entry = JOB_KINDS.get(name)
    if entry is None:
        raise ValidationError(f"unknown job kind {name!r}; known: {sorted(names())}")
    kind: JobKind[Any] = importlib.import_module(entry.module).KIND
    return kind


def kinds() -> list[JobKind[Any]]:
    """Every registered descriptor."""
    return [job_kind(n) for n in names()]


def task_kinds() -> tuple[str, ...]:
    """Every site-level task kind a site can run (what ``allowed_jobs`` may name)."""
    return tuple(dict.fromkeys(k for kind in kinds() for k in kind.task_kinds))


def default_task_kinds() -> tuple[str, ...]:
    """Return the task kinds a site runs when its policy names none: all but the opt-in ones."""
    opt_in = {r.task_kind for kind in kinds() for r in kind.rounds if r.opt_in}
    return tuple(k for k in task_kinds() if k not in opt_in)


def sum_kinds() -> tuple[str, ...]:
    """Return the kinds with a secure mode.

    A site whose policy requires secure aggregation refuses their site-level releases.
    """
    return tuple(kind.name for kind in kinds() if kind.sums)


def site_round(task: Task) -> Round[Any, Any, Any]:
    """Return the round that answers a site-level task (ValidationError if none does)."""
    candidates = [r for kind in kinds() for r in kind.rounds if r.task_kind == task.kind]
    for rnd in candidates:
        if rnd.answers(task):
            return rnd
    if candidates:
        raise candidates[0].unanswered(task)
    raise ValidationError(f"no job kind has {task.kind!r} tasks")


def secure_round(source: str, statistic: str) -> tuple[JobKind[Any], SumRound[Any, Any, Any]]:
    """Return the kind and the round a secure contribution names (``source``, ``statistic``)."""
    from dpfed.common.jobs.contract import SumRound

    known = []
    for kind in kinds():
        for rnd in kind.rounds:
            if isinstance(rnd, SumRound):
                known.append(rnd.source)
                if (rnd.source, rnd.statistic) == (source, statistic):
                    return kind, rnd
    raise ValidationError(f"source must be one of {sorted(set(known))} with its statistic, got "
                          f"{source!r} / {statistic!r}")
