"""The federation PKI (dpfed.common.transport.certs) and its CLI (dpfed.aggregator.certs_cli)."""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store

from dpfed.aggregator.certs_cli import main as certs_main
from dpfed.common import exit_codes
from dpfed.common.errors import AuthenticationError, CertificateError, ConfigError, ValidationError
from dpfed.common.transport import certs

SITES = ["a", "b"]
ANALYSTS = ["x"]


def _init(root: Path, **kwargs: object) -> certs.Federation:
    args: dict[str, object] = {
        "coordinator_hosts": ["coord.example", "10.1.2.3"],
        "sites": SITES,
        "analysts": ANALYSTS,
    }
    args.update(kwargs)
    return certs.init_federation(root, **args)  # type: ignore[arg-type]


@pytest.fixture
def fed(tmp_path: Path) -> Path:
    root = tmp_path / "fed"
    _init(root)
    return root


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# ------------------------------------------------------------------------------ layout


def test_init_writes_the_documented_layout(fed: Path) -> None:
    expected = {
        "ca.pem",
        "ca.key",
        "coordinator/coordinator.pem",
        "coordinator/coordinator.key",
        "coordinator/ca.pem",
        "sites/a/site.pem",
        "sites/a/site.key",
        "sites/a/ca.pem",
        "sites/b/site.pem",
        "sites/b/site.key",
        "sites/b/ca.pem",
        "analysts/x/analyst.pem",
        "analysts/x/analyst.key",
        "analysts/x/ca.pem",
        # The coordinator's allow-lists and the revocation lists (root and every site kit).
        "coordinator/access.toml",
        "revoked.toml",
        "sites/a/revoked.toml",
        "sites/b/revoked.toml",
    }
    assert set(_hashes(fed)) == expected
    # Every kit carries a byte-identical copy of the CA certificate.
    ca = (fed / "ca.pem").read_bytes()
    for kit_ca in fed.rglob("*/ca.pem"):
        assert kit_ca.read_bytes() == ca


def test_keys_are_0600_and_key_directories_0700(fed: Path) -> None:
    keys = list(fed.rglob("*.key"))
    assert len(keys) == 5
    for key in keys:
        assert _mode(key) == 0o600, key
        assert _mode(key.parent) == 0o700, key.parent
    for directory in [fed, fed / "sites", fed / "analysts"]:
        assert _mode(directory) == 0o700
    for pem in fed.rglob("*.pem"):
        assert _mode(pem) & 0o077 in (0o044, 0o004, 0o040, 0), pem  # public, umask-dependent
        assert _mode(pem) & 0o600 == 0o600


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_key_modes_do_not_depend_on_the_umask(tmp_path: Path, open_umask: None) -> None:
    # With umask 0 a write-then-chmod or a default-mode open would leave 0644/0666 keys.
    root = tmp_path / "fed"
    _init(root)
    for key in root.rglob("*.key"):
        assert _mode(key) == 0o600
    assert _mode(root / "sites" / "a") == 0o700
    assert _mode(root / "ca.pem") == 0o644
    assert not list(root.rglob(".*.tmp"))


# ------------------------------------------------------------------------------ contents


def test_ca_is_a_p256_path_length_zero_signing_ca(fed: Path) -> None:
    ca = _load(fed / "ca.pem")
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    assert ca.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    assert isinstance(ca.signature_hash_algorithm, hashes.SHA256)
    assert ca.issuer == ca.subject


@pytest.mark.parametrize(
    ("rel", "role", "name", "usage"),
    [
        ("sites/a/site.pem", "site", "a", ExtendedKeyUsageOID.CLIENT_AUTH),
        ("sites/b/site.pem", "site", "b", ExtendedKeyUsageOID.CLIENT_AUTH),
        ("analysts/x/analyst.pem", "analyst", "x", ExtendedKeyUsageOID.CLIENT_AUTH),
        (
            "coordinator/coordinator.pem",
            "coordinator",
            "coordinator",
            ExtendedKeyUsageOID.SERVER_AUTH,
        ),
    ],
)
def test_leaf_identity_usage_and_algorithms(
    fed: Path, rel: str, role: str, name: str, usage: x509.ObjectIdentifier
) -> None:
    cert = _load(fed / rel)
    principal = certs.principal_from_certificate(cert)
    assert (principal.role, principal.name) == (role, name)
    expected_uri = "urn:dpfed:coordinator" if role == "coordinator" else f"urn:dpfed:{role}:{name}"
    assert certs.certificate_uris(cert) == [expected_uri]
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == role
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [usage]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    assert isinstance(cert.signature_hash_algorithm, hashes.SHA256)


