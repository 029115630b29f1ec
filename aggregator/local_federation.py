"""A whole federation on one machine: certificates, data, configs, and the real processes.

Used by ``dpfed simulate`` and by the end-to-end tests. The coordinator and each site run as
separate ``python -m dpfed.aggregator`` / ``python -m dpfed.site_agent`` processes -- the same
entry points
as ``dpfed-aggregator`` and ``dpfed-site`` -- over real gRPC with mutual TLS (certificates made
by ``dpfed.common.transport.certs``), with durable SQLite ledgers and a durable job store on disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dpfed.aggregator import simulate_metrics
from dpfed.aggregator.client import Coordinator
from dpfed.common.data.demo_data import write_demo
from dpfed.common.errors import DpfedError, ProcessExitedError
from dpfed.common.privacy.accounting import DEFAULT_ACCOUNTANT
from dpfed.common.transport.certs import init_federation

ANALYST = "analyst"
STARTUP_TIMEOUT_S = 60.0


def _q(p: Path) -> str:
    """Render a path as a TOML string."""
    return json.dumps(str(p.resolve()))


@dataclass
class SiteSettings:
    """Per-site knobs written into ``site.toml``."""

    budget_epsilon: float = 10.0
    budget_delta: float = 1e-4
    accountant: str = DEFAULT_ACCOUNTANT
    allowed_jobs: tuple[str, ...] = ("pca", "svt", "query")
    max_epsilon_per_task: float | None = None
    connect_timeout_s: float = 60.0
    noise_seed: int | None = None
    #: ``[budget.analysts]``: per-analyst epsilon shares, as (analyst id, epsilon) pairs.
    analyst_budgets: tuple[tuple[str, float], ...] = ()
    #: ``policy.evaluation_summary`` ("none" or "dp").
    evaluation_summary: str = "none"
    #: ``policy.secure_tolerated_dropouts``: sites a secure sum may lose mid-round.
    secure_tolerated_dropouts: int = 0


@dataclass
class LocalFederation:
    """Files and processes of a federation rooted at ``root``."""

    root: Path
    site_ids: list[str]
    schema_path: Path
    data_paths: dict[str, Path]
    min_sites: int = 1
    task_deadline_s: float = 600.0
    resume_wait_s: float = 60.0
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = field(default_factory=dict)
    port: int | None = None
    #: Serve Prometheus metrics from every process on a free loopback port (``dpfed simulate
    #: --metrics``; ``dpfed.aggregator.simulate_metrics``).
    metrics: bool = False

    # ------------------------------------------------------------------ layout
    @property
    def certs(self) -> Path:
        """Federation directory written by ``dpfed certs init``."""
        return self.root / "certs"

    @property
    def logs(self) -> Path:
        """Where each process's log goes."""
        return self.root / "logs"

    @property
    def aggregator_config(self) -> Path:
        """The coordinator's ``aggregator.toml``."""
        return self.root / "coordinator" / "aggregator.toml"

    @property
    def store(self) -> Path:
        """The coordinator's job store."""
        return self.root / "coordinator" / "store"

    def site_dir(self, site_id: str) -> Path:
        """Return a site's directory (config and ledger)."""
        return self.root / "sites" / site_id

    def site_config(self, site_id: str) -> Path:
        """Return a site's ``site.toml``."""
        return self.site_dir(site_id) / "site.toml"

    def ledger_path(self, site_id: str) -> Path:
        """Return a site's ledger file."""
        return self.site_dir(site_id) / "ledger.sqlite"

    @property
    def address(self) -> str:
        """The running coordinator's address."""
        if self.port is None:
            raise DpfedError("the coordinator has not been started")
        return f"127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, root: Path, *, n_sites: int = 3, rows: int = 2000, features: int = 8,
               seed: int = 0, fmt: str = "csv", data: list[Path] | None = None,
               schema: Path | None = None, min_sites: int | None = None,
               task_deadline_s: float = 600.0, resume_wait_s: float = 60.0,
               settings: SiteSettings | None = None, mixed: bool = False,
               metrics: bool = False) -> LocalFederation:
        """Write certificates, data (demo data unless ``data``/``schema``) and configs."""
        root = root.resolve()
        root.mkdir(parents=True, exist_ok=True)
        if data:
            if schema is None:
                raise DpfedError("data files need a schema")
            n_sites = len(data)
            schema_path, paths = schema.resolve(), [p.resolve() for p in data]
        else:
            schema_path, paths = write_demo(root / "data", n_sites, rows, features, seed=seed,
                                            fmt=fmt, mixed=mixed)
        site_ids = [f"hospital-{i + 1}" for i in range(n_sites)]
        init_federation(root / "certs", coordinator_hosts=["localhost"], sites=site_ids,
                        analysts=[ANALYST], force=True)
        fed = cls(root, site_ids, Path(schema_path), dict(zip(site_ids, paths, strict=True)),
                  min_sites=min_sites or n_sites, task_deadline_s=task_deadline_s,
                  resume_wait_s=resume_wait_s, metrics=metrics)
        fed.write_aggregator_config()
        for i, site_id in enumerate(site_ids):
            s = settings or SiteSettings()
            if s.noise_seed is not None:
                s = SiteSettings(**{**s.__dict__, "noise_seed": s.noise_seed * 1000 + i})
            fed.write_site_config(site_id, s)
        return fed

    def write_aggregator_config(self) -> None:
        """(Re)write ``aggregator.toml``."""
        c = self.certs / "coordinator"
        self.aggregator_config.parent.mkdir(parents=True, exist_ok=True)
        self.aggregator_config.write_text(
            "[server]\nlisten = \"127.0.0.1:0\"\n\n"
            f"[tls]\nca = {_q(self.certs / 'ca.pem')}\ncert = {_q(c / 'coordinator.pem')}\n"
            f"key = {_q(c / 'coordinator.key')}\n\n"
            f"[federation]\nschema = {_q(self.schema_path)}\n"
            f"access_list = {_q(c / 'access.toml')}\n\n"
            f"[jobs]\nmin_sites = {self.min_sites}\ntask_deadline_s = {self.task_deadline_s}\n"
            f"resume_wait_s = {self.resume_wait_s}\n\n"
            f"[store]\npath = {_q(self.store)}\n\n{self._metrics_table('coordinator')}")

    def write_site_config(self, site_id: str, s: SiteSettings) -> None:
        """(Re)write one site's ``site.toml``."""
        d = self.site_dir(site_id)
        d.mkdir(parents=True, exist_ok=True)
        kit = self.certs / "sites" / site_id
        policy = f"[policy]\nallowed_jobs = {json.dumps(list(s.allowed_jobs))}\n"
        if s.max_epsilon_per_task is not None:
            policy += f"max_epsilon_per_task = {s.max_epsilon_per_task}\n"
        if s.evaluation_summary != "none":
            policy += f"evaluation_summary = {json.dumps(s.evaluation_summary)}\n"
        if s.secure_tolerated_dropouts:
            policy += f"secure_tolerated_dropouts = {s.secure_tolerated_dropouts}\n"
        shares = "".join(f"{name} = {eps}\n" for name, eps in s.analyst_budgets)
        analysts = f"\n[budget.analysts]\n{shares}" if shares else ""
        testing = ("" if s.noise_seed is None else
                   f"\n[testing]\ndeterministic_noise_seed = {s.noise_seed}\n")
        self.site_config(site_id).write_text(
            f"[coordinator]\naddress = \"127.0.0.1:1\"\n"
            f"connect_timeout_s = {s.connect_timeout_s}\n\n"
            f"[tls]\nca = {_q(kit / 'ca.pem')}\ncert = {_q(kit / 'site.pem')}\n"
            f"key = {_q(kit / 'site.key')}\nrevocation_list = {_q(kit / 'revoked.toml')}\n\n"
            f"[data]\npath = {_q(self.data_paths[site_id])}\nschema = {_q(self.schema_path)}\n\n"
            f"[ledger]\npath = {_q(self.ledger_path(site_id))}\n\n"
            f"[budget]\nepsilon = {s.budget_epsilon}\ndelta = {s.budget_delta}\n"
            f"accountant = \"{s.accountant}\"\n{analysts}\n{policy}{testing}\n"
            f"{self._metrics_table(site_id)}")

    def metrics_port_file(self, name: str) -> Path:
        """Where a process (``"coordinator"`` or a site id) writes its metrics port."""
        return (self.root / "coordinator" if name == "coordinator"
                else self.site_dir(name)) / "metrics.port"

    def _metrics_table(self, name: str) -> str:
        if not self.metrics:
            return "[metrics]\nenabled = false\n"
        return (f"[metrics]\nenabled = true\nlisten = \"127.0.0.1:0\"\n"
                f"port_file = {_q(self.metrics_port_file(name))}\n")

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = self.logs / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen([sys.executable, *argv], stdout=fh, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        self.procs[name] = (proc, log)
        return proc

    def log_tail(self, name: str, lines: int = 15) -> str:
        """Return the last lines of a process's log."""
        path = self.logs / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def check_alive(self, *names: str) -> None:
        """Raise with the log tail if a process (default: all) has exited."""
        for name in names or tuple(self.procs):
            proc = self.procs[name][0]
            if proc.poll() is not None:
                raise ProcessExitedError(f"{name} exited with code {proc.returncode}; last log "
                                         "lines:\n" + self.log_tail(name), proc.returncode)

    def start_coordinator(self, *, port: int | None = None, timeout: float = STARTUP_TIMEOUT_S,
                          extra: list[str] | None = None) -> int:
        """Start the coordinator (on ``port``, default a free one); return its port."""
        port_file = self.root / "coordinator" / "port"
        port_file.unlink(missing_ok=True)
        listen = f"127.0.0.1:{port if port is not None else 0}"
        self._spawn("coordinator", ["-m", "dpfed.aggregator", "--config",
        str(self.aggregator_config),
                                    "--listen", listen, "--port-file", str(port_file),
                                    *(extra or [])])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive("coordinator")
            text = port_file.read_text().strip() if port_file.exists() else ""
            if text:
                self.port = int(text)
                return self.port
            time.sleep(0.05)
        raise DpfedError(f"the coordinator did not start within {timeout:g}s:\n"
                         + self.log_tail("coordinator"))

    def start_site(self, site_id: str, *, extra: list[str] | None = None) -> None:
        """Start one site agent pointed at the running coordinator."""
        self._spawn(site_id, ["-m", "dpfed.site_agent", "--config", str(self.site_config(site_id)),
                              "--coordinator", self.address, *(extra or [])])

    def start_sites(self) -> None:
        """Start every site agent."""
        for site_id in self.site_ids:
            self.start_site(site_id)

    def analyst(self, timeout: float = 30.0) -> Coordinator:
        """Open an analyst client with the analyst certificate."""
        kit = self.certs / "analysts" / ANALYST
        return Coordinator(self.address, ca=kit / "ca.pem", cert=kit / "analyst.pem",
                           key=kit / "analyst.key", timeout=timeout)

    def wait_for_sites(self, n: int | None = None, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until ``n`` (default all) sites are connected and have sent their row counts.

        A site connects before counting its rows and sends the count right after
        (docs/data-sources.md, "Start-up"); this fails fast if a process dies.
        """
        want = len(self.site_ids) if n is None else n
        deadline = time.monotonic() + timeout
        with self.analyst() as coord:
            while True:
                self.check_alive()
                sites = [s for s in coord.sites() if s.connected]
                if len(sites) >= want and all(s.row_count > 0 for s in sites):
                    if self.metrics:
                        simulate_metrics.announce(self)
                    return
                if time.monotonic() > deadline:
                    raise DpfedError(f"fewer than {want} sites connected and counted within "
                                     f"{timeout:g}s (logs in {self.logs})")
                time.sleep(0.1)

    def signal(self, name: str, sig: int) -> None:
        """Send a signal to a process."""
        self.procs[name][0].send_signal(sig)

    def wait(self, name: str, timeout: float = 30.0) -> int:
        """Wait for a process to exit; return its exit code."""
        return self.procs[name][0].wait(timeout)

    def stop(self, name: str, timeout: float = 15.0) -> int | None:
        """SIGTERM (SIGCONT first, in case it was stopped), wait, SIGKILL if needed."""
        return self._stop_together([name], timeout)[name]

    def _stop_together(self, names: list[str], timeout: float) -> dict[str, int | None]:
        """Signal every process of ``names`` at once, then wait for each (SIGKILL if needed)."""
        for name in names:
            proc = self.procs[name][0]
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name in names:
            proc = self.procs[name][0]
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return {name: self.procs[name][0].returncode for name in names}

    def stop_all(self) -> None:
        """Stop every process: the sites together first, then the coordinator."""
        if self.metrics:
            simulate_metrics.save_snapshots(self)
        self._stop_together([n for n in self.procs if n != "coordinator"], 15.0)
        if "coordinator" in self.procs:
            self.stop("coordinator")
