"""Names and files from elsewhere (issue 19, Robustness).

* A ``synth_eval`` task whose job id is ``..`` made a site write its report one directory
  above ``evaluations``; ids from the wire are now one safe path component. A real site
  process, sent the task by a hostile coordinator speaking the real protocol.
* A 2 MiB model file with a 2 GiB deflated member made ``dpfed synth-sample`` take 2.2 GB;
  the members' sizes are now checked from the zip directory and ``.npy`` headers before
  numpy loads anything. A real ``dpfed synth-sample`` process; its peak RSS is measured.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.aggregator.result_file import decode_result, encode_result
from dpfed.common.data.encoding import encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.common.validation import path_component
from tests.e2e.federations import roomy_settings
from tests.e2e.rogue_coordinator import RogueCoordinator

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

DPFED = [sys.executable, "-m", "dpfed.aggregator.cli"]


@pytest.fixture
async def site(tmp_path: Path) -> AsyncIterator[tuple[LocalFederation, RogueCoordinator]]:
    fed = LocalFederation.create(tmp_path / "fed", n_sites=1, rows=300, features=4, seed=9,
                                 settings=roomy_settings(allowed_jobs=("pca", "synth_eval")))
    coordinator = RogueCoordinator(fed.certs)
    fed.port = await coordinator.start()
    fed.start_site("hospital-1")
    try:
        await coordinator.wait_for("hospital-1")
        yield fed, coordinator
    finally:
        fed.stop("hospital-1")
        await coordinator.stop()


@pytest.mark.parametrize("job_id", ["..", ".", "../../x", "a/b"])
async def test_a_job_id_from_the_wire_never_leaves_the_evaluations_folder(
        site: tuple[LocalFederation, RogueCoordinator], job_id: str) -> None:
    fed, coordinator = site
    schema = Schema.load(fed.schema_path)
    table, _report = encode_table(schema, pd.read_csv(fed.data_paths["hospital-1"]).head(50))
    arrays = {f"col:{c}": np.ascontiguousarray(table.columns[c]) for c in schema.names}
    answer = await coordinator.ask("hospital-1", Task(
        f"{job_id}/evaluate", job_id, "synth_eval", 0.0, 0.0,
        {"schema_digest": schema.digest()}, arrays))
    assert isinstance(answer, TaskResult) and answer.metadata["evaluated"], answer
    site_dir = fed.site_dir("hospital-1")
    reports = sorted(p.relative_to(site_dir) for p in site_dir.rglob("synth_evaluation.html"))
    assert reports == [Path("evaluations") / path_component(job_id) / "synth_evaluation.html"]
    assert not list(fed.root.rglob("x/synth_evaluation.html"))


def deflated_bomb(path: Path, gib: int = 2) -> None:
    """A model-like .npz whose one deflated member expands to ``gib`` GiB of zeros."""
    good = np.load(io.BytesIO(encode_result({"x": np.arange(3.0)}, {"kind": "synth"})))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        zf.writestr("metadata.npy", _npy(good["metadata"]))
        with zf.open("components.npy", "w", force_zip64=True) as member:
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(header, {
                "descr": "<f8", "fortran_order": False, "shape": (gib << 27,)})
            member.write(header.getvalue())
            block = bytes(8 << 20)
            for _ in range((gib << 30) // len(block)):
                member.write(block)


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def test_synth_sample_refuses_a_model_with_a_two_gib_member(tmp_path: Path) -> None:
    bomb = tmp_path / "model.npz"
    deflated_bomb(bomb)
    proc = subprocess.Popen([*DPFED, "synth-sample", str(bomb), "--rows", "10", "--out",
                             str(tmp_path / "rows.csv")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _pid, status, usage = os.wait4(proc.pid, 0)
    assert proc.stderr is not None and proc.stdout is not None
    err = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    print(f"\n{bomb.stat().st_size / 2**20:.1f} MiB model file: exit {proc.returncode}, peak RSS "
          f"{usage.ru_maxrss / 1024:.0f} MiB: {err.strip()}")
    assert proc.returncode != 0 and "member 'components.npy' expands from" in err, err
    # the 2 GiB member inflated it to 2.2 GB; a refusal before inflating stays below the
    # member's own size (peaks of 0.3-1.5 GB were seen, varying with the machine's load)
    assert usage.ru_maxrss < 1900 * 1024


def test_a_header_that_claims_more_than_its_member_holds_is_refused() -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:  # stored: no expansion, only a lying header
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {
            "descr": "<f8", "fortran_order": False, "shape": (1 << 28,)})
        zf.writestr("x.npy", header.getvalue() + bytes(64))
    with pytest.raises(ValidationError, match="member 'x.npy' announces 2,147,483,648 bytes"):
        decode_result(buf.getvalue())
    with pytest.raises(ValidationError, match="expands to .* at most 1,000 are read"):
        decode_result(encode_result({"x": np.zeros(1000)}, {}), max_bytes=1000)
