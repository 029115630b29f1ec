"""deploy/: the image, the compose files, and the topology played with real processes.

There is no Docker engine on the CI machine. The image is checked by replaying the
Dockerfile's COPY lines on the .dockerignore-filtered context and installing the wheel that
``pip install .`` builds from it. The compose files are validated against the Compose
Specification's JSON schema and read for what each service mounts. The e2e test plays
deploy/docker-compose.yml with real processes: init.sh (its volumes pointed at temporary
directories), the coordinator, the analyst's exact command started while the coordinator is
still starting (it must retry, not exit 6), both healthchecks, the three hospitals, and then
a fourth hospital joining through deploy/hospital/docker-compose.yml as docs/operations.md
tells it to.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from dpfed.aggregator.cli import build_parser as dpfed_parser
from dpfed.aggregator.config import load_aggregator_config
from dpfed.aggregator.server_main import build_parser as aggregator_parser
from dpfed.common import exit_codes
from dpfed.site_agent.cli import build_parser as site_parser
from dpfed.site_agent.config import load_site_config
from tests.e2e.federations import stop_processes, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
HOSPITAL_COMPOSE = DEPLOY / "hospital" / "docker-compose.yml"
COMPOSE_SCHEMA = Path(__file__).parent / "compose_spec" / "compose-spec.json"
PARSERS = {"dpfed": dpfed_parser, "dpfed-site": site_parser,
           "dpfed-aggregator": aggregator_parser}
#: How the tests start each console script (the same entry points, from this checkout).
MODULES = {"dpfed": "dpfed.aggregator.cli", "dpfed-site": "dpfed.site_agent",
           "dpfed-aggregator": "dpfed.aggregator"}
SITES = ("hospital-a", "hospital-b", "hospital-c")
#: What init.sh puts in each service's volume -- and nothing else.
KITS = {"coordinator-kit": {"ca.pem", "coordinator.pem", "coordinator.key", "access.toml",
                            "schema.toml"},
        "analyst-kit": {"ca.pem", "analyst.pem", "analyst.key"},
        **{f"{s}-kit": {"ca.pem", "site.pem", "site.key", "revoked.toml"} for s in SITES},
        **{f"{s}-data": {"schema.toml", "site.csv"} for s in SITES}}


def load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mounts(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, container path, read-only) of a service's short-syntax volumes.

    A variable (``${DPFED_SITE_DIR:?}``) is left as ``$DPFED_SITE_DIR``.
    """
    out = []
    for vol in service.get("volumes", []):
        parts = re.sub(r"\$\{(\w+)[^}]*\}", r"$\1", vol).split(":")
        out.append((parts[0], parts[1], parts[2:] == ["ro"]))
    return out


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


# ---------------------------------------------------------------- the compose files


def init_commands() -> list[list[str]]:
    """The ``dpfed ...`` command lines of init.sh, its variables at their defaults."""
    text = (DEPLOY / "init.sh").read_text().replace("\\\n", " ")
    defaults = dict(re.findall(r'^(\w+)="\$\{\1:-([^}]*)\}"', text, flags=re.M))
    for var, default in defaults.items():
        text = text.replace(f'"${var}"', default).replace(f"${var}", default)
    return [shlex.split(line.strip()) for line in text.splitlines()
            if line.strip().startswith("dpfed ")]


def test_compose_files_follow_the_compose_specification() -> None:
    import jsonschema

    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema)
    for path in (COMPOSE, HOSPITAL_COMPOSE):
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator.iter_errors(load(path))]
        assert not errors, (path, errors)
    # ... and it catches mistakes: a misspelt key, a restart policy of the wrong type.
    broken = load(COMPOSE)
    broken["services"]["hospital-a"]["volume"] = broken["services"]["hospital-a"].pop("volumes")
    broken["services"]["coordinator"]["restart"] = ["on-failure"]
    assert len(list(validator.iter_errors(broken))) == 2


