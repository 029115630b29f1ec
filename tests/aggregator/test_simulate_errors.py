"""`dpfed simulate` validates everything before it makes anything, through the shared codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dpfed.aggregator.cli import main
from dpfed.aggregator.local_federation import LocalFederation
from dpfed.common import exit_codes
from dpfed.common.errors import ProcessExitedError

CASES = [
    (["--k", "50"], exit_codes.USAGE, "--k must be <= 20, got 50"),
    (["--features", "4", "--k", "3", "--rank", "2"], exit_codes.USAGE, "--rank must be >= 3"),
    (["--epsilon", "-1"], exit_codes.USAGE, "--epsilon must be finite and > 0"),
    (["--delta", "2"], exit_codes.USAGE, "--delta must be in the open interval (0, 1)"),
    (["--calibration", "classic", "--epsilon", "10", "--delta", "0.01"], exit_codes.USAGE,
     "--calibration classic is not differentially private"),
    (["--budget-epsilon", "0.5", "--epsilon", "1"], exit_codes.CONFIG_ERROR,
     "--budget-epsilon 0.5 is smaller than --epsilon 1"),
    (["--sites", "2", "--min-sites", "3"], exit_codes.CONFIG_ERROR, "--min-sites 3 is more than"),
    (["--sites", "0"], exit_codes.CONFIG_ERROR, "--sites must be >= 1"),
    (["--job", "synth", "--composition", "zcdp", "--synth-mode", "row-aligned"], exit_codes.USAGE,
     "--composition zcdp needs --synth-mode generative"),
    # Flags the chosen job would ignore are refused, named.
    (["--job", "svt", "--aggregation", "secure"], exit_codes.CONFIG_ERROR,
     "--aggregation does not apply to --job svt (it is for --job pca or synth or query)"),
    (["--composition", "zcdp"], exit_codes.CONFIG_ERROR,
     "--composition does not apply to --job pca (it is for --job synth)"),
    (["--job", "query", "--k", "2"], exit_codes.CONFIG_ERROR, "--k does not apply to --job query"),
    (["--job", "synth", "--clip-norm", "schema"], exit_codes.CONFIG_ERROR,
     "--clip-norm does not apply to --job synth"),
    (["--job", "svt", "--delta", "1e-6"], exit_codes.CONFIG_ERROR,
     "--delta does not apply to --job svt"),
    (["--job", "query", "--delta", "1e-6"], exit_codes.CONFIG_ERROR,
     "--delta applies to --job query only with --aggregation secure"),
    (["--job", "query", "--data", "a.csv", "--schema", "s.toml"], exit_codes.CONFIG_ERROR,
     "--data does not apply to --job query"),
    (["--data", "a.csv", "--schema", "s.toml", "--rows", "500"], exit_codes.CONFIG_ERROR,
     "--rows shapes the generated demo data; with --data the files decide"),
    (["--job", "pca", "--synth-rows", "10"], exit_codes.CONFIG_ERROR,
     "--synth-rows does not apply to --job pca"),
]


def test_a_bad_clip_norm_is_a_usage_error_naming_the_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--out", str(tmp_path / "run"), "--clip-norm", "-2"])
    assert exc.value.code == exit_codes.USAGE
    assert "argument --clip-norm: expected 'auto'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("args", "code", "message"), CASES)
def test_bad_values_fail_before_anything_is_made(tmp_path: Path, args: list[str], code: int,
                                                 message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["simulate", "--out", str(out), *args]) == code
    captured = capsys.readouterr()
    assert message in captured.err and "n_components" not in captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""
    assert not out.exists()


def test_as_a_process_too(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "dpfed.aggregator.cli", "simulate", "--out",
                          str(out), "--k", "50"], capture_output=True, text=True, timeout=120)
    assert run.returncode == exit_codes.USAGE and "Traceback" not in run.stderr
    assert run.stderr == "dpfed simulate: --k must be <= 20, got 50\n" and not out.exists()


def test_bad_files_are_data_errors_before_anything_is_made(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    schema = tmp_path / "schema.toml"
    schema.write_text('[[columns]]\nname = "age"\ntype = "continuous"\nmin = 0\nmax = 110\n\n'
                      '[[columns]]\nname = "sbp"\ntype = "continuous"\nmin = 60\nmax = 250\n')
    good = tmp_path / "a.csv"
    good.write_text("age,sbp\n40,120\n50,130\n")
    wrong = tmp_path / "b.csv"
    wrong.write_text("age,weight\n40,70\n")
    out = tmp_path / "run"
    base = ["simulate", "--out", str(out), "--schema", str(schema), "--k", "1"]
    for data, needle in (([good, tmp_path / "missing.csv"], "missing.csv"),
                         ([good, wrong], "sbp")):
        assert main([*base, *[a for d in data for a in ("--data", str(d))]]) == \
            exit_codes.DATA_ERROR
        assert needle in capsys.readouterr().err and not out.exists()
    assert main([*base, "--data", str(good), "--k", "3"]) == exit_codes.USAGE
    assert "--k must be <= 2, got 3" in capsys.readouterr().err


def test_a_data_file_with_no_usable_row_is_a_data_error_naming_its_site(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    schema = tmp_path / "schema.toml"
    schema.write_text('[[columns]]\nname = "age"\ntype = "continuous"\nmin = 0\nmax = 110\n\n'
                      '[[columns]]\nname = "sbp"\ntype = "continuous"\nmin = 60\nmax = 250\n')
    good = tmp_path / "a.csv"
    good.write_text("age,sbp\n" + "".join(f"{40 + i % 30},{120 + i % 40}\n" for i in range(300)))
    dropped = tmp_path / "b.csv"  # every row has an unparsable value: the sites drop it
    dropped.write_text("age,sbp\n" + "unknown,120\n" * 300)
    for job in ("pca", "synth"):
        out = tmp_path / f"run-{job}"
        code = main(["simulate", "--job", job, "--out", str(out), "--schema", str(schema),
                     "--data", str(good), "--data", str(dropped),
                     *(["--k", "1"] if job == "pca" else [])])
        err = capsys.readouterr().err
        assert code == exit_codes.DATA_ERROR, err
        assert f"--data {dropped} (site hospital-2): no row survives the sites' row policy" in err
        assert "read 300 rows" in err and not out.exists()


def test_an_out_that_is_a_file_is_refused_before_anything_is_made(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    assert main(["simulate", "--out", str(taken)]) == exit_codes.CONFIG_ERROR
    assert f"--out {taken} is a file: give a folder" in capsys.readouterr().err
    assert taken.read_text() == "mine"
    assert main(["simulate", "--out", str(taken / "run")]) == exit_codes.CONFIG_ERROR
    assert "is a file, not a folder" in capsys.readouterr().err


def test_a_child_process_exit_code_is_passed_on() -> None:
    assert exit_codes.for_error(ProcessExitedError("site exited", 4)) == exit_codes.DATA_ERROR
    assert exit_codes.for_error(ProcessExitedError("killed", -9)) == exit_codes.INTERNAL_ERROR
    assert exit_codes.for_error(ProcessExitedError("odd", 0)) == exit_codes.INTERNAL_ERROR


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_site_that_stops_on_bad_data_gives_the_data_error_code(tmp_path: Path) -> None:
    fed = LocalFederation.create(tmp_path / "fed", n_sites=1, rows=200, features=3, seed=1)
    fed.data_paths["hospital-1"].write_text("not,the,schema\n1,2,3\n")  # columns missing
    try:
        fed.start_coordinator()
        fed.start_sites()
        with pytest.raises(ProcessExitedError) as info:
            fed.wait_for_sites(timeout=60)
    finally:
        fed.stop_all()
    assert info.value.exit_code == exit_codes.DATA_ERROR
    assert exit_codes.for_error(info.value) == exit_codes.DATA_ERROR
    assert "hospital-1 exited with code 4" in str(info.value)