def test_coordinator_sans_name_hosts_and_loopback(fed: Path) -> None:
    cert = _load(fed / "coordinator" / "coordinator.pem")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["coord.example", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.1.2.3"),
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]


def test_client_certificates_carry_no_host_names(fed: Path) -> None:
    san = _load(fed / "sites" / "a" / "site.pem").extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert san.value.get_values_for_type(x509.DNSName) == []
    assert san.value.get_values_for_type(x509.IPAddress) == []


def test_chains_verify_with_an_independent_verifier(fed: Path) -> None:
    # cryptography's RFC 5280 / CA-B Forum path validator, not our own checks.
    store = Store([_load(fed / "ca.pem")])
    client_verifier = PolicyBuilder().store(store).build_client_verifier()
    for rel in ["sites/a/site.pem", "sites/b/site.pem", "analysts/x/analyst.pem"]:
        verified = client_verifier.verify(_load(fed / rel), [])
        assert verified.chain[-1] == _load(fed / "ca.pem")
    coordinator = _load(fed / "coordinator" / "coordinator.pem")
    for host in [x509.DNSName("coord.example"), x509.DNSName("localhost")]:
        PolicyBuilder().store(store).build_server_verifier(host).verify(coordinator, [])
    server_ip = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
    PolicyBuilder().store(store).build_server_verifier(server_ip).verify(coordinator, [])
    with pytest.raises(x509.verification.VerificationError):
        wrong = PolicyBuilder().store(store).build_server_verifier(x509.DNSName("evil.example"))
        wrong.verify(coordinator, [])
    # A site certificate is no server certificate (clientAuth only).
    with pytest.raises(x509.verification.VerificationError):
        PolicyBuilder().store(store).build_server_verifier(x509.DNSName("localhost")).verify(
            _load(fed / "sites" / "a" / "site.pem"), []
        )


def test_keys_belong_to_their_certificates(fed: Path) -> None:
    for cert_path in [*fed.rglob("site.pem"), *fed.rglob("analyst.pem"), fed / "ca.pem"]:
        key_path = cert_path.with_suffix(".key")
        key = certs.parse_private_key(key_path.read_bytes(), key_path, "key")
        assert certs.key_matches_certificate(key, _load(cert_path))
    site_a = certs.parse_private_key((fed / "sites/a/site.key").read_bytes(), "k", "key")
    assert not certs.key_matches_certificate(site_a, _load(fed / "sites/b/site.pem"))


def test_two_federations_have_distinguishable_cas(tmp_path: Path) -> None:
    one, two = _init(tmp_path / "one"), _init(tmp_path / "two")
    ca_one, ca_two = _load(one.ca_cert_path), _load(two.ca_cert_path)
    assert ca_one.subject != ca_two.subject
    site = _load(tmp_path / "one" / "sites" / "a" / "site.pem")
    assert certs.is_signed_by(site, ca_one)
    assert not certs.is_signed_by(site, ca_two)


def test_validity_days_and_clock_skew_backdating(tmp_path: Path) -> None:
    before = _now()
    federation = _init(tmp_path / "fed", validity_days=30, ca_validity_days=60)
    ca = _load(federation.ca_cert_path)
    site = _load(tmp_path / "fed" / "sites" / "a" / "site.pem")
    assert site.not_valid_before_utc <= before - certs.CLOCK_SKEW + dt.timedelta(seconds=1)
    assert site.not_valid_after_utc - site.not_valid_before_utc == dt.timedelta(days=30)
    assert ca.not_valid_after_utc - ca.not_valid_before_utc == dt.timedelta(days=60)
    assert all(i.not_after == site.not_valid_after_utc for i in federation.issued)


