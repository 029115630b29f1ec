"""The ``profile`` job kind: what each site's row policy did, and DP means to impute with.

Two site-level releases (task kind ``profile``, told apart by the task's ``release`` key):
``policy`` -- every site's DP count vector of what its row policy did
(:mod:`dpfed.common.data.policy_counts`), charged at the site and reported per site -- and,
when the job names continuous or date columns, ``means`` -- every site's DP sums of those
columns' observed values (:mod:`dpfed.common.data.imputation`), pooled by the coordinator into
a DP mean per column, a public ``impute`` value. The budget is split evenly between the two
(all of it to ``policy`` without columns). There is no secure form: the counts are reported
per site by design. Privacy: each round's docstring; docs/privacy.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np

from dpfed.common.data.encoding import EncodingReport
from dpfed.common.data.imputation import observed_sums, observed_sums_mechanism
from dpfed.common.data.policy_counts import (
    policy_count_names,
    policy_counts,
    policy_counts_mechanism,
)
from dpfed.common.data.schema import ContinuousColumn, Schema
from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.jobs.contract import Ask, JobKind, Release, Request, Round, Site
from dpfed.common.jobs.params import Params, ParseContext, RoundShare, param
from dpfed.common.jobs.release import job_params, noisy_release, require_rows
from dpfed.common.jobs.results import NOISE_BOUND_TAIL, require_array, require_positive_int
from dpfed.common.privacy.mechanisms import GaussianMechanism
from dpfed.common.transport.protocol import Task, TaskResult

V = TypeVar("V")
#: The task key naming which of the two releases a ``profile`` task asks for.
RELEASE_KEY = "release"
#: Most columns a job may name (each adds two entries to a site's release).
MAX_COLUMNS = 1000


def _columns(value: Any, ctx: ParseContext) -> list[str]:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValidationError(f"--columns must be a list of column names (a,b), got {value!r}")
    if len(value) > MAX_COLUMNS or len(set(value)) != len(value):
        raise ValidationError(f"--columns must name distinct columns (at most {MAX_COLUMNS})")
    if ctx.schema is not None:
        for name in value:
            if name not in ctx.schema.names or not isinstance(ctx.schema.column(name),
                                                              ContinuousColumn):
                raise ValidationError(
                    f"--columns: {name!r} is not a continuous or date column of the schema; "
                    f"those are {continuous_columns(ctx.schema)}")
    return list(value)


def continuous_columns(schema: Schema) -> list[str]:
    """Return the schema's continuous and date columns, in order (the default of ``columns``)."""
    return [c.name for c in schema.columns if isinstance(c, ContinuousColumn)]


def _default_columns(ctx: ParseContext) -> list[str]:
    if ctx.schema is None:
        raise ValidationError("profile needs --columns when the coordinator does not send the "
                              "federation's schema")
    return continuous_columns(ctx.schema)


def _site_only(value: Any, _ctx: ParseContext) -> str:
    if value != "site":
        raise ValidationError(
            f"--aggregation {value!r} is not available for profile: its policy counts are "
            "reported per site and its means have no secure form; use --aggregation site "
            "(the default)")
    return "site"


@dataclass(frozen=True)
class ProfileParams(Params):
    """A site profile: policy counts per site, DP means of ``columns`` (default: all)."""

    kind: ClassVar[str] = "profile"
    columns: list[str] = param(parse=_columns, derive_default=_default_columns,
                               flag="--columns",
                               help="continuous/date columns to learn a DP mean of, a,b "
                                    "(default: all of them; [] for the policy counts only)")
    aggregation: str = param("site", parse=_site_only, omit=lambda _p: True,
                             help="site only (the counts are per-site releases)")

    def shares(self, epsilon: float, delta: float) -> list[RoundShare]:
        """Half to each release; all to ``policy`` when no column is named."""
        if not self.columns:
            return [RoundShare(POLICY.name, epsilon, delta)]
        return [RoundShare(POLICY.name, epsilon / 2, delta / 2),
                RoundShare(MEANS.name, epsilon / 2, delta / 2)]

    def check_privacy(self, epsilon: float, delta: float) -> None:
        """Gaussian releases need delta > 0 in every round."""
        if not delta > 0:
            raise ValidationError("profile releases Gaussian noise: --delta must be > 0")
        del epsilon

    def plan_note(self, epsilon: float, delta: float) -> str:
        """Say how the budget is split between the two releases."""
        if not self.columns:
            return (f"budget: all of (epsilon {epsilon:g}, delta {delta:g}) to the policy "
                    "counts (no column to learn a mean of)")
        return (f"budget: half to the policy counts, half to the means of "
                f"{len(self.columns)} column(s): (epsilon {epsilon / 2:g}, delta {delta / 2:g}) "
                "each")


