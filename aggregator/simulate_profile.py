"""``dpfed simulate --job profile``: the site profile job end to end, against the truth.

Started like ``dpfed simulate`` (coordinator + N site processes over mTLS, mixed demo data or
the user's ``--data``/``--schema``), then as an analyst it runs one ``profile`` job (policy
counts per site, DP means of every continuous and date column). Only a simulation can read
every site's rows, so it reads them once more here -- the same files under the same schema
and row policy the sites use -- for the noise-free figures, passed through the job's own
post-processing (:func:`profile_truth`), and prints and writes (``report.html``) the job's
tables with a "true" column beside each DP one. ``profile.npz`` is the job's result file.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dpfed.aggregator.jobs.profile import missing_rates, suggested_impute
from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.aggregator.profile_report import ProfileTruth, profile_report, profile_text
from dpfed.aggregator.result_file import decode_result
from dpfed.aggregator.simulation_output import print_budgets, say
from dpfed.common import exit_codes
from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.encoding import EncodedTable, EncodingReport
from dpfed.common.data.imputation import dp_means, observed_sums
from dpfed.common.data.policy_counts import policy_count_names, policy_counts
from dpfed.common.data.schema import Schema
from dpfed.common.jobs.profile import SiteCounts
from dpfed.common.transport.protocol import JobEvent, JobSpec, JobState

if TYPE_CHECKING:
    from dpfed.aggregator.simulate import SimulationOptions


def check_profile_options(opts: SimulationOptions, schema: Schema) -> None:
    """Validate epsilon/delta and the job against the sites' schema, before anything starts."""
    from dpfed.common.jobs.registry import job_kind
    from dpfed.common.validation import check_delta, check_epsilon

    job_kind("profile").canonical({}, check_epsilon(opts.epsilon), check_delta(opts.delta),
                                  schema)


def _kept_tables(path: Path, schema: Schema, report: EncodingReport) -> Iterator[EncodedTable]:
    """Yield a site file's kept rows chunk by chunk, merging what its policy did into ``report``."""
    for table, chunk in open_data_source(spec_from_path(path), schema).iter_chunks():
        report.merge(chunk)
        yield table


def profile_truth(schema: Schema, paths: Mapping[str, Path], sites: list[str],
                  columns: list[str]) -> ProfileTruth:
    """Return the noise-free figures of a profile job from every site's rows (simulation only).

    Each site's file is read as the site reads it (:func:`open_data_source` under the schema
    and the default row policy): its :class:`EncodingReport` gives the exact policy counts and
    its kept rows the exact observed sums; both then go through the job's own
    post-processing (:func:`missing_rates`, :func:`dp_means`), so a true figure differs from
    its DP one by the noise alone.
    """
    exact: dict[str, np.ndarray] = {}
    kept: dict[str, int] = {}
    sums: list[np.ndarray] = []
    for site in sites:
        report = EncodingReport()
        tables = _kept_tables(paths[site], schema, report)
        if columns:
            sums.append(observed_sums(tables, schema, columns))
        else:
            deque(tables, maxlen=0)
        exact[site] = policy_counts(report, schema)
        kept[site] = report.rows_kept
    counts = SiteCounts(policy_count_names(schema), exact, kept, 0.0)
    means = dp_means(schema, columns, sums) if columns else {}
    return ProfileTruth(np.array([exact[s] for s in sites]), missing_rates(schema, counts),
                        np.array([means[c] for c in columns]),
                        {c: suggested_impute(schema, c, m) for c, m in means.items()})


def run_profile_simulation(opts: SimulationOptions) -> int:
    """Run the profile simulation (``opts.out`` already prepared); return an exit code."""
    out = opts.out.resolve()
    t0 = time.monotonic()
    seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(4), "little")
    if not opts.data:
        say("data", f"generating {opts.sites} x {opts.rows} rows x {opts.features} mixed "
             f"columns (seed {seed}) -> {out / 'data'}")
    settings = SiteSettings(
        budget_epsilon=opts.budget_epsilon or max(10.0, 2 * opts.epsilon),
        budget_delta=opts.budget_delta or min(0.5, 10 * opts.delta),
        noise_seed=opts.seed, allowed_jobs=("profile",))
    fed = LocalFederation.create(out, n_sites=opts.sites, rows=opts.rows,
                                 features=opts.features, seed=seed, fmt=opts.data_format,
                                 data=opts.data or None, schema=opts.schema,
                                 min_sites=opts.min_sites or None,
                                 task_deadline_s=opts.deadline, settings=settings, mixed=True,
                                 metrics=opts.metrics)
    try:
        fed.start_coordinator()
        say("coordinator", f"serving on {fed.address} (mTLS)")
        fed.start_sites()
        fed.wait_for_sites()
        with fed.analyst() as coord:
            say("sites", ", ".join(f"{s.site_id} ({s.row_count} rows)" for s in coord.sites()))

            def progress(event: JobEvent) -> None:
                say("profile", f"[{event.progress * 100:5.1f}%] {event.message}")

            job = coord.submit(JobSpec("profile", opts.epsilon, opts.delta, {},
                                       opts.min_sites, opts.deadline), on_event=progress)
            if job.state != JobState.SUCCEEDED:
                from dpfed.aggregator.client import job_failure

                exc = job_failure(job)
                say("profile", f"FAILED: {exc}")
                return exit_codes.for_error(exc)
            data = coord.fetch_result(job.job_id)
            budgets = coord.budgets()
    finally:
        fed.stop_all()
    (out / "profile.npz").write_bytes(data)
    _arrays, meta = decode_result(data)
    sites = [s["site_id"] for s in meta["sites"]]
    say("evaluate", "the exact figures from every site's real rows, for comparison")
    truth = profile_truth(Schema.load(fed.schema_path), fed.data_paths, sites,
                          list(meta.get("mean_columns", [])))
    report = profile_report(data, truth)
    report.heading("Budgets")
    report.table(("site", "epsilon spent", "epsilon cap", "delta spent", "delta cap",
                  "releases"),
                 [(s, b.epsilon_spent, b.epsilon_cap, b.delta_spent, b.delta_cap, b.events)
                  for s, _c, b in budgets if b is not None])
    (out / "report.html").write_text(report.render(), encoding="utf-8")
    print()
    print(f"dpfed simulate --job profile: {len(sites)} sites, epsilon {opts.epsilon:g}, "
          f"delta {opts.delta:g} per site (DP figures, then the truth only a simulation sees)\n")
    print(profile_text(data, truth) + "\n")
    print_budgets(budgets)
    print(f"  total {time.monotonic() - t0:.1f}s; results in {out}: profile.npz, report.html, "
          "sites/*/ledger.sqlite, logs/")
    return exit_codes.OK
