"""``dpfed synth`` and ``dpfed synth-sample``: federated DP synthesis from the command line.

Registered on the ``dpfed`` parser by :func:`register`; heavy modules are imported inside the
commands so that ``dpfed --help`` stays fast. See docs/synthesis.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dpfed.aggregator.cli_files import check_input_file, check_output_file, write_result
from dpfed.common import exit_codes
from dpfed.common.errors import ValidationError

if TYPE_CHECKING:
    from dpfed.aggregator.client import Coordinator
    from dpfed.common.transport.protocol import JobEvent


#: Seconds between two progress lines of a long write (a short write prints none).
PROGRESS_SECONDS = 2.0


def write_progress(out: str, every: float = PROGRESS_SECONDS) -> Callable[[int, int], None]:
    """Return a ``progress(written, total)`` callback for :meth:`SynthModel.write`.

    It prints ``writing OUT: 3,145,728 / 10,000,000 rows (31%), 1,204,000 rows/s`` to stderr
    at most every ``every`` seconds (nothing for a write shorter than that).
    """
    start = time.monotonic()
    last = start

    def report(written: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last < every or written >= total:
            return
        last = now
        rate = written / max(now - start, 1e-9)
        print(f"writing {out}: {written:,} / {total:,} rows ({written / total:.0%}), "
              f"{rate:,.0f} rows/s", file=sys.stderr, flush=True)

    return report


def _synth_plan(args: argparse.Namespace, coord: Coordinator) -> list[tuple[str, float, float]]:
    from dpfed.aggregator.client import Coordinator
    from dpfed.aggregator.plan_cli import print_left_out, who_takes_part
    from dpfed.common.job_params import SynthParams
    from dpfed.common.jobs.registry import job_kind
    from dpfed.common.jobs.synth_evaluation import EVALUATE_SUMMARY
    from dpfed.common.privacy.composition import rounds_rho

    spec = Coordinator.synth_spec(epsilon=args.epsilon, delta=args.delta, mode=args.mode,
                                  aggregation=args.aggregation,
                                  evaluate_rows=args.evaluate_rows if args.evaluate else 0,
                                  evaluate_summary=_summary_budget(args), pairs=args.pairs,
                                  pair_groups=args.pair_groups, composition=args.composition)
    params = SynthParams.parse(SynthParams.submitted(spec.params), None)  # as the job will be
    plan = params.plan(args.epsilon, args.delta)
    kind = job_kind("synth")
    sites, left_out = who_takes_part(kind, params, kind.plan(params, args.epsilon, args.delta),
                                     coord.sites(), args.epsilon, args.delta)
    print(f"synth plan ({params.mode}, aggregation {params.aggregation}): every site taking "
          "part is charged, per round:")
    if params.aggregation == "secure":
        print("  every round is a secure sum (Skellam noise shared among the sites, sized "
              "for the largest tolerated-colluders t among them); the coordinator sees only "
              "the noisy pooled totals")
        if params.composition == "zcdp":
            print("  under --composition zcdp each secure sum is planned to spend at most its "
                  "share of rho: its sites calibrate to and record the Skellam noise's own "
                  "epsilon, a few per cent above the round's epsilon below")
    if params.pair_rounds:
        most = ("the number of columns - 1" if params.pairs is None else str(params.pairs))
        print(f"  pair_scores and pairs measure at most {most} DP 2-way marginal(s) of column "
              f"pairs (--pairs; 0 skips them), {params.pair_groups} groups per ordered column "
              "(--pair-groups)")
    if params.composition == "zcdp":
        print(f"  --composition zcdp: every round gets its share of rho = "
              f"{rounds_rho(plan):.4g} (the job's epsilon "
              f"{args.epsilon:g} at delta {args.delta:g}); the epsilons below are each round's "
              "own guarantee. Only sites whose ledger uses the zcdp accountant take part; it "
              "adds the rounds' rho")
    print(f"{'site':<16} {'round':<11} {'epsilon':>10} {'delta':>10} {'eps left now':>13}")
    for site in sites or []:
        left = f"{site.budget.epsilon_remaining:.4g}" if site.budget else "?"
        for name, eps, dlt in plan:
            print(f"{site.site_id:<16} {name:<11} {eps:>10.4g} {dlt:>10.3g} {left:>13}")
        if params.summary_epsilon:
            if EVALUATE_SUMMARY.task_kind in site.allowed_kinds:
                print(f"{site.site_id:<16} {'evaluate_summary':<11} "
                      f"{params.summary_epsilon:>10.4g} {params.summary_delta:>10.3g} {left:>13}")
            else:
                print(f"{site.site_id:<16} evaluate_summary: not asked (the site's policy has "
                      "no evaluation_summary = \"dp\")")
    if not sites:
        for name, eps, dlt in plan:
            print(f"{'(every site)':<16} {name:<11} {eps:>10.4g} {dlt:>10.3g} {'?':>13}")
    print_left_out(left_out)
    note = params.plan_note(args.epsilon, args.delta)
    if note:
        print(note)
    total_eps = sum(e for _, e, _ in plan)
    total_delta = sum(d for _, _, d in plan)
    if params.composition == "zcdp":
        print(f"total per site: rho {rounds_rho(plan):.4g}, i.e. "
              f"({args.epsilon:g}, {args.delta:g})-DP by zCDP composition")
    else:
        print(f"total per site: epsilon {total_eps:.4g}, delta {total_delta:.3g}")
    if params.summary_epsilon:
        print(f"plus, at sites whose policy allows DP evaluation summaries: epsilon "
              f"{params.summary_epsilon:.4g}, delta {params.summary_delta:.3g} "
              "(round evaluate_summary)")
    if params.evaluate_rows:
        print("with --evaluate every site holds out min(N/5, 20000) of its rows from every "
              "round (they are its local evaluation's unseen rows)")
    return plan


def _summary_budget(args: argparse.Namespace) -> tuple[float, float] | None:
    """Return the DP evaluation summary's (epsilon, delta) from the flags, or None."""
    if args.evaluate_summary_epsilon is None:
        if args.evaluate_summary_delta is not None:
            raise ValidationError("--evaluate-summary-delta needs --evaluate-summary-epsilon")
        return None
    if not args.evaluate:
        raise ValidationError("--evaluate-summary-epsilon needs --evaluate (the summary is of "
                              "the sites' evaluation of a synthetic sample)")
    delta = args.delta if args.evaluate_summary_delta is None else args.evaluate_summary_delta
    return args.evaluate_summary_epsilon, delta


