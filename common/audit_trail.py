"""Signed ledger exports: a hash chain of JSON lines that an ethics board can read and check.

A site writes its ledger as one JSON object per line (format ``dpfed-ledger-export``,
version 1):

1. a **header**: the site id, its certificate (PEM), the budget policy, when it was written;
2. one **record** per ledger event, oldest first (type ``charge``: time, analyst, study, job,
   task, kind, parameters digest, cost, release digest);
3. a **trailer**: the number of records, the summed cost and what the policy says was spent
   and is left;
4. the **signature**: ECDSA P-256 / SHA-256 by the key of the site's certificate over the
   trailer line.

Every record and the trailer hold ``prev``, the SHA-256 (hex) of the exact bytes of the line
before it (the first record: of the site's genesis string, :func:`genesis`); the trailer also
holds the header's hash, so the signature over the trailer covers every line. The records do
not depend on the header, so two exports of one ledger share their records byte for byte: a
later export *extends* an earlier one exactly when its chain passes through the earlier one's
last hash. :func:`verify_export` checks the certificate against the federation CA, the chain,
the record numbering, the totals, the signature, and optionally that the export extends an
earlier one; docs/governance.md ("Audit export") says what each failure means.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from dpfed.common.errors import AuthenticationError, ValidationError, VerificationError
from dpfed.common.privacy.accounting import BudgetPolicy, BudgetStatus, PrivacyCost
from dpfed.common.privacy.spent import Spent
from dpfed.common.transport.certs import fingerprint, is_signed_by, principal_from_certificate

FORMAT = "dpfed-ledger-export"
VERSION = 1
SIGNATURE_ALGORITHM = "ecdsa-p256-sha256"
#: Record types this version writes and reads. A later version adds the data steward's
#: decisions (``approval``, ``denial``) to the same chain.
RECORD_TYPES: tuple[str, ...] = ("charge",)
#: Longest line accepted when verifying (a header with its certificate is a few KiB).
MAX_LINE_BYTES = 1 << 20
#: Domain separation: this signature can never be mistaken for another dpfed signature.
_TAG = b"dpfed-ledger-export-v1\n"
_ABOUT = ("One JSON object per line: this header, one record per ledger event (oldest first), "
          "a trailer with the totals, and the site's signature. Every record and the trailer "
          "hold prev, the SHA-256 of the exact bytes of the line before them (the first record: "
          "of the text 'dpfed-ledger-export 1 <site>'); the trailer holds the SHA-256 of this "
          "header too; the signature (ECDSA P-256, SHA-256, by the key of the certificate below) "
          "covers the trailer and so every line. Check it with: "
          "dpfed audit verify FILE --ca ca.pem")


def encode_line(obj: Mapping[str, Any]) -> bytes:
    """Return one line's bytes (compact JSON, ASCII, no NaN), without the newline."""
    return json.dumps(obj, ensure_ascii=True, allow_nan=False,
                      separators=(",", ":")).encode("ascii")


def line_hash(line: bytes) -> str:
    """Return the SHA-256 (hex) of a line's bytes, as the next line's ``prev`` holds it."""
    return hashlib.sha256(line).hexdigest()


def genesis(site: str) -> str:
    """Return the ``prev`` of a site's first record: the hash of ``FORMAT VERSION site``."""
    return line_hash(f"{FORMAT} {VERSION} {site}".encode())


@dataclass(frozen=True)
class ChargeRecord:
    """One ledger event as the export shows it (type ``charge``)."""

    seq: int
    time: str
    analyst: str
    study: str
    job_id: str
    task_id: str
    kind: str
    mechanism: str
    parameters_digest: str
    epsilon: float
    delta: float
    rho: float
    sensitivity: float
    noise_scale: float
    release_digest: str
    release_bytes: int

    def as_json(self) -> dict[str, Any]:
        """Return the record's fields in reading order (``prev`` is added by the writer)."""
        return {"type": "charge", "seq": self.seq, "time": self.time, "analyst": self.analyst,
                "study": self.study, "job_id": self.job_id, "task_id": self.task_id,
                "kind": self.kind, "mechanism": self.mechanism,
                "parameters_digest": self.parameters_digest, "epsilon": self.epsilon,
                "delta": self.delta, "rho": self.rho, "sensitivity": self.sensitivity,
                "noise_scale": self.noise_scale, "release_digest": self.release_digest,
                "release_bytes": self.release_bytes}

    @property
    def cost(self) -> PrivacyCost:
        """The charged cost."""
        return PrivacyCost(self.epsilon, self.delta, self.rho, self.mechanism, self.sensitivity,
                           self.noise_scale)