def test_federation_result_lists_every_principal(tmp_path: Path) -> None:
    federation = _init(tmp_path / "fed")
    assert [str(i.principal) for i in federation.issued] == [
        "coordinator/coordinator",
        "site/a",
        "site/b",
        "analyst/x",
    ]
    site_b = federation.issued[2]
    assert site_b.kit_dir == tmp_path / "fed" / "sites" / "b"
    assert site_b.fingerprint == certs.fingerprint(_load(site_b.cert_path))


def test_a_federation_may_start_without_sites(tmp_path: Path) -> None:
    federation = certs.init_federation(
        tmp_path / "fed", coordinator_hosts=[], sites=[], analysts=[]
    )
    assert [str(i.principal) for i in federation.issued] == ["coordinator/coordinator"]
    added = certs.issue_certificate(tmp_path / "fed", role="site", name="late")
    assert _mode(added.kit_dir.parent) == 0o700
    assert certs.is_signed_by(_load(added.cert_path), _load(federation.ca_cert_path))


# ------------------------------------------------------------------------------ issuing later


def test_issue_a_new_site_touches_only_its_kit_and_the_allow_list(fed: Path) -> None:
    before = _hashes(fed)
    issued = certs.issue_certificate(fed, role="site", name="c")
    after = _hashes(fed)
    new = set(after) - set(before)
    assert new == {"sites/c/site.pem", "sites/c/site.key", "sites/c/ca.pem",
                   "sites/c/revoked.toml"}
    changed = {k for k in before if before[k] != after[k]}
    # The allow-list and the site lists every kit's revoked.toml carries; nothing else.
    assert changed == {"coordinator/access.toml", "revoked.toml", "sites/a/revoked.toml",
                       "sites/b/revoked.toml"}
    assert 'sites = ["a", "b", "c"]' in (fed / "sites" / "a" / "revoked.toml").read_text()
    assert _mode(issued.key_path) == 0o600 and _mode(issued.kit_dir) == 0o700
    ca = _load(fed / "ca.pem")
    store = Store([ca])
    PolicyBuilder().store(store).build_client_verifier().verify(_load(issued.cert_path), [])
    assert certs.principal_from_certificate(_load(issued.cert_path)) == certs.Principal("site", "c")
    assert issued.ca_path.read_bytes() == (fed / "ca.pem").read_bytes()


def test_issue_a_new_analyst(fed: Path) -> None:
    issued = certs.issue_certificate(fed, role="analyst", name="y", validity_days=7)
    cert = _load(issued.cert_path)
    assert issued.cert_path == fed / "analysts" / "y" / "analyst.pem"
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == dt.timedelta(days=7)


def test_issue_refuses_to_overwrite_unless_forced(fed: Path) -> None:
    before = _hashes(fed)
    with pytest.raises(ConfigError, match=r"refusing to overwrite.*sites/a/site.pem.*--force"):
        certs.issue_certificate(fed, role="site", name="a")
    assert _hashes(fed) == before
    renewed = certs.issue_certificate(fed, role="site", name="a", force=True)
    after = _hashes(fed)
    changed = {k for k in before if before[k] != after[k]}
    # The replaced certificate is revoked: every copy of the revocation list changes.
    assert changed == {"sites/a/site.pem", "sites/a/site.key", "coordinator/access.toml",
                       "revoked.toml", "sites/a/revoked.toml", "sites/b/revoked.toml"}
    assert certs.is_signed_by(_load(renewed.cert_path), _load(fed / "ca.pem"))


def test_reissue_coordinator_for_new_hosts(fed: Path) -> None:
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        certs.issue_certificate(fed, role="coordinator", hosts=["new.example"])
    issued = certs.issue_certificate(fed, role="coordinator", hosts=["new.example"], force=True)
    san = _load(issued.cert_path).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.value.get_values_for_type(x509.DNSName) == ["new.example", "localhost"]


def test_issue_caps_validity_at_the_ca_expiry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _init(tmp_path / "fed", validity_days=5, ca_validity_days=10)
    with caplog.at_level(logging.WARNING, logger="dpfed.common.transport.certs"):
        issued = certs.issue_certificate(tmp_path / "fed", role="site", name="c", validity_days=365)
    assert issued.not_after == _load(tmp_path / "fed" / "ca.pem").not_valid_after_utc
    assert "shortened" in caplog.text


