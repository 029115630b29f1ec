"""The signed ledger export: what it holds, and that every kind of tampering fails verification.

Real SQLite ledgers charged through ``Ledger.charge_and_release``, real certificates from the
project's certificate tool, the real export and verification code (and their CLIs).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from cryptography import x509

from dpfed.aggregator.cli import main as dpfed_main
from dpfed.common import exit_codes
from dpfed.common.audit_trail import encode_line, genesis, line_hash, verify_export
from dpfed.common.errors import ConfigError, VerificationError
from dpfed.common.privacy.accounting import BudgetPolicy, PrivacyCost
from dpfed.common.privacy.spent import Spent
from dpfed.common.transport.certs import fingerprint, init_federation
from dpfed.site_agent.audit_export import export_ledger
from dpfed.site_agent.cli import main as site_main
from dpfed.site_agent.config import load_site_config
from dpfed.site_agent.ledger import Ledger

CHARGES = (("t1", "job-a", 0.5, "alice"), ("t2", "job-a", 0.25, "alice"),
           ("t3", "job-b", 1.0, "bob"), ("t4", "job-c", 0.125, ""))


def _site_config(root: Path, site: str, certs: Path) -> Path:
    kit = certs / "sites" / site
    config = root / f"{site}.toml"
    config.write_text(
        f'[coordinator]\naddress = "localhost:1"\n\n'
        f'[tls]\nca = "{kit / "ca.pem"}"\ncert = "{kit / "site.pem"}"\n'
        f'key = "{kit / "site.key"}"\n\n'
        f'[data]\npath = "{root / "unused.csv"}"\nschema = "{root / "unused.toml"}"\n\n'
        f'[ledger]\npath = "{root / f"{site}.sqlite"}"\n\n'
        '[budget]\nepsilon = 10.0\ndelta = 1e-4\naccountant = "basic"\n')
    return config


def _charge_all(ledger_path: Path) -> None:
    with Ledger(ledger_path, BudgetPolicy(10.0, 1e-4)) as ledger:
        for task, job, eps, analyst in CHARGES:
            ledger.charge_and_release(
                task_id=task, job_id=job, kind="pca",
                payload_digest=hashlib.sha256(task.encode()).hexdigest(),
                cost=PrivacyCost(eps, 1e-6, eps * eps / 2, "gaussian", 1.0, 2.0),
                release=lambda t=task: f"noisy {t}".encode(), analyst=analyst)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("audit")
    init_federation(root / "certs", coordinator_hosts=["localhost"],
                    sites=["hospital-1", "hospital-2"], analysts=["alice"])
    init_federation(root / "other", coordinator_hosts=["localhost"], sites=["hospital-1"],
                    analysts=[])
    config = _site_config(root, "hospital-1", root / "certs")
    _charge_all(root / "hospital-1.sqlite")
    export = root / "export.jsonl"
    export_ledger(load_site_config(config), export)
    return {"root": root, "config": config, "export": export, "ca": root / "certs" / "ca.pem",
            "other_ca": root / "other" / "ca.pem"}


def _cas(path: Path) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(path.read_bytes())


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def _write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def test_the_export_holds_every_charge_with_its_analyst_and_verifies(
        world: dict[str, Path]) -> None:
    summary = verify_export(world["export"], _cas(world["ca"]))
    assert summary.site == "hospital-1" and summary.records == len(CHARGES)
    assert summary.analysts == ("alice", "bob") and summary.jobs == 3
    assert summary.totals.epsilon == pytest.approx(sum(c[2] for c in CHARGES))
    assert summary.status.epsilon_remaining == pytest.approx(10.0 - 1.875)
    lines = [json.loads(x) for x in _lines(world["export"])]
    assert [x["type"] for x in lines] == ["header", "charge", "charge", "charge", "charge",
                                          "trailer", "signature"]
    with Ledger(world["root"] / "hospital-1.sqlite", BudgetPolicy(10.0, 1e-4)) as ledger:
        events = ledger.events()
    for record, event, (task, job, eps, analyst) in zip(lines[1:5], events, CHARGES, strict=True):
        assert (record["task_id"], record["job_id"], record["epsilon"], record["analyst"]) == (
            task, job, eps, analyst)
        assert record["study"] == ""
        assert record["parameters_digest"] == event.payload_digest
        assert record["release_digest"] == hashlib.sha256(f"noisy {task}".encode()).hexdigest()
    assert lines[-2]["count"] == 4 and lines[-2]["totals"]["epsilon"] == pytest.approx(1.875)


@pytest.mark.slow
def test_every_single_flipped_byte_fails(world: dict[str, Path], tmp_path: Path) -> None:
    data = world["export"].read_bytes()
    cas = _cas(world["ca"])
    tampered = tmp_path / "flipped.jsonl"
    for i in range(len(data)):
        changed = bytearray(data)
        changed[i] ^= 0x01
        tampered.write_bytes(bytes(changed))
        with pytest.raises(VerificationError):
            verify_export(tampered, cas)


@pytest.mark.parametrize("change", ["remove first", "remove middle", "remove last", "swap",
                                    "truncate records", "truncate signature", "cut mid-line",
                                    "append", "duplicate"])
def test_removed_reordered_truncated_or_added_events_fail(world: dict[str, Path], tmp_path: Path,
                                                          change: str) -> None:
    lines = _lines(world["export"])
    if change == "remove first":
        del lines[1]
    elif change == "remove middle":
        del lines[2]
    elif change == "remove last":
        del lines[4]
    elif change == "swap":
        lines[2], lines[3] = lines[3], lines[2]
    elif change == "truncate records":
        lines = lines[:3]
    elif change == "truncate signature":
        lines = lines[:-1]
    elif change == "append":
        lines.append(lines[1])
    elif change == "duplicate":
        lines.insert(2, lines[1])
    path = _write(tmp_path / "changed.jsonl", lines)
    if change == "cut mid-line":
        path.write_bytes(world["export"].read_bytes()[:-20])
    with pytest.raises(VerificationError) as info:
        verify_export(path, _cas(world["ca"]))
    message = str(info.value)
    assert any(word in message for word in ("removed", "reordered", "truncated", "added",
                                            "altered")), message


def _rechain(objs: list[dict[str, object]]) -> list[bytes]:
    """Encode lines again with a correct hash chain (what a forger without the key can do)."""
    head = encode_line(objs[0])
    out, chain = [head], genesis(str(objs[0]["site"]))
    for obj in objs[1:-1]:
        obj["prev"] = chain
        if obj["type"] == "trailer":
            obj["header"] = line_hash(head)
        out.append(encode_line(obj))
        chain = line_hash(out[-1])
    return [*out, encode_line(objs[-1])]


def test_a_recomputed_chain_without_the_key_fails_at_the_signature(world: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    """Someone who drops an event and rebuilds every hash and total still cannot sign."""
    objs = [json.loads(x) for x in _lines(world["export"])]
    del objs[3]  # the third charge (epsilon 1.0)
    for n, obj in enumerate(objs[1:4], start=1):
        obj["seq"] = n
    kept = [o for o in objs if o["type"] == "charge"]
    spent = Spent.of(PrivacyCost(o["epsilon"], o["delta"], o["rho"], o["mechanism"],
                                 o["sensitivity"], o["noise_scale"]) for o in kept)
    total = spent.basic
    status = BudgetPolicy(10.0, 1e-4, "basic").status(spent)
    trailer = objs[-2]
    trailer["count"] = len(kept)
    trailer["totals"] = {"epsilon": total.epsilon, "delta": total.delta, "rho": total.rho}
    trailer["spent"].update(epsilon_spent=status.epsilon_spent, delta_spent=status.delta_spent,
                            epsilon_remaining=status.epsilon_remaining,
                            delta_remaining=status.delta_remaining)
    rebuilt = _write(tmp_path / "rebuilt.jsonl", _rechain(objs))
    with pytest.raises(VerificationError, match="signature does not verify"):
        verify_export(rebuilt, _cas(world["ca"]))


def test_a_wrong_certificate_fails(world: dict[str, Path], tmp_path: Path) -> None:
    # Another federation's CA: the site certificate in the export was not issued by it.
    with pytest.raises(VerificationError, match="not issued by the CA"):
        verify_export(world["export"], _cas(world["other_ca"]))
    # A genuine export of hospital-2 whose header claims hospital-1.
    config2 = _site_config(world["root"], "hospital-2", world["root"] / "certs")
    _charge_all(world["root"] / "hospital-2.sqlite")
    export2 = tmp_path / "h2.jsonl"
    export_ledger(load_site_config(config2), export2)
    assert verify_export(export2, _cas(world["ca"])).site == "hospital-2"
    lines = _lines(export2)
    lines[0] = lines[0].replace(b'"site":"hospital-2"', b'"site":"hospital-1"')
    with pytest.raises(VerificationError, match="identifies site/hospital-2"):
        verify_export(_write(tmp_path / "claims.jsonl", lines), _cas(world["ca"]))
    # hospital-1's export re-chained under hospital-2's certificate: the signature (by
    # hospital-1's key) does not verify with hospital-2's certificate.
    header = json.loads(_lines(world["export"])[0])
    header["certificate"], header["site"] = json.loads(lines[0])["certificate"], "hospital-2"
    swapped = _rechain([header, *(json.loads(x) for x in _lines(world["export"])[1:])])
    with pytest.raises(VerificationError, match="signature does not verify"):
        verify_export(_write(tmp_path / "swapped.jsonl", swapped), _cas(world["ca"]))


def test_a_revoked_site_certificate_fails(world: dict[str, Path]) -> None:
    cert = x509.load_pem_x509_certificate(json.loads(_lines(world["export"])[0])["certificate"]
                                          .encode())
    with pytest.raises(VerificationError, match="revocation list"):
        verify_export(world["export"], _cas(world["ca"]), frozenset({fingerprint(cert)}))


def test_the_cli_verifies_and_exits_11_on_tampering(world: dict[str, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.jsonl"
    assert site_main(["ledger", "export", "--config", str(world["config"]), "--out",
                      str(out)]) == exit_codes.OK
    assert "wrote 4 ledger event(s) of site hospital-1" in capsys.readouterr().out
    assert dpfed_main(["audit", "verify", str(out), "--ca", str(world["ca"])]) == exit_codes.OK
    text = capsys.readouterr().out
    assert "VERIFIED" in text and "4 ledger event(s) of 3 job(s)" in text
    assert dpfed_main(["audit", "verify", str(out), "--ca", str(world["ca"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["analysts"] == ["alice", "bob"]
    lines = _lines(out)
    del lines[2]
    _write(out, lines)
    assert dpfed_main(["audit", "verify", str(out), "--ca",
                       str(world["ca"])]) == exit_codes.VERIFICATION_FAILED
    err = capsys.readouterr().err
    assert err.startswith("dpfed audit: line 3 does not chain to line 2"), err
    # Inputs that are not an export's problem keep their own codes.
    assert dpfed_main(["audit", "verify", str(out), "--ca",
                       str(tmp_path / "missing.pem")]) == exit_codes.CERTIFICATE_ERROR
    assert dpfed_main(["audit", "verify", str(tmp_path / "nothing.jsonl"), "--ca",
                       str(world["ca"])]) == exit_codes.VERIFICATION_FAILED


def test_export_refusals_are_clear(world: dict[str, Path], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert site_main(["ledger", "export", "--config",
                      str(world["config"])]) == exit_codes.CONFIG_ERROR
    assert "needs --out FILE" in capsys.readouterr().err
    fresh = _site_config(tmp_path, "hospital-2", world["root"] / "certs")
    with pytest.raises(ConfigError, match="no ledger at"):
        export_ledger(load_site_config(fresh), tmp_path / "x.jsonl")
    assert not (tmp_path / "hospital-2.sqlite").exists()  # export never creates a ledger


def test_an_empty_ledger_exports_and_verifies(world: dict[str, Path], tmp_path: Path) -> None:
    config = _site_config(tmp_path, "hospital-2", world["root"] / "certs")
    Ledger(tmp_path / "hospital-2.sqlite", BudgetPolicy(10.0, 1e-4)).close()
    export_ledger(load_site_config(config), tmp_path / "empty.jsonl")
    summary = verify_export(tmp_path / "empty.jsonl", _cas(world["ca"]))
    assert summary.records == 0 and summary.status.epsilon_spent == 0.0


def test_a_certificate_not_valid_at_export_time_fails(world: dict[str, Path],
                                                      tmp_path: Path) -> None:
    objs = [json.loads(x) for x in _lines(world["export"])]
    objs[0]["exported_at"] = "1999-01-01T00:00:00+00:00"
    with pytest.raises(VerificationError, match="was not valid"):
        verify_export(_write(tmp_path / "old.jsonl", _rechain(objs)), _cas(world["ca"]))


def test_a_later_export_extends_an_earlier_one_unless_history_changed(
        world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cas = _cas(world["ca"])
    root = tmp_path / "later"
    root.mkdir()
    config = _site_config(root, "hospital-1", world["root"] / "certs")
    _charge_all(root / "hospital-1.sqlite")
    first = export_ledger(load_site_config(config), root / "first.jsonl")
    with Ledger(root / "hospital-1.sqlite", BudgetPolicy(10.0, 1e-4)) as ledger:
        ledger.charge_and_release(task_id="t5", job_id="job-d", kind="svt",
                                  payload_digest=hashlib.sha256(b"t5").hexdigest(),
                                  cost=PrivacyCost(0.1, 0.0, 0.005, "laplace", 1.0, 10.0),
                                  release=lambda: b"more", analyst="alice")
    export_ledger(load_site_config(config), root / "second.jsonl")
    earlier = verify_export(root / "first.jsonl", cas)
    assert earlier.last_hash == first.last_hash
    assert verify_export(root / "second.jsonl", cas, extends=earlier).records == 5
    # The record lines themselves are the same bytes in both exports.
    assert _lines(root / "first.jsonl")[1:5] == _lines(root / "second.jsonl")[1:5]
    assert dpfed_main(["audit", "verify", str(root / "second.jsonl"), "--ca", str(world["ca"]),
                       "--extends", str(root / "first.jsonl")]) == exit_codes.OK
    assert "4 record(s) unchanged, 1 added since" in capsys.readouterr().out
    # The earlier export does not extend the later one (it lacks an event) ...
    with pytest.raises(VerificationError, match="fewer than the 5"):
        verify_export(root / "first.jsonl", cas,
                      extends=verify_export(root / "second.jsonl", cas))
    # ... and a ledger whose past differs (one charge attributed to another analyst) does not
    # extend the export of the original, though it is genuinely signed by the same site.
    other = tmp_path / "rewritten"
    other.mkdir()
    config2 = _site_config(other, "hospital-1", world["root"] / "certs")
    with Ledger(other / "hospital-1.sqlite", BudgetPolicy(10.0, 1e-4)) as ledger:
        for task, job, eps, analyst in CHARGES:
            ledger.charge_and_release(
                task_id=task, job_id=job, kind="pca",
                payload_digest=hashlib.sha256(task.encode()).hexdigest(),
                cost=PrivacyCost(eps, 1e-6, eps * eps / 2, "gaussian", 1.0, 2.0),
                release=lambda t=task: f"noisy {t}".encode(),
                analyst="mallory" if task == "t2" else analyst)
    export_ledger(load_site_config(config2), other / "rewritten.jsonl")
    assert verify_export(other / "rewritten.jsonl", cas).records == 4
    with pytest.raises(VerificationError, match="history was changed"):
        verify_export(other / "rewritten.jsonl", cas, extends=earlier)
