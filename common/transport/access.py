"""Who may connect: the coordinator's allow-lists and the federation's revocation list.

A certificate signed by the federation CA proves *who* a caller is; this module decides
whether that caller is *welcome*. Two small TOML files, written by the ``dpfed certs`` tool
and re-read by the processes that use them whenever they change (no restart):

``coordinator/access.toml`` (in the coordinator's kit)::

    # Maintained by 'dpfed certs init/issue/revoke'.
    sites = ["hospital-a", "hospital-b"]     # site ids admitted
    analysts = ["alice"]                      # analyst ids admitted

    [[revoked]]                               # certificates that must no longer work
    fingerprint = "3F:A2:...:9C"              # SHA-256, as 'dpfed certs show' prints it
    principal = "site/hospital-b"
    revoked_at = "2026-11-23T15:40:00+00:00"
    reason = "replaced by 'dpfed certs issue --force'"

``sites/<id>/revoked.toml`` (in every site kit, and ``revoked.toml`` at the federation root):
the same ``[[revoked]]`` entries and the ``sites`` list (not the analysts): a site refuses a
coordinator whose certificate is revoked, and a secure round with a peer that is revoked or
not one of the federation's ``sites`` (:mod:`dpfed.common.secagg.policy`).

``dpfed certs init`` writes both with every id it issues; ``issue`` adds the new id (and
revokes the certificate it replaces under ``--force``); ``revoke`` adds the current
certificate of a principal to every copy of the revocation list and removes its id from the
allow-lists. Copy the changed files to the machines that use them; each process notices the
change at its next check (every new connection, and every ``reload_interval`` seconds for
live sessions).

A file that becomes unreadable or malformed is reported and the last good version stays in
force (an operator's typo never opens the federation); a process that starts with such a file
refuses to start.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import secrets
import threading
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from dpfed.common.errors import ConfigError
from dpfed.common.transport.identity import Principal, check_principal_id

logger = logging.getLogger(__name__)

#: File name of the coordinator's allow-lists (in its kit).
ACCESS_FILE = "access.toml"
#: File name of the revocation list (federation root and every site kit).
REVOCATION_FILE = "revoked.toml"
_HEX = frozenset("0123456789ABCDEF")


def normalise_fingerprint(text: object, where: str) -> str:
    """Return a SHA-256 fingerprint as colon-separated upper-case hex, or raise ConfigError.

    Accepts the ``dpfed certs show`` form (``AB:CD:...``) or plain hex, any case.
    """
    if not isinstance(text, str):
        raise ConfigError(f"{where}: fingerprint must be a string, got {text!r}")
    digits = text.replace(":", "").strip().upper()
    if len(digits) != 64 or not set(digits) <= _HEX:
        raise ConfigError(f"{where}: fingerprint must be a SHA-256 fingerprint (64 hex digits, "
                          f"optionally colon-separated), got {text[:80]!r}")
    return ":".join(digits[i:i + 2] for i in range(0, 64, 2))


@dataclass(frozen=True)
class Revoked:
    """One revoked certificate."""

    fingerprint: str
    principal: str = ""
    revoked_at: str = ""
    reason: str = ""


@dataclass(frozen=True)
class AccessList:
    """The content of ``access.toml`` (or of ``revoked.toml``: no analysts list).

    Attributes
    ----------
    sites, analysts : tuple of str
        Admitted ids, sorted.
    revoked : tuple of Revoked
        Revoked certificates, oldest first.
    """

    sites: tuple[str, ...] = ()
    analysts: tuple[str, ...] = ()
    revoked: tuple[Revoked, ...] = ()
    _fingerprints: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_fingerprints",
                           frozenset(r.fingerprint for r in self.revoked))

    def is_revoked(self, fingerprint: str) -> bool:
        """Whether the certificate with this (normalised) fingerprint is revoked."""
        return fingerprint in self._fingerprints

    def admits(self, principal: Principal) -> bool:
        """Whether ``principal``'s id is on the allow-list of its role."""
        if principal.role == "site":
            return principal.name in self.sites
        if principal.role == "analyst":
            return principal.name in self.analysts
        return False

    def with_ids(self, role: str, ids: Iterable[str]) -> AccessList:
        """Return a copy with ``ids`` added to the ``role`` list."""
        if role == "site":
            return replace(self, sites=tuple(sorted({*self.sites, *ids})))
        if role == "analyst":
            return replace(self, analysts=tuple(sorted({*self.analysts, *ids})))
        return self

    def without_id(self, role: str, name: str) -> AccessList:
        """Return a copy with ``name`` removed from the ``role`` list."""
        if role == "site":
            return replace(self, sites=tuple(s for s in self.sites if s != name))
        if role == "analyst":
            return replace(self, analysts=tuple(a for a in self.analysts if a != name))
        return self

    def with_revoked(self, entry: Revoked) -> AccessList:
        """Return a copy that also revokes ``entry`` (no duplicate fingerprints)."""
        if self.is_revoked(entry.fingerprint):
            return self
        return replace(self, revoked=(*self.revoked, entry))


