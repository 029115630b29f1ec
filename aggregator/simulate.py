"""``dpfed simulate``: a whole federation on this machine, started the way users start it.

The coordinator and N hospitals run as separate processes (``dpfed-aggregator`` and
``dpfed-site``, via ``python -m``) over real gRPC with mutual TLS, using throwaway
certificates made by ``dpfed certs``, generated demo data with a latent factor structure (or
the user's files), and durable SQLite ledgers. The simulation then acts as an analyst: it
waits for the sites, runs the jobs end to end with streamed progress, and writes a report
that compares the DP result with the non-private result on the pooled data -- a comparison
only a simulation can make, since it alone can read every site's rows.

Everything is left in ``--out``: certificates, data, configs, ledgers, the coordinator's job
store, logs, ``pca.npz`` and ``report.html``.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from dpfed.aggregator.cli_files import check_output_dir
from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.aggregator.pca_report import PooledReference, captured_fraction, pca_report
from dpfed.aggregator.pca_result import PCAResult
from dpfed.aggregator.simulation_output import prepare_output, print_budgets, say
from dpfed.common import exit_codes
from dpfed.common.data.data_sources import open_data_source, scan, spec_from_path
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ConfigError, DataError, JobFailedError
from dpfed.common.job_choices import AGGREGATIONS, CENTERINGS, SITE_WEIGHTINGS, parse_clip_norm
from dpfed.common.pca.dppca import GramAccumulator
from dpfed.common.pca.features import UnitBallMap
from dpfed.common.privacy.accounting import BudgetStatus
from dpfed.common.transport.protocol import JobEvent, JobInfo


@dataclass
class SimulationOptions:
    """What to simulate (see ``dpfed simulate --help``)."""

    out: Path
    sites: int = 3
    rows: int = 20_000
    features: int = 20
    k: int = 5
    rank: int | None = None
    epsilon: float = 1.0
    delta: float = 1e-5
    calibration: str = "analytic"
    min_sites: int = 0
    clip_norm: float | str | None = None  # None: the job's default (auto)
    centering: str = "mean"
    site_weighting: str = "size"
    aggregation: str = "site"
    seed: int | None = None
    data: list[Path] = field(default_factory=list)
    schema: Path | None = None
    data_format: str = "csv"
    budget_epsilon: float | None = None
    budget_delta: float | None = None
    deadline: float = 600.0
    job: str = "pca"
    synth_rows: int = 20_000
    synth_mode: str = "generative"
    composition: str = "basic"
    omop: bool = False
    metrics: bool = False


#: The defaults of the flags below that are left None by the parser, so that a flag the
#: user typed can be told from one left at its default (:data:`JOB_FLAGS`).
DEFAULTS: dict[str, Any] = {
    "sites": 3, "rows": 20_000, "features": 20, "k": 5, "delta": 1e-5,
    "calibration": "analytic", "centering": "mean", "site_weighting": "size",
    "aggregation": "site", "data_format": "csv", "synth_rows": 20_000,
    "synth_mode": "generative", "composition": "basic",
}
#: Flags that only some jobs use: given with another ``--job`` they are refused, named.
JOB_FLAGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "k": ("--k", ("pca",)),
    "rank": ("--rank", ("pca",)),
    "calibration": ("--calibration", ("pca",)),
    "clip_norm": ("--clip-norm", ("pca",)),
    "centering": ("--centering", ("pca",)),
    "site_weighting": ("--site-weighting", ("pca",)),
    "aggregation": ("--aggregation", ("pca", "synth", "query")),
    "delta": ("--delta", ("pca", "synth", "query", "profile")),
    "data": ("--data", ("pca", "synth", "profile")),
    "schema": ("--schema", ("pca", "synth", "profile")),
    "synth_rows": ("--synth-rows", ("synth",)),
    "synth_mode": ("--synth-mode", ("synth",)),
    "composition": ("--composition", ("synth",)),
    "omop": ("--omop", ("pca", "synth")),
}
#: Flags that shape the generated demo data: refused with --data (the files decide).
DEMO_FLAGS = {"sites": "--sites", "rows": "--rows", "features": "--features",
              "data_format": "--format"}


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``dpfed simulate`` options to a parser."""
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default runs/simulate-<UTC time>)")
    p.add_argument("--sites", type=int, help="number of hospitals (default 3)")
    p.add_argument("--rows", type=int, help="rows per hospital (demo data; default 20000)")
    p.add_argument("--features", type=int, help="columns of the demo data (default 20)")
    p.add_argument("--k", type=int, help="--job pca: number of principal components K "
                   "(default 5)")
    p.add_argument("--rank", type=int, help="--job pca: eigenpairs each site sends (default 2K)")
    p.add_argument("--epsilon", type=float, default=1.0, help="epsilon per site for the job")
    p.add_argument("--delta", type=float, help="delta per site for the job (default 1e-5; "
                   "--job query: only with --aggregation secure; not --job svt)")
    p.add_argument("--calibration", choices=["analytic", "classic"],
                   help="--job pca (default analytic)")
    p.add_argument("--min-sites", type=int, default=0, help="quorum (default: all sites)")
    p.add_argument("--clip-norm", type=parse_clip_norm, default=None, metavar="auto|schema|C",
                   help="--job pca: row-norm bound: auto = a DP quantile of the row norms "
                   "(default, also with --aggregation secure), "
                   "schema = the worst case the schema allows, or a number")
    p.add_argument("--centering", choices=list(CENTERINGS),
                   help="--job pca: mean = centred PCA around a DP mean (default); none = "
                   "uncentred")
    p.add_argument("--site-weighting", choices=list(SITE_WEIGHTINGS),
                   help="--job pca: size = weight sites by N_s/N (default); equal = 1/S "
                   "(the paper's)")
    p.add_argument("--aggregation", choices=list(AGGREGATIONS),
                   help="site = each site noises its own release (default); secure = a secure "
                        "sum with distributed noise (pooled-data utility; --job pca, synth or "
                        "query)")
    p.add_argument("--seed", type=int, help="make data AND noise reproducible (demo/tests "
                   "only: the noise is then not private)")
    p.add_argument("--data", type=Path, action="append", default=[],
                   help="--job pca, synth or profile: a site's data file (repeat once per "
                   "site; CSV or Parquet)")
    p.add_argument("--schema", type=Path, help="schema.toml for --data")
    p.add_argument("--format", dest="data_format", choices=["csv", "parquet"],
                   help="format of the generated demo data (default csv)")
    p.add_argument("--budget-epsilon", type=float, help="each site's total epsilon budget "
                   "(default max(10, 2 x --epsilon))")
    p.add_argument("--budget-delta", type=float, help="each site's total delta budget "
                   "(default 10 x --delta)")
    p.add_argument("--deadline", type=float, default=600.0, help="per-site task deadline, s")
    p.add_argument("--job", choices=["pca", "synth", "svt", "query", "profile"], default="pca",
                   help="which job to simulate: pca (default); synth (federated DP synthesis on "
                   "mixed demo data; docs/synthesis.md); svt or query (demo data with nominal "
                   "and ordinal columns; docs/queries.md); profile (what each site's row "
                   "policy did and DP means to impute with, against the true figures; "
                   "docs/data-sources.md)")
    p.add_argument("--synth-rows", type=int,
                   help="--job synth: synthetic rows to write (generative mode; default 20000)")
    p.add_argument("--synth-mode", choices=["generative", "row-aligned"],
                   help="--job synth: output mode (default generative)")
    p.add_argument("--composition", choices=["basic", "zcdp"],
                   help="--job synth: how the rounds share the budget (default basic; zcdp: "
                   "shares of rho, the simulated sites then account in zcdp)")
    p.add_argument("--omop", action="store_true", default=None,
                   help="generate an OMOP CDM warehouse per site (PostgreSQL for the first, "
                   "DuckDB for the others; --rows persons each, at most 5000) and run --job pca "
                   "or synth on the schema's feature extraction (docs/data-sources.md)")
    p.add_argument("--metrics", action="store_true", help="serve Prometheus metrics from the "
                   "coordinator and every site on free loopback ports (addresses printed; the "
                   "last scrape of each is saved in OUT/metrics/)")