@dataclass(frozen=True)
class ExportSummary:
    """What an export holds (returned by the writer and by a successful verification)."""

    site: str
    certificate_fingerprint: str
    exported_at: str
    records: int
    totals: PrivacyCost
    status: BudgetStatus
    first_time: str
    last_time: str
    analysts: tuple[str, ...]
    jobs: int
    #: The chain's hash after the last record (the genesis when there is none): a later
    #: export of the same ledger passes through it.
    last_hash: str


def _totals(policy: BudgetPolicy, records: list[ChargeRecord]) -> tuple[PrivacyCost,
                                                                        BudgetStatus]:
    spent = Spent.of(r.cost for r in records)
    return spent.basic, policy.status(spent)


def _trailer(policy: BudgetPolicy, records: list[ChargeRecord]) -> dict[str, Any]:
    total, status = _totals(policy, records)
    return {"type": "trailer", "count": len(records),
            "totals": {"epsilon": total.epsilon, "delta": total.delta, "rho": total.rho},
            "spent": {"accountant": status.accountant, "epsilon_spent": status.epsilon_spent,
                      "epsilon_remaining": status.epsilon_remaining,
                      "epsilon_cap": status.epsilon_cap, "delta_spent": status.delta_spent,
                      "delta_remaining": status.delta_remaining,
                      "delta_cap": status.delta_cap},
            "first_time": records[0].time if records else "",
            "last_time": records[-1].time if records else ""}


def _summary(site: str, cert: x509.Certificate, exported_at: str, policy: BudgetPolicy,
             records: list[ChargeRecord], last_hash: str) -> ExportSummary:
    total, status = _totals(policy, records)
    return ExportSummary(site, fingerprint(cert), exported_at, len(records), total, status,
                         records[0].time if records else "", records[-1].time if records else "",
                         tuple(sorted({r.analyst for r in records if r.analyst})),
                         len({r.job_id for r in records}), last_hash)


def write_export(out: IO[bytes], *, site: str, certificate_pem: bytes,
                 signing_key: ec.EllipticCurvePrivateKey, policy: BudgetPolicy,
                 records: Iterable[ChargeRecord], software: str,
                 exported_at: str | None = None) -> ExportSummary:
    """Write a signed export of ``records`` to ``out``; return what it holds."""
    cert = x509.load_pem_x509_certificate(certificate_pem)
    when = exported_at or dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    header = {"type": "header", "format": FORMAT, "version": VERSION, "about": _ABOUT,
              "site": site, "exported_at": when, "software": software,
              "record_types": list(RECORD_TYPES),
              "policy": {"accountant": policy.accountant, "epsilon": policy.epsilon,
                         "delta": policy.delta,
                         "max_epsilon_per_task": policy.max_epsilon_per_task},
              "signature_algorithm": SIGNATURE_ALGORITHM,
              "certificate": certificate_pem.decode("ascii")}
    kept = list(records)
    head = encode_line(header)
    out.write(head + b"\n")
    chain = genesis(site)
    for record in kept:
        line = encode_line({**record.as_json(), "prev": chain})
        out.write(line + b"\n")
        chain = line_hash(line)
    trailer = encode_line({**_trailer(policy, kept), "header": line_hash(head), "prev": chain})
    signature = signing_key.sign(_TAG + trailer, ec.ECDSA(hashes.SHA256()))
    out.write(trailer + b"\n")
    out.write(encode_line({"type": "signature", "algorithm": SIGNATURE_ALGORITHM,
                           "signature": base64.b64encode(signature).decode("ascii")}) + b"\n")
    return _summary(site, cert, when, policy, kept, chain)