def _id_list(data: dict[str, object], key: str, role: str, where: str) -> tuple[str, ...]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise ConfigError(f"{where}: {key} must be a list of {role} ids, got {value!r}")
    try:
        return tuple(sorted({check_principal_id(v, role) for v in value}))
    except ValueError as exc:
        raise ConfigError(f"{where}: {key}: {exc}") from None


def parse_access_list(text: str, where: str) -> AccessList:
    """Parse the TOML text of ``access.toml`` / ``revoked.toml``; raise ConfigError if bad."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where} is not valid TOML: {exc}") from None
    unknown = set(data) - {"sites", "analysts", "revoked"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (valid: sites, "
                          "analysts, revoked)")
    sites = _id_list(data, "sites", "site", where)
    analysts = _id_list(data, "analysts", "analyst", where)
    raw = data.get("revoked", [])
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: revoked must be an array of tables ([[revoked]])")
    revoked = []
    for i, item in enumerate(raw):
        at = f"{where}: revoked[{i}]"
        if not isinstance(item, dict) or "fingerprint" not in item:
            raise ConfigError(f"{at} must be a table with a fingerprint")
        extra = set(item) - {"fingerprint", "principal", "revoked_at", "reason"}
        if extra:
            raise ConfigError(f"{at}: unknown key(s) {', '.join(sorted(extra))}")
        texts = {k: item.get(k, "") for k in ("principal", "revoked_at", "reason")}
        if not all(isinstance(v, str) for v in texts.values()):
            raise ConfigError(f"{at}: principal, revoked_at and reason must be strings")
        revoked.append(Revoked(normalise_fingerprint(item["fingerprint"], at),
                               str(texts["principal"]), str(texts["revoked_at"]),
                               str(texts["reason"])))
    return AccessList(sites, analysts, tuple(revoked))


def read_access_list(path: str | os.PathLike[str]) -> AccessList:
    """Read ``access.toml`` / ``revoked.toml``; raise ConfigError naming the file if bad."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"access list {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"access list {p} cannot be read: {exc}") from None
    return parse_access_list(text, str(p))


#: The id lists of ``access.toml``; a site's ``revoked.toml`` carries only ``sites``.
ALL_LISTS: tuple[str, ...] = ("sites", "analysts")
SITE_LISTS: tuple[str, ...] = ("sites",)


def format_access_list(access: AccessList, *, lists: tuple[str, ...] = ALL_LISTS) -> str:
    """Return the TOML text of ``access`` with the id lists named in ``lists`` (and revocations)."""
    out = ["# Maintained by 'dpfed certs init/issue/revoke'; read again whenever it changes."]
    if "sites" in lists:
        out.append(f"sites = {json.dumps(list(access.sites))}")
    if "analysts" in lists:
        out.append(f"analysts = {json.dumps(list(access.analysts))}")
    for r in access.revoked:
        out += ["", "[[revoked]]", f"fingerprint = {json.dumps(r.fingerprint)}",
                f"principal = {json.dumps(r.principal)}",
                f"revoked_at = {json.dumps(r.revoked_at)}", f"reason = {json.dumps(r.reason)}"]
    return "\n".join(out) + "\n"


def write_access_list(path: str | os.PathLike[str], access: AccessList, *,
                      lists: tuple[str, ...] = ALL_LISTS) -> None:
    """Write ``access`` to ``path`` atomically (a reader never sees half a file)."""
    p = Path(path)
    tmp = p.parent / f".{p.name}.{secrets.token_hex(6)}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(format_access_list(access, lists=lists))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, p)
    finally:
        if tmp.exists():
            tmp.unlink()