def refuse_flags_that_do_not_apply(args: argparse.Namespace) -> None:
    """Raise ConfigError naming the first flag the chosen ``--job`` (or ``--data``) ignores."""
    def given(name: str) -> bool:
        value = getattr(args, name, None)
        return value is not None and value != []

    for name, (flag, jobs) in JOB_FLAGS.items():
        if given(name) and args.job not in jobs:
            raise ConfigError(f"{flag} does not apply to --job {args.job} (it is for --job "
                              f"{' or '.join(jobs)})")
    if args.job == "query" and given("delta") and args.aggregation != "secure":
        raise ConfigError("--delta applies to --job query only with --aggregation secure (the "
                          "site-level query job spends epsilon only)")
    if args.data:
        for name, flag in DEMO_FLAGS.items():
            if given(name):
                raise ConfigError(f"{flag} shapes the generated demo data; with --data the "
                                  "files decide (one site per --data file)")


def simulation_options_from_args(args: argparse.Namespace) -> SimulationOptions:
    """Build options from parsed arguments (validating combinations)."""
    refuse_flags_that_do_not_apply(args)
    for name, default in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    out = check_output_dir(args.out or Path("runs") / f"simulate-{datetime.now(UTC):%Y%m%dT%H%M%S}",
                           "--out")
    if args.data and not args.schema:
        raise ConfigError("--data needs --schema (the federation's schema.toml)")
    if args.schema and not args.data:
        raise ConfigError("--schema applies to --data files; without --data demo data is "
                          "generated with its own schema")
    n_sites = len(args.data) if args.data else args.sites
    if args.job == "synth" and not 1 <= args.synth_rows <= 100_000_000:
        raise ConfigError(f"--synth-rows must be between 1 and 100,000,000, got "
                          f"{args.synth_rows}")
    for name, value, low in (("--sites", n_sites, 1), ("--rows", args.rows, 1),
                             ("--features", args.features, 2), ("--k", args.k, 1)):
        if value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    opts = SimulationOptions(out=out, sites=n_sites, rows=args.rows, features=args.features,
                             k=args.k, rank=args.rank, epsilon=args.epsilon, delta=args.delta,
                             calibration=args.calibration, min_sites=args.min_sites,
                             clip_norm=args.clip_norm, centering=args.centering,
                             site_weighting=args.site_weighting, aggregation=args.aggregation,
                             seed=args.seed, data=list(args.data),
                             schema=args.schema, data_format=args.data_format,
                             budget_epsilon=args.budget_epsilon, budget_delta=args.budget_delta,
                             deadline=args.deadline, job=args.job, synth_rows=args.synth_rows,
                             synth_mode=args.synth_mode.replace("-", "_"),
                             composition=args.composition, metrics=args.metrics,
                             omop=bool(getattr(args, "omop", None)))
    if opts.omop:  # before anything is made
        from dpfed.aggregator.simulate_omop import check_omop_options

        check_omop_options(opts)
    if opts.job == "synth":  # before anything is made
        from dpfed.aggregator.simulate_synth import check_synth_options

        check_synth_options(opts)
    return opts


