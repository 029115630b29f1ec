"""``dpfed``: the analyst's command line, certificate tool and local simulation.

    dpfed simulate [--sites N --rows R --features P --k K --epsilon E --delta D --seed S --out DIR]
    dpfed certs init|issue|show ...
    dpfed demo-data --out DIR [--sites N --rows R --features P --seed S]
    dpfed sites [--all] [--json]         connected sites, rows and remaining budgets
    dpfed budgets [--json]               every known site's budget
    dpfed pca --k K --epsilon E --delta D [--rank R] [--calibration analytic|classic]
              [--min-sites M] [--clip-norm auto|schema|C] [--centering mean|none]
              [--site-weighting size|equal] [--aggregation site|secure] [--wait-sites N]
              --out pca.npz [--report HTML]
    dpfed svt --queries Q.toml --epsilon E --threshold T [--session ID] ...   (docs/queries.md)
    dpfed query --columns C[,C2] --workload W --epsilon E [--bins C=EDGES] ...
    dpfed synth --epsilon E --delta D --rows N --out synth.parquet [--mode generative|row-aligned]
                [--plan] [--evaluate] [--model synth_model.npz] [--report report.html]
    dpfed synth-sample MODEL --rows N [--out FILE] more rows from a saved model (no budget)
    dpfed report RESULT [--out report.html]   the HTML report of a result file
    dpfed jobs [--limit N] [--json]      recent jobs
    dpfed job ID [--watch] [--json]      one job (follow its progress with --watch)
    dpfed fetch ID --out FILE.npz        download a finished job's result file
    dpfed cancel ID [--reason TEXT]      stop an unfinished job (charges made stay charged)
    dpfed audit verify EXPORT --ca CA    check a site's signed ledger export

Analyst commands connect with ``--coordinator HOST:PORT --ca CA --cert CERT --key KEY`` (or
the environment variables DPFED_COORDINATOR, DPFED_CA, DPFED_CERT, DPFED_KEY,
DPFED_SERVER_NAME). Every command exits with a code of ``dpfed.common.exit_codes`` (table in
docs/cli.md); ``--json`` field names are documented there too.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, cast

from dpfed.aggregator.cli_files import (
    check_input_file,
    check_output_dir,
    check_output_file,
    write_result,
)
from dpfed.common import exit_codes
from dpfed.common.cli_support import (
    LazyArgumentParser,
    add_json_flag,
    add_version,
    address,
    check_address,
    format_table,
    parse_args,
    print_json,
    run_command,
)
from dpfed.common.errors import ConfigError, ValidationError
from dpfed.common.job_choices import AGGREGATIONS, CENTERINGS, SITE_WEIGHTINGS, parse_clip_norm

# Start-up time matters (``dpfed --help`` < 0.3 s): numpy, pandas, scipy, grpc and
# cryptography are imported inside the commands that use them, never at module level.
if TYPE_CHECKING:
    from dpfed.aggregator.client import Coordinator
    from dpfed.common.privacy.accounting import BudgetStatus
    from dpfed.common.transport.protocol import JobEvent

if TYPE_CHECKING:
    from dpfed.aggregator.pca_result import PCAResult

ENV = {"coordinator": "DPFED_COORDINATOR", "ca": "DPFED_CA", "cert": "DPFED_CERT",
       "key": "DPFED_KEY", "server_name": "DPFED_SERVER_NAME"}


def _connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection (or environment variables DPFED_*)")
    g.add_argument("--coordinator", type=address("--coordinator"), metavar="HOST:PORT",
                   help="coordinator address [$DPFED_COORDINATOR]")
    g.add_argument("--ca", help="federation CA certificate [$DPFED_CA]")
    g.add_argument("--cert", help="analyst certificate [$DPFED_CERT]")
    g.add_argument("--key", help="analyst private key [$DPFED_KEY]")
    g.add_argument("--server-name", help="TLS name of the coordinator, when the address is not "
                   "in its certificate [$DPFED_SERVER_NAME]")
    g.add_argument("--timeout", type=float, default=30.0, help="per-call timeout, seconds")


def _job_args(p: argparse.ArgumentParser) -> None:
    """Add the connection flags and ``--study`` (a command that submits a job)."""
    _connection_args(p)
    p.add_argument("--study", default="", metavar="NAME",
                   help="spend from this study's budget at every site (each site's "
                   "[studies.NAME]); a site without the study refuses the job")


def connect(args: argparse.Namespace) -> Coordinator:
    """Open a connection from flags or environment; ConfigError names what is missing."""
    from dpfed.aggregator.client import Coordinator

    values = {k: getattr(args, k, None) or os.environ.get(env) for k, env in ENV.items()}
    if not values["coordinator"]:
        raise ConfigError("no coordinator address: pass --coordinator HOST:PORT or set "
                          "DPFED_COORDINATOR")
    if not getattr(args, "coordinator", None):
        check_address(values["coordinator"] or "", "DPFED_COORDINATOR")
    missing = [f"--{k}" for k in ("ca", "cert", "key") if not values[k]]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)} (an analyst certificate from "
                          "`dpfed certs init --analysts NAME`; or set DPFED_CA/CERT/KEY)")
    return Coordinator(values["coordinator"] or "", ca=values["ca"], cert=values["cert"],
                       key=values["key"], server_name=values["server_name"],
                       timeout=args.timeout, study=getattr(args, "study", "") or "")


def print_event(event: JobEvent) -> None:
    """One progress line per event."""
    print(f"[{event.progress * 100:5.1f}%] {event.stage:<9} {event.message}", flush=True)


# --------------------------------------------------------------------------- commands


def cmd_sites(args: argparse.Namespace) -> int:
    """List sites."""
    from dpfed.aggregator.json_views import evaluation_summary_policy, site_json

    with connect(args) as coord:
        sites = coord.sites(include_disconnected=args.all)
    if args.json:
        print_json([site_json(s) for s in sites])
        return exit_codes.OK
    if not sites:
        print("no sites connected")
        return exit_codes.OK
    rows = []
    for s in sites:
        b = s.budget
        rows.append((s.site_id, "connected" if s.connected else "offline", s.row_count,
                     f"{b.epsilon_spent:.4g}" if b else "?",
                     f"{b.epsilon_remaining:.4g}" if b else "?",
                     f"{b.delta_remaining:.3g}" if b else "?", ",".join(s.allowed_kinds),
                     s.secure_policy or "off", evaluation_summary_policy(s)))
    print(format_table(("site", "state", "rows", "eps spent", "eps left", "delta left", "jobs",
                        "secure aggregation", "eval summary"), rows, right=(2, 3, 4, 5)))
    return exit_codes.OK


def cmd_budgets(args: argparse.Namespace) -> int:
    """List every known site's budget."""
    from dpfed.aggregator.json_views import budget_row_json

    with connect(args) as coord:
        rows = coord.budgets()
    if args.study:
        return _study_budgets(args.study, rows, args.json)
    if args.json:
        print_json([budget_row_json(site_id, connected, b) for site_id, connected, b in rows])
        return exit_codes.OK
    if not rows:
        print("no sites known")
    for site_id, connected, b in rows:
        if b is None:
            print(f"{site_id}: no budget reported")
            continue
        state = "connected" if connected else "offline"
        if b.accountant == "basic":
            spent = (f"epsilon {b.epsilon_spent:.6g}/{b.epsilon_cap:g} spent, delta "
                     f"{b.delta_spent:.3g}/{b.delta_cap:g}")
        else:  # pld (tight composition) and zcdp read the spend at the site's delta cap
            spent = (f"epsilon {b.epsilon_spent:.6g}/{b.epsilon_cap:g} spent at delta "
                     f"{b.delta_cap:g}")
        print(f"{site_id} ({state}): {b.accountant} accountant, {spent}, rho "
              f"{b.rho_spent:.6g}, {b.events} release(s)")
    return exit_codes.OK


