"""``dpfed audit verify EXPORT --ca ca.pem [--extends EARLIER] [--revoked FILE] [--json]``.

Checks a site's signed ledger export (``dpfed-site ledger export``) against the federation
CA: the site certificate inside it, the hash chain, the record numbering, the totals and the
signature (``dpfed.common.audit_trail.verify_export``); with ``--extends``, also that it holds
an earlier export's records unchanged. A verified export prints what it holds and exits 0;
anything else names the problem and exits 11 (``VERIFICATION_FAILED``); an unreadable CA
file exits 5.
"""

from __future__ import annotations

import argparse
from typing import Any

from dpfed.common import exit_codes
from dpfed.common.cli_support import add_json_flag, print_json


def register(sub: Any) -> None:
    """Add ``dpfed audit verify`` to the ``dpfed`` parser."""
    audit = sub.add_parser("audit", help="check a site's signed ledger export")
    verbs = audit.add_subparsers(dest="audit_command", required=True, metavar="COMMAND")
    p = verbs.add_parser("verify", help="verify a 'dpfed-site ledger export' file against the "
                         "federation CA (exit 0: verified; 11: it does not verify)")
    p.add_argument("export", help="the export file (JSON lines)")
    p.add_argument("--ca", required=True, help="the federation CA certificate (ca.pem)")
    p.add_argument("--extends", metavar="EARLIER",
                   help="an earlier export of the same site: check that this one holds its "
                   "records unchanged (no past event altered or removed since)")
    p.add_argument("--revoked", metavar="REVOKED_TOML",
                   help="also refuse a site certificate on this revocation list (the "
                   "federation's revoked.toml)")
    add_json_flag(p)
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    """Verify one export; print a summary (raises VerificationError when it fails)."""
    from dpfed.common.audit_trail import verify_export
    from dpfed.common.transport.access import read_access_list
    from dpfed.common.transport.certs import parse_certificates, read_pem_file

    cas = parse_certificates(read_pem_file(args.ca, "CA certificate"), args.ca,
                             "CA certificate")
    revoked = (frozenset() if args.revoked is None else
               frozenset(r.fingerprint for r in read_access_list(args.revoked).revoked))
    earlier = None if args.extends is None else verify_export(args.extends, cas, revoked)
    s = verify_export(args.export, cas, revoked, extends=earlier)
    if args.json:
        print_json({"verified": True, "site": s.site,
                    "certificate_fingerprint": s.certificate_fingerprint,
                    "exported_at": s.exported_at, "records": s.records, "jobs": s.jobs,
                    "analysts": list(s.analysts), "first_time": s.first_time,
                    "last_time": s.last_time,
                    "totals": {"epsilon": s.totals.epsilon, "delta": s.totals.delta,
                               "rho": s.totals.rho},
                    "spent": {"accountant": s.status.accountant,
                              "epsilon_spent": s.status.epsilon_spent,
                              "epsilon_cap": s.status.epsilon_cap,
                              "delta_spent": s.status.delta_spent,
                              "delta_cap": s.status.delta_cap},
                    "extends": None if earlier is None else {
                        "export": args.extends, "records": earlier.records}})
        return exit_codes.OK
    period = f"{s.first_time} to {s.last_time}" if s.records else "no events"
    print(f"VERIFIED: {args.export}")
    print(f"  site         {s.site} (certificate {s.certificate_fingerprint}, issued by the CA "
          f"in {args.ca})")
    print(f"  exported at  {s.exported_at}")
    print(f"  records      {s.records} ledger event(s) of {s.jobs} job(s), {period}; every "
          "line chained, numbered and signed")
    print(f"  analysts     {', '.join(s.analysts) or '(none attributed)'}")
    print(f"  spent        epsilon {s.status.epsilon_spent:.6g} of {s.status.epsilon_cap:g}, "
          f"delta {s.status.delta_spent:.3g} of {s.status.delta_cap:g} ({s.status.accountant} "
          "accountant); the trailer's totals match the records")
    if earlier is not None:
        print(f"  extends      {args.extends}: its {earlier.records} record(s) unchanged, "
              f"{s.records - earlier.records} added since")
    return exit_codes.OK