def check_data_files(opts: SimulationOptions) -> Schema:
    """Open every ``--data`` file as its simulated site will, and read it through once.

    Each file is checked for the schema's columns and counted under the sites' row policy
    (the site config's defaults): a file none of whose rows survives would make its site
    refuse every task, so it is a data error here, naming the site, before anything starts.
    Returns the schema (``--schema``).

    Raises
    ------
    DataError, SchemaError
        Naming the file and the site (``hospital-<i>``, as the simulation names them).
    """
    assert opts.schema is not None
    schema = Schema.load(opts.schema)
    for i, path in enumerate(opts.data):
        source = open_data_source(spec_from_path(path), schema)
        report = scan(source)
        if report.rows_kept == 0:
            raise DataError(f"--data {path} (site hospital-{i + 1}): no row survives the "
                            f"sites' row policy ({report.summary()}); that site would refuse "
                            "every task")
    return schema


def pooled_reference(schema: Schema, paths: list[Path], *, centred: bool) -> PooledReference:
    """Non-private target from the REAL pooled rows (every site's rows together).

    Rows are mapped to ``u`` (each column to [-1, 1] by the schema bounds, nothing clipped);
    the matrix is their covariance about the true pooled mean (``centred``) or their second
    moment about the schema midpoints -- ``sum_s G_s / sum_s N_s``, so a 9,000-row site counts
    nine times a 1,000-row one, as in pooled PCA.
    """
    unit_ball = UnitBallMap(schema)
    p = unit_ball.n_features
    gram = GramAccumulator(p)
    total = np.zeros(p)
    counts = []
    for path in paths:
        before = gram.n_rows
        for table, _ in open_data_source(spec_from_path(path), schema).iter_chunks():
            u = unit_ball.scaled(table)
            total += u.sum(axis=0)
            gram.add(u)
        counts.append(gram.n_rows - before)
    n = max(gram.n_rows, 1)
    matrix = gram.gram() / n
    what = ("second moment about the schema midpoints" if not centred else
            "covariance about their true mean")
    if centred:
        mean = total / n
        matrix -= np.outer(mean, mean)
    label = (f"non-private PCA of the real pooled rows (all {sum(counts)} rows of the "
             f"{len(paths)} sites together, columns scaled by the schema bounds, {what})")
    return PooledReference(matrix, counts, label)


