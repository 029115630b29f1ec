"""``dpfed certs``: create, extend and inspect the federation's PKI from the command line.

Sub-commands::

    dpfed certs init  --out DIR --coordinator-host HOST [--coordinator-host HOST ...]
                      [--sites a,b,c] [--analysts alice,bob] [--validity-days N]
                      [--ca-validity-days N] [--force]
    dpfed certs issue --ca-dir DIR (--site ID | --analyst ID | --coordinator HOST [HOST ...])
                      [--validity-days N] [--force]
    dpfed certs revoke --ca-dir DIR NAME [--reason TEXT]
    dpfed certs show  PATH [PATH ...]

``init`` and ``issue`` also maintain the coordinator's allow-lists
(``coordinator/access.toml``); ``issue --force`` and ``revoke`` add the replaced or revoked
certificate to the revocation list that the coordinator and the sites read again without a
restart (``docs/operations.md``, "Certificates, allow-lists and revocation").

They print the paths they wrote, never key material, and return an exit code from
:mod:`dpfed.common.exit_codes`: ``CONFIG_ERROR`` for bad flags or a refusal to overwrite,
``CERTIFICATE_ERROR`` for a missing, malformed or expired CA or certificate.

The ``dpfed`` CLI calls :func:`register` with its sub-parsers; every sub-command sets
``func`` on the parsed namespace, a callable ``(argparse.Namespace) -> int`` that runs it.
:func:`main` is the same thing standalone (``python -m dpfed.aggregator.certs_cli certs init ...``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dpfed.common import exit_codes
from dpfed.common.errors import CertificateError, ConfigError, ValidationError
from dpfed.common.transport.cert_defaults import DEFAULT_CA_VALIDITY_DAYS, DEFAULT_VALIDITY_DAYS

if TYPE_CHECKING:
    from dpfed.common.transport import certs


def _id_list(text: str) -> list[str]:
    """Parse ``a,b,c`` (spaces and empty items ignored) into a list of ids."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _fail(command: str, exc: Exception) -> int:
    # Bad flags, a refusal to overwrite, or an unwritable --out (OSError) are configuration
    # errors; a broken CA or certificate file is a certificate error.
    code = (
        exit_codes.CERTIFICATE_ERROR
        if isinstance(exc, CertificateError)
        else exit_codes.CONFIG_ERROR
    )
    print(f"dpfed certs {command}: error: {exc}", file=sys.stderr)
    return code


def _print_issued(issued: certs.IssuedCertificate) -> None:
    principal = issued.principal
    label = "coordinator" if principal.role == "coordinator" else str(principal)
    print(
        f"{label:<24} kit {issued.kit_dir}/  "
        f"(certificate {issued.cert_path.name}, key {issued.key_path.name}, ca.pem; "
        f"valid until {issued.not_after:%Y-%m-%d})"
    )


def _run_init(args: argparse.Namespace) -> int:
    from dpfed.common.transport import certs

    try:
        federation = certs.init_federation(
            args.out,
            coordinator_hosts=args.coordinator_hosts,
            sites=args.sites,
            analysts=args.analysts,
            validity_days=args.validity_days,
            ca_validity_days=args.ca_validity_days,
            force=args.force,
        )
    except (ConfigError, ValidationError, OSError) as exc:
        return _fail("init", exc)
    print(f"{'federation CA':<24} {federation.ca_cert_path}")
    print(f"{'CA private key':<24} {federation.ca_key_path}  (keep it offline; never copy it)")
    for issued in federation.issued:
        _print_issued(issued)
    print("Hand each kit directory to its owner over a trusted channel.")
    return exit_codes.OK


def _run_issue(args: argparse.Namespace) -> int:
    from dpfed.common.transport import certs

    if args.coordinator is not None:
        role, name, hosts = "coordinator", None, args.coordinator
    elif args.site is not None:
        role, name, hosts = "site", args.site, None
    else:
        role, name, hosts = "analyst", args.analyst, None
    try:
        issued = certs.issue_certificate(
            args.ca_dir,
            role=role,
            name=name,
            hosts=hosts,
            validity_days=args.validity_days,
            force=args.force,
        )
    except (ConfigError, ValidationError, OSError) as exc:
        return _fail("issue", exc)
    _print_issued(issued)
    print(f"The coordinator's allow-list ({args.ca_dir / 'coordinator' / 'access.toml'}) "
          "now admits it; copy that file to the coordinator (read without a restart).")
    if args.force:
        print("The certificate it replaced is revoked; copy revoked.toml to the sites too.")
    elif role == "site":
        print("Copy revoked.toml (it lists the federation's sites) to every site too: a site "
              "takes part in secure rounds only with the sites on its copy.")
    return exit_codes.OK


def _resolve_name(ca_dir: Path, name: str) -> tuple[str, str | None]:
    """Turn ``site/ID``, ``analyst/ID``, ``coordinator`` or a bare id into (role, id)."""
    from dpfed.common.transport import certs

    if name == certs.COORDINATOR_NAME:
        return "coordinator", None
    role, sep, rest = name.partition("/")
    if sep:
        if role not in certs.CLIENT_ROLES:
            raise ValidationError(f"NAME must be site/ID, analyst/ID or coordinator, got {name!r}")
        return role, rest
    found = [r for r in certs.CLIENT_ROLES
             if certs.kit_paths(ca_dir, certs.Principal(r, name))[0].exists()]
    if len(found) != 1:
        what = "no site or analyst kit" if not found else "both a site and an analyst kit"
        raise ValidationError(f"{ca_dir} has {what} named {name!r}; write site/{name} or "
                              f"analyst/{name}")
    return found[0], name


