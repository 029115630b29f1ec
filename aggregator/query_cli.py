"""``dpfed svt``, ``dpfed query`` and ``dpfed report`` (registered by :mod:`dpfed.aggregator.cli`).

dpfed svt --queries q.toml --epsilon E --threshold T [--cutoff C] [--numeric-epsilon E3]
[--monotonic] [--out svt.npz|svt.csv] [--json]        open a session
dpfed svt --session JOB_ID --queries next.toml [--out ...]        continue it (no charge)
dpfed svt --session JOB_ID --close                                close it
dpfed query --columns ward,severity | --columns age --bins age=0,18,65,110
--workload identity|all_range|prefix|marginals|custom [--k K]
[--workload-file W.npy|W.csv] [--strategy auto|identity|h2|wavelet|prefix|optimized]
[--noise auto|laplace|gaussian] --epsilon E [--delta D]
[--reconstruction least_squares|nnls|l1] [--aggregation site|secure]
[--secure-noise auto|skellam|dlaplace]
[--out query.npz|query.csv] [--json]
dpfed report RESULT.npz [--out report.html]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpfed.aggregator.cli_files import check_input_file, check_output_file, write_result
from dpfed.common import exit_codes
from dpfed.common.errors import ValidationError

# pandas and the gRPC client are imported inside the commands: ``dpfed --help`` stays fast.
if TYPE_CHECKING:
    import pandas as pd

    from dpfed.aggregator.client import Coordinator
    from dpfed.common.transport.protocol import JobEvent

#: ``dpfed query`` prints at most this many answers (it says how to get the others).
SHOWN_ANSWERS = 60


def _frame_json(df: pd.DataFrame) -> list[dict[str, Any]]:
    rows = df.to_dict(orient="records")
    return [{str(k): (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in r.items()} for r in rows]


def parse_bins(values: list[str]) -> dict[str, Any]:
    """``--bins age=0,18,65,110`` (edges) or ``--bins age=8`` (equal-width count)."""
    out: dict[str, Any] = {}
    for v in values:
        name, sep, rest = v.partition("=")
        if not sep or not name or not rest:
            raise ValidationError(f"--bins {v!r}: expected COLUMN=EDGES (e.g. age=0,18,65,110) "
                                  "or COLUMN=COUNT (e.g. age=8)")
        try:
            parts = [float(p) for p in rest.split(",")]
        except ValueError:
            raise ValidationError(f"--bins {v!r}: edges must be numbers") from None
        if len(parts) == 1:
            if not parts[0].is_integer() or parts[0] < 1:
                raise ValidationError(f"--bins {v!r}: a bin count must be a positive integer")
            out[name] = int(parts[0])
        else:
            out[name] = parts
    return out


def cmd_svt(args: argparse.Namespace, connect: Callable[[argparse.Namespace], Coordinator],
            on_event: Callable[[JobEvent], None]) -> int:
    """Open, continue or close an SVT session."""
    if args.close and not args.session:
        raise ValidationError("--close needs --session JOB_ID (the session to close)")
    if not args.session:
        if args.queries is None:
            raise ValidationError("--queries FILE is required to open a session")
        if args.epsilon is None or args.threshold is None:
            raise ValidationError("opening a session needs --epsilon (its whole cost per site) "
                                  "and --threshold T")
    elif any(v is not None for v in (args.threshold, args.numeric_epsilon)) or args.monotonic:
        raise ValidationError("--threshold/--cutoff/--numeric-epsilon/--monotonic are fixed "
                              "when a session opens; with --session give only --queries")
    elif not args.close and args.queries is None:
        raise ValidationError("--session needs --queries FILE (the next batch) or --close")
    if args.queries is not None:
        check_input_file(args.queries, "--queries", "query set")
    if args.out:
        check_output_file(args.out, "--out")
    quiet = args.json
    with connect(args) as coord:
        result = coord.svt(args.queries, epsilon=args.epsilon, threshold=args.threshold,
                           cutoff=args.cutoff, numeric_epsilon=args.numeric_epsilon,
                           monotonic=args.monotonic, session=args.session, close=args.close,
                           min_sites=args.min_sites, deadline_seconds=args.deadline,
                           on_event=None if quiet else on_event)
    if args.out:
        write_result(lambda: result.save(args.out), args.out, result.metadata)
    if args.json:
        print(json.dumps({"session": result.session, "job_id": result.metadata["job_id"],
                          "action": result.metadata["action"],
                          "halted_sites": result.halted_sites,
                          "queries": _frame_json(result.table),
                          "sites": _frame_json(result.sites)}, indent=1, default=str))
        return exit_codes.OK
    print(f"session {result.session} ({result.metadata['action']}); sites halted: "
          f"{', '.join(result.halted_sites) or 'none'}")
    if len(result.table):
        import pandas as pd

        with pd.option_context("display.max_rows", 200, "display.width", 160):
            print(result.table.to_string(index=False))
    if args.out:
        print(f"wrote {args.out}")
    if result.metadata["action"] == "close":
        print(f"session {result.session} is closed: it takes no more batches (a new session "
              "opens with --queries, --epsilon and --threshold)")
    else:
        print(f"continue with: dpfed svt --session {result.session} --queries NEXT.toml "
              f"(or --close)")
    return exit_codes.OK


def cmd_query(args: argparse.Namespace, connect: Callable[[argparse.Namespace], Coordinator],
              on_event: Callable[[JobEvent], None]) -> int:
    """Run a matrix-mechanism query job."""
    columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    bins = parse_bins(args.bins)
    if args.workload_file is not None:
        check_input_file(args.workload_file, "--workload-file", "workload matrix")
    if args.out:
        check_output_file(args.out, "--out")
    with connect(args) as coord:
        result = coord.query(columns, epsilon=args.epsilon, delta=args.delta, bins=bins,
                             workload=args.workload, k=args.k,
                             workload_matrix=args.workload_file, strategy=args.strategy,
                             noise=args.noise, reconstruction=args.reconstruction,
                             min_sites=args.min_sites, deadline_seconds=args.deadline,
                             on_event=None if args.json else on_event,
                             aggregation=args.aggregation, secure_noise=args.secure_noise)
    secure = result.metadata.get("secure")
    if args.out:
        write_result(lambda: result.save(args.out), args.out, result.metadata)
    if args.json:
        print(json.dumps({"job_id": result.metadata["job_id"], "strategy": result.strategy,
                          "noise": result.noise, "aggregation": args.aggregation,
                          "secure": secure, "expected_rmse": result.expected_rmse,
                          "identity_expected_rmse": result.identity_expected_rmse,
                          "histogram": _frame_json(result.histogram),
                          "answers": _frame_json(result.answers)}, indent=1, default=str))
        return exit_codes.OK
    print(f"strategy {result.strategy} ({result.noise} noise): expected RMSE per query "
          f"{result.expected_rmse:.4g} (identity {result.identity_expected_rmse:.4g})")
    if isinstance(secure, dict):
        print(f"secure aggregation: {len(secure['participants'])} participants "
              f"({', '.join(secure['participants'])}), tolerating {secure['tolerated_colluders']}"
              f" colluding parties; {secure['guarantee']}")
    import pandas as pd

    total = len(result.answers)
    with pd.option_context("display.max_rows", SHOWN_ANSWERS, "display.width", 160):
        print(result.answers.head(SHOWN_ANSWERS).to_string(index=False))
    if args.out:
        print(f"wrote {args.out} (all {total:,} answers)")
    elif total > SHOWN_ANSWERS:
        job = result.metadata["job_id"]
        print(f"showed the first {SHOWN_ANSWERS} of {total:,} answers. All of them, at no "
              f"further privacy cost: dpfed fetch {job} --out query.npz (then dpfed report "
              "query.npz), or next time --out FILE.csv or --json")
    return exit_codes.OK


def register(sub: Any, connection_args: Callable[[argparse.ArgumentParser], None],
             connect: Callable[[argparse.Namespace], Coordinator],
             on_event: Callable[[JobEvent], None]) -> None:
    """Add the ``svt`` and ``query`` subcommands."""
    p = sub.add_parser("svt", help="which queries are above a threshold at each site (sparse "
                       "vector technique, a session over several batches)")
    p.add_argument("--queries", type=Path, help="query set (.toml or .json; docs/queries.md)")
    p.add_argument("--epsilon", type=float, help="opening: the session's whole cost per site")
    p.add_argument("--threshold", type=float, help="opening: the public threshold T (a count)")
    p.add_argument("--cutoff", type=int, default=1, help="opening: stop after c 'above' "
                   "answers per site (default 1)")
    p.add_argument("--numeric-epsilon", type=float, help="opening: part of --epsilon paid for "
                   "noisy counts of the 'above' queries")
    p.add_argument("--monotonic", action="store_true", help="opening: monotonic noise (only for "
                   "a chain of nested predicates; checked)")
    p.add_argument("--session", help="continue (or --close) the session opened by this job id")
    p.add_argument("--close", action="store_true", help="close --session")
    p.add_argument("--min-sites", type=int, default=0, help="quorum (default: coordinator's)")
    p.add_argument("--deadline", type=float, default=0.0, help="per-site deadline, seconds")
    p.add_argument("--out", help="write the result (.npz) or the table (.csv)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    connection_args(p)
    p.set_defaults(func=lambda a: cmd_svt(a, connect, on_event))

    p = sub.add_parser("query", help="linear queries over a histogram with the matrix "
                       "mechanism (identity, ranges, prefixes, marginals, custom)")
    p.add_argument("--columns", required=True, help="1-3 comma-separated columns")
    p.add_argument("--bins", action="append", default=[], metavar="COL=EDGES|COUNT",
                   help="public bins of a continuous column (repeat per column)")
    p.add_argument("--workload", default="identity",
                   choices=["identity", "all_range", "prefix", "marginals", "custom"])
    p.add_argument("--k", type=int, help="marginal order for --workload marginals")
    p.add_argument("--workload-file", type=Path, help="custom workload matrix (.npy or CSV)")
    p.add_argument("--strategy", default="auto",
                   choices=["auto", "identity", "h2", "wavelet", "prefix", "optimized"])
    p.add_argument("--noise", default="auto", choices=["auto", "laplace", "gaussian"])
    p.add_argument("--epsilon", type=float, required=True, help="epsilon per site")
    p.add_argument("--delta", type=float, default=0.0, help="delta per site (Gaussian only)")
    p.add_argument("--reconstruction", default="least_squares",
                   choices=["least_squares", "nnls", "l1"])
    p.add_argument("--aggregation", default="site", choices=["site", "secure"],
                   help="site = each site noises its own answers (default); secure = one secure "
                   "sum with distributed noise (pooled-data error; see --secure-noise)")
    p.add_argument("--secure-noise", default="auto", choices=["auto", "skellam", "dlaplace"],
                   help="a secure sum's noise: skellam ((epsilon, delta), needs --delta), "
                   "dlaplace (distributed discrete Laplace, pure epsilon) or auto (default: "
                   "the lower expected error)")
    p.add_argument("--min-sites", type=int, default=0, help="quorum (default: coordinator's)")
    p.add_argument("--deadline", type=float, default=0.0, help="per-site deadline, seconds")
    p.add_argument("--out", help="write the result (.npz) or the answers (.csv)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    connection_args(p)
    p.set_defaults(func=lambda a: cmd_query(a, connect, on_event))
