"""A minimal site for ``dpfed-site check`` tests: an age/ward schema and an insecure site.toml."""

from __future__ import annotations

import json
from pathlib import Path

#: Two columns: ``age`` continuous in [0, 110], ``ward`` nominal with categories a and b.
AGE_WARD_SCHEMA = """
[[columns]]
name = "age"
type = "continuous"
min = 0
max = 110

[[columns]]
name = "ward"
type = "nominal"
categories = ["a", "b"]
"""


def check_site(tmp_path: Path, data: Path, data_options: str = "") -> Path:
    """Write ``schema.toml`` and a ``site.toml`` reading ``data``; return the config's path.

    ``data_options``: extra ``[data]`` lines (e.g. ``on_missing = "drop"``). The coordinator
    address is unreachable and TLS is off: only the local checks can pass.
    """
    (tmp_path / "schema.toml").write_text(AGE_WARD_SCHEMA)
    config = tmp_path / "site.toml"
    config.write_text(
        "[coordinator]\naddress = \"127.0.0.1:1\"\n\n[tls]\ninsecure = true\n\n"
        f"[data]\npath = {json.dumps(str(data))}\n"
        f"schema = {json.dumps(str(tmp_path / 'schema.toml'))}\n{data_options}\n"
        f"[ledger]\npath = {json.dumps(str(tmp_path / 'ledger.sqlite'))}\n\n"
        "[budget]\nepsilon = 1.0\ndelta = 1e-5\n")
    return config