def test_issue_without_a_ca_is_a_certificate_error(tmp_path: Path) -> None:
    with pytest.raises(CertificateError, match=r"CA certificate .*ca.pem does not exist"):
        certs.issue_certificate(tmp_path, role="site", name="c")
    assert not (tmp_path / "sites").exists()


def test_issue_with_an_expired_ca(tmp_path: Path) -> None:
    ca, key = certs.generate_ca(validity_days=1, not_before=_now() - dt.timedelta(days=3))
    (tmp_path / "ca.pem").write_bytes(certs.certificate_pem(ca))
    (tmp_path / "ca.key").write_bytes(certs.private_key_pem(key))
    with pytest.raises(CertificateError, match="expired on"):
        certs.issue_certificate(tmp_path, role="site", name="c")


def test_issue_with_a_ca_key_from_elsewhere(fed: Path, tmp_path: Path) -> None:
    _init(tmp_path / "other")
    (fed / "ca.key").write_bytes((tmp_path / "other" / "ca.key").read_bytes())
    with pytest.raises(CertificateError, match="does not match the CA certificate"):
        certs.issue_certificate(fed, role="site", name="c")


def test_issue_argument_checks(fed: Path) -> None:
    with pytest.raises(ValidationError, match="needs an id"):
        certs.issue_certificate(fed, role="site")
    with pytest.raises(ValidationError, match="coordinator certificate only"):
        certs.issue_certificate(fed, role="site", name="c", hosts=["h.example"])
    with pytest.raises(ValidationError, match="role must be one of"):
        certs.issue_certificate(fed, role="admin", name="c")
    with pytest.raises(ValidationError, match="no id of its own"):
        certs.issue_certificate(fed, role="coordinator", name="other")
    with pytest.raises(ValidationError, match="validity_days must be >= 1"):
        certs.issue_certificate(fed, role="site", name="c", validity_days=0)
    assert not (fed / "sites" / "c").exists()


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "bad",
    ["", "A", "Site", "-a", ".a", "_a", "a" * 64, "a/b", "a b", "a:b", "ä", "a\n", "../x"],
)
def test_invalid_ids_are_refused_with_the_rule(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValidationError) as info:
        _init(tmp_path / "fed", sites=[bad])
    assert certs.ID_RULE in str(info.value)
    assert repr(bad) in str(info.value)
    assert not (tmp_path / "fed").exists()


@pytest.mark.parametrize("good", ["a", "0", "a" * 63, "hosp-1.north_2", "x.y-z"])
def test_valid_ids(good: str) -> None:
    assert certs.check_principal_id(good) == good


def test_non_string_ids_and_id_lists(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="site id"):
        certs.check_principal_id(7, "site")
    with pytest.raises(ValidationError, match="list of ids"):
        _init(tmp_path / "fed", sites="a,b")
    with pytest.raises(ValidationError, match=r"duplicates \['a'\]"):
        _init(tmp_path / "fed", sites=["a", "b", "a"])


@pytest.mark.parametrize(
    "bad", ["*.example", "a..b", "host:443", "-a.example", "a b", "", "x" * 64]
)
def test_invalid_coordinator_hosts(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValidationError, match="coordinator host"):
        _init(tmp_path / "fed", coordinator_hosts=[bad])
    assert not (tmp_path / "fed").exists()


@pytest.mark.parametrize(
    ("given", "normalised"),
    [
        ("Coord.Example.", "coord.example"),
        ("[::1]", "::1"),
        ("10.0.0.1", "10.0.0.1"),
        ("dpfed_coordinator", "dpfed_coordinator"),
        ("2001:db8::0:1", "2001:db8::1"),
    ],
)
def test_host_normalisation(given: str, normalised: str) -> None:
    assert certs.check_host(given) == normalised


def test_validity_arguments(tmp_path: Path) -> None:
    for bad in [0, -1, 1.5, True, "30"]:
        with pytest.raises(ValidationError, match="validity_days"):
            _init(tmp_path / "fed", validity_days=bad)
    with pytest.raises(ValidationError, match="cannot outlive the CA"):
        _init(tmp_path / "fed", validity_days=30, ca_validity_days=10)
    assert not (tmp_path / "fed").exists()


# ------------------------------------------------------------------------------ overwrite


