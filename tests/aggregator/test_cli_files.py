"""Files the dpfed commands read and write: one exit code per kind, checked before anything."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

from dpfed.aggregator.cli import main
from dpfed.aggregator.cli_files import (
    check_input_file,
    check_output_dir,
    check_output_file,
    write_result,
)
from dpfed.common import exit_codes
from dpfed.common.errors import ConfigError, DataError
from tests.aggregator.test_synth_model import build

#: Connection flags pointing nowhere: a command that connected would fail with 5 or 6.
NOWHERE = ["--coordinator", "127.0.0.1:1", "--ca", "missing-ca.pem", "--cert", "missing.pem",
           "--key", "missing.key"]


def test_output_checks(tmp_path: Path) -> None:
    (tmp_path / "file.txt").write_text("x")
    assert check_output_file(tmp_path / "new" / "deeper" / "a.npz", "--out") == \
        tmp_path / "new" / "deeper" / "a.npz"
    assert check_output_file(tmp_path / "file.txt", "--out") == tmp_path / "file.txt"
    with pytest.raises(ConfigError, match="--out .* is a folder"):
        check_output_file(tmp_path, "--out")
    with pytest.raises(ConfigError, match=r"--report .*file.txt is a file, not a folder"):
        check_output_file(tmp_path / "file.txt" / "r.html", "--report")
    with pytest.raises(ConfigError, match="--out is empty"):
        check_output_file("", "--out")
    assert check_output_dir(tmp_path / "run", "--out") == tmp_path / "run"
    with pytest.raises(ConfigError, match="is a file: give a folder"):
        check_output_dir(tmp_path / "file.txt", "--out")
    assert not (tmp_path / "new").exists() and not (tmp_path / "run").exists()  # made nothing


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_folder_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="this user cannot write in"):
        check_output_file(locked / "a.npz", "--out")


def test_input_checks_and_the_recovery_message(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="MODEL nope.npz: no such model file"):
        check_input_file("nope.npz", "MODEL", "model")
    with pytest.raises(DataError, match="is not a file"):
        check_input_file(tmp_path, "RESULT", "result")

    def full_disk() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(ConfigError) as info:
        write_result(full_disk, "out.npz", {"job_id": "j-1"})
    assert str(info.value) == (
        "job j-1 finished, but out.npz could not be written (No space left on device); its "
        "result is kept at the coordinator and costs no budget to get again: "
        "dpfed fetch j-1 --out FILE.npz")


@pytest.mark.parametrize(("argv", "needle"), [
    (["report", "nope.npz"], "RESULT nope.npz: no such result file"),
    (["synth-sample", "nope.npz", "--rows", "5"], "MODEL nope.npz: no such model file"),
    (["svt", "--queries", "nope.toml", "--epsilon", "1", "--threshold", "5", *NOWHERE],
     "--queries nope.toml: no such query set file"),
    (["query", "--columns", "age", "--workload", "custom", "--workload-file", "nope.npy",
      "--epsilon", "1", *NOWHERE], "--workload-file nope.npy: no such workload matrix file"),
])
def test_a_missing_input_file_is_a_data_error_before_connecting(
        argv: list[str], needle: str, capsys: pytest.CaptureFixture[str],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == exit_codes.DATA_ERROR
    assert needle in capsys.readouterr().err


def test_synth_sample_writes_a_default_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    model = build().save(tmp_path / "synth_model.npz")
    monkeypatch.chdir(tmp_path)
    assert main(["synth-sample", str(model), "--rows", "25"]) == exit_codes.OK
    assert "wrote synth_sample.parquet (25 rows)" in capsys.readouterr().out
    assert len(pd.read_parquet(tmp_path / "synth_sample.parquet")) == 25
    assert main(["synth-sample", str(model), "--rows", "5", "--out", str(tmp_path)]) == \
        exit_codes.CONFIG_ERROR
    assert "--out" in capsys.readouterr().err


def test_fetch_refuses_an_out_name_that_is_not_npz_before_connecting(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The result is written as received: a ``.csv`` name would hold npz bytes."""
    out = tmp_path / "result.csv"
    assert main(["fetch", "some-job", "--out", str(out), *NOWHERE]) == exit_codes.USAGE
    err = capsys.readouterr().err
    assert "--out" in err and ".npz" in err and "synth-sample" in err
    assert not out.exists()