@dataclass(frozen=True)
class SiteCounts:
    """The ``policy`` round's value: each site's noisy counts (``names`` order) and their sd."""

    names: tuple[str, ...]
    counts: Mapping[str, np.ndarray]
    rows: Mapping[str, int]
    sigma: float


@dataclass(frozen=True)
class PooledSums:
    """The ``means`` round's value: the sites' noisy ``[s, n]`` vectors and their sd."""

    columns: list[str]
    releases: list[np.ndarray]
    sigma: float


def _whole_pass(site: Site) -> EncodingReport:
    report = EncodingReport()
    for _table, chunk in site.data.iter_chunks():
        report.merge(chunk)
    return report


def _bounded(result: TaskResult, name: str, length: int, bound: float) -> np.ndarray:
    a = require_array(result, name, (length,))
    if float(np.max(np.abs(a), initial=0.0)) > bound:
        raise ProtocolError(f"{name!r} has an entry beyond {bound:.6g}, more than an honest "
                            "release can hold")
    return a


#: Largest number of rows a site's table may be read as (a check of hostile counts only).
MAX_ROWS_READ = 10 ** 12


def counts_mechanism(schema: Schema, epsilon: float, delta: float) -> GaussianMechanism:
    """Return the ``policy`` round's mechanism (sensitivity ``sqrt(2 + C + O)``)."""
    return policy_counts_mechanism(schema, epsilon, delta)


def sums_mechanism(n_columns: int, epsilon: float, delta: float) -> GaussianMechanism:
    """Return the ``means`` round's mechanism (sensitivity ``2 sqrt(C)``)."""
    return observed_sums_mechanism(n_columns, epsilon, delta)


class ProfileRound(Round[ProfileParams, None, V]):
    """What both releases share: the task's ``release`` key names the round."""

    task_kind = "profile"

    def answers(self, task: Task) -> bool:
        """Answer a ``profile`` task naming this release."""
        return task.params.get(RELEASE_KEY) == self.name

    def unanswered(self, task: Task) -> ValidationError:
        """Name the two releases a ``profile`` task may ask for."""
        return ValidationError(f"a profile task must name {RELEASE_KEY} 'policy' or 'means', "
                               f"got {task.params.get(RELEASE_KEY)!r}")

    def params_of(self, task: Task, site: Site) -> ProfileParams:
        """Parse the job's parameters the task carries (refused when it names another release)."""
        if not self.answers(task):
            raise self.unanswered(task)
        return job_params(ProfileParams, task, site, (RELEASE_KEY,))

    def request(self, ask: Ask[ProfileParams, None]) -> Request:
        """Ask for the job's parameters and the release's name."""
        return Request({**ask.params.to_mapping(), RELEASE_KEY: self.name})