def check_options(opts: SimulationOptions) -> None:
    """Validate epsilon, delta, K, R and the files before any data or process is made.

    The job parameters go through the coordinator's own validation against the schema the
    sites will hold (the demo schema, or ``--schema``), and ``--data`` files are opened and
    checked for the schema's columns, so a mistake costs no generated data and no start-up.

    Raises
    ------
    ValidationError, ConfigError, DataError, SchemaError
        Naming the internal field; ``dpfed simulate`` rewrites it to the flag.
    """
    from dpfed.aggregator.client import pca_params
    from dpfed.common.data.demo_data import demo_model
    from dpfed.common.jobs.registry import job_kind
    from dpfed.common.validation import check_delta, check_epsilon

    check_epsilon(opts.epsilon)
    check_delta(opts.delta)
    budget_eps = opts.budget_epsilon
    if budget_eps is not None and check_epsilon(budget_eps, "--budget-epsilon") < opts.epsilon:
        raise ConfigError(f"--budget-epsilon {budget_eps:g} is smaller than --epsilon "
                          f"{opts.epsilon:g}: every site would refuse the job")
    if opts.budget_delta is not None and check_delta(
            opts.budget_delta, "--budget-delta") < opts.delta:
        raise ConfigError(f"--budget-delta {opts.budget_delta:g} is smaller than --delta "
                          f"{opts.delta:g}: every site would refuse the job")
    if opts.min_sites > opts.sites:
        raise ConfigError(f"--min-sites {opts.min_sites} is more than the {opts.sites} "
                          "simulated site(s)")
    if opts.data:
        schema = check_data_files(opts)
    else:
        schema = demo_model(opts.features, seed=0).schema
    params = pca_params(opts.k, rank=opts.rank, calibration=opts.calibration,
                        clip_norm=opts.clip_norm, centering=opts.centering,
                        site_weighting=opts.site_weighting, aggregation=opts.aggregation)
    job_kind("pca").canonical(params, opts.epsilon, opts.delta, schema)