def _study_budgets(study: str, rows: list[tuple[str, bool, BudgetStatus | None]],
                   as_json: bool) -> int:
    """Print what every site says of ``study``'s budget (``dpfed budgets --study``)."""
    from dpfed.aggregator.json_views import budget_json

    found = [(site_id, connected, next((s for s in (b.studies if b else ()) if s.name == study),
                                      None)) for site_id, connected, b in rows]
    if as_json:
        print_json([{"site_id": site_id, "connected": connected, "study": study,
                     "expires": s.expires if s else None,
                     "budget": budget_json(s.status) if s else None}
                    for site_id, connected, s in found])
        return exit_codes.OK
    table = []
    for site_id, connected, s in found:
        state = "connected" if connected else "offline"
        if s is None:
            table.append((site_id, state, "-", "-", "-", "not a study of this site"))
            continue
        b = s.status
        expired = s.expires < datetime.now(UTC).date().isoformat()
        table.append((site_id, state, f"{b.epsilon_spent:.6g}", f"{b.epsilon_remaining:.6g}",
                      f"{b.epsilon_cap:g}", f"{s.expires}{' (expired)' if expired else ''}"))
    print(f"study {study}:")
    print(format_table(("site", "state", "eps spent", "eps left", "eps cap", "expires"), table,
                       right=(2, 3, 4)))
    return exit_codes.OK


