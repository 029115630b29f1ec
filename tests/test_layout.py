"""The tree's shape is part of the design: layering rules, no import cycles, one install name,
and no reference to a document that is not in the repository."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "site_agent", "aggregator")


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if "pb" in parts:
                continue
            mods["dpfed." + ".".join(parts)] = path
    return mods


def _imports(path: Path, module: str, known: set[str], *, top_level_only: bool) -> set[str]:
    """dpfed modules imported by ``path`` (top-level statements only if asked)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
                   for n in ast.walk(block)}
    nodes = [n for n in (tree.body if top_level_only else list(ast.walk(tree)))
             if id(n) not in typing_only]  # imports for type checking only never run
    out: set[str] = set()
    for node in nodes:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != module and n.startswith("dpfed."):
                out.add(n)
    return out


def _graph(*, top_level_only: bool) -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(p, m, known, top_level_only=top_level_only) for m, p in mods.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            # a package's __init__ importing its own submodules is not a cycle of concern
            if d.startswith(m + "."):
                continue
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycles() -> None:
    cycle = _find_cycle(_graph(top_level_only=False))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cycle_finder_catches_a_planted_cycle() -> None:
    graph = _graph(top_level_only=False)
    graph["dpfed.common.errors"] = graph["dpfed.common.errors"] | {"dpfed.common.validation"}
    graph["dpfed.common.validation"] = graph["dpfed.common.validation"] | {"dpfed.common.errors"}
    assert _find_cycle(graph) is not None


def test_layering() -> None:
    graph = _graph(top_level_only=False)
    for mod, deps in graph.items():
        if mod.startswith("dpfed.common"):
            bad = sorted(d for d in deps if not d.startswith("dpfed.common"))
            assert not bad, f"{mod} (network-free core) imports {bad}"
        if mod.startswith("dpfed.common.privacy"):
            algorithms = ("pca", "synth", "queries", "evaluation")
            bad = sorted(d for d in deps
                         if any(d.startswith(f"dpfed.common.{a}") for a in algorithms))
            assert not bad, f"{mod} (privacy core) imports algorithms {bad}"
        if mod.startswith("dpfed.site_agent"):
            assert not [d for d in deps if d.startswith("dpfed.aggregator")], mod
        if mod.startswith("dpfed.aggregator"):
            assert not [d for d in deps if d.startswith("dpfed.site_agent")
                        and mod not in ("dpfed.aggregator.local_federation",
                                        "dpfed.aggregator.simulate")], mod


def test_version_is_one_name() -> None:
    import dpfed

    assert re.fullmatch(r"\d+\.\d+\.\d+.*", dpfed.__version__)


def test_wheel_installs_only_dpfed(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True,
                       timeout=240)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build a wheel here: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("dpfed-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"dpfed"}, top
    for required in ("dpfed/__init__.py", "dpfed/common/pca/dppca.py",
                     "dpfed/site_agent/ledger.py", "dpfed/aggregator/cli.py",
                     "dpfed/common/pb/v1/site_link_pb2.py", "dpfed/common/py.typed"):
        assert required in names, required


_DOC_REF = re.compile(
    r"(?<![\w/.-])((?:docs|deploy|bench|proto|tests)/[\w./-]+\.(?:md|py|toml|yml|sh))")


def test_no_reference_to_a_document_outside_the_repository() -> None:
    texts = [p for p in ROOT.rglob("*") if p.suffix in {".py", ".md", ".toml", ".sh", ".yml"}
             and not any(part in {".venv", ".git", "build", "dist", "pb", "runs"}
                         or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)
             and p.is_file() and p.relative_to(ROOT).parts[0] != "dpfed"]
    missing = []
    for path in texts:
        text = path.read_text(encoding="utf-8", errors="replace")
        for word in ("DESIGN.md", "STYLE.md", "shared/research", "shared/seeds"):
            if word in text and path.name != "test_layout.py":
                missing.append(f"{path.relative_to(ROOT)} mentions {word}")
        for ref in _DOC_REF.findall(text):
            ref = ref.rstrip(".")
            if not (ROOT / ref).exists():
                missing.append(f"{path.relative_to(ROOT)} refers to {ref}")
        if path.parent == ROOT / "docs" or path.name == "README.md":
            for link in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", text):
                if not (path.parent / link).exists():
                    missing.append(f"{path.relative_to(ROOT)} links to {link}")
    assert not missing, "\n".join(missing)


def test_every_legend_has_a_fixed_place() -> None:
    # matplotlib's loc="best" (a legend's default) searches for a free spot and warns when the
    # search takes over a second -- which happens on a busy machine, and the warning is an
    # error in this suite: a report's figure must not depend on the machine's load.
    bare = [f"{p.relative_to(ROOT)}:{i}" for pkg in (*PACKAGES, "bench")
            for p in (ROOT / pkg).rglob("*.py")
            if ".venv" not in p.relative_to(ROOT).parts  # a bench environment's own packages
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if re.search(r"\.legend\((?![^)]*\bloc=)", line)]
    assert not bare, bare
