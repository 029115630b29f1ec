"""Who a party of the federation is: a role and an id, and how they are written in a URI.

Certificates carry the identity as a URI subject alternative name (``urn:dpfed:site:<id>``,
``urn:dpfed:analyst:<id>``, ``urn:dpfed:coordinator``); :mod:`dpfed.common.transport.certs`
reads and writes it, and access lists name the same ids.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, get_args

from dpfed.common.errors import AuthenticationError, ValidationError

#: The three kinds of principal in a federation.
Role = Literal["site", "analyst", "coordinator"]
ROLES: tuple[Role, ...] = get_args(Role)
#: Roles that authenticate as TLS clients (they dial the coordinator).
CLIENT_ROLES: tuple[Role, ...] = ("site", "analyst")

#: The coordinator has no id of its own; its principal name is this constant.
COORDINATOR_NAME = "coordinator"
URN_PREFIX = "urn:dpfed:"

ID_RULE = (
    "1 to 63 characters: lower-case letters, digits, '.', '_' or '-', "
    "starting with a letter or digit (^[a-z0-9][a-z0-9._-]{0,62}$)"
)
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")



@dataclass(frozen=True)
class Principal:
    """An authenticated party of the federation: a role and a name (the id).

    Parameters
    ----------
    role : {"site", "analyst", "coordinator"}
        What the party is.
    name : str
        Its id (``"coordinator"`` for the coordinator).
    """

    role: Role
    name: str

    def __str__(self) -> str:
        return f"{self.role}/{self.name}"

    @property
    def uri(self) -> str:
        """The URI SAN that encodes this principal in a certificate."""
        if self.role == "coordinator":
            return f"{URN_PREFIX}coordinator"
        return f"{URN_PREFIX}{self.role}:{self.name}"


def check_role(role: object) -> Role:
    """Return ``role`` if it is one of :data:`ROLES`, else raise ``ValidationError``."""
    if role not in ROLES:
        allowed = ", ".join(repr(r) for r in ROLES)
        raise ValidationError(f"role must be one of {allowed}, got {role!r}")
    return role


def check_principal_id(name: object, role: str = "principal") -> str:
    """Return ``name`` if it is a valid site/analyst id (see :data:`ID_RULE`).

    Parameters
    ----------
    name : object
        The proposed id.
    role : str
        Used in the error message only (``"site id must be ..."``).

    Raises
    ------
    ValidationError
        If ``name`` is not a string matching the rule.
    """
    if not isinstance(name, str) or not _ID_RE.fullmatch(name):
        raise ValidationError(f"{role} id must be {ID_RULE}; got {name!r}")
    return name


def make_principal(role: str, name: str | None = None) -> Principal:
    """Build a validated :class:`Principal` (``name`` is ignored/optional for the coordinator).

    Raises
    ------
    ValidationError
        Unknown role, invalid id, or a coordinator name other than ``"coordinator"``.
    """
    checked = check_role(role)
    if checked == "coordinator":
        if name not in (None, COORDINATOR_NAME):
            raise ValidationError(
                f"the coordinator has no id of its own (its name is {COORDINATOR_NAME!r}), "
                f"got {name!r}"
            )
        return Principal("coordinator", COORDINATOR_NAME)
    if name is None:
        raise ValidationError(f"a {checked} certificate needs an id ({ID_RULE})")
    return Principal(checked, check_principal_id(name, checked))


def parse_principal_uri(uri: str) -> Principal | None:
    """Return the principal encoded by a ``urn:dpfed:...`` URI, or None if it encodes none.

    ``urn:dpfed:site:<id>``, ``urn:dpfed:analyst:<id>`` and ``urn:dpfed:coordinator`` are
    recognised; anything else (other URIs, a malformed id, an unknown role) gives None.
    """
    if not uri.startswith(URN_PREFIX):
        return None
    rest = uri[len(URN_PREFIX) :]
    if rest == "coordinator":
        return Principal("coordinator", COORDINATOR_NAME)
    role, sep, name = rest.partition(":")
    if not sep or role not in CLIENT_ROLES or not _ID_RE.fullmatch(name):
        return None
    return Principal(role, name)


def principal_from_uris(uris: Iterable[str], *, source: str) -> Principal:
    """Return the single dpfed principal among ``uris``.

    Parameters
    ----------
    uris : iterable of str
        URI subject alternative names of one certificate.
    source : str
        What the URIs came from, for the error message.

    Raises
    ------
    AuthenticationError
        If no URI, or more than one, encodes a dpfed identity (an ambiguous certificate is
        refused rather than guessed at).
    """
    found = {p for p in (parse_principal_uri(u) for u in uris) if p is not None}
    if not found:
        raise AuthenticationError(
            f"{source} carries no dpfed identity (a URI SAN like urn:dpfed:site:<id>); "
            "issue it with 'dpfed certs init' or 'dpfed certs issue'"
        )
    if len(found) > 1:
        names = ", ".join(sorted(str(p) for p in found))
        raise AuthenticationError(f"{source} carries several dpfed identities ({names})")
    return found.pop()