#: ``dpfed pca`` flags of the pca job's parameters (for error messages).
PCA_FIELD_FLAGS = {"n_components": "--k", "rank": "--rank", "clip_norm": "--clip-norm",
                   "calibration": "--calibration"}


def cmd_pca(args: argparse.Namespace) -> int:
    """Run a DP-PCA job (or, with ``--plan``, show what it would charge where)."""
    if args.plan:
        from dpfed.aggregator.plan_cli import print_kind_plan

        with connect(args) as coord:
            print_kind_plan("pca", _pca_params(args), args.epsilon, args.delta,
                            *coord.federation())
        return exit_codes.OK
    check_output_file(args.out, "--out")
    if args.report:
        check_output_file(args.report, "--report")
    with connect(args) as coord:
        if args.wait_sites:
            print(f"waiting for {args.wait_sites} site(s) to connect (up to "
                  f"{args.wait_timeout:g}s)...", flush=True)
            coord.wait_for_sites(args.wait_sites, timeout=args.wait_timeout)
        result = coord.pca(args.k, epsilon=args.epsilon, delta=args.delta, rank=args.rank,
                           calibration=args.calibration, clip_norm=args.clip_norm,
                           aggregation=args.aggregation,
                           min_sites=args.min_sites, deadline_seconds=args.deadline,
                           on_event=print_event, centering=args.centering,
                           site_weighting=args.site_weighting,
                           clip_quantile=args.clip_quantile)
    path = write_result(lambda: result.save(args.out), args.out, result.metadata)
    if args.report:
        report = write_result(lambda: write_pca_report(result, args.report), args.report,
                              result.metadata, then=" and dpfed report FILE")
        print(f"wrote {report}")
    meta = result.metadata
    k = result.n_components_
    ratios = ", ".join(f"{v:.3f}" for v in result.explained_variance_ratio_[:k])
    print(f"wrote {path}: {k} components over {len(result.feature_names_in_)} "
          f"features from {len(meta.get('sites', []))} site(s), "
          f"{meta.get('n_rows_total', '?')} rows; explained variance ratio: {ratios}")
    return exit_codes.OK


def _pca_params(args: argparse.Namespace) -> dict[str, object]:
    from dpfed.aggregator.client import pca_params

    return pca_params(args.k, rank=args.rank, calibration=args.calibration,
                      clip_norm=args.clip_norm, centering=args.centering,
                      site_weighting=args.site_weighting, clip_quantile=args.clip_quantile,
                      aggregation=args.aggregation)


def write_pca_report(result: PCAResult, out: str | Path) -> Path:
    """Write the HTML report of ``result`` to ``out``."""
    from dpfed.aggregator.pca_report import pca_report

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(pca_report(result).render(), encoding="utf-8")
    return path