def cmd_synth(args: argparse.Namespace, connect: Callable[[argparse.Namespace], Coordinator],
              on_event: Callable[[JobEvent], None]) -> int:
    """Run a federated synthesis job; write the table, the model and the report."""
    from dpfed.aggregator.client import Coordinator
    from dpfed.aggregator.synth_model import check_rows, output_format
    from dpfed.aggregator.synth_report import write_synth_report
    from dpfed.common.job_params import SynthParams

    mode = args.mode.replace("-", "_")
    # --mode / --aggregation combinations are refused here, before anything connects or runs
    SynthParams.parse(Coordinator.synth_spec(
        epsilon=args.epsilon, delta=args.delta, mode=mode, aggregation=args.aggregation,
        pairs=args.pairs, pair_groups=args.pair_groups, composition=args.composition).params, None)
    if mode == "row_aligned":
        if args.rows is not None:
            raise ValidationError("--rows: row-aligned mode releases exactly one noisy row per "
                                  "real row; omit --rows")
    elif not args.plan:
        if args.rows is None:
            raise ValidationError("--rows is required in generative mode (how many synthetic "
                                  "rows to write)")
        check_rows(args.rows)
    fmt = output_format(args.out, args.format)
    if not args.plan:
        for flag, path in (("--out", args.out), ("--model", args.model),
                           ("--report", args.report)):
            if path:
                check_output_file(path, flag)
    with connect(args) as coord:
        if args.plan:
            _synth_plan(args, coord)
            return exit_codes.OK
        if args.wait_sites:
            print(f"waiting for {args.wait_sites} site(s) to connect...", flush=True)
            coord.wait_for_sites(args.wait_sites, timeout=args.wait_timeout)
        model = coord.synth_model(
            epsilon=args.epsilon, delta=args.delta, rows=args.rows, mode=mode,
            continuous_link=args.continuous_link, n_bins=args.n_bins, rank=args.rank,
            clip_norm=args.clip_norm, min_sites=args.min_sites,
            deadline_seconds=args.deadline, on_event=on_event,
            evaluate_rows=args.evaluate_rows if args.evaluate else 0,
            aggregation=args.aggregation,
            evaluate_summary=_summary_budget(args), pairs=args.pairs,
            pair_groups=args.pair_groups, composition=args.composition)
    then = " and dpfed synth-sample FILE --rows N --out TABLE"
    model_path = write_result(lambda: model.save(args.model), args.model, model.metadata, then)
    written = write_result(lambda: model.write(args.out, args.rows, fmt=fmt,
                                               progress=write_progress(args.out)),
                           args.out, model.metadata, f" (or use {model_path}){then}")
    label = ("row-aligned: ONE NOISY ROW PER REAL ROW" if mode == "row_aligned"
             else "generative: new rows from the DP model")
    print(f"wrote {args.out} ({written} rows, {fmt}; {label})")
    print(f"wrote {model_path} (the fitted DP model: `dpfed synth-sample {model_path} "
          "--rows N --out FILE` draws more at no privacy cost)")
    if args.report:
        sample = model.sample(None if mode == "row_aligned" else min(args.rows, 50_000))
        print(f"wrote {write_synth_report(args.report, model, sample)}")
    return exit_codes.OK


