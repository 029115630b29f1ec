"""The ``synth`` job's evaluation rounds, after the model is made (they cannot fail the job).

``evaluate`` (task kind ``synth_eval``): a synthetic sample goes to every site whose data is
in the model; each compares it with its own rows -- the training rows of the job against the
holdout they never saw (:mod:`dpfed.common.evaluation.site_holdout`) -- writes a report in
its own directory and answers only that it did: nothing leaves, nothing is charged.
``evaluate_summary`` (task kind ``synth_eval_dp``, sites whose policy says
``evaluation_summary = "dp"``): the same comparison released as a DP summary
(:mod:`dpfed.common.evaluation.dp_summary`), charged at the job's summary budget.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import ContinuousColumn, OrdinalColumn, Schema
from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.evaluation.dp_summary import (
    MAX_COMPARED_ROWS,
    ExactSummary,
    SummaryAccumulator,
    release_summary,
    summary_cost,
)
from dpfed.common.evaluation.holdout import holdout_positions, job_key, position_mask
from dpfed.common.evaluation.site_holdout import TrainingRows, site_secret, split_rows
from dpfed.common.job_params import SYNTH_MAX_BINS, SynthParams
from dpfed.common.jobs.contract import Ask, Free, NewCharge, Release, Request, Site
from dpfed.common.jobs.contract import Round as BaseRound
from dpfed.common.jobs.synth_rounds import check_schema
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.common.validation import check_int

log = logging.getLogger(__name__)

#: Largest synthetic sample an evaluation task may carry.
MAX_EVALUATION_ROWS = 50_000
#: Largest |value| a noisy summary statistic may have (a share or TVD plus noise).
MAX_SUMMARY_VALUE = 1e6
SUMMARY_META = ("n_train", "n_compared", "n_holdout", "threshold", "sigma_tvd",
                "sigma_near_train", "sigma_near_holdout")
_NOTHING = PrivacyCost(0.0, 0.0, 0.0, "none")


def synthetic_from_arrays(schema: Schema, arrays: Mapping[str, np.ndarray]) -> EncodedTable:
    """Validate a synthetic sample sent by the coordinator (one array per column, ``col:<name>``).

    Continuous columns must be finite and within the schema bounds, categorical columns valid
    codes; every column the same length (1..MAX_EVALUATION_ROWS). A ``missing = "category"``
    column may come with a boolean ``missing:<name>`` array marking its missing values
    (:func:`sample_arrays`; the column holds its fill value there).
    """
    columns: dict[str, np.ndarray] = {}
    missing: dict[str, np.ndarray] = {}
    n: int | None = None
    for col in schema.columns:
        a = arrays.get(f"col:{col.name}")
        if a is None or a.ndim != 1:
            raise ValidationError(f"the evaluation sample lacks column {col.name!r}")
        if n is None:
            n = int(a.shape[0])
        if a.shape[0] != n or not 1 <= n <= MAX_EVALUATION_ROWS:
            raise ValidationError("evaluation sample columns must have the same length, "
                                  f"1..{MAX_EVALUATION_ROWS}")
        if isinstance(col, ContinuousColumn):
            v = np.asarray(a, dtype=np.float64)
            if not np.all(np.isfinite(v)) or v.min() < col.min or v.max() > col.max:
                raise ValidationError(f"evaluation column {col.name!r} outside the schema bounds")
            columns[col.name] = v
        else:
            size = col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories
            if not np.issubdtype(a.dtype, np.integer) or a.min() < 0 or a.max() >= size:
                raise ValidationError(f"evaluation column {col.name!r} has invalid codes")
            columns[col.name] = a.astype(np.int32)
        mask = arrays.get(f"missing:{col.name}")
        if mask is not None:
            if col.missing != "category" or mask.dtype != np.bool_ or mask.shape != (n,):
                raise ValidationError(f"missing:{col.name} must be a boolean array of {n} "
                                      "entries, for a missing = \"category\" column only")
            if mask.any():
                missing[col.name] = np.asarray(mask)
    assert n is not None
    return EncodedTable(schema, columns, n, missing)


def sample_arrays(sample: EncodedTable, rows: int) -> dict[str, np.ndarray]:
    """Return the first ``rows`` rows of ``sample`` as the evaluation round's arrays.

    One array per column (``col:<name>``) and, for a column with missing values, a boolean
    ``missing:<name>`` marking them, as :func:`synthetic_from_arrays` reads them.
    """
    out = {}
    for col in sample.schema.columns:
        out[f"col:{col.name}"] = np.ascontiguousarray(sample.columns[col.name][:rows])
        mask = sample.missing_mask(col.name)[:rows]
        if mask.any():
            out[f"missing:{col.name}"] = np.ascontiguousarray(mask, dtype=np.bool_)
    return out


def _secret(site: Site) -> bytes:
    if site.state_dir is None:
        raise ValidationError("this round is not bound to a site directory; the evaluation "
                              "holdout needs the site's secret")
    return site_secret(site.state_dir)


@dataclass(frozen=True)
class Sample:
    """A synthetic sample as the evaluation rounds carry it (one array per column)."""

    arrays: Mapping[str, np.ndarray]
    n_rows: int


class Evaluate(BaseRound[SynthParams, Sample, list[str]]):
    """``evaluate``: a site-local report of the sample against the site's rows (free)."""

    name = "evaluate"
    task_kind = "synth_eval"

    def prepare(self, task: Task, site: Site) -> Release:
        """Validate the sample and split the site's rows; the runner writes the report."""
        from dpfed.common.evaluation.site_report import evaluate_at_site, report_dir

        schema = site.data.schema
        if task.epsilon != 0.0 or task.delta != 0.0:
            raise ValidationError("an evaluation task spends no budget: epsilon and delta "
                                  "must be 0")
        if task.params.get("schema_digest") != schema.digest():
            raise ValidationError("schema digest mismatch: the sample was made for another "
                                  "schema; refusing")
        synthetic = synthetic_from_arrays(schema, task.arrays)
        job = task.job_id
        train, holdout = split_rows(site.data, job_key(_secret(site), job))

        def write(site_dir: Path) -> str:
            path, _ = evaluate_at_site(schema, train, holdout, synthetic.to_frame(),
                                       site_id=f"job {job}",
                                       out_dir=report_dir(site_dir, job))
            return str(path)

        def done(_rng: np.random.Generator) -> TaskResult:
            return TaskResult(task.task_id, _NOTHING, {}, {"evaluated": True,
                                                           "n_synthetic": synthetic.n_rows})

        return Release(Free(write), done)

    def request(self, ask: Ask[SynthParams, Sample]) -> Request:
        """Return the sample, for the schema it was made for."""
        return Request({"schema_digest": ask.schema.digest()}, ask.inputs.arrays)

    def pool(self, results: Mapping[str, TaskResult], ask: Ask[SynthParams, Sample]
             ) -> list[str]:
        """Return the sites that wrote their report."""
        return sorted(results)