# ---------------------------------------------------------------------- verification


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Yield (line number, bytes without the newline); every line must end with one."""
    try:
        fh = path.open("rb")
    except FileNotFoundError:
        raise VerificationError(f"{path} does not exist") from None
    except OSError as exc:
        raise VerificationError(f"{path} cannot be read: {exc.strerror or exc}") from None
    with fh:
        number = 0
        while True:
            raw = fh.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                raise VerificationError(f"line {number} is longer than {MAX_LINE_BYTES} bytes: "
                                        "this is not a dpfed ledger export")
            if not raw.endswith(b"\n"):
                raise VerificationError(f"line {number} does not end with a newline: the "
                                        "export was cut short (truncated)")
            yield number, raw[:-1]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("a key appears twice")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse(number: int, line: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(line.decode("ascii"), object_pairs_hook=_no_duplicates,
                         parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise VerificationError(f"line {number} is not valid JSON ({exc}): the export was "
                                "altered") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise VerificationError(f"line {number} is not a JSON object with a type")
    return obj


def _field(obj: Mapping[str, Any], name: str, kind: type | tuple[type, ...],
           where: str) -> Any:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise VerificationError(f"{where}: field {name!r} is missing or has the wrong type")
    if isinstance(value, float) and not math.isfinite(value):
        raise VerificationError(f"{where}: field {name!r} is not finite")
    return value


def _number(obj: Mapping[str, Any], name: str, where: str) -> float:
    return float(_field(obj, name, (int, float), where))


def _record(number: int, obj: Mapping[str, Any]) -> ChargeRecord:
    where = f"line {number}"
    s = {n: _field(obj, n, str, where) for n in (
        "time", "analyst", "study", "job_id", "task_id", "kind", "mechanism",
        "parameters_digest", "release_digest")}
    f = {n: _number(obj, n, where) for n in ("epsilon", "delta", "rho", "sensitivity",
                                             "noise_scale")}
    return ChargeRecord(_field(obj, "seq", int, where), s["time"], s["analyst"], s["study"],
                        s["job_id"], s["task_id"], s["kind"], s["mechanism"],
                        s["parameters_digest"], f["epsilon"], f["delta"], f["rho"],
                        f["sensitivity"], f["noise_scale"], s["release_digest"],
                        _field(obj, "release_bytes", int, where))


def _certificate(header: Mapping[str, Any], cas: list[x509.Certificate],
                 revoked: frozenset[str]) -> x509.Certificate:
    """Return the header's site certificate, checked against the CA and revocation list."""
    site = _field(header, "site", str, "the header")
    try:
        cert = x509.load_pem_x509_certificate(
            _field(header, "certificate", str, "the header").encode("ascii"))
        # cryptography parses lazily: read every part now, so damage shows here.
        issuer = cert.issuer.rfc4514_string()
        _ = (cert.subject, cert.extensions, cert.not_valid_before_utc, cert.not_valid_after_utc,
             cert.public_key())
    except Exception:  # noqa: BLE001 -- cryptography raises many kinds for a damaged one
        raise VerificationError("the header's certificate is not a valid PEM certificate: "
                                "the export was altered") from None
    if not any(is_signed_by(cert, ca) for ca in cas):
        raise VerificationError(
            f"the certificate in the export (issuer {issuer}) is not "
            "issued by the CA given with --ca: the export comes from another federation, or "
            "it was signed with a certificate the federation never issued")
    try:
        principal = principal_from_certificate(cert, source="the export's certificate")
    except (AuthenticationError, ValueError) as exc:
        raise VerificationError(str(exc)) from None
    if principal.role != "site" or principal.name != site:
        raise VerificationError(f"the export claims site {site!r} but its certificate "
                                f"identifies {principal}")
    if fingerprint(cert) in revoked:
        raise VerificationError(f"the certificate of site {site!r} ({fingerprint(cert)}) is "
                                "on the revocation list")
    when = _field(header, "exported_at", str, "the header")
    try:
        at = dt.datetime.fromisoformat(when)
    except ValueError:
        raise VerificationError(f"the header's exported_at {when!r} is not a time") from None
    if at.tzinfo is None or not cert.not_valid_before_utc <= at <= cert.not_valid_after_utc:
        raise VerificationError(
            f"the export says it was written at {when}, when the site certificate was not "
            f"valid ({cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d})")
    return cert


def _policy(header: Mapping[str, Any]) -> BudgetPolicy:
    p = _field(header, "policy", dict, "the header")
    cap = p.get("max_epsilon_per_task")
    try:
        return BudgetPolicy(_number(p, "epsilon", "the header's policy"),
                            _number(p, "delta", "the header's policy"),
                            _field(p, "accountant", str, "the header's policy"),
                            None if cap is None else _number(p, "max_epsilon_per_task",
                                                             "the header's policy"))
    except ValidationError as exc:
        raise VerificationError(f"the header's policy is not valid: {exc}") from None