def test_init_refuses_to_overwrite_and_changes_nothing(fed: Path) -> None:
    before = _hashes(fed)
    with pytest.raises(ConfigError, match=r"refusing to overwrite .*ca.pem.*and \d+ more"):
        _init(fed)
    assert _hashes(fed) == before


def test_init_refuses_if_any_single_target_exists(tmp_path: Path) -> None:
    # A lone leftover key must stop init before it writes anything (no half-new federation).
    root = tmp_path / "fed"
    (root / "sites" / "b").mkdir(parents=True)
    (root / "sites" / "b" / "site.key").write_bytes(b"old key")
    with pytest.raises(ConfigError, match=r"sites/b/site.key"):
        _init(root)
    assert sorted(p.name for p in root.rglob("*") if p.is_file()) == ["site.key"]


def test_init_force_makes_a_new_ca(fed: Path) -> None:
    old_ca = _load(fed / "ca.pem")
    _init(fed, force=True)
    new_ca = _load(fed / "ca.pem")
    assert new_ca != old_ca
    assert certs.is_signed_by(_load(fed / "sites" / "a" / "site.pem"), new_ca)
    assert not certs.is_signed_by(_load(fed / "sites" / "a" / "site.pem"), old_ca)
    assert all(_mode(k) == 0o600 for k in fed.rglob("*.key"))


# ------------------------------------------------------------------------------ identities


def test_principal_uri_round_trip() -> None:
    for principal in [
        certs.Principal("site", "a"),
        certs.Principal("analyst", "x.y"),
        certs.make_principal("coordinator"),
    ]:
        assert certs.parse_principal_uri(principal.uri) == principal
    assert str(certs.Principal("site", "a")) == "site/a"


@pytest.mark.parametrize(
    "uri",
    [
        "urn:dpfed:site:",
        "urn:dpfed:site:A",
        "urn:dpfed:admin:a",
        "urn:dpfed:coordinator:x",
        "urn:dpfed:site",
        "urn:other:site:a",
        "spiffe://dpfed/site/a",
        "URN:DPFED:site:a",
    ],
)
def test_non_identities_are_not_parsed(uri: str) -> None:
    assert certs.parse_principal_uri(uri) is None


def test_ambiguous_or_missing_identity_is_refused() -> None:
    with pytest.raises(AuthenticationError, match="no dpfed identity"):
        certs.principal_from_uris(["https://example.org"], source="peer")
    with pytest.raises(AuthenticationError, match="several dpfed identities"):
        certs.principal_from_uris(["urn:dpfed:site:a", "urn:dpfed:site:b"], source="peer")
    # The same identity twice is not ambiguous.
    assert certs.principal_from_uris(["urn:dpfed:site:a"] * 2, source="peer").name == "a"


def test_identity_is_read_from_the_uri_not_the_subject(tmp_path: Path) -> None:
    ca, ca_key = certs.generate_ca()
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "a")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(_now())
        .not_valid_after(_now() + dt.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())
    )
    with pytest.raises(AuthenticationError, match="no dpfed identity"):
        certs.principal_from_certificate(cert)


def test_make_certificate_rejects_an_empty_window() -> None:
    ca, ca_key = certs.generate_ca()
    start = _now()
    for end in [start, start - dt.timedelta(seconds=1)]:
        with pytest.raises(ValidationError, match="must be later than"):
            certs.make_certificate(
                ca, ca_key, role="site", name="a", not_before=start, not_after=end
            )


# ------------------------------------------------------------------------------ describe


def test_describe_certificate(fed: Path) -> None:
    info = certs.describe_certificate(fed / "coordinator" / "coordinator.pem")
    assert info.principal == certs.Principal("coordinator", "coordinator")
    assert info.dns_names == ("coord.example", "localhost")
    assert info.ip_addresses == ("10.1.2.3", "127.0.0.1", "::1")
    assert info.extended_key_usage == ("serverAuth",)
    assert not info.is_ca
    assert info.fingerprint_sha256 == certs.fingerprint(
        _load(fed / "coordinator" / "coordinator.pem")
    )
    assert len(info.fingerprint_sha256.split(":")) == 32
    text = "\n".join(info.lines())
    assert "identity:    coordinator/coordinator" in text
    site = certs.describe_certificate(fed / "sites" / "a" / "site.pem")
    assert site.principal == certs.Principal("site", "a")
    assert site.subject == "CN=a,OU=site"
    assert site.issuer == certs.describe_certificate(fed / "ca.pem").subject
    ca = certs.describe_certificate(fed / "ca.pem")
    assert ca.is_ca and ca.principal is None
    assert "identity:    federation CA" in "\n".join(ca.lines())


