"""The site's side of revocation: refuse a coordinator whose certificate is revoked.

gRPC verifies that the coordinator's certificate chains to the federation CA and names the
dialled host, but it has no revocation list, and grpcio does not show a *client* the
server's certificate. So before each connection the agent makes one TLS handshake of its own
to the same address, with the same CA, client certificate and server name, reads the
certificate the coordinator presents, and compares its SHA-256 fingerprint with the site's
revocation list (``[tls] revocation_list``, the ``revoked.toml`` that ``dpfed certs`` writes
into every site kit). While connected, the list is read again every ``interval_s`` seconds
and the stream is dropped as soon as the coordinator's certificate appears on it.

Limitation: the check is a separate handshake, not the one gRPC makes. An attacker on the
path who holds a revoked coordinator key could relay the check to the real coordinator and
answer only the gRPC connection itself. Revocation of the coordinator's certificate is
therefore an operational safeguard (a retired or replaced coordinator is no longer used); a
compromised coordinator key calls for a new federation CA (``dpfed certs init --force``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from dpfed.common.errors import ProtocolError
from dpfed.common.transport.access import WatchedAccessList
from dpfed.common.transport.certs import fingerprint

log = logging.getLogger(__name__)


class CoordinatorRevokedError(ProtocolError):
    """The coordinator presented a certificate on the site's revocation list."""


def split_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` too) into host and port; raise ProtocolError."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ProtocolError(f"coordinator address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


@dataclass
class CoordinatorCheck:
    """Check the coordinator's certificate against the site's revocation list.

    Parameters
    ----------
    revocation : WatchedAccessList
        The site's ``revoked.toml`` (read again when it changes).
    ca, cert, key : Path
        The site's TLS files, used for the check's own handshake.
    server_name : str, optional
        Name to verify instead of the dialled host (``[coordinator] server_name``).
    interval_s : float
        How often a live stream re-checks the list.
    timeout_s : float
        Timeout of the check's handshake.
    """

    revocation: WatchedAccessList
    ca: Path
    cert: Path
    key: Path
    server_name: str | None = None
    interval_s: float = 1.0
    timeout_s: float = 10.0

    def _context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        ctx.set_alpn_protocols(["h2"])
        return ctx

    async def coordinator_fingerprint(self, address: str) -> str:
        """Handshake with ``address`` and return the fingerprint of the certificate shown.

        Raises
        ------
        OSError, ssl.SSLError, TimeoutError
            The coordinator cannot be reached or its certificate does not verify.
        """
        host, port = split_address(address)
        _reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=self._context(),
                                    server_hostname=self.server_name or host),
            self.timeout_s)
        try:
            ssl_object = writer.get_extra_info("ssl_object")
            der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        finally:
            # Abort rather than close: a graceful TLS close waits for the server's
            # close_notify, which a gRPC server never sends on a connection that spoke no HTTP/2
            # -- every site start stalled 5 s there. Nothing is left to say on this connection.
            writer.transport.abort()
            try:
                await asyncio.wait_for(writer.wait_closed(), self.timeout_s)
            except (OSError, ssl.SSLError, TimeoutError):
                pass
        if not der:
            raise ProtocolError(f"the coordinator at {address} presented no certificate")
        return fingerprint(x509.load_der_x509_certificate(der))

    def refuse_if_revoked(self, fp: str) -> None:
        """Raise CoordinatorRevokedError if ``fp`` is on the revocation list."""
        if self.revocation.current().is_revoked(fp):
            raise CoordinatorRevokedError(
                f"the coordinator's certificate (sha256 {fp[:23]}...) is on this site's "
                f"revocation list {self.revocation.path}; the site will not talk to it")

    async def check(self, address: str) -> str:
        """Return the coordinator's fingerprint after checking it is not revoked."""
        fp = await self.coordinator_fingerprint(address)
        self.refuse_if_revoked(fp)
        return fp

    async def wait_until_revoked(self, fp: str) -> None:
        """Return once ``fp`` appears on the revocation list (checked every ``interval_s``)."""
        while True:
            await asyncio.sleep(self.interval_s)
            if self.revocation.current().is_revoked(fp):
                log.error("[CoordinatorCheck] the coordinator's certificate (sha256 %s...) was "
                          "revoked; dropping the connection", fp[:23])
                return