def utc_now_text() -> str:
    """Return the current UTC time as ISO-8601 seconds (for ``revoked_at``)."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class WatchedAccessList:
    """An access or revocation file that is read again whenever it changes on disk.

    Parameters
    ----------
    path : path
        The file. It must exist and parse at construction (ConfigError otherwise).

    Notes
    -----
    :meth:`current` compares the file's ``(mtime_ns, size, inode)`` with the last read, so a
    check costs one ``stat``. After an unreadable or malformed change the previous content
    stays in force and the error is logged once per change.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._signature = self._stat()
        self._access = read_access_list(self.path)
        self._failed_signature: tuple[int, int, int] | None = None

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = self.path.stat()
        except OSError:
            return (-1, -1, -1)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def current(self) -> AccessList:
        """Return the content in force, reading the file again if it changed."""
        self.reload()
        return self._access

    def reload(self) -> bool:
        """Read the file again if it changed; return True if the content in force changed."""
        signature = self._stat()
        with self._lock:
            if signature == self._signature or signature == self._failed_signature:
                return False
            try:
                fresh = read_access_list(self.path)
            except ConfigError as exc:
                self._failed_signature = signature
                logger.error("[AccessList.reload] %s; the previous version stays in force", exc)
                return False
            self._signature, self._failed_signature = signature, None
            changed = fresh != self._access
            self._access = fresh
        if changed:
            logger.info("[AccessList.reload] %s changed: %d site(s), %d analyst(s), %d revoked "
                        "certificate(s)", self.path, len(fresh.sites), len(fresh.analysts),
                        len(fresh.revoked))
        return changed


# --------------------------------------------------------------------------------------------
# Maintaining the files of a federation directory (used by ``dpfed certs``)


def coordinator_access_path(root: str | os.PathLike[str]) -> Path:
    """``<root>/coordinator/access.toml``: the allow-lists the coordinator reads."""
    return Path(root) / "coordinator" / ACCESS_FILE


def load_federation_access(root: str | os.PathLike[str]) -> AccessList:
    """Return the federation's access list (empty if none was written yet)."""
    path = coordinator_access_path(root)
    if not path.exists():
        return AccessList()
    return read_access_list(path)


def publish_federation_access(root: str | os.PathLike[str], access: AccessList) -> list[Path]:
    """Write ``access`` to every file of the federation directory that carries it.

    ``coordinator/access.toml`` gets the lists and the revocations; ``revoked.toml`` at the
    root and in every site kit gets the revocations and the site list (what a site checks its
    secure-round peers against). Returns the paths written.
    """
    base = Path(root)
    written = []
    coordinator_dir = base / "coordinator"
    if coordinator_dir.is_dir():
        write_access_list(coordinator_dir / ACCESS_FILE, access)
        written.append(coordinator_dir / ACCESS_FILE)
    write_access_list(base / REVOCATION_FILE, access, lists=SITE_LISTS)
    written.append(base / REVOCATION_FILE)
    sites_dir = base / "sites"
    if sites_dir.is_dir():
        for kit in sorted(p for p in sites_dir.iterdir() if p.is_dir()):
            write_access_list(kit / REVOCATION_FILE, access, lists=SITE_LISTS)
            written.append(kit / REVOCATION_FILE)
    return written


def record_issued(root: str | os.PathLike[str], principal: Principal,
                  replaced_fingerprint: str | None = None) -> AccessList:
    """Admit ``principal`` and revoke the certificate its new one replaced, if any."""
    access = load_federation_access(root).with_ids(principal.role, [principal.name])
    if replaced_fingerprint is not None:
        access = access.with_revoked(Revoked(
            normalise_fingerprint(replaced_fingerprint, "replaced certificate"), str(principal),
            utc_now_text(), "replaced by 'dpfed certs issue --force'"))
        logger.info("[Access.record_issued] the previous certificate of %s (%s...) is revoked",
                    principal, replaced_fingerprint[:23])
    publish_federation_access(root, access)
    return access


def record_revoked(root: str | os.PathLike[str], principal: Principal, fingerprint: str,
                   reason: str) -> AccessList:
    """Revoke the certificate ``fingerprint`` of ``principal`` and remove its id from the lists."""
    access = load_federation_access(root).without_id(principal.role, principal.name)
    access = access.with_revoked(Revoked(normalise_fingerprint(fingerprint, "certificate"),
                                         str(principal), utc_now_text(), reason))
    publish_federation_access(root, access)
    logger.info("[Access.record_revoked] %s revoked (%s...)", principal, fingerprint[:23])
    return access
