"""deploy/k8s/ validates against the Kubernetes schemas and does what docs/operations.md says.

Every object is checked with ``kubernetes-validate`` (its schemas ship in the package: no
network) in strict mode -- an unknown or misspelt field fails -- at the oldest Kubernetes the
manifests support (1.27: gRPC probes) and the newest the package knows. The JSON patches of
the overlays are applied to their base objects (RFC 6902, as kustomize applies them) and the
results validated too; where ``kubectl`` is installed, ``kubectl kustomize`` renders every
kustomization and the rendered objects are validated as well. The configs in deploy/k8s load
with dpfed's own strict config readers, and every path they name lies on a mounted volume.
The site's exec probes are run, as written, against status files in each state the agent can
be in, and give the verdicts a kubelet needs (restart only a stuck agent).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dpfed.aggregator.config import load_aggregator_config
from dpfed.common import exit_codes
from dpfed.site_agent import agent_status
from dpfed.site_agent.cli import build_parser
from dpfed.site_agent.cli import main as site_main
from dpfed.site_agent.config import load_site_config

ROOT = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
KUSTOMIZATIONS = sorted(p.parent for p in ROOT.rglob("kustomization.yaml"))
SITE_DIRECTORIES = (ROOT / "site", ROOT / "overlays" / "site-postgres")
SITE_PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def _kustomization(directory: Path) -> dict[str, Any]:
    doc: dict[str, Any] = _documents(directory / "kustomization.yaml")[0]
    return doc


def _objects(directory: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The objects a kustomization lists as resources (recursively), with their file."""
    for entry in _kustomization(directory).get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            yield from _objects(target)
        else:
            for doc in _documents(target):
                yield target, doc


