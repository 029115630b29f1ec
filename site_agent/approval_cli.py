"""The data steward's commands: ``dpfed-site approvals``, ``approve ID`` and ``deny ID``.

They read and write the approval queue in the site's ledger file
(:mod:`dpfed.site_agent.approvals`) and may run while the agent is running: the agent sees a
decision at the coordinator's next resend of the job's task.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from dpfed.common import exit_codes
from dpfed.common.errors import NotFoundError

if TYPE_CHECKING:
    from dpfed.site_agent.config import SiteConfig

#: The subcommands this module adds.
COMMANDS = ("approvals", "approve", "deny")


def add_approval_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``approvals``, ``approve`` and ``deny`` to ``dpfed-site``'s subcommands."""
    listing = sub.add_parser("approvals", help="list the jobs waiting for the data steward's "
                             "approval (--all: decided ones too)")
    listing.add_argument("--all", action="store_true", help="also list decided requests")
    listing.add_argument("--json", action="store_true", help="print JSON")
    approve = sub.add_parser("approve", help="approve a waiting job: its tasks run and are "
                             "charged when the coordinator resends them")
    deny = sub.add_parser("deny", help="deny a waiting job: its tasks are refused, nothing is "
                          "charged")
    approve.add_argument("id", type=int, help="the request's number (dpfed-site approvals)")
    deny.add_argument("id", type=int, help="the request's number (dpfed-site approvals)")
    deny.add_argument("--reason", default="", help="why (sent to the coordinator with the "
                      "refusal and kept with the decision)")
    for p in (listing, approve, deny):
        p.add_argument("--config", required=True, help="path to site.toml")
        p.add_argument("--ledger", help="ledger file, if the agent runs with --ledger")


def approval_command(config: SiteConfig, args: argparse.Namespace) -> int:
    """Run one of :data:`COMMANDS` against the site's ledger file."""
    from dpfed.site_agent.approvals import APPROVED, DENIED, ApprovalQueue, format_requests
    from dpfed.site_agent.ledger import Ledger

    if not config.ledger_path.exists():
        if args.command != "approvals":
            raise NotFoundError(f"no approval request {args.id} at this site: there is no "
                                f"ledger at {config.ledger_path} yet")
        print(f"no ledger at {config.ledger_path} yet: no job has reached this site")
        return exit_codes.OK
    ledger = Ledger(config.ledger_path, config.budget)
    try:
        queue = ApprovalQueue(ledger)
        if args.command == "approvals":
            requests = queue.requests(pending_only=not args.all)
            if args.json:
                print(json.dumps([r.as_json() for r in requests], indent=2))
                return exit_codes.OK
            spent: dict[str, float] = {}
            for event in ledger.events():
                spent[event.job_id] = spent.get(event.job_id, 0.0) + event.epsilon
            if not config.approval.any_manual:
                print("note: this site's policy.approval is \"auto\" with no manual rule; no "
                      "new job waits for approval")
            print(format_requests(requests, spent))
            return exit_codes.OK
        decision = APPROVED if args.command == "approve" else DENIED
        decided = queue.decide(args.id, decision, getattr(args, "reason", ""))
        after = ("its tasks run and are charged when the coordinator resends them"
                 if decision == APPROVED else "its tasks are refused; nothing is charged")
        print(f"request {decided.id} {decision}: job {decided.job_id} of analyst "
              f"{decided.analyst or '(not attributed)'}; {after}")
        return exit_codes.OK
    finally:
        ledger.close()
