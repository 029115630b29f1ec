"""Whom a site sums with: every peer verified, on the federation's list and not revoked.

:meth:`SecureAggregationPolicy.check_round` with keys signed by real kits from the project's
CA tool; the list is the site kit's ``revoked.toml`` as ``dpfed certs`` writes it, re-read
when it changes (the real-process attack is in tests/e2e/test_secure_revoked_peers.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dpfed.common.errors import ValidationError
from dpfed.common.secagg.keys import SignedKey, generate_ephemeral, sign_ephemeral
from dpfed.common.secagg.masking import MaskContext
from dpfed.common.secagg.policy import SecureAggregationPolicy
from dpfed.common.transport.access import read_access_list
from dpfed.common.transport.certs import (
    init_federation,
    parse_certificates,
    parse_private_key,
    read_pem_file,
    revoke_certificate,
)

SITES = ["hospital-a", "hospital-b", "hospital-c"]
CONTEXT = MaskContext("job-1", "pca-sum-1", "job-1/pca-sum-1")


@pytest.fixture
def fed(tmp_path: Path) -> Path:
    root = tmp_path / "fed"
    init_federation(root, coordinator_hosts=["localhost"], sites=SITES, analysts=[])
    return root


def signed(fed: Path, site_id: str) -> SignedKey:
    kit = fed / "sites" / site_id
    _key, public = generate_ephemeral()
    return sign_ephemeral(site_id=site_id, public_key=public, context=CONTEXT,
                          signing_key=parse_private_key(read_pem_file(kit / "site.key", "k"),
                                                        kit / "site.key", "k"),
                          certificate_pem=read_pem_file(kit / "site.pem", "c"))


def check(fed: Path, policy: SecureAggregationPolicy, participants: list[str]) -> None:
    ca = parse_certificates(read_pem_file(fed / "ca.pem", "ca"), fed / "ca.pem", "ca")[0]
    policy.check_round(participants, {s: signed(fed, s) for s in participants},
                       context=CONTEXT, ca=ca)


def test_the_kit_lists_the_federation_sites(fed: Path) -> None:
    assert read_access_list(fed / "sites" / "hospital-a" / "revoked.toml").sites == tuple(SITES)


def test_a_listed_unrevoked_set_passes_and_a_revocation_is_seen_without_restart(
        fed: Path) -> None:
    policy = SecureAggregationPolicy(federation_list=fed / "sites" / "hospital-a"
                                     / "revoked.toml")
    check(fed, policy, SITES)
    revoke_certificate(fed, role="site", name="hospital-c")
    with pytest.raises(ValidationError, match=r"'hospital-c' presents a revoked certificate"):
        check(fed, policy, SITES)


def test_too_few_participants_after_the_checks_are_refused(fed: Path) -> None:
    policy = SecureAggregationPolicy(min_participants=3, tolerated=1,
                                     federation_list=fed / "sites" / "hospital-a"
                                     / "revoked.toml")
    with pytest.raises(ValidationError, match="2 participants; this site's policy requires "
                                              "at least 3"):
        check(fed, policy, SITES[:2])


def test_without_a_list_every_round_is_refused(fed: Path) -> None:
    with pytest.raises(ValidationError, match=r"no list of the federation's sites.*"
                                              r"revocation_list"):
        check(fed, SecureAggregationPolicy(), SITES)


def test_an_old_list_without_sites_is_refused_with_the_fix(fed: Path) -> None:
    old = fed / "old-revoked.toml"
    old.write_text("# an older dpfed wrote only the revocations\n")
    with pytest.raises(ValidationError, match="lists no federation sites; copy the current"):
        check(fed, SecureAggregationPolicy(federation_list=old), SITES)


def test_a_missing_list_refuses_the_round_naming_the_file(fed: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ValidationError, match=f"secure round refused: access list {missing} "
                                              "does not exist"):
        check(fed, SecureAggregationPolicy(federation_list=missing), SITES)