def _validate(doc: dict[str, Any], where: str) -> None:
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            raise AssertionError(f"{where}: {doc['kind']} {doc['metadata']['name']} is not "
                                 f"valid for Kubernetes {version} at {path}: {exc.message}"
                                 ) from None


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def _apply_json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply RFC 6902 add/replace/remove/test operations (what the overlays use)."""
    out = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "test":
            current = node[int(last)] if isinstance(node, list) else node[last]
            assert current == op["value"], f"test failed at {op['path']}: {current!r}"
        elif op["op"] in ("add", "replace"):
            if isinstance(node, list):
                if last == "-":
                    node.append(op["value"])
                elif op["op"] == "add":
                    node.insert(int(last), op["value"])
                else:
                    node[int(last)] = op["value"]
            else:
                assert op["op"] == "add" or last in node, f"nothing to replace at {op['path']}"
                node[last] = op["value"]
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise AssertionError(f"unsupported patch operation {op['op']!r}")
    return out


def _generated_names(directory: Path) -> set[str]:
    """Names of the ConfigMaps a kustomization (or a base it uses) generates."""
    k = _kustomization(directory)
    names = {g["name"] for g in k.get("configMapGenerator", [])}
    for entry in k.get("resources", []):
        if (directory / entry).is_dir():
            names |= _generated_names((directory / entry).resolve())
    return names


def _patched(directory: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every object of a kustomization, with its JSON patches applied."""
    objects = [(str(f.relative_to(ROOT)), d) for f, d in _objects(directory)]
    for patch in _kustomization(directory).get("patches", []):
        ops = _documents(directory / patch["path"])[0]
        target = patch["target"]
        hits = [i for i, (_, d) in enumerate(objects)
                if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"{patch['path']}: no single {target} in the base"
        where, doc = objects[hits[0]]
        objects[hits[0]] = (f"{where} + {patch['path']}", _apply_json_patch(doc, ops))
    return objects


def test_there_are_manifests_for_the_coordinator_a_site_and_an_overlay() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in KUSTOMIZATIONS}
    assert names == {"coordinator", "site", "overlays/site-postgres"}


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_object_validates(directory: Path) -> None:
    objects = _patched(directory)
    assert objects
    for where, doc in objects:
        _validate(doc, where)
    for generator in _kustomization(directory).get("configMapGenerator", []):
        data = {f: (directory / f).read_text(encoding="utf-8") for f in generator["files"]}
        _validate({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": generator["name"]}, "data": data}, str(directory))


def test_the_validation_catches_a_misspelt_field() -> None:
    """The check is strict: a typo in a field name fails it (so it cannot pass vacuously)."""
    (_, statefulset), = [(f, d) for f, d in _objects(ROOT / "site") if d["kind"] == "StatefulSet"]
    broken = copy.deepcopy(statefulset)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(AssertionError, match="not valid"):
        _validate(broken, "planted typo")


def _by_kind(directory: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for _, doc in _patched(directory):
        out.setdefault(doc["kind"], []).append(doc)
    return out


def test_the_coordinator_passes_tls_through_and_probes_its_health_port() -> None:
    objects = _by_kind(ROOT / "coordinator")
    assert "Ingress" not in objects and "Secret" not in objects  # no TLS termination, no keys
    (sts,) = objects["StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    config = load_aggregator_config(ROOT / "coordinator" / "aggregator.toml")
    assert config.listen.endswith(f":{ports['tls']}")
    assert config.health_listen is not None and config.health_listen.endswith(
        f":{ports['health']}")
    assert config.metrics.enabled and config.metrics.listen.endswith(f":{ports['metrics']}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["health"]
    public = [s for s in objects["Service"] if s["spec"].get("type") == "LoadBalancer"]
    assert [(p["port"], p["protocol"]) for s in public for p in s["spec"]["ports"]] == [
        (50051, "TCP")]  # only the mTLS port leaves the cluster; not health, not metrics
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "store"
    _paths_are_mounted(sts, [config.store_path, config.schema_path, config.access_list,
                             *_tls_paths(config.tls)])


def test_the_site_dials_out_keeps_its_ledger_and_reads_its_kit_from_a_secret() -> None:
    for directory in SITE_DIRECTORIES:
        objects = _by_kind(directory)
        assert "Ingress" not in objects and "Secret" not in objects
        (sts,) = objects["StatefulSet"]
        pod = sts["spec"]["template"]["spec"]
        config = load_site_config(directory / "site.toml")
        kit = next(v for v in pod["volumes"] if v["name"] == "kit")
        assert kit["secret"]["secretName"] == "dpfed-site-kit"
        assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "ledger"
        paths = [config.ledger_path, config.data.schema, *_tls_paths(config.tls)]
        if config.revocation_list is not None:
            paths.append(config.revocation_list)
        if config.data.path is not None:
            paths.append(config.data.path)
        _paths_are_mounted(sts, paths)
        for service in objects.get("Service", []):
            assert service["spec"].get("clusterIP") == "None"  # nothing reaches in
        (policy,) = objects["NetworkPolicy"]
        ingress_ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        assert ingress_ports <= {int(config.metrics.listen.rpartition(":")[2])}
    assert not load_site_config(ROOT / "site" / "site.toml").metrics.enabled
    pg = _by_kind(ROOT / "overlays" / "site-postgres")["StatefulSet"][0]
    env = pg["spec"]["template"]["spec"]["containers"][0]["env"]
    config = load_site_config(ROOT / "overlays" / "site-postgres" / "site.toml")
    assert config.data.format == "postgres" and config.metrics.enabled
    assert [e["name"] for e in env] == [config.data.password_env]


def _site_container(directory: Path) -> dict[str, Any]:
    (sts,) = _by_kind(directory)["StatefulSet"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _probe(container: dict[str, Any], tmp_path: Path, config_text: str, probe: str) -> int:
    """Run ``probe``'s command as written, its ``--config`` swapped for a copy in tmp_path."""
    command = list(container[probe]["exec"]["command"])
    assert command[:2] == ["dpfed-site", "health"], command
    at = command.index("--config") + 1
    config = tmp_path / "site.toml"
    config.write_text(config_text)
    command[at] = str(config)
    return site_main(command[1:])


def _max_age(container: dict[str, Any], probe: str) -> float:
    args = build_parser().parse_args(container[probe]["exec"]["command"][1:])
    return float(args.max_age)


@pytest.mark.parametrize("directory", SITE_DIRECTORIES,
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_site_probes_restart_a_stuck_agent_only(directory: Path, tmp_path: Path) -> None:
    """What the kubelet concludes from the site's probes, run against every agent state.

    Ready only while connected; alive while the agent runs, connected or waiting for its
    coordinator (no restart loop while the coordinator is down); a stale status (agent gone
    or stuck) fails both. A permanent stop (7, 4) fails both with its own code; the agent has
    exited by then, so Kubernetes shows that exit code, and its log as termination message.
    """
    container = _site_container(directory)
    (config_volume,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    for probe in SITE_PROBES:
        command = container[probe]["exec"]["command"]
        assert command[command.index("--config") + 1] == f"{config_volume['mountPath']}/site.toml"
        assert container[probe]["timeoutSeconds"] >= 5  # a Python start on a busy node
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    liveness_age = _max_age(container, "livenessProbe")
    for probe in SITE_PROBES:  # a heartbeat or two may be late without failing a probe
        assert _max_age(container, probe) >= 3 * agent_status.HEARTBEAT_S, probe
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= liveness_age

    ledger = tmp_path / "ledger" / "ledger.sqlite"
    ledger.parent.mkdir()
    text = (directory / "site.toml").read_text(encoding="utf-8")
    configured = str(load_site_config(directory / "site.toml").ledger_path)
    assert f'"{configured}"' in text
    text = text.replace(f'"{configured}"', f'"{ledger}"')
    stale = liveness_age + 5
    states = {  # name: (state, seconds since written, exit code) -> (ready, alive)
        "connected": ((agent_status.CONNECTED, 2, None), (True, True)),
        "waiting for the coordinator": ((agent_status.CONNECTING, 2, None), (False, True)),
        "stuck while connected": ((agent_status.CONNECTED, stale, None), (False, False)),
        "stuck while waiting": ((agent_status.CONNECTING, stale, None), (False, False)),
        "refused or revoked": ((agent_status.STOPPED, 2, 7), (False, False)),
        "data error": ((agent_status.STOPPED, 2, 4), (False, False)),
    }
    for name, ((state, age, code), (ready, alive)) in states.items():
        now = time.time()
        agent_status.write_status(agent_status.status_path(ledger), agent_status.AgentStatus(
            state, now - 600, now - age, 1, "coordinator.example.org:50051", "hospital-a",
            code))
        verdicts = {probe: _probe(container, tmp_path, text, probe) for probe in SITE_PROBES}
        assert (verdicts["readinessProbe"] == 0) is ready, (name, verdicts)
        assert (verdicts["livenessProbe"] == 0) is alive, (name, verdicts)
        assert (verdicts["startupProbe"] == 0) is alive, (name, verdicts)
        if code is not None:
            assert set(verdicts.values()) == {code}, (name, verdicts)
    agent_status.status_path(ledger).unlink()
    assert _probe(container, tmp_path, text, "livenessProbe") == (
        exit_codes.COORDINATOR_UNREACHABLE)  # no status: the agent never started
    # Waiting for the coordinator is done in-process, not by exiting 6 into a crash loop.
    assert load_site_config(directory / "site.toml").connect_timeout_s >= 24 * 3600


def _tls_paths(tls: Any) -> list[Path]:
    assert tls is not None, "the Kubernetes configs use mutual TLS"
    return [tls.ca, tls.cert, tls.key]


def _paths_are_mounted(sts: dict[str, Any], paths: list[Path | None]) -> None:
    """Every path a config names lies under a mount of a volume the StatefulSet defines."""
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"] for v in pod["volumes"]} | {
        t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
    mounts = [(Path(m["mountPath"]), m["name"]) for m in container["volumeMounts"]]
    assert {name for _, name in mounts} <= volumes
    for path in paths:
        assert path is not None
        assert any(path.is_relative_to(mount) for mount, _ in mounts), (
            f"{path} is on no volume mount of {container['name']}")


@pytest.mark.skipif(shutil.which("kubectl") is None,
                    reason="kubectl (with its built-in kustomize) is not installed")
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_kustomize_renders_valid_objects(directory: Path) -> None:
    kubectl = shutil.which("kubectl")
    assert kubectl is not None
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d is not None]
    assert {d["kind"] for d in rendered} >= {"Namespace", "StatefulSet", "ConfigMap",
                                            "NetworkPolicy", "ServiceAccount"}
    for doc in rendered:
        _validate(doc, f"kubectl kustomize {directory.relative_to(ROOT)}")
    expected = {(d["kind"], d["metadata"]["name"]) for _, d in _patched(directory)}
    got = {(d["kind"], d["metadata"]["name"]) for d in rendered if d["kind"] != "ConfigMap"}
    assert got == expected
    # kustomize's own patching and ours agree: the same StatefulSet, up to the image it
    # rewrote and the hash suffix of generated ConfigMap names.
    (sts,) = [d for d in rendered if d["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"].startswith("registry.example.org/dpfed:")
    pod["containers"][0]["image"] = "dpfed"
    generated = _generated_names(directory)
    for volume in pod["volumes"]:
        name = volume.get("configMap", {}).get("name", "")
        if name.rpartition("-")[0] in generated:
            volume["configMap"]["name"] = name.rpartition("-")[0]
    (ours,) = [d for _, d in _patched(directory) if d["kind"] == "StatefulSet"]
    assert sts["spec"] == ours["spec"]
