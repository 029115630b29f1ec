"""deploy/: every compose service's command and file exists, and the topology really runs.

There is no Docker engine on the CI machine, so the second test plays the compose file with
real processes: it runs init.sh's commands, starts the coordinator and the three hospitals
from the deploy configs (container paths mapped to temporary directories, one ledger volume
per site), and runs the analyst service's exact command.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from dpfed.aggregator.cli import build_parser as dpfed_parser
from dpfed.aggregator.config import load_aggregator_config
from dpfed.aggregator.server_main import build_parser as aggregator_parser
from dpfed.site_agent.cli import build_parser as site_parser
from dpfed.site_agent.config import load_site_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PARSERS = {"dpfed": dpfed_parser, "dpfed-site": site_parser,
           "dpfed-aggregator": aggregator_parser}


def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def init_commands() -> list[list[str]]:
    text = (DEPLOY / "init.sh").read_text().replace("\\\n", " ")
    return [shlex.split(line.strip()) for line in text.splitlines()
            if line.strip().startswith("dpfed ")]


def deploy_path(container_path: str) -> Path:
    assert container_path.startswith("/deploy/"), container_path
    return DEPLOY / container_path[len("/deploy/"):]


def test_console_scripts_match_pyproject() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == set(PARSERS)


def test_every_service_command_and_file_exists() -> None:
    services = compose()["services"]
    assert set(services) == {"init", "coordinator", "hospital-a", "hospital-b", "hospital-c",
                             "analyst"}
    dockerfile = DEPLOY / "Dockerfile"
    assert services["init"]["build"]["dockerfile"] == "deploy/Dockerfile" and dockerfile.exists()
    for src in re.findall(r"^COPY (\S+)", dockerfile.read_text(), flags=re.M):
        assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"
    for name, svc in services.items():
        cmd = svc["command"]
        if cmd[0] == "sh":
            assert deploy_path(cmd[1]).exists(), f"{name}: missing script {cmd[1]}"
            continue
        assert cmd[0] in PARSERS, f"{name}: {cmd[0]} is not a dpfed entry point"
        PARSERS[cmd[0]]().parse_args(cmd[1:])  # raises SystemExit on an unknown flag
        for arg in cmd:
            if arg.startswith("/deploy/"):
                assert deploy_path(arg).exists(), f"{name}: missing {arg}"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists()
            else:
                assert src in compose()["volumes"], f"{name}: undeclared volume {src}"
    for argv in init_commands():
        dpfed_parser().parse_args(argv[1:])
    load_aggregator_config(DEPLOY / "aggregator.toml")
    for site in ("a", "b", "c"):
        cfg = load_site_config(DEPLOY / "sites" / f"hospital-{site}.toml")
        assert cfg.tls is not None and f"hospital-{site}" in str(cfg.tls.cert)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_compose_topology_runs_with_real_processes(tmp_path: Path) -> None:
    services = compose()["services"]
    volumes = {v: tmp_path / v for v in compose()["volumes"]}
    for d in volumes.values():
        d.mkdir()

    def mounts(service: str) -> dict[str, Path]:
        out = {}
        for vol in services[service].get("volumes", []):
            src, dst = vol.split(":")[:2]
            out[dst] = DEPLOY if src.startswith(".") else volumes[src]
        return out

    def localize(text: str, service: str) -> str:
        for dst, src in sorted(mounts(service).items(), key=lambda kv: -len(kv[0])):
            text = text.replace(f'"{dst}/', f'"{src}/').replace(f'"{dst}"', f'"{src}"')
        return text

    def localize_argv(argv: list[str], service: str) -> list[str]:
        out = []
        for a in argv:
            for dst, src in sorted(mounts(service).items(), key=lambda kv: -len(kv[0])):
                if a == dst or a.startswith(dst + "/"):
                    a = str(src) + a[len(dst):]
                    break
            out.append(a)
        return out

    dpfed = [sys.executable, "-m", "dpfed.aggregator.cli"]
    for argv in init_commands():  # init service, as init.sh runs them
        argv = localize_argv(argv, "init")
        if "demo-data" in argv:
            argv[argv.index("--rows") + 1] = "2000"  # smaller data, same shape
        subprocess.run([*dpfed, *argv[1:]], check=True, capture_output=True, timeout=120)

    procs: list[subprocess.Popen[bytes]] = []
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(service: str, module: str, config: Path, extra: list[str]) -> None:
        local = tmp_path / f"{service}.toml"
        local.write_text(localize(config.read_text(), service))
        with open(logs / f"{service}.log", "wb") as fh:  # the child keeps its own handle
            procs.append(subprocess.Popen([sys.executable, "-m", module, "--config", str(local),
                                           *extra], stdout=fh, stderr=subprocess.STDOUT))

    port_file = tmp_path / "port"
    try:
        start("coordinator", "aggregator", DEPLOY / "aggregator.toml",
              ["--listen", "127.0.0.1:0", "--port-file", str(port_file)])
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert procs[0].poll() is None, (logs / "coordinator.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        for site in ("hospital-a", "hospital-b", "hospital-c"):
            # The compose network's name "coordinator" is reached here at 127.0.0.1, which
            # the coordinator certificate also names.
            start(site, "site_agent", DEPLOY / "sites" / f"{site}.toml",
                  ["--coordinator", address])
        analyst = services["analyst"]
        env = {**os.environ, **{k: localize_argv([v], "analyst")[0] for k, v in
                                analyst["environment"].items()}}
        env["DPFED_COORDINATOR"] = address
        run = subprocess.run([*dpfed, *localize_argv(analyst["command"], "analyst")[1:]],
                             env=env, capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stdout + run.stderr
        assert (volumes["results"] / "pca.npz").exists()
        for site in ("hospital-a", "hospital-b", "hospital-c"):
            assert (volumes[f"{site}-ledger"] / "ledger.sqlite").exists()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