def cmd_synth_sample(args: argparse.Namespace) -> int:
    """Draw rows from a saved synthesis model (post-processing: no budget)."""
    from dpfed.aggregator.synth_model import SynthModel, check_rows, output_format

    check_input_file(args.model, "MODEL", "model")
    check_output_file(args.out, "--out")
    model = SynthModel.load(args.model)
    rows = None if args.rows is None else check_rows(args.rows)
    written = model.write(args.out, rows, fmt=output_format(args.out, args.format),
                          progress=write_progress(args.out))
    print(f"wrote {args.out} ({written} rows)")
    return exit_codes.OK


def register(sub: Any, connection_args: Callable[[argparse.ArgumentParser], None],
             connect: Callable[[argparse.Namespace], Coordinator],
             on_event: Callable[[JobEvent], None]) -> None:
    """Add the ``synth`` and ``synth-sample`` subcommands."""
    p = sub.add_parser("synth", help="run a federated DP synthesis job; write the synthetic "
                       "table (Parquet/CSV), the fitted model and report.html")
    p.add_argument("--epsilon", type=float, required=True, help="epsilon spent at each site")
    p.add_argument("--delta", type=float, required=True, help="delta spent at each site")
    p.add_argument("--rows", type=int, help="synthetic rows to write (generative mode)")
    p.add_argument("--out", default="synth.parquet",
                   help="output table (.parquet default, .csv for CSV)")
    p.add_argument("--format", choices=["parquet", "csv"], help="default: from --out")
    p.add_argument("--mode", choices=["generative", "row-aligned"], default="generative",
                   help="generative (default): new rows from the DP model; row-aligned: one "
                   "noisy row per real row")
    p.add_argument("--plan", action="store_true",
                   help="print each site's epsilon/delta per round and exit (nothing runs)")
    p.add_argument("--aggregation", choices=["site", "secure"], default="site",
                   help="site (default): every site noises its own histograms and PCA factor; "
                   "secure: secure sums with distributed noise (pooled-data utility; "
                   "generative mode only)")
    p.add_argument("--continuous-link", choices=["quantile", "identity"], default="quantile")
    p.add_argument("--n-bins", type=int, default=32,
                   help="public bins per continuous column (default 32)")
    p.add_argument("--rank", type=int, help="number of factors (default: information rule)")
    p.add_argument("--clip-norm", type=float, help="latent norm bound (default sqrt(dim))")
    p.add_argument("--pairs", type=int, metavar="N",
                   help="generative mode: measure at most N DP 2-way marginals of column pairs "
                   "(rounds pair_scores and pairs; default: number of columns - 1; 0 skips "
                   "them)")
    p.add_argument("--pair-groups", type=int, metavar="G",
                   help="most groups per ordinal/continuous column in a pair table (2..64, "
                   "default 6)")
    p.add_argument("--composition", choices=["basic", "zcdp"], default="basic",
                   help="basic (default): every round gets its share of epsilon and delta; "
                   "zcdp: its share of the job's zCDP rho (less noise per round; only sites "
                   "whose ledger uses the zcdp accountant take part)")
    p.add_argument("--evaluate", action="store_true",
                   help="send a synthetic sample to every site, which compares it with its own "
                   "rows and writes an HTML report in its own directory (nothing comes back); "
                   "every site then holds out min(N/5, 20000) rows from every round")
    p.add_argument("--evaluate-rows", type=int, default=2000,
                   help="rows of that sample (default 2000, at most 50000)")
    p.add_argument("--evaluate-summary-epsilon", type=float, metavar="EPSILON",
                   help="with --evaluate: also ask the sites whose policy allows it for a DP "
                   "summary of their evaluation, charged at this epsilon (on top of --epsilon)")
    p.add_argument("--evaluate-summary-delta", type=float, metavar="DELTA",
                   help="delta of that summary (default: --delta)")
    p.add_argument("--model", default="synth_model.npz", help="where to save the model")
    p.add_argument("--report", default="report.html", help="HTML report ('' to skip)")
    p.add_argument("--min-sites", type=int, default=0, help="quorum (default: coordinator's)")
    p.add_argument("--deadline", type=float, default=0.0, help="per-site deadline, seconds")
    p.add_argument("--wait-sites", type=int, default=0, metavar="N",
                   help="first wait until N sites are connected")
    p.add_argument("--wait-timeout", type=float, default=300.0, help="seconds for --wait-sites")
    connection_args(p)
    p.set_defaults(func=lambda a: cmd_synth(a, connect, on_event))

    p = sub.add_parser("synth-sample", help="draw rows from a saved synthesis model (no budget)")
    p.add_argument("model", help="model file written by `dpfed synth`")
    p.add_argument("--rows", type=int, help="rows to draw (required for generative models)")
    p.add_argument("--out", default="synth_sample.parquet",
                   help="output table (.parquet or .csv; default synth_sample.parquet)")
    p.add_argument("--format", choices=["parquet", "csv"], help="default: from --out")
    p.set_defaults(func=cmd_synth_sample)