def _check_trailer(trailer: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Compare the signed trailer with the totals recomputed from the records."""
    if trailer.get("count") != expected["count"]:
        raise VerificationError(f"the trailer counts {trailer.get('count')!r} records but the "
                                f"export holds {expected['count']}: records were removed or "
                                "added")
    for group in ("totals", "spent"):
        got = _field(trailer, group, dict, "the trailer")
        for name, want in expected[group].items():
            value = got.get(name)
            same = (value == want if isinstance(want, str) else
                    isinstance(value, int | float) and not isinstance(value, bool)
                    and math.isclose(value, want, rel_tol=1e-9))
            if not same:
                raise VerificationError(f"the trailer's {group}.{name} is {value!r}, but the "
                                        f"records add up to {want!r}")


def verify_export(path: str | Path, cas: list[x509.Certificate],
                  revoked: frozenset[str] = frozenset(),
                  extends: ExportSummary | None = None) -> ExportSummary:
    """Verify a ledger export against the federation CA; return what it holds.

    ``extends``: the summary of an earlier verified export of the same site; the export must
    then hold that export's records, unchanged, as its first records.

    Raises
    ------
    VerificationError
        Naming the line and what is wrong: an altered, removed, added, reordered or
        truncated line, totals that do not match, a certificate the CA did not issue (or
        revoked, or naming another site), a signature that does not verify, or history that
        differs from the earlier export.
    """
    lines = _lines(Path(path))
    first = next(lines, None)
    if first is None:
        raise VerificationError(f"{path} is empty")
    header = _parse(*first)
    if header["type"] != "header" or header.get("format") != FORMAT:
        raise VerificationError(f"line 1 is not the header of a {FORMAT} file")
    if header.get("version") != VERSION:
        raise VerificationError(f"the export has format version {header.get('version')!r}; "
                                f"this dpfed reads version {VERSION}")
    cert = _certificate(header, cas, revoked)
    policy = _policy(header)
    site = str(header["site"])
    if extends is not None and extends.site != site:
        raise VerificationError(f"the export is of site {site!r}, the earlier one of "
                                f"{extends.site!r}")
    records: list[ChargeRecord] = []
    chain = genesis(site)
    mark = chain if extends is not None and extends.records == 0 else None
    trailer_line: bytes | None = None
    trailer: dict[str, Any] = {}
    signature: dict[str, Any] | None = None
    for number, line in lines:
        if signature is not None:
            raise VerificationError(f"line {number} follows the signature: lines were added")
        obj = _parse(number, line)
        kind = obj["type"]
        if kind == "signature":
            if trailer_line is None:
                raise VerificationError(f"line {number}: a signature before the trailer")
            signature = obj
            continue
        if trailer_line is not None:
            raise VerificationError(f"line {number} follows the trailer: lines were added")
        if obj.get("prev") != chain:
            before = "the site's genesis" if number == 2 else f"line {number - 1}"
            raise VerificationError(
                f"line {number} does not chain to {before} (its prev is not the SHA-256 of "
                f"{before}): a line was altered, removed or reordered")
        if kind == "trailer":
            trailer_line, trailer = line, obj
            continue
        if kind not in RECORD_TYPES:
            raise VerificationError(f"line {number} has the unknown type {kind!r}")
        record = _record(number, obj)
        if record.seq != len(records) + 1:
            raise VerificationError(f"line {number} holds record {record.seq} where record "
                                    f"{len(records) + 1} belongs: records were removed or "
                                    "reordered")
        records.append(record)
        chain = line_hash(line)
        if extends is not None and len(records) == extends.records:
            mark = chain
    if trailer_line is None or signature is None:
        raise VerificationError("the export ends before its trailer and signature: it was "
                                "truncated")
    if trailer.get("header") != line_hash(first[1]):
        raise VerificationError("the trailer does not hold the SHA-256 of line 1: the header "
                                "was altered")
    _check_trailer(trailer, {**_trailer(policy, records), "count": len(records)})
    if signature.get("algorithm") != SIGNATURE_ALGORITHM:
        raise VerificationError(f"unknown signature algorithm {signature.get('algorithm')!r}")
    text = _field(signature, "signature", str, "the signature")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise VerificationError("the signature is not base64") from None
    if base64.b64encode(raw).decode("ascii") != text:  # unused low bits could be changed
        raise VerificationError("the signature is not in canonical base64: it was altered")
    public = cert.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise VerificationError("the site certificate has no EC key")
    try:
        public.verify(raw, _TAG + trailer_line, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise VerificationError("the signature does not verify with the site certificate: the "
                                "trailer was altered, or the export was signed with another "
                                "key") from None
    if extends is not None and mark != extends.last_hash:
        raise VerificationError(
            f"the export does not extend the earlier one: its first {extends.records} "
            "record(s) differ from the earlier export's (history was changed or removed)"
            if len(records) >= extends.records else
            f"the export holds {len(records)} record(s), fewer than the {extends.records} of "
            "the earlier export: records were removed")
    return _summary(site, cert, header["exported_at"], policy, records, chain)
