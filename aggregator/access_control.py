"""The coordinator's admission rule: allow-listed ids with certificates that are not revoked.

Every authenticated call (a site's ``SiteLink.Connect``, every analyst method) passes
:meth:`AccessControl.check` after its certificate was verified against the federation CA:

* a certificate on the revocation list is refused, whatever its id;
* a site is admitted only if its id is on the site allow-list, an analyst only if its id is
  on the analyst allow-list. The lists are the union of the access file written by
  ``dpfed certs`` (``federation.access_list``, read again when it changes) and the inline
  ``federation.allowed_sites`` / ``allowed_analysts`` of ``aggregator.toml``;
* ``allow_any_site`` / ``allow_any_analyst`` (labs only) admit every CA-signed id of that
  role; they are logged as a warning at start-up. Revocation still applies.

With no list and no opt-out, nobody of that role is admitted (refused by default).
"""

from __future__ import annotations

import logging
from pathlib import Path

from dpfed.common.transport.access import AccessList, WatchedAccessList
from dpfed.common.transport.identity import Principal

log = logging.getLogger(__name__)


class AccessControl:
    """Decide whether an authenticated principal may use the coordinator.

    Parameters
    ----------
    access_list : Path, optional
        The access file (``coordinator/access.toml``); read now (ConfigError if missing or
        malformed) and again whenever it changes.
    sites, analysts : iterable of str
        Ids admitted in addition to the file's.
    allow_any_site, allow_any_analyst : bool
        Admit any CA-signed id of that role (labs only).
    """

    def __init__(self, *, access_list: Path | None = None, sites: tuple[str, ...] = (),
                 analysts: tuple[str, ...] = (), allow_any_site: bool = False,
                 allow_any_analyst: bool = False) -> None:
        self.watched = WatchedAccessList(access_list) if access_list is not None else None
        self.inline = AccessList(tuple(sorted(set(sites))), tuple(sorted(set(analysts))))
        self.allow_any = {"site": allow_any_site, "analyst": allow_any_analyst}
        for role, on in self.allow_any.items():
            if on:
                log.warning("[AccessControl] allow_any_%s = true: every %s with a certificate "
                            "from the federation CA is admitted (for labs only)", role, role)
        current = self._file()
        for role, ids in (("site", current.sites + self.inline.sites),
                          ("analyst", current.analysts + self.inline.analysts)):
            if not ids and not self.allow_any[role]:
                log.warning("[AccessControl] no %s is on an allow-list: every %s will be "
                            "refused (federation.access_list / allowed_%ss)", role, role, role)

    def _file(self) -> AccessList:
        return self.watched.current() if self.watched is not None else AccessList()

    def reload(self) -> bool:
        """Read the access file again if it changed; True if its content changed."""
        return self.watched.reload() if self.watched is not None else False

    def check(self, principal: Principal, fingerprint: str | None) -> str | None:
        """Return why ``principal`` is refused, or None if it is admitted.

        Parameters
        ----------
        principal : Principal
            From the verified client certificate.
        fingerprint : str or None
            SHA-256 fingerprint of that certificate (None only without TLS).
        """
        current = self._file()
        if fingerprint is not None and current.is_revoked(fingerprint):
            return (f"the certificate of {principal} (sha256 {fingerprint[:23]}...) has been "
                    "revoked")
        if principal.role in self.allow_any and self.allow_any[principal.role]:
            return None
        if current.admits(principal) or self.inline.admits(principal):
            return None
        return (f"{principal.role} {principal.name!r} is not admitted to this federation "
                f"(not on the coordinator's allow-list of {principal.role}s)")