def cmd_report(args: argparse.Namespace) -> int:
    """Write the HTML report of a saved result file (any kind)."""
    from dpfed.aggregator.result_reports import report_for_result

    check_input_file(args.result, "RESULT", "result")
    out = check_output_file(args.out or Path(args.result).with_suffix(".html"), "--out")
    rep = report_for_result(args.result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(rep.render(), encoding="utf-8")
    print(f"wrote {out}")
    return exit_codes.OK


def cmd_jobs(args: argparse.Namespace) -> int:
    """List recent jobs."""
    from dpfed.aggregator.json_views import job_json

    with connect(args) as coord:
        jobs = coord.jobs(args.limit)
    if args.json:
        print_json([job_json(j) for j in jobs])
        return exit_codes.OK
    if not jobs:
        print("no jobs")
        return exit_codes.OK
    rows = []
    for j in jobs:
        ok = sum(1 for s in j.sites if s.status == "ok")
        rows.append((j.job_id, j.spec.kind, j.state, f"{j.spec.epsilon:g}",
                     f"{ok}/{len(j.sites)}", j.created, j.error))
    print(format_table(("job", "kind", "state", "epsilon", "sites ok", "created", "error"),
                       rows, right=(3, 4)))
    return exit_codes.OK


def cmd_job(args: argparse.Namespace) -> int:
    """Show (or follow) one job."""
    from dpfed.aggregator.describe import describe_job
    from dpfed.aggregator.json_views import job_json

    with connect(args) as coord:
        if args.watch:
            job = coord.watch(args.job_id, on_event=None if args.json else print_event)
        else:
            job = coord.job(args.job_id)
    if args.json:
        print_json(job_json(job))
    else:
        print(describe_job(job))
    if job.state == "failed":
        from dpfed.aggregator.client import job_failure

        return exit_codes.for_error(job_failure(job))
    return exit_codes.OK


def cmd_fetch(args: argparse.Namespace) -> int:
    """Download a result file (a NumPy ``.npz`` archive, written as received)."""
    out = check_output_file(args.out, "--out")
    if out.suffix.lower() != ".npz":
        raise ValidationError(
            f"--out {args.out}: a job's result is a NumPy .npz archive, written as received; "
            "give a name ending in .npz (then `dpfed report` draws it, `dpfed synth-sample` "
            "turns a synth model into CSV or Parquet rows)")
    with connect(args) as coord:
        data = coord.fetch_result(args.job_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    print(f"wrote {out} ({len(data)} bytes)")
    return exit_codes.OK


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel an unfinished job."""
    with connect(args) as coord:
        job = coord.cancel(args.job_id, args.reason)
    print(f"job {job.job_id}: {job.state}" + (f" ({job.error})" if job.error else ""))
    return exit_codes.OK


def cmd_demo_data(args: argparse.Namespace) -> int:
    """Write a demo schema and one data file per site."""
    from dpfed.common.data.demo_data import write_demo

    check_output_dir(args.out, "--out")
    schema, paths = write_demo(args.out, args.sites, args.rows, args.features, seed=args.seed,
                               mixed=args.mixed, fmt=args.format)
    print(f"wrote {schema}")
    for p in paths:
        print(f"wrote {p}")
    return exit_codes.OK


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run the local simulation."""
    from dpfed.aggregator.simulate import run_simulation, simulation_options_from_args

    return run_simulation(simulation_options_from_args(args))


def _simulate_arguments(parser: argparse.ArgumentParser) -> None:
    from dpfed.aggregator.simulate import add_simulate_arguments

    add_simulate_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    """Build the command-line interface.

    A command sets ``func`` (``(args) -> exit code``) and, where its options map to job
    parameters, ``field_flags`` (parameter name -> flag) so error messages name the flag.
    """
    parser = argparse.ArgumentParser(
        prog="dpfed", description="Federated differential privacy for hospital consortia.",
        epilog="Run `dpfed COMMAND --help` for a command's options. Exit codes: docs/cli.md.")
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=LazyArgumentParser)

    sim = sub.add_parser("simulate", help="coordinator + N hospitals as local processes over "
                         "real mTLS gRPC, generated (or your) data, every job end to end",
                         populate=_simulate_arguments)
    sim.set_defaults(func=cmd_simulate, field_flags=PCA_FIELD_FLAGS)

    from dpfed.aggregator.certs_cli import register as register_certs

    register_certs(cast("argparse._SubParsersAction[argparse.ArgumentParser]", sub))
    from dpfed.aggregator.audit_cli import register as register_audit

    register_audit(sub)

    p = sub.add_parser("demo-data", help="generate demo hospital tables with a latent factor "
                       "structure and their schema.toml")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--rows", type=int, default=20_000, help="rows per site")
    p.add_argument("--features", type=int, default=20, help="number of columns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed", action="store_true", help="add ordinal and nominal columns")
    p.add_argument("--format", choices=["csv", "parquet"], default="csv")
    p.set_defaults(func=cmd_demo_data)

    p = sub.add_parser("sites", help="connected sites, rows and remaining budgets")
    p.add_argument("--all", action="store_true", help="include sites seen before but offline")
    add_json_flag(p)
    _connection_args(p)
    p.set_defaults(func=cmd_sites)

    p = sub.add_parser("budgets", help="every known site's privacy budget")
    p.add_argument("--study", default="", metavar="NAME",
                   help="show this study's budget at every site instead")
    add_json_flag(p)
    _connection_args(p)
    p.set_defaults(func=cmd_budgets)

    p = sub.add_parser("pca", help="run a DP-PCA job (DPdisPCA) and save pca.npz")
    p.add_argument("--k", type=int, required=True, help="number of components K")
    p.add_argument("--rank", type=int, help="eigenpairs each site sends (default 2K)")
    p.add_argument("--epsilon", type=float, required=True,
                   help="epsilon spent at each site, over all the job's rounds")
    p.add_argument("--delta", type=float, required=True, help="delta spent at each site")
    p.add_argument("--calibration", choices=["analytic", "classic"], default="analytic")
    p.add_argument("--clip-norm", type=parse_clip_norm, default=None, metavar="auto|schema|C",
                   help="row-norm bound: auto = a DP quantile of the row norms (default), "
                   "schema = the worst case the schema allows, or a number")
    p.add_argument("--clip-quantile", type=float, default=None, metavar="Q",
                   help="quantile of the row norms --clip-norm auto uses (default 0.9)")
    p.add_argument("--centering", choices=list(CENTERINGS), default=None,
                   help="mean = centred PCA around a DP mean (default); none = uncentred")
    p.add_argument("--site-weighting", choices=list(SITE_WEIGHTINGS), default=None,
                   help="size = weight sites by N_s/N (default); equal = 1/S (the paper's)")
    p.add_argument("--report", metavar="HTML", help="also write the HTML report here")
    p.add_argument("--aggregation", choices=list(AGGREGATIONS), default=None,
                   help="site: each site noises its own release (default); secure: a secure "
                        "sum with distributed noise (pooled-data utility)")
    p.add_argument("--plan", action="store_true",
                   help="only show what every site taking part would be charged per round, "
                        "and which sites would not take part (nothing is submitted)")
    p.add_argument("--min-sites", type=int, default=0, help="quorum (default: coordinator's)")
    p.add_argument("--deadline", type=float, default=0.0, help="per-site deadline, seconds")
    p.add_argument("--out", default="pca.npz", help="output file (default pca.npz)")
    p.add_argument("--wait-sites", type=int, default=0, metavar="N",
                   help="first wait until N sites are connected (retrying while the "
                   "coordinator starts)")
    p.add_argument("--wait-timeout", type=float, default=300.0,
                   help="seconds for --wait-sites (default 300)")
    _job_args(p)
    p.set_defaults(func=cmd_pca, field_flags=PCA_FIELD_FLAGS)

    p = sub.add_parser("report", help="write the HTML report of a result file (pca, svt, "
                       "query)")
    p.add_argument("result", help="a result file (.npz) from dpfed pca/svt/query/fetch")
    p.add_argument("--out", help="output HTML (default: the result's name with .html)")
    p.set_defaults(func=cmd_report)

    from dpfed.aggregator.query_cli import register as register_queries
    from dpfed.aggregator.run_cli import register as register_run
    from dpfed.aggregator.synth_cli import register as register_synth

    register_queries(sub, _job_args, connect, print_event)
    register_synth(sub, _job_args, connect, print_event)
    register_run(sub, _job_args, connect, print_event)

    p = sub.add_parser("jobs", help="recent jobs")
    p.add_argument("--limit", type=int, default=20, help="how many jobs, newest first")
    add_json_flag(p)
    _connection_args(p)
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("job", help="one job's state (--watch follows its progress)")
    p.add_argument("job_id")
    p.add_argument("--watch", action="store_true", help="follow its progress until it ends")
    add_json_flag(p)
    _connection_args(p)
    p.set_defaults(func=cmd_job)

    p = sub.add_parser("fetch", help="download a finished job's result file")
    p.add_argument("job_id")
    p.add_argument("--out", required=True)
    _connection_args(p)
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("cancel", help="stop an unfinished job (what sites charged stays charged)")
    p.add_argument("job_id")
    p.add_argument("--reason", default="", help="recorded in the job's error")
    _connection_args(p)
    p.set_defaults(func=cmd_cancel)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = parse_args(build_parser(), argv)
    func: Callable[[argparse.Namespace], int] = args.func
    flags: dict[str, str] = getattr(args, "field_flags", None) or {}
    return run_command(f"dpfed {args.command}", lambda: func(args), flags)


if __name__ == "__main__":
    sys.exit(main())
