"""``dpfed-site ledger export --config site.toml --out FILE``: the signed audit export.

Reads every charge of the site's ledger through its public API (events, and the analyst each
was attributed to), and writes them as a hash-chained JSON-lines file signed with the key of
the site's certificate (format: ``dpfed.common.audit_trail``). The ledger is only read; an
agent may keep running meanwhile (SQLite WAL: the export sees the charges committed when it
started reading). A record's study is empty for a charge made under no study.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from dpfed import __version__
from dpfed.common import exit_codes
from dpfed.common.errors import ConfigError

# cryptography and sqlite are imported by the functions that use them: this module also
# builds ``dpfed-site --help``, which must stay fast.
if TYPE_CHECKING:
    from dpfed.common.audit_trail import ChargeRecord, ExportSummary
    from dpfed.common.transport.identity import Role
    from dpfed.site_agent.config import SiteConfig
    from dpfed.site_agent.ledger import LedgerEvent

#: The certificate role that signs an export.
_SITE: tuple[Role, ...] = ("site",)


def add_export_arguments(ledger: argparse.ArgumentParser) -> None:
    """Add ``export`` and ``--out`` to the ``dpfed-site ledger`` parser."""
    ledger.add_argument("action", nargs="?", choices=["export"],
                        help="export: write a signed, hash-chained record of every ledger "
                        "event for auditors (checked with 'dpfed audit verify')")
    ledger.add_argument("--out", help="export: the file to write (JSON lines)")


def charge_records(events: list[LedgerEvent], analysts: dict[str, str],
                   studies: dict[str, str] | None = None) -> list[ChargeRecord]:
    """Return the ledger's events as export records, oldest first (with analyst and study)."""
    from dpfed.common.audit_trail import ChargeRecord

    studies = studies or {}
    return [ChargeRecord(e.seq, e.created_at, analysts.get(e.task_id, ""),
                         studies.get(e.task_id, ""), e.job_id,
                         e.task_id, e.kind, e.mechanism, e.payload_digest, e.epsilon, e.delta,
                         e.rho, e.sensitivity, e.noise_scale, e.result_digest, e.result_size)
            for e in events]


def export_ledger(config: SiteConfig, out: Path) -> ExportSummary:
    """Write the signed export of the site's ledger to ``out`` (atomically).

    Raises
    ------
    ConfigError
        No TLS certificate in the config, or no ledger file yet.
    CertificateError
        The site's certificate or key cannot be used.
    """
    from dpfed.common.audit_trail import write_export
    from dpfed.common.transport.certs import (
        certificate_pem,
        parse_certificates,
        parse_private_key,
    )
    from dpfed.common.transport.tls import check_tls_files
    from dpfed.site_agent.ledger import Ledger

    if config.tls is None:
        raise ConfigError(f"{config.source}: an export is signed with the site's certificate "
                          "key; the config has no [tls] certificate (insecure)")
    if not config.ledger_path.is_file():
        raise ConfigError(f"no ledger at {config.ledger_path}: nothing to export (the agent "
                          "creates it on its first run)")
    material = check_tls_files(config.tls.ca, config.tls.cert, config.tls.key, use="client",
                               roles=_SITE)
    leaf = parse_certificates(material.cert_chain_pem, config.tls.cert, "site certificate")[0]
    key = parse_private_key(material.key_pem, config.tls.key, "site key")
    with Ledger(config.ledger_path, config.budget) as ledger:
        events = ledger.events()
        records = charge_records(events, ledger.attributions(), ledger.studies())
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with tmp.open("wb") as fh:
            summary = write_export(fh, site=material.principal.name,
                                   certificate_pem=certificate_pem(leaf), signing_key=key,
                                   policy=config.budget, records=records,
                                   software=f"dpfed {__version__}")
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return summary


def export_command(config: SiteConfig, out: str | None) -> int:
    """Run ``dpfed-site ledger export``; print what was written."""
    if not out:
        raise ConfigError("ledger export needs --out FILE (the export to write)")
    summary = export_ledger(config, Path(out))
    status = summary.status
    print(f"wrote {summary.records} ledger event(s) of site {summary.site} to {out}: epsilon "
          f"spent {status.epsilon_spent:.6g} of {status.epsilon_cap:g} ({status.accountant}), "
          f"signed with certificate {summary.certificate_fingerprint}")
    print(f"check it with: dpfed audit verify {out} --ca <the federation's ca.pem>")
    return exit_codes.OK