def test_each_service_holds_only_its_own_kit_data_and_credentials() -> None:
    services = load(COMPOSE)["services"]
    holders: dict[str, set[str]] = {}
    for name, svc in services.items():
        for src, _, _ in mounts(svc):
            holders.setdefault(src, set()).add(name)
            if src.startswith("."):
                assert (DEPLOY / src).is_file(), f"{name} bind-mounts {src}: only single files"
    assert holders["ca"] == holders["demo-data"] == {"init"}
    assert holders["coordinator-kit"] == {"init", "coordinator"}
    assert holders["analyst-kit"] == {"init", "analyst"} and holders["results"] == {"analyst"}
    assert holders["coordinator-store"] == {"coordinator"}
    for site in SITES:
        assert holders[f"{site}-kit"] == holders[f"{site}-data"] == {"init", site}
        assert holders[f"{site}-ledger"] == {site}
    assert {v for v in holders if not v.startswith(".")} == set(load(COMPOSE)["volumes"])
    for name in ("coordinator", "analyst", *SITES):
        kit = [ro for _, dst, ro in mounts(services[name]) if dst == "/kit"]
        assert kit == [True], f"{name} must mount exactly its own kit, read-only"
    # Analyst credentials: in the analyst service only.
    for name, svc in services.items():
        env = svc.get("environment", {})
        assert not [k for k in env if k.startswith("DPFED_")] or name == "analyst", name
    assert services["analyst"]["environment"]["DPFED_KEY"] == "/kit/analyst.key"
    hospital = load(HOSPITAL_COMPOSE)["services"]
    assert list(hospital) == ["site"] and not hospital["site"].get("environment")
    assert {dst for _, dst, _ in mounts(hospital["site"])} == {
        "/etc/dpfed/site.toml", "/kit", "/data", "/var/lib/dpfed"}


def test_ports_restart_policies_and_healthchecks() -> None:
    for path in (COMPOSE, HOSPITAL_COMPOSE):
        for name, svc in load(path)["services"].items():
            for port in svc.get("ports", []):
                assert port.startswith("${DPFED_BIND:-127.0.0.1}:"), (name, port)
            if name in ("init", "analyst"):  # one-shot
                assert "restart" not in svc and "healthcheck" not in svc, name
                continue
            # Docker's restart policies cannot tell exit codes apart: a bounded on-failure
            # keeps a permanent exit (7 revoked, 4 data) from restarting for ever.
            policy = svc["restart"]
            bounded = re.fullmatch(r"on-failure:(\d+)", policy)
            assert bounded and 1 <= int(bounded.group(1)) <= 5, f"{name}: restart {policy!r}"
            test = svc["healthcheck"]["test"]
            assert test[0] == "CMD" and test[1] in PARSERS, (name, test)
            PARSERS[test[1]]().parse_args(test[2:])
    assert load(COMPOSE)["services"]["hospital-a"]["healthcheck"]["test"][1:3] == [
        "dpfed-site", "health"]
    ops = (ROOT / "docs" / "operations.md").read_text()
    assert "on-failure:3" in ops and "DPFED_BIND" in ops and "deploy/hospital/" in ops


def test_console_scripts_match_pyproject() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == set(PARSERS) == set(MODULES)


def test_every_service_command_and_file_exists() -> None:
    services = load(COMPOSE)["services"]
    assert set(services) == {"init", "coordinator", *SITES, "analyst"}
    assert services["init"]["build"]["dockerfile"] == "deploy/Dockerfile"
    for path in (COMPOSE, HOSPITAL_COMPOSE):
        doc = load(path)
        for name, svc in doc["services"].items():
            targets = {dst for _, dst, _ in mounts(svc)}
            for src, _, _ in mounts(svc):
                if src.startswith("."):
                    assert (path.parent / src).exists(), f"{name}: missing {src}"
                elif not src.startswith("$"):
                    assert src in doc["volumes"], f"{name}: undeclared volume {src}"
            cmd = svc["command"]
            if cmd[0] == "sh":
                assert cmd[1] in targets, f"{name}: {cmd[1]} is not mounted"
                continue
            assert cmd[0] in PARSERS, f"{name}: {cmd[0]} is not a dpfed entry point"
            PARSERS[cmd[0]]().parse_args(cmd[1:])  # raises SystemExit on an unknown flag
            for arg in cmd:
                if arg.startswith("/etc/dpfed/"):
                    assert arg in targets, f"{name}: {arg} is not mounted"
    for argv in init_commands():
        dpfed_parser().parse_args(argv[1:])
    load_aggregator_config(DEPLOY / "aggregator.toml")
    site = load_site_config(DEPLOY / "site.toml")
    assert site.tls is not None and str(site.tls.key) == "/kit/site.key"
    assert site.connect_timeout_s >= 3600  # waits in-process, not by restarts


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


# ---------------------------------------------------------------- the topology, played