class PolicyCounts(ProfileRound[SiteCounts]):
    """``policy``: the site's count vector of what its row policy did, noised and charged.

    Privacy: relation replace-one on the rows the site *reads* (the kept count ``N_s`` rides
    along as public, as in every release); one row moves the drop buckets by ``e_i - e_j``
    and each column's ``missing``/``other`` entries by at most 1, so the L2 sensitivity is
    ``sqrt(2 + C + O)`` (C columns, O with ``other``); calibration: analytic Gaussian at the
    round's (epsilon, delta) (:func:`dpfed.common.data.policy_counts.policy_counts_mechanism`).
    """

    name = "policy"

    def prepare(self, task: Task, site: Site) -> Release:
        """Count what the policy did over one pass; price the Gaussian noise."""
        self.params_of(task, site)
        schema = site.data.schema
        report = _whole_pass(site)
        require_rows(report.rows_kept)
        exact = policy_counts(report, schema)
        mech = counts_mechanism(schema, task.epsilon, task.delta)
        return noisy_release(task, mech.cost(), lambda rng: {"counts": mech.release(exact, rng)},
                             {"n_rows": report.rows_kept})

    def check(self, result: TaskResult, ask: Ask[ProfileParams, None]) -> None:
        """One finite count per name, none beyond any table's size plus the noise's tail."""
        sigma = counts_mechanism(ask.schema, ask.budget.epsilon, ask.budget.delta).sigma
        require_positive_int(result.metadata, "n_rows")
        _bounded(result, "counts", len(policy_count_names(ask.schema)),
                 MAX_ROWS_READ + NOISE_BOUND_TAIL * sigma)

    def pool(self, results: Mapping[str, TaskResult], ask: Ask[ProfileParams, None]
             ) -> SiteCounts:
        """Keep every site's counts apart (they are reported per site)."""
        sigma = counts_mechanism(ask.schema, ask.budget.epsilon, ask.budget.delta).sigma
        return SiteCounts(policy_count_names(ask.schema),
                          {s: results[s].arrays["counts"] for s in sorted(results)},
                          {s: int(results[s].metadata["n_rows"]) for s in sorted(results)},
                          sigma)


class ObservedSums(ProfileRound[PooledSums]):
    """``means``: per column, the sum of its observed values scaled to [-1, 1] and their count.

    Privacy: relation replace-one (``N_s`` public); a row moves ``(s_c, n_c)`` by at most
    ``(2, 0)`` or ``(1, 1)`` per column, so the L2 sensitivity is ``2 sqrt(C)`` for C columns;
    calibration: analytic Gaussian at the round's (epsilon, delta)
    (:func:`dpfed.common.data.imputation.observed_sums_mechanism`). The pooled mean is
    post-processing.
    """

    name = "means"

    def prepare(self, task: Task, site: Site) -> Release:
        """Sum the observed values of the job's columns; price the Gaussian noise."""
        params = self.params_of(task, site)
        if not params.columns:
            raise ValidationError("a profile 'means' release needs at least one column")
        n_rows = 0

        def tables() -> Any:
            nonlocal n_rows
            for table, _report in site.data.iter_chunks():
                n_rows += table.n_rows
                yield table

        exact = observed_sums(tables(), site.data.schema, params.columns)
        require_rows(n_rows)
        mech = sums_mechanism(len(params.columns), task.epsilon, task.delta)
        return noisy_release(task, mech.cost(), lambda rng: {"sums": mech.release(exact, rng)},
                             {"n_rows": n_rows})

    def check(self, result: TaskResult, ask: Ask[ProfileParams, None]) -> None:
        """``2C`` finite entries, each within ``N_s`` plus the noise's tail."""
        n_rows = require_positive_int(result.metadata, "n_rows")
        sigma = sums_mechanism(len(ask.params.columns), ask.budget.epsilon,
                               ask.budget.delta).sigma
        _bounded(result, "sums", 2 * len(ask.params.columns),
                 n_rows + NOISE_BOUND_TAIL * sigma)

    def pool(self, results: Mapping[str, TaskResult], ask: Ask[ProfileParams, None]
             ) -> PooledSums:
        """Keep the sites' vectors, for :func:`dpfed.common.data.imputation.dp_means`."""
        sigma = sums_mechanism(len(ask.params.columns), ask.budget.epsilon,
                               ask.budget.delta).sigma
        return PooledSums(list(ask.params.columns),
                          [results[s].arrays["sums"] for s in sorted(results)], sigma)


POLICY = PolicyCounts()
MEANS = ObservedSums()

KIND: JobKind[ProfileParams] = JobKind(
    name="profile", params=ProfileParams, rounds=(POLICY, MEANS),
    run="dpfed.aggregator.jobs.profile:run",
    report="dpfed.aggregator.profile_report:profile_report",
    summary="what each site's row policy did, and DP means to impute with")