def test_describe_refuses_non_certificates(fed: Path, tmp_path: Path) -> None:
    with pytest.raises(CertificateError, match="does not exist"):
        certs.describe_certificate(tmp_path / "missing.pem")
    with pytest.raises(CertificateError, match="looks like a private key"):
        certs.describe_certificate(fed / "sites" / "a" / "site.key")
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n")
    with pytest.raises(CertificateError, match="not a valid PEM certificate"):
        certs.describe_certificate(garbage)
    with pytest.raises(CertificateError, match="is a directory"):
        certs.describe_certificate(fed)


# ------------------------------------------------------------------------------ CLI


def test_cli_init_issue_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fed"
    code = certs_main(
        [
            "certs", "init", "--out", str(out),
            "--coordinator-host", "coord.example", "--coordinator-host", "10.0.0.5",
            "--sites", "a, b,,c", "--analysts", "x", "--validity-days", "30",
        ]
    )  # fmt: skip
    printed = capsys.readouterr()
    assert code == exit_codes.OK, printed.err
    assert sorted(p.name for p in (out / "sites").iterdir()) == ["a", "b", "c"]
    assert str(out / "sites" / "c") in printed.out
    assert "PRIVATE KEY" not in printed.out + printed.err
    for key in out.rglob("*.key"):  # no key material ever printed
        assert key.read_text().splitlines()[1] not in printed.out

    before = _hashes(out)
    assert certs_main(["certs", "issue", "--ca-dir", str(out), "--site", "d"]) == exit_codes.OK
    printed = capsys.readouterr()
    assert "site/d" in printed.out and "PRIVATE KEY" not in printed.out
    after = _hashes(out)
    lists = {"coordinator/access.toml", "revoked.toml",
             *(f"sites/{s}/revoked.toml" for s in "abc")}
    assert {k: after[k] for k in before if k not in lists} == {
        k: v for k, v in before.items() if k not in lists}

    assert certs_main(["certs", "show", str(out / "sites" / "d" / "site.pem")]) == exit_codes.OK
    shown = capsys.readouterr().out
    assert "identity:    site/d" in shown and "sha256:" in shown

    code = certs_main(
        ["certs", "issue", "--ca-dir", str(out), "--coordinator", "new.example", "--force"]
    )
    assert code == exit_codes.OK
    assert (
        "new.example"
        in certs.describe_certificate(out / "coordinator" / "coordinator.pem").dns_names
    )


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fed"
    init = ["certs", "init", "--out", str(out), "--coordinator-host", "localhost", "--sites", "a"]
    assert certs_main(init) == exit_codes.OK
    capsys.readouterr()

    assert certs_main(init) == exit_codes.CONFIG_ERROR  # refuses to overwrite
    assert "refusing to overwrite" in capsys.readouterr().err
    assert certs_main([*init, "--force"]) == exit_codes.OK
    capsys.readouterr()

    bad_id = ["certs", "issue", "--ca-dir", str(out), "--site", "Bad Id"]
    assert certs_main(bad_id) == exit_codes.CONFIG_ERROR
    assert "site id must be" in capsys.readouterr().err

    no_ca = ["certs", "issue", "--ca-dir", str(tmp_path / "nowhere"), "--site", "b"]
    assert certs_main(no_ca) == exit_codes.CERTIFICATE_ERROR
    assert "does not exist" in capsys.readouterr().err

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello")
    assert certs_main(["certs", "show", str(garbage)]) == exit_codes.CERTIFICATE_ERROR
    assert f"{garbage} is not a PEM certificate" in capsys.readouterr().err

    with pytest.raises(SystemExit) as usage:  # argparse: --site and --analyst are exclusive
        certs_main(["certs", "issue", "--ca-dir", str(out), "--site", "b", "--analyst", "y"])
    assert usage.value.code == exit_codes.USAGE
