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

Once admitted, what an analyst may do with a job is :class:`JobAccess`'s decision: its own
jobs only, unless ``[access]`` grants a group read access or an admin role.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from dpfed.common.errors import NotFoundError, PermissionDeniedError
from dpfed.common.transport.access import AccessList, WatchedAccessList
from dpfed.common.transport.identity import Principal

if TYPE_CHECKING:
    from dpfed.aggregator.store import JobStore
    from dpfed.common.transport.protocol import JobInfo

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


class JobAccess:
    """Who may see and act on which jobs (``[access]`` in aggregator.toml).

    Jobs, their results, their request ids and the SVT sessions they open belong to the
    analyst who submitted them (``JobInfo.submitted_by``, from the certificate). By default
    only that analyst may watch, fetch, list, continue or cancel them. A coordinator may
    grant more, explicitly:

    * ``groups``: named sets of analysts who may *read* each other's jobs (watch, fetch,
      list) -- never continue an SVT session or cancel a job that is not theirs;
    * ``admins``: analysts who may read and cancel every job (an operator's certificate),
      but not continue another analyst's SVT session either.

    Parameters
    ----------
    groups : mapping of str to tuple of str
        Group name -> analyst ids.
    admins : tuple of str
        Analyst ids with the admin role.
    """

    def __init__(self, *, groups: Mapping[str, tuple[str, ...]] | None = None,
                 admins: tuple[str, ...] = ()) -> None:
        self.groups = {name: frozenset(ids) for name, ids in (groups or {}).items()}
        self.admins = frozenset(admins)

    def is_admin(self, principal: Principal) -> bool:
        """Whether ``principal`` has the admin role."""
        return principal.role == "analyst" and principal.name in self.admins

    def readable_owners(self, principal: Principal) -> frozenset[str] | None:
        """Return the ``submitted_by`` values whose jobs ``principal`` may read (None: all)."""
        if self.is_admin(principal):
            return None
        peers = {principal.name}
        for members in self.groups.values():
            if principal.name in members:
                peers |= members
        return frozenset(str(Principal("analyst", name)) for name in peers)

    def may_read(self, principal: Principal, job: JobInfo) -> bool:
        """Whether ``principal`` may watch, fetch or list ``job``."""
        owners = self.readable_owners(principal)
        return owners is None or job.submitted_by in owners

    def may_cancel(self, principal: Principal, job: JobInfo) -> bool:
        """Whether ``principal`` may cancel ``job`` (its owner or an admin)."""
        return job.submitted_by == str(principal) or self.is_admin(principal)

    def readable(self, principal: Principal, job: JobInfo) -> JobInfo:
        """Return ``job`` if ``principal`` may read it; else NotFoundError, as for no job.

        Another analyst's job is reported exactly like an unknown id, so job ids leak nothing.
        """
        if not self.may_read(principal, job):
            raise NotFoundError(f"no job with id {job.job_id!r}")
        return job

    def check_continuation(self, principal: Principal, kind: str, session: str,
                           store: JobStore) -> None:
        """Refuse an SVT batch or close unless ``principal`` opened the session.

        ``kind`` and ``session`` are the submitted job's kind and its ``session`` parameter
        ("" when absent). A session was paid for (at every site) by the analyst who opened
        it; continuing it costs nothing more, so only the opener may (the sites check too).
        """
        if kind != "svt" or not session:
            return
        opened = self.readable(principal, store.get_job(session))
        if opened.submitted_by != str(principal):
            raise PermissionDeniedError(
                f"SVT session {session} was opened by {opened.submitted_by}; only the analyst "
                "who opened (and paid for) a session may continue or close it")