def run_simulation(opts: SimulationOptions) -> int:
    """Run the whole simulation; return an exit code (errors are raised, not printed)."""
    if opts.omop:
        from dpfed.aggregator.simulate_omop import run_omop_simulation

        return run_omop_simulation(opts, run_simulation)
    if opts.job in ("svt", "query"):
        from dpfed.aggregator.simulate_queries import run_query_simulation

        return run_query_simulation(opts)
    if opts.job == "profile":
        from dpfed.aggregator.simulate_profile import check_profile_options, run_profile_simulation
        from dpfed.common.data.demo_data import demo_model

        check_profile_options(opts, check_data_files(opts) if opts.data else
                              demo_model(opts.features, seed=0, mixed=True).schema)
        prepare_output(opts.out.resolve())
        return run_profile_simulation(opts)
    if opts.job == "synth":
        from dpfed.aggregator.simulate_synth import run_synth_simulation

        if opts.data:
            check_data_files(opts)
        prepare_output(opts.out.resolve())
        return run_synth_simulation(opts)
    check_options(opts)
    out = opts.out.resolve()
    prepare_output(out)
    t0 = time.monotonic()
    seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(4), "little")
    if opts.data:
        say("data", f"using {len(opts.data)} file(s) with schema {opts.schema}")
    else:
        say("data", f"generating {opts.sites} x {opts.rows} rows x {opts.features} columns "
             f"(latent factor structure, seed {seed}) -> {out / 'data'}")
    settings = SiteSettings(
        budget_epsilon=opts.budget_epsilon or max(10.0, 2 * opts.epsilon),
        budget_delta=opts.budget_delta or min(0.5, 10 * opts.delta),
        noise_seed=opts.seed)
    fed = LocalFederation.create(out, n_sites=opts.sites, rows=opts.rows,
                                 features=opts.features, seed=seed, fmt=opts.data_format,
                                 data=opts.data or None, schema=opts.schema,
                                 min_sites=opts.min_sites or None,
                                 task_deadline_s=opts.deadline, settings=settings,
                                 metrics=opts.metrics)
    say("certs", f"federation CA, coordinator, {len(fed.site_ids)} site and 1 analyst "
         f"certificate(s) -> {fed.certs}")
    schema = Schema.load(fed.schema_path)
    try:
        fed.start_coordinator()
        say("coordinator", f"serving on {fed.address} (mTLS), store {fed.store}")
        fed.start_sites()
        fed.wait_for_sites()
        with fed.analyst() as coord:
            say("sites", ", ".join(f"{s.site_id} ({s.row_count} rows)" for s in coord.sites()))

            def progress(event: JobEvent) -> None:
                say("pca", f"[{event.progress * 100:5.1f}%] {event.message}")

            job_t0 = time.monotonic()
            try:
                result = coord.pca(opts.k, epsilon=opts.epsilon, delta=opts.delta,
                                   rank=opts.rank, calibration=opts.calibration,
                                   clip_norm=opts.clip_norm, centering=opts.centering,
                                   site_weighting=opts.site_weighting,
                                   min_sites=opts.min_sites, aggregation=opts.aggregation,
                                   on_event=progress)
            except JobFailedError as exc:
                say("pca", f"FAILED: {exc}")
                raise
            job_seconds = time.monotonic() - job_t0
            result.save(out / "pca.npz")
            budgets = coord.budgets()
            jobs = coord.jobs(5)
    finally:
        fed.stop_all()

    say("evaluate", "non-private PCA of the real pooled rows (all sites together), for "
         "comparison")
    paths = [fed.data_paths[s] for s in fed.site_ids]
    reference = pooled_reference(schema, paths, centred=result.centering == "mean")
    counts = reference.counts
    energy = _write_report(out, opts, result, reference, budgets, jobs[0] if jobs else None,
                           job_seconds)
    print()
    print(f"dpfed simulate: {len(fed.site_ids)} sites, {sum(counts)} rows, "
          f"{result.n_features_in_} features, K={result.n_components_}, centering "
          f"{result.centering}, clip radius {result.clip_radius:.3g} "
          f"({result.metadata.get('clip_norm_requested')})")
    print_budgets(budgets)
    print(f"  captured energy of the DP subspace relative to non-private PCA of the real pooled "
          f"rows: {energy:.3f} (K={result.n_components_}, epsilon={opts.epsilon:g}, "
          f"delta={opts.delta:g}, {opts.calibration})")
    print(f"    compared with: {reference.label}")
    print(f"  job time {job_seconds:.1f}s, total {time.monotonic() - t0:.1f}s")
    data_dir = "" if opts.data else "data/, "
    print(f"  results in {out}: pca.npz, report.html, certs/, {data_dir}sites/*/ledger.sqlite, "
          "coordinator/store/, logs/")
    return exit_codes.OK


def _write_report(out: Path, opts: SimulationOptions, result: PCAResult,
                  reference: PooledReference,
                  budgets: list[tuple[str, bool, BudgetStatus | None]],
                  job: JobInfo | None, job_seconds: float) -> float:
    fraction = captured_fraction(result, reference)
    intro = (f"Generated {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC. A coordinator and "
             f"{len(reference.counts)} hospital site agents ran as separate processes over gRPC "
             "with mutual TLS; every value that left a site was noised and charged to that "
             "site's ledger first.")
    extra = {"job wall time (s)": round(job_seconds, 2),
             "seeded (reproducible, not private)": opts.seed is not None,
             "captured energy at K, DP / non-private pooled": float(fraction[-1])}
    rep = pca_report(result, title="dpfed simulation report", reference=reference,
                     intro=intro, extra=extra)
    rep.heading("Ledgers")
    rep.table(("site", "epsilon spent", "epsilon cap", "delta spent", "delta cap", "releases"),
              [(site_id, b.epsilon_spent, b.epsilon_cap, b.delta_spent, b.delta_cap, b.events)
               for site_id, _c, b in budgets if b is not None])
    if job is not None:
        rep.heading("Job")
        rep.table(("job id", "state", "submitted", "updated", "sites ok"),
                  [(job.job_id, job.state, job.created, job.updated,
                    f"{sum(1 for o in job.sites if o.status == 'ok')}/{len(job.sites)}")])
    rep.heading("Files")
    rep.preformatted("\n".join(sorted(str(p.relative_to(out)) for p in out.rglob("*")
                                      if p.is_file() and p.suffix in (".npz", ".toml", ".sqlite",
                                                                      ".log", ".csv", ".parquet",
                                                                      ".pem"))))
    (out / "report.html").write_text(rep.render(), encoding="utf-8")
    return float(fraction[-1])
