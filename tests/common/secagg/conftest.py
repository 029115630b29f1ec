"""Shared fixtures of the secure-sum tests: a federation's CA and site certificates."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpfed.common.transport.certs import init_federation

#: The sites of the in-process secure sums.
SITES = ("hospital-a", "hospital-b", "hospital-c", "hospital-d")


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A federation directory made by the project's own CA tool (module-scoped: ~1 s)."""
    root = tmp_path_factory.mktemp("fed") / "f"
    init_federation(root, coordinator_hosts=["localhost"], sites=list(SITES), analysts=[])
    return root
