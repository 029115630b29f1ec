"""The deployed topology on separate network namespaces: partition a hospital and heal it.

The compose topology (``deploy/docker-compose.yml``: coordinator, three hospitals, analyst)
is rebuilt with Linux network namespaces instead of containers. Every process runs in a
namespace of its own with its own address on a private bridge, and reaches the coordinator by
NAME (``coordinator``, from a per-namespace ``/etc/netns/<ns>/hosts`` that ``ip netns exec``
mounts over ``/etc/hosts``), with the certificates ``dpfed certs`` made for that name::

    ns <p>-sw      bridge br0 (the "switch"; no address)
    ns <p>-coord   10.231.0.10  coordinator   dpfed-aggregator on :50051
    ns <p>-h1..h3  10.231.0.11..13            dpfed-site (hospital-1..3), dialling out
    ns <p>-an      10.231.0.20                dpfed CLI (analyst)

Every address lives inside namespaces this test creates (the bridge sits in its own
namespace too), so the host's network is never touched. The partition is the hospital's
link on the switch going down; healing is bringing it up again.

Skipped, with the reason, where namespaces cannot be made (not root, no ``ip``, a sandbox
that forbids them). Namespaces and their hosts files are removed on every exit path, and
leftovers of an earlier run that was killed are removed first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dpfed.aggregator.certs_cli import main as certs_main
from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.common import exit_codes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PREFIX = "dpnt"  # namespaces of this test: dpnt<pid>-<role>
SUBNET = "10.231.0"
COORDINATOR_IP = f"{SUBNET}.10"
PORT = 50051
NODES = {"coord": 10, "h1": 11, "h2": 12, "h3": 13, "an": 20}
SITES = {"hospital-1": "h1", "hospital-2": "h2", "hospital-3": "h3"}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _netns_unavailable() -> str | None:
    """Why this test cannot run here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run the e2e suite as root)"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _remove_namespace(ns: str) -> None:
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def _remove_stale_namespaces() -> None:
    """Delete namespaces left by an earlier run of this test whose process is gone."""
    listing = _ip("netns", "list", check=False).stdout
    for ns in re.findall(rf"^({PREFIX}(\d+)-\w+)", listing, flags=re.M):
        name, pid = ns
        if not Path(f"/proc/{pid}").exists():
            _remove_namespace(name)


