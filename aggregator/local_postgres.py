"""A throw-away PostgreSQL server on this machine (the system's initdb and pg_ctl).

For ``dpfed simulate --omop`` (one of its warehouses is PostgreSQL) and the tests. The server
listens on 127.0.0.1 (a free port) with password (SCRAM) authentication for TCP and trust on
its private Unix socket, which only the process that started it uses to load data. When run as
root -- CI containers are -- the server runs as the ``postgres`` system user (PostgreSQL
refuses to run as root). :func:`start` returns None with the reason when no server can start.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ADMIN = "dpfed_admin"


@dataclass
class PostgresServer:
    """A running server: its port, data directory and how to stop it."""

    port: int
    socket_dir: str
    root: str
    pg_ctl: str
    run_as: list[str]

    def admin_conninfo(self) -> str:
        """Return the administrator's connection string (the private Unix socket)."""
        return f"host={self.socket_dir} port={self.port} dbname=postgres user={ADMIN}"

    def tcp_conninfo(self, user: str, dbname: str = "postgres") -> str:
        """Return the connection string of ``user`` over TCP (password authentication)."""
        return f"host=127.0.0.1 port={self.port} dbname={dbname} user={user}"

    def stop(self) -> None:
        """Stop the server and delete its files."""
        subprocess.run([*self.run_as, self.pg_ctl, "stop", "-D", f"{self.root}/data", "-m",
                        "fast", "-w"], capture_output=True, check=False, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start() -> tuple[PostgresServer | None, str]:
    """Start a server; return (server, "") or (None, why not)."""
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        return None, ("no PostgreSQL server binaries (initdb, pg_ctl) on PATH or in "
                      "/usr/lib/postgresql/*/bin; install the 'postgresql' package")
    run_as: list[str] = []
    root = tempfile.mkdtemp(prefix="dpfed-pg-")
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        try:
            import pwd

            user = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(root, ignore_errors=True)
            return None, "running as root and there is no 'postgres' user to run the server"
        if runuser is None:
            shutil.rmtree(root, ignore_errors=True)
            return None, "running as root and 'runuser' is missing"
        os.chown(root, user.pw_uid, user.pw_gid)
        run_as = [runuser, "-u", "postgres", "--"]
    os.chmod(root, 0o755)
    pwfile = Path(root) / "pw"
    # Never used (the administrator connects over the private socket), but initdb needs one
    # for TCP: a random one, so no other local user can log in as the administrator.
    pwfile.write_text(secrets.token_urlsafe(24) + "\n")
    if run_as:
        import pwd

        user = pwd.getpwnam("postgres")
        os.chown(pwfile, user.pw_uid, user.pw_gid)
    port = _free_port()
    init = subprocess.run(
        [*run_as, initdb, "-D", f"{root}/data", "-U", ADMIN, "--auth-local=trust",
         "--auth-host=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8", "--no-instructions"],
        capture_output=True, text=True, check=False, timeout=120)
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        return None, f"initdb failed: {init.stderr.strip()[-300:]}"
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    started = subprocess.run(
        [*run_as, pg_ctl, "start", "-D", f"{root}/data", "-w", "-t", "60", "-l",
         f"{root}/server.log", "-o", options],
        capture_output=True, text=True, check=False, timeout=120)
    if started.returncode != 0:
        log = Path(root, "server.log")
        tail = log.read_text()[-300:] if log.exists() else started.stderr[-300:]
        shutil.rmtree(root, ignore_errors=True)
        return None, f"the PostgreSQL server did not start: {tail.strip()}"
    return PostgresServer(port, root, root, pg_ctl, run_as), ""
