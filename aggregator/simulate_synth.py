"""``dpfed simulate --job synth``: the federated synthesis job end to end on this machine.

Demo data with skewed continuous, ordinal and nominal columns (or the user's files) at N
hospitals; the coordinator and the sites run as real processes over mTLS. Left in ``--out``:
``synth.parquet`` (the synthetic table), ``synth_model.npz`` (the fitted DP model),
``report.html`` (the coordinator's report: DP vs synthetic marginals, correlation heat maps,
budget table -- and, since the simulation made every site's rows, the synthetic table against
the real pooled rows: marginals, point masses, tails, correlations) and, in every
``sites/<id>/evaluations/<job>/``, ``synth_evaluation.html`` -- the site-local evaluation
of a synthetic sample against that site's own rows, written by the site process itself in the
job's evaluation round (nothing of it goes to the coordinator).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.aggregator.simulation_output import print_budgets, say
from dpfed.aggregator.synth_report import write_synth_report
from dpfed.common import exit_codes
from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import Schema
from dpfed.common.errors import JobFailedError, ValidationError
from dpfed.common.job_params import SynthParams
from dpfed.common.privacy.accounting import DEFAULT_ACCOUNTANT
from dpfed.common.transport.protocol import JobEvent
from dpfed.common.validation import path_component

if TYPE_CHECKING:
    from dpfed.aggregator.simulate import SimulationOptions

#: Rows of the synthetic sample each site evaluates against.
EVALUATION_ROWS = 5000


def check_synth_options(opts: SimulationOptions) -> None:
    """Refuse --synth-mode / --aggregation / --composition combinations the job refuses."""
    try:
        SynthParams.parse({"mode": opts.synth_mode, "aggregation": opts.aggregation,
                                  "composition": opts.composition}, None)
    except ValidationError as exc:
        raise ValidationError(str(exc).replace("--mode", "--synth-mode")) from None


#: Most real rows the simulation reads back from every site for its report.
MAX_REAL_ROWS = 200_000


def real_rows(schema_path: Path, paths: list[Path]) -> EncodedTable:
    """Every site's real rows, pooled (at most :data:`MAX_REAL_ROWS` of each site's first).

    Only the simulation may read them: it generated them (or was handed the files) and
    compares the synthetic table with them in its report.
    """
    schema = Schema.load(schema_path)
    parts = []
    for path in paths:
        taken = 0
        for table, _report in open_data_source(spec_from_path(path), schema).iter_chunks():
            parts.append(table)
            taken += table.n_rows
            if taken >= MAX_REAL_ROWS:
                break
    return EncodedTable.concatenate(parts)


def print_real_comparison(figures: dict[str, Any], n_real: int) -> None:
    """Print the key figures of the report's comparison with the real rows."""
    if not figures:
        return
    print(f"  against the {n_real} real rows (simulation only): correlation error of the "
          f"values {figures['correlation_error']:.3f} (max {figures['correlation_max']:.3f}); "
          f"latent correlation error synthetic {figures['latent_synthetic_error']:.3f}, "
          f"released DP estimate {figures['latent_released_error']:.3f}")
    for name, col in figures["columns"].items():
        real, syn, missing = col["real_tail"], col["synthetic_tail"], col.get("missing")
        absent = ("" if missing is None else
                  f"missing real {missing[0]:.3f} / synthetic {missing[1]:.3f}, ")
        if real is None or syn is None:
            if absent:
                print(f"    {name}: {absent}TVD {col['tvd']:.3f}")
            continue
        print(f"    {name}: {absent}p99 real / synthetic {col['p99_text']} (released "
              f"{col['p99_band']}), sd {col['sd_text']}, TVD {col['tvd']:.3f}")


def run_synth_simulation(opts: SimulationOptions) -> int:
    """Run the synthesis simulation (``opts.out`` already prepared); return an exit code."""
    out = opts.out.resolve()
    t0 = time.monotonic()
    check_synth_options(opts)
    seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(4), "little")
    if not opts.data:
        say("data", f"generating {opts.sites} x {opts.rows} rows x {opts.features} mixed "
             f"columns (skewed continuous, ordinal, nominal; seed {seed}) -> {out / 'data'}")
    settings = SiteSettings(
        budget_epsilon=opts.budget_epsilon or max(10.0, 2 * opts.epsilon),
        budget_delta=opts.budget_delta or min(0.5, 10 * opts.delta),
        noise_seed=opts.seed, allowed_jobs=("pca", "synth", "synth_rows", "synth_eval"),
        accountant="zcdp" if opts.composition == "zcdp" else DEFAULT_ACCOUNTANT)
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
                say("synth", f"[{event.progress * 100:5.1f}%] {event.message}")

            job_t0 = time.monotonic()
            try:
                model = coord.synth_model(epsilon=opts.epsilon, delta=opts.delta,
                                          rows=None if opts.synth_mode == "row_aligned"
                                          else opts.synth_rows,
                                          mode=opts.synth_mode, min_sites=opts.min_sites,
                                          on_event=progress, evaluate_rows=EVALUATION_ROWS,
                                          aggregation=opts.aggregation,
                                          composition=opts.composition)
            except JobFailedError as exc:
                say("synth", f"FAILED: {exc}")
                return exit_codes.for_error(exc)
            job_seconds = time.monotonic() - job_t0
            budgets = coord.budgets()
    finally:
        fed.stop_all()

    rows = None if opts.synth_mode == "row_aligned" else opts.synth_rows
    t_write = time.monotonic()
    written = model.write(out / "synth.parquet", rows)
    write_seconds = time.monotonic() - t_write
    model.save(out / "synth_model.npz")
    sample = model.sample(None if rows is None else min(rows, 50_000))
    real = real_rows(fed.schema_path, [fed.data_paths[s] for s in fed.site_ids])
    figures: dict[str, Any] = {}
    write_synth_report(out / "report.html", model, sample,
                       title="dpfed simulate: federated synthesis",
                       extra={"job seconds": round(job_seconds, 1)}, real=real,
                       figures=figures)
    job_id = str(model.metadata.get("job_id", ""))
    for site_id in fed.site_ids:
        path = (fed.site_dir(site_id) / "evaluations" / path_component(job_id)
                / "synth_evaluation.html")
        state = "written by the site" if path.exists() else "MISSING"
        say("evaluate", f"{site_id}: site-local evaluation report {state}: {path}")
    print()
    print(f"dpfed simulate --job synth: {len(fed.site_ids)} sites, mode {model.mode}, "
          f"aggregation {opts.aggregation}, composition {opts.composition} (site ledgers: "
          f"{'zcdp' if opts.composition == 'zcdp' else DEFAULT_ACCOUNTANT} accountant), "
          f"latent dimension {model.links.dim}, "
          f"rank {model.factor_model.rank}, column pairs "
          f"{0 if model.pair_correction is None else len(model.pair_correction.edges)}")
    print_budgets(budgets)
    print(f"  wrote {written} synthetic rows in {write_seconds:.1f}s; job {job_seconds:.1f}s, "
          f"total {time.monotonic() - t0:.1f}s")
    print_real_comparison(figures, real.n_rows)
    print(f"  results in {out}: synth.parquet, synth_model.npz, report.html, "
          "sites/*/evaluations/*/synth_evaluation.html, sites/*/ledger.sqlite, logs/")
    return exit_codes.OK
