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
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from dpfed.aggregator.describe import describe_job
from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.aggregator.pca_result import PCAResult
from dpfed.aggregator.report import Report, captured_energy_plot, scree_plot
from dpfed.common import exit_codes
from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ConfigError, DpfedError, JobFailedError
from dpfed.common.pca.dppca import GramAccumulator, captured_energy, top_components
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
    clip_norm: float | None = None
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


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``dpfed simulate`` options to a parser."""
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default runs/simulate-<UTC time>)")
    p.add_argument("--sites", type=int, default=3, help="number of hospitals (default 3)")
    p.add_argument("--rows", type=int, default=20_000, help="rows per hospital (demo data)")
    p.add_argument("--features", type=int, default=20, help="columns of the demo data")
    p.add_argument("--k", type=int, default=5, help="number of principal components K")
    p.add_argument("--rank", type=int, help="eigenpairs each site sends (default 2K)")
    p.add_argument("--epsilon", type=float, default=1.0, help="epsilon per site for the job")
    p.add_argument("--delta", type=float, default=1e-5, help="delta per site for the job")
    p.add_argument("--calibration", choices=["analytic", "classic"], default="analytic")
    p.add_argument("--min-sites", type=int, default=0, help="quorum (default: all sites)")
    p.add_argument("--clip-norm", type=float, help="public row-norm bound (default: none)")
    p.add_argument("--seed", type=int, help="make data AND noise reproducible (demo/tests "
                   "only: the noise is then not private)")
    p.add_argument("--data", type=Path, action="append", default=[],
                   help="a site's data file (repeat once per site; CSV or Parquet)")
    p.add_argument("--schema", type=Path, help="schema.toml for --data")
    p.add_argument("--format", dest="data_format", choices=["csv", "parquet"], default="csv",
                   help="format of the generated demo data")
    p.add_argument("--budget-epsilon", type=float, help="each site's total epsilon budget "
                   "(default max(10, 2 x --epsilon))")
    p.add_argument("--budget-delta", type=float, help="each site's total delta budget "
                   "(default 10 x --delta)")
    p.add_argument("--deadline", type=float, default=600.0, help="per-site task deadline, s")
    p.add_argument("--job", choices=["pca", "synth"], default="pca",
                   help="which job to run: pca (default) or synth (federated DP synthesis on "
                   "mixed demo data)")
    p.add_argument("--synth-rows", type=int, default=20_000,
                   help="--job synth: synthetic rows to write (generative mode)")
    p.add_argument("--synth-mode", choices=["generative", "row-aligned"], default="generative",
                   help="--job synth: output mode")


def simulation_options_from_args(args: argparse.Namespace) -> SimulationOptions:
    """Build options from parsed arguments (validating combinations)."""
    out = args.out or Path("runs") / f"simulate-{datetime.now(UTC):%Y%m%dT%H%M%S}"
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
    return SimulationOptions(out=out, sites=n_sites, rows=args.rows, features=args.features,
                             k=args.k, rank=args.rank, epsilon=args.epsilon, delta=args.delta,
                             calibration=args.calibration, min_sites=args.min_sites,
                             clip_norm=args.clip_norm, seed=args.seed, data=list(args.data),
                             schema=args.schema, data_format=args.data_format,
                             budget_epsilon=args.budget_epsilon, budget_delta=args.budget_delta,
                             deadline=args.deadline, job=args.job,
                             synth_rows=args.synth_rows,
                             synth_mode=args.synth_mode.replace("-", "_"))


def _say(step: str, text: str) -> None:
    print(f"[simulate] {step:<12} {text}", flush=True)


def pooled_second_moment(schema: Schema, paths: list[Path],
                         clip_norm: float | None) -> tuple[np.ndarray, list[int]]:
    """Non-private reference: the average of the sites' G_s/N_s, as DPdisPCA's A_c estimates."""
    unit_ball = UnitBallMap(schema, clip_norm)
    total = np.zeros((unit_ball.n_features, unit_ball.n_features))
    counts = []
    for path in paths:
        acc = GramAccumulator(unit_ball.n_features)
        for table, _ in open_data_source(spec_from_path(path), schema).iter_chunks():
            acc.add(unit_ball.transform(table)[0])
        total += acc.gram() / max(acc.n_rows, 1)
        counts.append(acc.n_rows)
    return total / len(paths), counts


MARKER = ".dpfed-simulation"


def prepare_output(out: Path) -> None:
    """Create ``out``, or empty it if it holds an earlier simulation (never anything else).

    A fresh directory each run keeps a demo from inheriting the previous run's spent budget.
    """
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise ConfigError(f"--out {out} exists and is not an earlier dpfed simulation; "
                              "choose an empty or new directory")
        _say("output", f"replacing the earlier simulation in {out}")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by dpfed simulate; the directory is replaced on re-run\n")


def run_simulation(opts: SimulationOptions) -> int:
    """Run the whole simulation; return an exit code."""
    out = opts.out.resolve()
    prepare_output(out)
    if opts.job == "synth":
        from dpfed.aggregator.simulate_synth import run_synth_simulation

        return run_synth_simulation(opts)
    t0 = time.monotonic()
    seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(4), "little")
    if opts.data:
        _say("data", f"using {len(opts.data)} file(s) with schema {opts.schema}")
    else:
        _say("data", f"generating {opts.sites} x {opts.rows} rows x {opts.features} columns "
             f"(latent factor structure, seed {seed}) -> {out / 'data'}")
    settings = SiteSettings(
        budget_epsilon=opts.budget_epsilon or max(10.0, 2 * opts.epsilon),
        budget_delta=opts.budget_delta or min(0.5, 10 * opts.delta),
        noise_seed=opts.seed)
    fed = LocalFederation.create(out, n_sites=opts.sites, rows=opts.rows,
                                 features=opts.features, seed=seed, fmt=opts.data_format,
                                 data=opts.data or None, schema=opts.schema,
                                 min_sites=opts.min_sites or None,
                                 task_deadline_s=opts.deadline, settings=settings)
    _say("certs", f"federation CA, coordinator, {len(fed.site_ids)} site and 1 analyst "
         f"certificate(s) -> {fed.certs}")
    schema = Schema.load(fed.schema_path)
    try:
        fed.start_coordinator()
        _say("coordinator", f"serving on {fed.address} (mTLS), store {fed.store}")
        fed.start_sites()
        fed.wait_for_sites()
        with fed.analyst() as coord:
            _say("sites", ", ".join(f"{s.site_id} ({s.row_count} rows)" for s in coord.sites()))

            def progress(event: JobEvent) -> None:
                _say("pca", f"[{event.progress * 100:5.1f}%] {event.message}")

            job_t0 = time.monotonic()
            try:
                result = coord.pca(opts.k, epsilon=opts.epsilon, delta=opts.delta,
                                   rank=opts.rank, calibration=opts.calibration,
                                   clip_norm=opts.clip_norm, min_sites=opts.min_sites,
                                   on_event=progress)
            except JobFailedError as exc:
                _say("pca", f"FAILED: {exc}")
                return exit_codes.JOB_FAILED
            job_seconds = time.monotonic() - job_t0
            result.save(out / "pca.npz")
            budgets = coord.budgets()
            jobs = coord.jobs(5)
    except DpfedError as exc:
        print(f"[simulate] error: {exc}", file=sys.stderr)
        return exit_codes.INTERNAL_ERROR
    finally:
        fed.stop_all()

    _say("evaluate", "non-private pooled PCA on the same (unit-ball) features, for comparison")
    paths = [fed.data_paths[s] for s in fed.site_ids]
    reference, counts = pooled_second_moment(schema, paths, opts.clip_norm)
    energy = _write_report(out, opts, result, reference, counts, budgets,
                           jobs[0] if jobs else None, job_seconds)
    print()
    print(f"dpfed simulate: {len(fed.site_ids)} sites, {sum(counts)} rows, "
          f"{len(result.feature_names_in_)} features, K={result.n_components_}")
    for site_id, _connected, b in budgets:
        if b is not None:
            print(f"  {site_id}: spent epsilon {b.epsilon_spent:.4g} of {b.epsilon_cap:g}, "
                  f"delta {b.delta_spent:.3g} of {b.delta_cap:g} ({b.events} release(s))")
    print(f"  captured energy of the DP subspace relative to non-private PCA: {energy:.3f} "
          f"(epsilon={opts.epsilon:g}, delta={opts.delta:g}, {opts.calibration})")
    print(f"  job time {job_seconds:.1f}s, total {time.monotonic() - t0:.1f}s")
    data_dir = "" if opts.data else "data/, "
    print(f"  results in {out}: pca.npz, report.html, certs/, {data_dir}sites/*/ledger.sqlite, "
          "coordinator/store/, logs/")
    return exit_codes.OK


def _write_report(out: Path, opts: SimulationOptions, result: PCAResult, reference: np.ndarray,
                  counts: list[int], budgets: list[tuple[str, bool, BudgetStatus | None]],
                  job: JobInfo | None, job_seconds: float) -> float:
    k = result.n_components_
    p = reference.shape[0]
    exact_vectors = top_components(reference, min(p, max(k, 10)))
    q_dp = captured_energy(result.components_, reference)
    q_np = captured_energy(exact_vectors[:k], reference)
    ratio = q_dp / q_np if q_np > 0 else float("nan")
    exact_eigs = np.sort(np.linalg.eigvalsh(reference))[::-1]
    ks = np.arange(1, k + 1)
    dp_cum = np.array([captured_energy(result.components_[:i], reference) for i in ks])
    np_cum = np.array([captured_energy(exact_vectors[:i], reference) for i in ks])

    rep = Report("dpfed simulation report")
    rep.paragraph(f"Generated {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC. A coordinator and "
                  f"{len(counts)} hospital site agents ran as separate processes over gRPC with "
                  "mutual TLS; every value that left a site was noised and charged to that "
                  "site's ledger first.")
    rep.heading("Summary")
    rep.key_values({
        "sites": len(counts), "rows (total)": sum(counts), "features p": p,
        "components K": k, "rank R sent per site": result.metadata.get("rank"),
        "epsilon per site": opts.epsilon, "delta per site": opts.delta,
        "calibration": opts.calibration,
        "captured energy, DP / non-private (q/q_o)": ratio,
        "job wall time (s)": round(job_seconds, 2),
        "seeded (reproducible, not private)": opts.seed is not None,
    })
    rep.heading("Scree plot")
    shown = max(2 * k, 10)
    rep.image(scree_plot(result.spectrum_[:shown], exact_eigs[:shown],
                         title=f"Eigenvalues, epsilon={opts.epsilon:g} per site"), "scree plot")
    rep.heading("Captured energy")
    rep.image(captured_energy_plot(ks, dp_cum, np_cum), "captured energy")
    rep.heading("Sites")
    rows = []
    sites_meta = {s["site_id"]: s for s in result.metadata.get("sites", [])}
    for site_id, _connected, b in budgets:
        m = sites_meta.get(site_id, {})
        rows.append((site_id, m.get("n_rows", "?"), m.get("noise_sigma", "?"),
                     b.epsilon_spent if b else "?", b.epsilon_cap if b else "?",
                     b.delta_spent if b else "?", b.events if b else "?"))
    rep.table(("site", "rows N_s", "noise sigma", "epsilon spent", "epsilon cap",
               "delta spent", "releases"), rows)
    rep.heading("Components (DP)")
    names = list(result.feature_names_in_)
    top = []
    for i, comp in enumerate(result.components_):
        order = np.argsort(-np.abs(comp))[:5]
        top.append((i + 1, f"{result.explained_variance_ratio_[i]:.3f}",
                    ", ".join(f"{names[j]} ({comp[j]:+.2f})" for j in order)))
    rep.table(("component", "explained variance ratio", "largest loadings"), top)
    if job is not None:
        rep.heading("Job")
        rep.preformatted(describe_job(job))
    rep.heading("Files")
    rep.preformatted("\n".join(sorted(str(p.relative_to(out)) for p in out.rglob("*")
                                      if p.is_file() and p.suffix in (".npz", ".toml", ".sqlite",
                                                                      ".log", ".csv", ".parquet",
                                                                      ".pem"))))
    (out / "report.html").write_text(rep.render(), encoding="utf-8")
    return float(ratio)
