"""deploy/: every compose service's command and file exists, and the topology really runs.

There is no Docker engine on the CI machine, so the e2e test plays the compose file with
real processes: it runs init.sh itself (its volume paths pointed at temporary directories),
starts the coordinator from the deploy config, starts the analyst service's exact command
while the coordinator is still starting (it must retry, not exit 6), runs the coordinator's
healthcheck command, then starts the three hospitals from their deploy configs.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import zipfile
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


def init_defaults() -> dict[str, str]:
    """init.sh's ``VAR="${VAR:-default}"`` lines."""
    text = (DEPLOY / "init.sh").read_text()
    return dict(re.findall(r'^(\w+)="\$\{\1:-([^}]*)\}"', text, flags=re.M))


def init_commands() -> list[list[str]]:
    text = (DEPLOY / "init.sh").read_text().replace("\\\n", " ")
    for var, default in init_defaults().items():
        text = text.replace(f'"${var}"', default).replace(f"${var}", default)
    return [shlex.split(line.strip()) for line in text.splitlines()
            if line.strip().startswith("dpfed ")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def deploy_path(container_path: str) -> Path:
    assert container_path.startswith("/deploy/"), container_path
    return DEPLOY / container_path[len("/deploy/"):]


# ---------------------------------------------------------------- the image: Dockerfile + context

DOCKERFILE = DEPLOY / "Dockerfile"
#: What the built wheel must hold (the package and its generated protobuf code).
WHEEL_REQUIRED = ("dpfed/__init__.py", "dpfed/common/pca/dppca.py", "dpfed/site_agent/cli.py",
                  "dpfed/aggregator/cli.py", "dpfed/aggregator/server_main.py",
                  "dpfed/common/pb/v1/site_link_pb2.py", "dpfed/common/py.typed")


def dockerignore_patterns(root: Path = ROOT) -> list[str]:
    lines = (root / ".dockerignore").read_text().splitlines()
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


def build_context(root: Path = ROOT) -> set[str]:
    """Paths (files, folders, links) ``docker build -f deploy/Dockerfile ROOT`` would send.

    docker-py's implementation of the .dockerignore rules (last match wins, ``!`` exceptions,
    a folder's pattern covers its content) -- the same rules as the Docker CLI.
    """
    from docker.utils.build import exclude_paths

    return set(exclude_paths(str(root), dockerignore_patterns(root),
                             dockerfile="deploy/Dockerfile"))


def dockerfile_copies() -> tuple[str, list[tuple[list[str], str]]]:
    """The WORKDIR of the COPY lines and each COPY's (sources, destination)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    workdir, copies, workdirs = "/", [], []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] == "WORKDIR":
            workdir = words[1]
        elif words[0] in ("COPY", "ADD"):
            assert words[0] == "COPY", "ADD can fetch URLs and unpack archives: use COPY"
            args = [w for w in words[1:] if not w.startswith("--chown") and
                    not w.startswith("--chmod")]
            assert not any(a.startswith("--") for a in args), f"unsupported COPY flag: {line}"
            copies.append((args[:-1], args[-1]))
            workdirs.append(workdir)
    assert copies and len(set(workdirs)) == 1, "every COPY from one WORKDIR"
    return workdirs[0], copies


def reproduce_copies(context: set[str], image_root: Path) -> Path:
    """Lay out in ``image_root`` what the COPY lines put in the image; return the WORKDIR.

    A file goes to ``DEST`` (or ``DEST/name`` when DEST ends with ``/``); a folder's
    content (only what the context holds) goes under ``DEST``; symbolic links stay links,
    as COPY keeps them.
    """
    workdir, copies = dockerfile_copies()
    base = image_root / workdir.lstrip("/")
    for sources, dest in copies:
        target = base / dest
        for src in sources:
            src = src.rstrip("/")
            assert src in context, f"COPY {src}: left out of the build context by .dockerignore"
            path = ROOT / src
            if path.is_dir() and not path.is_symlink():
                target.mkdir(parents=True, exist_ok=True)
                for rel in sorted(p for p in context if p.startswith(src + "/")):
                    _copy_entry(ROOT / rel, target / rel[len(src) + 1:])
            else:
                into = dest.endswith("/") or len(sources) > 1
                _copy_entry(path, target / path.name if into else target)
    return base


def _copy_entry(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        dst.symlink_to(os.readlink(src))
    elif src.is_dir():
        dst.mkdir(exist_ok=True)
    else:
        shutil.copy2(src, dst)


def test_dockerignore_keeps_secrets_and_environments_out_of_the_build_context(
        tmp_path: Path) -> None:
    shutil.copy(ROOT / ".dockerignore", tmp_path / ".dockerignore")
    planted = [".venv/bin/python", ".venv/lib/site.py", "runs/simulate-1/certs/ca.key",
               "runs/simulate-1/sites/hospital-1/ledger.sqlite", "certs/sites/a/site.key",
               "federation/ca.pem", "data/site_01.csv", "pca.npz", "dpfed.egg-info/PKG-INFO",
               ".git/config", "common/__pycache__/x.cpython-311.pyc", "common/stray.key",
               "site_agent/ledger.sqlite", "dpfed/common"]
    kept = ["pyproject.toml", "README.md", "dpfed/__init__.py", "common/errors.py",
            "site_agent/cli.py", "aggregator/cli.py", "deploy/Dockerfile"]
    for rel in planted + kept:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    context = build_context(tmp_path)
    assert not [p for p in planted if p in context]
    assert [p for p in kept if p not in context] == []


def test_the_build_context_is_what_the_dockerfile_copies() -> None:
    context = build_context()
    _, copies = dockerfile_copies()
    sources = {s.rstrip("/") for srcs, _ in copies for s in srcs}
    needed = {".dockerignore", "deploy/Dockerfile", "deploy"} | sources
    extra = sorted(p for p in context if p not in needed and not any(
        p.startswith(s + "/") for s in sources) and not any(
        s.startswith(p + "/") for s in sources))
    assert not extra, f"sent to the build but never copied: {extra[:10]} ({len(extra)})"
    assert not [p for p in context if p.endswith((".key", ".sqlite", ".pyc"))]


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_the_image_wheel_holds_the_package_and_its_console_scripts_run(tmp_path: Path) -> None:
    """Build the wheel from exactly what the Dockerfile copies, install it, run it.

    No Docker engine here: the COPY lines are replayed on the .dockerignore-filtered
    context, ``pip wheel`` runs where ``RUN pip install .`` would, and the wheel goes into a
    fresh virtualenv. Its third-party dependencies come from this test environment (a path
    entry, not an install: PyPI is not needed); dpfed itself only from the wheel.
    """
    workdir = reproduce_copies(build_context(), tmp_path / "image")
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(wheels), str(workdir)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("dpfed-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [n for n in WHEEL_REQUIRED if n not in names]
    assert not missing, f"the image's wheel lacks {missing} ({len(names)} files)"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" /
                                "python"), "install", "--no-deps", "-q", str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    (site_packages,) = (venv / "lib").glob("python3*/site-packages")
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site_packages / "zz_test_dependencies.pth").write_text("\n".join(deps) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()

    def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, cwd=run_dir, env=env,
                              timeout=timeout)

    where = run(str(venv / "bin" / "python"), "-c", "import dpfed; print(dpfed.__file__)")
    assert where.stdout.startswith(str(site_packages)), where.stdout + where.stderr
    version = run("dpfed", "--version")
    assert version.returncode == 0 and version.stdout.startswith("dpfed "), version.stderr
    for script in ("dpfed-aggregator", "dpfed-site"):
        helped = run(script, "--help")
        assert helped.returncode == 0 and f"usage: {script}" in helped.stdout, helped.stderr
    # A tiny federation from the installed wheel: coordinator and sites are `python -m` of
    # the venv's interpreter, so every process runs the wheel's code.
    sim = run("dpfed", "simulate", "--sites", "2", "--rows", "400", "--features", "4", "--k",
              "1", "--seed", "1", "--out", str(tmp_path / "sim"), timeout=300)
    assert sim.returncode == 0, sim.stdout + sim.stderr
    assert "captured energy" in sim.stdout and (tmp_path / "sim" / "pca.npz").exists()


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
    health = services["coordinator"]["healthcheck"]["test"]
    assert health[0] == "CMD" and health[1] in PARSERS
    PARSERS[health[1]]().parse_args(health[2:])
    load_aggregator_config(DEPLOY / "aggregator.toml")
    for site in ("a", "b", "c"):
        cfg = load_site_config(DEPLOY / "sites" / f"hospital-{site}.toml")
        assert cfg.tls is not None and f"hospital-{site}" in str(cfg.tls.cert)


def test_only_init_mounts_the_ca_volume_and_services_wait_for_a_healthy_coordinator() -> None:
    services = compose()["services"]
    holders = [name for name, svc in services.items()
               if any(v.split(":")[0] == "ca" for v in svc.get("volumes", []))]
    assert holders == ["init"]
    for name in ("hospital-a", "hospital-b", "hospital-c", "analyst"):
        assert services[name]["depends_on"]["coordinator"]["condition"] == "service_healthy"
    analyst = services["analyst"]["command"]
    assert "--wait-sites" in analyst and "--wait-timeout" in analyst
    assert "cp analyst:/results/pca.npz" in (DEPLOY / "docker-compose.yml").read_text()


def test_example_configs_load_and_document_every_key() -> None:
    agg = load_aggregator_config(DEPLOY / "examples" / "aggregator.toml")
    assert agg.listen == "0.0.0.0:50051" and agg.log_format == "text"
    site = load_site_config(DEPLOY / "examples" / "site.toml")
    assert site.tls is not None and site.coordinator_address == "localhost:50051"
    # Every optional key is at least shown (commented) in the examples.
    agg_text = (DEPLOY / "examples" / "aggregator.toml").read_text()
    for key in ("health_listen", "port_file", "insecure", "allowed_sites", "min_sites",
                "task_deadline_s", "resume_wait_s", "format", "file"):
        assert re.search(rf"^#? ?{key} =", agg_text, flags=re.M), key
    site_text = (DEPLOY / "examples" / "site.toml").read_text()
    for key in ("server_name", "connect_timeout_s", "format", "table", "query", "delimiter",
                "chunk_rows", "on_missing", "on_invalid", "on_out_of_range", "accountant",
                "allowed_jobs", "max_epsilon_per_task", "file"):
        assert re.search(rf"^#? ?{key} =", site_text, flags=re.M), key


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
    # The init service: init.sh itself, its volumes pointed at the temporary directories.
    init_env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                "CA_DIR": str(volumes["ca"]), "PKI_DIR": str(volumes["pki"]),
                "DATA_DIR": str(volumes["demo-data"]), "DEMO_ROWS": "2000"}
    for _ in range(2):  # idempotent: a second `docker compose up` re-runs it
        subprocess.run(["sh", str(DEPLOY / "init.sh")], env=init_env, check=True,
                       capture_output=True, timeout=180)
    assert (volumes["ca"] / "ca.key").exists()
    assert not list(volumes["pki"].rglob("ca.key")), "the CA key reached the shared volume"
    assert (volumes["pki"] / "sites" / "hospital-b" / "site.key").stat().st_mode & 0o077 == 0

    address = f"127.0.0.1:{free_port()}"
    health_port = free_port()  # the container's loopback port 50052, here a free one
    procs: list[subprocess.Popen[bytes]] = []
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(service: str, module: str, config: Path, extra: list[str]) -> None:
        local = tmp_path / f"{service}.toml"
        # The coordinator's health port: a free one here instead of the container's 50052.
        local.write_text(localize(config.read_text(), service).replace(
            '"127.0.0.1:50052"', f'"127.0.0.1:{health_port}"'))
        with open(logs / f"{service}.log", "wb") as fh:  # the child keeps its own handle
            procs.append(subprocess.Popen([sys.executable, "-m", module, "--config", str(local),
                                           *extra], stdout=fh, stderr=subprocess.STDOUT))

    health_cmd = services["coordinator"]["healthcheck"]["test"][1:]
    coordinator_toml = tmp_path / "coordinator.toml"

    def healthcheck() -> subprocess.CompletedProcess[str]:
        argv = [str(coordinator_toml) if a.startswith("/deploy/") else a for a in health_cmd]
        return subprocess.run([sys.executable, "-m", "dpfed.aggregator", *argv[1:]],
                              capture_output=True, text=True, timeout=60)

    analyst_run: subprocess.Popen[str] | None = None
    try:
        start("coordinator", "aggregator", DEPLOY / "aggregator.toml", ["--listen", address])
        # The analyst starts as early as compose could start it: while the coordinator is
        # still coming up. --wait-sites must retry instead of exiting 6.
        analyst = services["analyst"]
        env = {**os.environ, **{k: localize_argv([v], "analyst")[0] for k, v in
                                analyst["environment"].items()}}
        env["DPFED_COORDINATOR"] = address
        analyst_run = subprocess.Popen([*dpfed, *localize_argv(analyst["command"], "analyst")[1:]],
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
        deadline = time.monotonic() + 60
        while healthcheck().returncode != 0:
            assert procs[0].poll() is None, (logs / "coordinator.log").read_text()
            assert time.monotonic() < deadline, "the coordinator never became healthy"
            time.sleep(0.5)
        for site in ("hospital-a", "hospital-b", "hospital-c"):
            # The compose network's name "coordinator" is reached here at 127.0.0.1, which
            # the coordinator certificate also names.
            start(site, "site_agent", DEPLOY / "sites" / f"{site}.toml",
                  ["--coordinator", address])
        out, _ = analyst_run.communicate(timeout=180)
        assert analyst_run.returncode == 0, out
        assert "waiting for 3 site(s)" in out
        assert (volumes["results"] / "pca.npz").exists()
        for site in ("hospital-a", "hospital-b", "hospital-c"):
            assert (volumes[f"{site}-ledger"] / "ledger.sqlite").exists()
        procs[0].terminate()
        procs[0].wait(15)
        unhealthy = healthcheck()
        assert unhealthy.returncode == 6, unhealthy.stdout + unhealthy.stderr
    finally:
        if analyst_run is not None and analyst_run.poll() is None:
            analyst_run.kill()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
