"""The committed generated protobuf code must match what proto/generate.py produces."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["proto_generate"] = module
    spec.loader.exec_module(module)
    written = module.generate(tmp_path)
    assert written, "protoc produced no files"
    stale = []
    for path in written:
        rel = path.relative_to(tmp_path)
        committed = ROOT / rel
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(str(rel))
    assert not stale, (f"generated code is stale: {stale}; run `python proto/generate.py` "
                       "and commit the result")