class Container:
    """One compose service played on this machine: its mounts are host paths.

    Named volumes become folders under ``volumes``; ``./file`` binds are the repository's
    files; ``$DPFED_SITE_DIR/x`` is ``site_dir/x``. Config files the command names are
    copied with their container paths rewritten to the host paths.
    """

    def __init__(self, compose_file: Path, name: str, volumes: Path, work: Path,
                 site_dir: Path | None = None) -> None:
        self.service = load(compose_file)["services"][name]
        self.name = name
        self.work = work
        self.paths: dict[str, Path] = {}
        for src, dst, _ in mounts(self.service):
            if src.startswith("."):
                host = compose_file.parent / src
            elif src.startswith("$DPFED_SITE_DIR/"):
                assert site_dir is not None
                host = site_dir / src.split("/", 1)[1]
            else:
                host = volumes / src
                host.mkdir(parents=True, exist_ok=True)
            self.paths[dst] = host

    def host(self, path: str) -> str:
        for dst in sorted(self.paths, key=len, reverse=True):
            if path == dst or path.startswith(dst + "/"):
                return str(self.paths[dst]) + path[len(dst):]
        return path

    def config(self, path: str, **replace: str) -> Path:
        text = re.sub(r'"(/[^"]*)"', lambda m: json.dumps(self.host(m.group(1))),
                      Path(self.host(path)).read_text())
        for old, new in replace.items():
            assert old in text, old
            text = text.replace(old, new)
        local = self.work / f"{self.name}-{Path(path).name}"
        local.write_text(text)
        return local

    def argv(self, argv: list[str], configs: dict[str, Path] | None = None) -> list[str]:
        configs = configs or {}
        return [sys.executable, "-m", MODULES[argv[0]],
                *(str(configs[a]) if a in configs else self.host(a) for a in argv[1:])]

    def env(self) -> dict[str, str]:
        return {**os.environ, **{k: self.host(str(v)) for k, v in
                                 self.service.get("environment", {}).items()}}


def _replace_atomically(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".new")
    shutil.copy(src, tmp)
    os.replace(tmp, dst)


