"""``dpfed run KIND``: any registered job kind from the command line, its flags from its params.

Every field of the kind's params class is a flag (``--column``, ``--aggregation``, ...; a
value is read as JSON where it parses, as text otherwise); ``--plan`` shows what every site
taking part would be charged per round and which sites would not take part; the result file
goes to ``--out`` and its report to ``--report``. The kinds with commands of their own
(``dpfed pca``, ``svt``, ``query``, ``synth``) run here too; ``dpfed profile`` is this
command for the ``profile`` kind, printing the result's tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpfed.common import exit_codes

if TYPE_CHECKING:
    from dpfed.aggregator.client import Coordinator
    from dpfed.common.transport.protocol import JobEvent


def _value(text: str) -> Any:
    """Parse a flag's value: JSON when it parses (numbers, lists, true/false), else text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _populate(kind_name: str, connection_args: Callable[[argparse.ArgumentParser], None]
              ) -> Callable[[argparse.ArgumentParser], None]:
    def populate(p: argparse.ArgumentParser) -> None:
        from dpfed.common.jobs.params import spec_of
        from dpfed.common.jobs.registry import job_kind

        kind = job_kind(kind_name)
        for f in dataclasses.fields(kind.params):
            spec = spec_of(f)
            p.add_argument(spec.flag or f"--{f.name.replace('_', '-')}", dest=f"param_{f.name}",
                           type=_value, default=None, metavar="VALUE",
                           help=spec.help or f"the job's {f.name!r} parameter")
        p.add_argument("--epsilon", type=float, required=True,
                       help="epsilon spent at each site, over all the job's rounds")
        p.add_argument("--delta", type=float, default=0.0, help="delta spent at each site")
        p.add_argument("--min-sites", type=int, default=0,
                       help="quorum (default: coordinator's)")
        p.add_argument("--deadline", type=float, default=0.0,
                       help="per-site deadline, seconds")
        p.add_argument("--plan", action="store_true",
                       help="only show what every site taking part would be charged per "
                            "round, and which sites would not take part (nothing is submitted)")
        p.add_argument("--out", type=Path, help=f"the result file (default {kind_name}.npz)")
        p.add_argument("--report", type=Path, metavar="HTML", help="also write its report")
        connection_args(p)

    return populate


def register(sub: Any, connection_args: Callable[[argparse.ArgumentParser], None],
             connect: Callable[[argparse.Namespace], Coordinator],
             on_event: Callable[[JobEvent], None]) -> None:
    """Add ``dpfed run KIND`` for every registered job kind."""
    from dpfed.common.cli_support import LazyArgumentParser
    from dpfed.common.jobs.registry import JOB_KINDS, names

    profile = sub.add_parser("profile", help="what each site's row policy did (DP counts per "
                             "site) and DP means of continuous/date columns to impute with",
                             populate=_populate("profile", connection_args))
    profile.set_defaults(func=lambda args: cmd_run(args, connect, on_event), kind="profile",
                         print_tables="dpfed.aggregator.profile_report:profile_text")
    run = sub.add_parser("run", help="run any job kind, its options from its parameters "
                         "(`dpfed run KIND --help`)")
    kinds = run.add_subparsers(dest="kind", required=True, metavar="KIND",
                               parser_class=LazyArgumentParser)
    for name in names():
        entry = JOB_KINDS.get(name)
        p = kinds.add_parser(name, help=entry.summary if entry else None,
                             populate=_populate(name, connection_args))
        p.set_defaults(func=lambda args: cmd_run(args, connect, on_event))


def cmd_run(args: argparse.Namespace, connect: Callable[[argparse.Namespace], Coordinator],
            on_event: Callable[[JobEvent], None]) -> int:
    """Plan or run one job of ``args.kind``; write its result file (and report)."""
    from dpfed.aggregator.client import job_failure
    from dpfed.aggregator.plan_cli import print_kind_plan
    from dpfed.common.transport.protocol import JobSpec, JobState

    params = {k[len("param_"):]: v for k, v in vars(args).items()
              if k.startswith("param_") and v is not None}
    with connect(args) as coord:
        if args.plan:
            print_kind_plan(args.kind, params, args.epsilon, args.delta, *coord.federation())
            return exit_codes.OK
        job = coord.submit(JobSpec(args.kind, args.epsilon, args.delta, params, args.min_sites,
                                   args.deadline), on_event=on_event)
        if job.state != JobState.SUCCEEDED:
            raise job_failure(job)
        data = coord.fetch_result(job.job_id)
    out = args.out or Path(f"{args.kind}.npz")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    print(f"wrote {out} (job {job.job_id}, {len(job.sites)} site(s))")
    if getattr(args, "print_tables", None):
        from dpfed.common.jobs.contract import resolve

        print(resolve(args.print_tables)(data))
    if args.report:
        from dpfed.aggregator.result_reports import report_for_result

        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(report_for_result(out).render(), encoding="utf-8")
        print(f"wrote {args.report}")
    return exit_codes.OK