@dataclass
class Topology:
    """The namespaces, links and processes of one run."""

    tag: str
    root: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)

    def ns(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def switch_port(self, node: str) -> str:
        return f"{self.tag}{node}s"[-15:]  # interface names are at most 15 characters

    def build(self) -> None:
        switch = self.ns("sw")
        for name in (switch, *(self.ns(n) for n in NODES)):
            _ip("netns", "add", name)
            self.namespaces.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for node, host in NODES.items():
            ns, port = self.ns(node), self.switch_port(node)
            peer = f"{self.tag}{node}n"[-15:]
            _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", peer,
                "netns", ns)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", ns, "link", "set", peer, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{host}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            hosts = Path("/etc/netns") / ns / "hosts"
            hosts.parent.mkdir(parents=True, exist_ok=True)
            hosts.write_text(f"127.0.0.1 localhost\n{COORDINATOR_IP} coordinator\n")

    def link(self, node: str, up: bool) -> None:
        _ip("-n", self.ns("sw"), "link", "set", self.switch_port(node), "up" if up else "down")

    def spawn(self, name: str, node: str, argv: list[str]) -> subprocess.Popen[bytes]:
        (self.root / "logs").mkdir(exist_ok=True)
        log = (self.root / "logs" / f"{name}.log").open("ab")
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(node), sys.executable, *argv],
                                stdout=log, stderr=subprocess.STDOUT, env=_env())
        log.close()
        self.procs[name] = proc
        return proc

    def analyst(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns("an"), sys.executable, "-m", "dpfed.aggregator.cli",
             *args], capture_output=True, text=True, timeout=timeout, env=_env(self.root))

    def log(self, name: str) -> str:
        path = self.root / "logs" / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def teardown(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for ns in reversed(self.namespaces):
            _remove_namespace(ns)
        try:
            Path("/etc/netns").rmdir()  # only if empty: other namespaces' files stay
        except OSError:
            pass


def _env(root: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPFED_")}
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if root is not None:
        kit = root / "certs" / "analysts" / "analyst"
        env.update(DPFED_COORDINATOR=f"coordinator:{PORT}", DPFED_CA=str(kit / "ca.pem"),
                   DPFED_CERT=str(kit / "analyst.pem"), DPFED_KEY=str(kit / "analyst.key"))
    return env


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[Topology]:
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    _remove_stale_namespaces()
    fed = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=1500, features=6, seed=21, min_sites=2,
        task_deadline_s=60, resume_wait_s=10,
        settings=SiteSettings(budget_epsilon=100.0, budget_delta=0.01, connect_timeout_s=60))
    # The coordinator is reached by name: its certificate must carry that name.
    assert certs_main(["certs", "issue", "--ca-dir", str(fed.certs), "--coordinator",
                       "coordinator", "--force"]) == exit_codes.OK
    text = fed.aggregator_config.read_text().replace('listen = "127.0.0.1:0"',
                                                     f'listen = "0.0.0.0:{PORT}"')
    fed.aggregator_config.write_text(text)
    topo = Topology(f"{PREFIX}{os.getpid()}", fed.root)
    try:
        topo.build()
        topo.spawn("coordinator", "coord", ["-m", "dpfed.aggregator", "--config",
                                            str(fed.aggregator_config)])
        for site, node in SITES.items():
            topo.spawn(site, node, ["-m", "dpfed.site_agent", "--config",
                                    str(fed.site_config(site)), "--coordinator",
                                    f"coordinator:{PORT}"])
        yield topo
    finally:
        topo.teardown()


def _connected(topo: Topology) -> set[str]:
    out = topo.analyst("sites", timeout=60)
    if out.returncode != exit_codes.OK:
        return set()
    return {line.split()[0] for line in out.stdout.splitlines() if " connected " in line}


def _wait_connected(topo: Topology, sites: set[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sites <= _connected(topo):
            return
        time.sleep(1)
    logs = "\n".join(f"--- {n}\n{topo.log(n)}" for n in ("coordinator", *SITES))
    pytest.fail(f"sites {sorted(sites)} not all connected within {timeout:g}s\n{logs}")


def _jobs(topo: Topology) -> list[dict[str, Any]]:
    """The analyst's ``dpfed jobs --json`` (newest first)."""
    out = topo.analyst("jobs", "--limit", "10", "--json")
    assert out.returncode == exit_codes.OK, out.stderr
    jobs: list[dict[str, Any]] = json.loads(out.stdout)
    return jobs


def test_partitioned_hospital_job_follows_policy_and_the_site_rejoins(
        topology: Topology) -> None:
    topo = topology
    # Every process has its own address; the coordinator is found by name from each.
    for node in NODES:
        addr = _ip("-n", topo.ns(node), "-4", "addr", "show", "eth0").stdout
        assert f"{SUBNET}.{NODES[node]}/24" in addr
    _wait_connected(topo, set(SITES), timeout=120)

    # Partition hospital-3 and run a job while it is cut off: the coordinator still holds
    # its (now silent) stream, so the task waits for the deadline; quorum 2 of 3 decides.
    topo.link("h3", up=False)
    try:
        job = topo.analyst("pca", "--k", "2", "--epsilon", "0.5", "--delta", "1e-6",
                           "--min-sites", "2", "--deadline", "6",
                           "--out", str(topo.root / "partitioned.npz"))
    finally:
        topo.link("h3", up=True)  # heal
    assert job.returncode == exit_codes.OK, job.stdout + job.stderr
    assert "from 2 site(s)" in job.stdout, job.stdout
    assert "site hospital-3: result received" not in job.stdout, job.stdout
    # Either its silent stream was still held (its task then timed out and is reported) or
    # keepalive had already dropped it (the job then never asked it): never an answer from it.
    newest = _jobs(topo)[0]
    assert (newest["state"], newest["sites_ok"]) == ("succeeded", 2)
    assert newest["sites_total"] in (2, 3)
    if newest["sites_total"] == 3:
        assert "site hospital-3:" in job.stdout, job.stdout

    # The site rejoins by itself (no restart, nobody touches it): a job that needs all
    # three sites succeeds.
    _wait_connected(topo, set(SITES), timeout=120)
    deadline = time.monotonic() + 120
    while True:
        full = topo.analyst("pca", "--k", "2", "--epsilon", "0.5", "--delta", "1e-6",
                            "--min-sites", "3", "--deadline", "20", "--wait-sites", "3",
                            "--out", str(topo.root / "healed.npz"))
        if full.returncode == exit_codes.OK or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert full.returncode == exit_codes.OK, full.stdout + full.stderr + topo.log("hospital-3")
    assert "from 3 site(s)" in full.stdout, full.stdout
    assert all(proc.poll() is None for proc in topo.procs.values()), "a process died"


def test_the_skip_reason_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    if sys.platform.startswith("linux"):
        assert "needs root" in (_netns_unavailable() or "")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    if sys.platform.startswith("linux"):
        assert "'ip' command" in (_netns_unavailable() or "")