def _run_revoke(args: argparse.Namespace) -> int:
    from dpfed.common.transport import certs

    try:
        role, name = _resolve_name(args.ca_dir, args.name)
        fp = certs.revoke_certificate(args.ca_dir, role=role, name=name, reason=args.reason)
    except (ConfigError, ValidationError, OSError) as exc:
        return _fail("revoke", exc)
    label = "coordinator" if role == "coordinator" else f"{role}/{name}"
    print(f"{label:<24} revoked (sha256 {fp})")
    print(f"Copy {args.ca_dir / 'coordinator' / 'access.toml'} to the coordinator and "
          f"revoked.toml to every site kit; they take effect without a restart.")
    return exit_codes.OK


def _run_show(args: argparse.Namespace) -> int:
    from dpfed.common.transport import certs

    for i, path in enumerate(args.paths):
        try:
            info = certs.describe_certificate(path)
        except (ConfigError, OSError) as exc:
            return _fail("show", exc)
        if i:
            print()
        print("\n".join(info.lines()))
    return exit_codes.OK


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``certs`` command and its ``init``/``issue``/``revoke``/``show`` sub-commands.

    Parameters
    ----------
    subparsers
        The object returned by ``parser.add_subparsers()`` of the ``dpfed`` CLI.
    """
    parser = subparsers.add_parser(
        "certs",
        help="create and inspect the federation's certificates",
        description="Create the federation CA and certificates, add a site or analyst "
        "later without re-provisioning the others, or show what a certificate contains.",
    )
    commands = parser.add_subparsers(dest="certs_command", metavar="{init,issue,revoke,show}")
    commands.required = True

    init = commands.add_parser(
        "init",
        help="create a new federation CA and all certificates",
        description="Create a federation CA and one kit (certificate, key, CA copy) for the "
        "coordinator and for every site and analyst. Refuses to overwrite unless --force.",
    )
    init.add_argument("--out", required=True, type=Path, help="directory to write (created 0700)")
    init.add_argument(
        "--coordinator-host",
        dest="coordinator_hosts",
        action="append",
        required=True,
        metavar="HOST",
        help="DNS name or IP the coordinator is reached at (repeatable; localhost, "
        "127.0.0.1 and ::1 are always added)",
    )
    init.add_argument(
        "--sites", type=_id_list, default=[], metavar="A,B,...", help="comma-separated site ids"
    )
    init.add_argument(
        "--analysts",
        type=_id_list,
        default=[],
        metavar="A,B,...",
        help="comma-separated analyst ids",
    )
    init.add_argument(
        "--validity-days",
        type=int,
        default=DEFAULT_VALIDITY_DAYS,
        metavar="N",
        help=f"lifetime of the issued certificates (default {DEFAULT_VALIDITY_DAYS})",
    )
    init.add_argument(
        "--ca-validity-days",
        type=int,
        default=DEFAULT_CA_VALIDITY_DAYS,
        metavar="N",
        help=f"lifetime of the CA (default {DEFAULT_CA_VALIDITY_DAYS})",
    )
    init.add_argument(
        "--force",
        action="store_true",
        help="replace existing files: creates a NEW CA, every old certificate stops working",
    )
    init.set_defaults(func=_run_init)

    issue = commands.add_parser(
        "issue",
        help="issue one more certificate with the existing CA",
        description="Issue a certificate for a new site or analyst (or re-issue the "
        "coordinator's) with the existing CA, touching no other file.",
    )
    issue.add_argument(
        "--ca-dir",
        required=True,
        type=Path,
        help="federation directory holding ca.pem and ca.key (the --out of 'certs init')",
    )
    who = issue.add_mutually_exclusive_group(required=True)
    who.add_argument("--site", metavar="ID", help="issue a site certificate")
    who.add_argument("--analyst", metavar="ID", help="issue an analyst certificate")
    who.add_argument(
        "--coordinator",
        nargs="+",
        metavar="HOST",
        help="issue the coordinator certificate for these hosts (needs --force if one exists)",
    )
    issue.add_argument(
        "--validity-days",
        type=int,
        default=DEFAULT_VALIDITY_DAYS,
        metavar="N",
        help=f"lifetime in days (default {DEFAULT_VALIDITY_DAYS}; capped at the CA's)",
    )
    issue.add_argument("--force", action="store_true", help="replace this principal's kit")
    issue.set_defaults(func=_run_issue)

    revoke = commands.add_parser(
        "revoke",
        help="revoke a site's, analyst's or the coordinator's current certificate",
        description="Add the principal's current certificate to the revocation list and "
        "remove its id from the coordinator's allow-list. The coordinator and the sites read "
        "the updated files without a restart; live connections of the revoked peer are "
        "dropped. Issue a new certificate later with 'certs issue'.",
    )
    revoke.add_argument(
        "--ca-dir",
        required=True,
        type=Path,
        help="federation directory holding ca.pem and ca.key (the --out of 'certs init')",
    )
    revoke.add_argument(
        "name",
        metavar="NAME",
        help="site/ID, analyst/ID, coordinator, or an id that names exactly one kit",
    )
    revoke.add_argument("--reason", default="revoked with 'dpfed certs revoke'",
                        help="recorded with the revocation")
    revoke.set_defaults(func=_run_revoke)

    show = commands.add_parser(
        "show",
        help="print a certificate's identity, names, validity and fingerprint",
        description="Print the identity, names, validity and SHA-256 fingerprint of PEM "
        "certificates.",
    )
    show.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="PEM certificate file")
    show.set_defaults(func=_run_show)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``certs ...`` as the ``dpfed`` CLI would; return the exit code."""
    parser = argparse.ArgumentParser(prog="dpfed")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