class EvaluateSummary(BaseRound[SynthParams, Sample, dict[str, dict[str, Any]]]):
    """``evaluate_summary``: a DP summary of the site's evaluation of the sample.

    Privacy: :mod:`dpfed.common.evaluation.dp_summary` (replace-one, L2 sensitivity
    ``sqrt(d + 1)`` of the scaled vector, analytic Gaussian). A site runs the kind only when
    its policy says ``evaluation_summary = "dp"``.
    """

    name = "evaluate_summary"
    task_kind = "synth_eval_dp"
    opt_in = True

    def prepare(self, task: Task, site: Site) -> Release:
        """Compute the exact summary (site-internal) and price its release."""
        cost = summary_cost(len(site.data.schema.columns), task.epsilon, task.delta)
        exact = exact_summary(task, site)

        def produce(rng: np.random.Generator) -> TaskResult:
            arrays, meta = release_summary(exact, epsilon=task.epsilon, delta=task.delta,
                                           rng=rng)
            return TaskResult(task.task_id, cost, arrays,
                              {**meta, "n_rows": exact.n_train, "software_version": __version__})

        return Release(NewCharge(cost), produce)

    def request(self, ask: Ask[SynthParams, Sample]) -> Request:
        """Return the sample, the schema and the bins the summary compares on."""
        return Request({"schema_digest": ask.schema.digest(), "n_bins": ask.params.n_bins},
                       ask.inputs.arrays)

    def check(self, result: TaskResult, ask: Ask[SynthParams, Sample]) -> None:
        """Shapes, finite values, bounded entries."""
        n_columns = len(ask.schema.columns)
        tvd, near = result.arrays.get("tvd"), result.arrays.get("near")
        for name, a, size in (("tvd", tvd, n_columns), ("near", near, 2)):
            if a is None or a.shape != (size,) or a.dtype != np.float64 or not np.all(
                    np.isfinite(a)) or float(np.abs(a).max(initial=0.0)) > MAX_SUMMARY_VALUE:
                raise ProtocolError(f"expected a finite float64 {name} of shape ({size},)")
        for key in SUMMARY_META:
            v = result.metadata.get(key)
            if not isinstance(v, int | float) or not np.isfinite(v) or v < 0:
                raise ProtocolError(f"summary metadata {key!r} must be a finite number >= 0")

    def pool(self, results: Mapping[str, TaskResult], ask: Ask[SynthParams, Sample]
             ) -> dict[str, dict[str, Any]]:
        """Each site's summary (each is its own: nothing is combined)."""
        names = ask.schema.names
        return {s: {"tvd": dict(zip(names, (float(x) for x in r.arrays["tvd"]), strict=True)),
                    "near_train": float(r.arrays["near"][0]),
                    "near_holdout": float(r.arrays["near"][1]),
                    **{k: float(r.metadata[k]) for k in SUMMARY_META},
                    "epsilon": r.spend.epsilon, "delta": r.spend.delta}
                for s, r in sorted(results.items())}


def exact_summary(task: Task, site: Site) -> ExactSummary:
    """Validate an ``evaluate_summary`` task and compute the exact summary (site-internal)."""
    schema = site.data.schema
    check_schema(task.params.get("schema_digest"), schema)
    n_bins = check_int(task.params.get("n_bins"), "n_bins", minimum=2, maximum=SYNTH_MAX_BINS)
    synthetic = synthetic_from_arrays(schema, task.arrays)
    if synthetic.n_rows < 2:
        raise ValidationError("the evaluation sample needs at least 2 rows")
    secret = _secret(site)
    view = TrainingRows(site.data, job_key(secret, task.job_id))
    n_train = view.n_total - view.n_holdout
    compared = holdout_positions(job_key(secret, task.job_id + "/compared"), n_train,
                                 size=min(n_train, MAX_COMPARED_ROWS))
    acc = SummaryAccumulator(schema, n_bins, synthetic)
    held = []
    seen = 0
    for train, holdout, _report in view.iter_parts():
        acc.add_training(train, position_mask(compared, seen, train.n_rows))
        seen += train.n_rows
        held.append(holdout)
    exact = acc.finish(EncodedTable.concatenate(held) if held else EncodedTable(
        schema, {c.name: np.zeros(0) for c in schema.columns}, 0))
    log.info("task=%s training=%d compared=%d holdout=%d (exact values stay local)",
             task.task_id, exact.n_train, exact.n_compared, exact.n_holdout)
    return exact


EVALUATE = Evaluate()
EVALUATE_SUMMARY = EvaluateSummary()