@pytest.mark.e2e
@pytest.mark.timeout(480)
def test_compose_topology_runs_and_a_hospital_joins_with_its_own_compose_file(
        tmp_path: Path) -> None:
    volumes, logs = tmp_path / "volumes", tmp_path / "logs"
    logs.mkdir()

    def container(name: str, **kw: Any) -> Container:
        return Container(kw.pop("compose_file", COMPOSE), name, kw.pop("volumes", volumes),
                         tmp_path, **kw)

    # init: init.sh itself, run twice (a second `docker compose up` re-runs it).
    init = container("init")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "CA_DIR": init.host("/ca"), "DEMO_DIR": init.host("/demo-data"),
           "OUT_DIR": str(volumes), "DEMO_ROWS": "2000", "RUN_UID": str(os.getuid())}
    assert init.host("/out/hospital-a-kit") == str(volumes / "hospital-a-kit")
    for _ in range(2):
        subprocess.run(["sh", init.host(init.service["command"][1])], env=env, check=True,
                       capture_output=True, timeout=180)
    for volume, files in KITS.items():
        assert {p.name for p in (volumes / volume).iterdir()} == files, volume
    for key in volumes.rglob("*.key"):
        assert key.stat().st_mode & 0o077 == 0, key
    assert [k.relative_to(volumes).parts[0] for k in volumes.rglob("ca.key")] == ["ca"]

    address = f"127.0.0.1:{free_port()}"
    coordinator, analyst = container("coordinator"), container("analyst")
    agg_toml = coordinator.config("/etc/dpfed/aggregator.toml", **{
        '"127.0.0.1:50052"': f'"127.0.0.1:{free_port()}"'})  # the container's loopback port
    configs = {"/etc/dpfed/aggregator.toml": agg_toml}

    def healthcheck(c: Container, cfgs: dict[str, Path]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(c.argv(c.service["healthcheck"]["test"][1:], cfgs),
                              capture_output=True, text=True, timeout=60)

    def start(c: Container, cfgs: dict[str, Path], *extra: str) -> subprocess.Popen[bytes]:
        with open(logs / f"{c.name}.log", "ab") as fh:
            return subprocess.Popen([*c.argv(c.service["command"], cfgs), *extra], stdout=fh,
                                    stderr=subprocess.STDOUT)

    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start(coordinator, configs, "--listen", address))
        # The analyst starts as early as compose could start it: while the coordinator is
        # still coming up. --wait-sites must retry instead of exiting 6.
        env = {**analyst.env(), "DPFED_COORDINATOR": address}
        analyst_run = subprocess.Popen(analyst.argv(analyst.service["command"]), env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
        procs.append(analyst_run)  # type: ignore[arg-type]
        wait_until(lambda: healthcheck(coordinator, configs).returncode == 0
                   or procs[0].poll() is not None, 90, "the coordinator to become healthy")
        assert procs[0].poll() is None, (logs / "coordinator.log").read_text()
        sites = {site: container(site) for site in SITES}
        site_configs = {}
        for site, c in sites.items():
            # The compose network's name "coordinator" is reached here at 127.0.0.1, which
            # the coordinator certificate also names.
            site_configs[site] = {"/etc/dpfed/site.toml": c.config(
                "/etc/dpfed/site.toml", **{'"coordinator:50051"': json.dumps(address)})}
            procs.append(start(c, site_configs[site]))
        out, _ = analyst_run.communicate(timeout=180)
        assert analyst_run.returncode == 0, out
        assert "waiting for 3 site(s)" in out and (volumes / "results" / "pca.npz").exists()
        for site, c in sites.items():
            assert (volumes / f"{site}-ledger" / "ledger.sqlite").exists()
            healthy = healthcheck(c, site_configs[site])
            assert healthy.returncode == 0 and healthy.stdout.startswith("healthy: connected")

        # A fourth hospital on "another machine", as docs/operations.md tells it: the CA
        # issues its kit, the coordinator gets the new access list, the hospital lays out
        # its folder and runs deploy/hospital/docker-compose.yml.
        dpfed = [sys.executable, "-m", MODULES["dpfed"]]
        subprocess.run([*dpfed, "certs", "issue", "--ca-dir", init.host("/ca"), "--site",
                        "hospital-d"], check=True, capture_output=True, timeout=60)
        _replace_atomically(Path(init.host("/ca")) / "coordinator" / "access.toml",
                            volumes / "coordinator-kit" / "access.toml")
        site_dir = tmp_path / "srv-dpfed"
        shutil.copytree(Path(init.host("/ca")) / "sites" / "hospital-d", site_dir / "kit")
        (site_dir / "data").mkdir()
        shutil.copy(volumes / "demo-data" / "schema.toml", site_dir / "data")
        shutil.copy(volumes / "demo-data" / "site_01.csv", site_dir / "data" / "visits.csv")
        (site_dir / "site.toml").write_text((DEPLOY / "site.toml").read_text().replace(
            '"coordinator:50051"', json.dumps(address)).replace(
            '"/data/site.csv"', '"/data/visits.csv"'))
        hospital = container("site", compose_file=HOSPITAL_COMPOSE,
                             volumes=tmp_path / "hospital-volumes", site_dir=site_dir)
        hospital.name = "hospital-d"
        d_configs = {"/etc/dpfed/site.toml": hospital.config("/etc/dpfed/site.toml")}
        check = subprocess.run(hospital.argv(["dpfed-site", "check", "--config",
                                              "/etc/dpfed/site.toml"], d_configs),
                               capture_output=True, text=True, timeout=120)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "ok      admission:" in check.stdout and "site hospital-d" in check.stdout
        agent = start(hospital, d_configs)
        procs.append(agent)
        wait_until(lambda: healthcheck(hospital, d_configs).returncode == 0, 90,
                   "hospital-d to become healthy")
        listed = subprocess.run([*dpfed, "sites", "--json"], env=env, capture_output=True,
                                text=True, timeout=60)
        assert "hospital-d" in {s["site_id"] for s in json.loads(listed.stdout)}

        # Revoked: a permanent exit, with its code for the restart policy and the probe.
        subprocess.run([*dpfed, "certs", "revoke", "--ca-dir", init.host("/ca"),
                        "site/hospital-d"], check=True, capture_output=True, timeout=60)
        _replace_atomically(Path(init.host("/ca")) / "coordinator" / "access.toml",
                            volumes / "coordinator-kit" / "access.toml")
        assert agent.wait(60) == exit_codes.REJECTED_BY_COORDINATOR
        probe = healthcheck(hospital, d_configs)
        assert probe.returncode == exit_codes.REJECTED_BY_COORDINATOR, probe.stdout
        assert "stopped" in probe.stdout and "exit code 7" in probe.stdout

        procs[0].terminate()
        procs[0].wait(15)
        unhealthy = healthcheck(coordinator, configs)
        assert unhealthy.returncode == exit_codes.COORDINATOR_UNREACHABLE, unhealthy.stdout
    finally:
        stop_processes(procs)
