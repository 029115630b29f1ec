"""The access and revocation files: format, validation, and reloading on change."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dpfed.common.errors import ConfigError
from dpfed.common.transport.access import (
    AccessList,
    Revoked,
    WatchedAccessList,
    format_access_list,
    normalise_fingerprint,
    parse_access_list,
    write_access_list,
)
from dpfed.common.transport.identity import Principal

FP = ":".join(["AB"] * 32)


def test_round_trip_and_lookups() -> None:
    access = AccessList(("a", "b"), ("alice",), (Revoked(FP, "site/c", "now", "lost"),))
    again = parse_access_list(format_access_list(access), "x")
    assert again == access
    assert again.admits(Principal("site", "a")) and not again.admits(Principal("site", "c"))
    assert again.admits(Principal("analyst", "alice"))
    assert not again.admits(Principal("coordinator", "coordinator"))
    assert again.is_revoked(FP)
    site_copy = parse_access_list(format_access_list(access, lists=("sites",)), "x")
    assert site_copy.sites == ("a", "b") and site_copy.analysts == ()
    assert site_copy.is_revoked(FP)


def test_fingerprints_are_normalised_and_checked() -> None:
    assert normalise_fingerprint("ab" * 32, "x") == FP
    for bad in ("AB:CD", "zz" * 32, 42):
        with pytest.raises(ConfigError, match="fingerprint"):
            normalise_fingerprint(bad, "x")


@pytest.mark.parametrize(("text", "match"), [
    ("sites = [\n", "not valid TOML"),
    ("site = []\n", "unknown key"),
    ("sites = \"a\"\n", "list of site ids"),
    ("sites = [\"Not An Id\"]\n", "site id"),
    ("[[revoked]]\nprincipal = \"site/a\"\n", "fingerprint"),
    (f"[[revoked]]\nfingerprint = \"{FP}\"\nwhen = 1\n", "unknown key"),
])
def test_malformed_files_are_refused_with_the_file_named(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_access_list(text, "access.toml")


def test_watched_file_reloads_on_change_and_keeps_the_last_good_version(tmp_path: Path) -> None:
    path = tmp_path / "access.toml"
    write_access_list(path, AccessList(("a",)))
    watched = WatchedAccessList(path)
    assert watched.current().sites == ("a",)
    assert not watched.reload()
    write_access_list(path, AccessList(("a", "b")))
    assert watched.current().sites == ("a", "b")
    path.write_text("sites = [\n")
    os.utime(path, ns=(1, 1))
    assert watched.current().sites == ("a", "b")  # a broken change never opens anything
    path.unlink()
    assert watched.current().sites == ("a", "b")
    write_access_list(path, AccessList(("c",)))
    assert watched.current().sites == ("c",)
    with pytest.raises(ConfigError, match="does not exist"):
        WatchedAccessList(tmp_path / "missing.toml")
