"""No production code draws from global random state (docs/privacy.md, invariant 5).

Production noise comes from ``dpfed.common.privacy.rng.production_rng()`` (a Generator seeded from
os.urandom per release) or ``secrets``; the global ``np.random.*`` functions and the
module-level ``random.*`` functions are never used, and nothing seeds from the clock.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "site_agent", "aggregator")
#: Constructors of explicit generators (the only np.random names production code may call).
ALLOWED_NP = {"Generator", "default_rng", "SeedSequence", "PCG64", "PCG64DXSM", "Philox",
              "SFC64", "BitGenerator"}
#: Instances of private streams (jitter, tests' injectable sources); never module functions.
ALLOWED_RANDOM = {"Random", "SystemRandom"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def production_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if "pb" not in p.relative_to(ROOT).parts]


def violations(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        dotted = _dotted(node.func)
        head, _, last = dotted.rpartition(".")
        if head in ("np.random", "numpy.random") and last not in ALLOWED_NP:
            found.append(f"{name}:{node.lineno}: global {dotted}()")
        if head == "random" and last not in ALLOWED_RANDOM:
            found.append(f"{name}:{node.lineno}: module-level {dotted}()")
        if last in ("seed", "default_rng", "SeedSequence", "Random") and any(
                "time" in _dotted(a) for a in ast.walk(node) if isinstance(a, ast.Attribute)):
            found.append(f"{name}:{node.lineno}: seeded from the clock")
    return found


def test_no_global_random_state_in_production_code() -> None:
    files = production_files()
    assert len(files) > 30
    problems = [v for f in files for v in violations(f.read_text(), str(f.relative_to(ROOT)))]
    assert not problems, "\n".join(problems)


def test_the_scanner_catches_planted_violations() -> None:
    planted = ("import numpy as np\nimport random\nimport time\n"
               "x = np.random.laplace(0, 1)\nnp.random.seed(3)\ny = random.random()\n"
               "g = np.random.default_rng(int(time.time()))\n")
    found = violations(planted, "planted.py")
    assert len(found) == 4, found
    clean = "import numpy as np\ng = np.random.default_rng(np.random.SeedSequence(5))\n"
    assert violations(clean, "clean.py") == []
