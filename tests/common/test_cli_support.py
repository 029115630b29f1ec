"""The CLI plumbing every binary shares: messages, addresses, tables, exit codes, JSON logs."""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path

import pytest

from dpfed.common import exit_codes
from dpfed.common.cli_support import (
    LazyArgumentParser,
    check_address,
    format_table,
    print_json,
    run_command,
    user_message,
)
from dpfed.common.errors import (
    BudgetExceededError,
    ConfigError,
    CoordinatorUnavailableError,
    JobBudgetExceededError,
    JobFailedError,
    QuorumError,
    SitesNotConnectedError,
    ValidationError,
)
from dpfed.common.logs import JsonFormatter

ROOT = Path(__file__).resolve().parents[2]
PCA_FLAGS = {"n_components": "--k", "rank": "--rank", "clip_norm": "--clip-norm",
             "calibration": "--calibration"}


def test_user_message_names_flags_not_fields() -> None:
    cases = {
        "n_components must be <= 20, got 50": "--k must be <= 20, got 50",
        "rank must be >= 3, got 2": "--rank must be >= 3, got 2",
        "pca needs n_components (K)": "pca needs --k (K)",
        "clip_norm must be finite and > 0, got -1.0":
            "--clip-norm must be finite and > 0, got -1.0",
        "this job needs min_sites=5. hospital-1: ok":
            "this job needs --min-sites 5. hospital-1: ok",
        "calibration='classic' is not DP at epsilon=10, delta=0.01; use calibration='analytic'":
            "--calibration classic is not DP at --epsilon 10, --delta 0.01; use --calibration "
            "analytic",
        # Prose keeps its words: only "<field> must" and field=value are rewritten.
        "site spent epsilon 1.0 of its rank-2 budget":
            "site spent epsilon 1.0 of its rank-2 budget",
    }
    for raw, expected in cases.items():
        assert user_message(ValidationError(raw), PCA_FLAGS) == expected
    # Without the command's own table only the common fields are rewritten.
    assert user_message(ValidationError("n_components must be <= 2")) == \
        "n_components must be <= 2"


@pytest.mark.parametrize("text", ["localhost", "localhost:", "host:port", "host:70000",
                                  "host:0", ":50051", "a b:1", "[::1]"])
def test_address_without_a_port_shows_the_expected_form(text: str) -> None:
    with pytest.raises(ConfigError, match=r"--coordinator must be host:port .*e\.g\. .+:50051"):
        check_address(text, "--coordinator")


@pytest.mark.parametrize("text", ["localhost:50051", "10.0.0.1:1", "[::1]:50051",
                                  "coord.example.org:65535"])
def test_valid_addresses(text: str) -> None:
    assert check_address(text, "--coordinator") == text
    assert check_address("0.0.0.0:0", "listen", allow_port_zero=True) == "0.0.0.0:0"


def test_error_classes_map_to_the_documented_codes() -> None:
    assert exit_codes.for_error(JobBudgetExceededError("x")) == exit_codes.BUDGET_EXCEEDED == 9
    assert exit_codes.for_error(BudgetExceededError("x")) == 9
    assert exit_codes.for_error(JobFailedError("x")) == exit_codes.JOB_FAILED == 8
    assert exit_codes.for_error(QuorumError("x")) == 8
    assert exit_codes.for_error(SitesNotConnectedError("x")) == exit_codes.SITES_NOT_CONNECTED
    assert exit_codes.for_error(CoordinatorUnavailableError("x")) == 6
    assert exit_codes.for_error(BrokenPipeError()) == exit_codes.PIPE_CLOSED == 141
    codes = [c for c, _, _ in exit_codes.TABLE]
    assert len(set(codes)) == len(codes)


def test_exit_code_table_is_the_same_in_docs_and_readme() -> None:
    docs = (ROOT / "docs" / "cli.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for code, name, _meaning in exit_codes.TABLE:
        assert re.search(rf"^\| {code} \| `{name}` \|", docs, flags=re.M), (code, name)
        assert re.search(rf"^\| {code} \| ", readme, flags=re.M), code


def test_run_command_prints_one_line_and_maps_the_code(capsys: pytest.CaptureFixture[str]) -> None:
    def fail() -> int:
        raise ValidationError("n_components must be <= 4, got 9")

    assert run_command("dpfed pca", fail, PCA_FLAGS) == exit_codes.USAGE
    err = capsys.readouterr().err
    assert err == "dpfed pca: --k must be <= 4, got 9\n"


def test_format_table_never_cuts_words() -> None:
    long_error = "only 0 site(s) answered round 'pca'; this job needs min_sites=3. " * 3
    text = format_table(("job", "state", "error"), [("abc", "failed", long_error),
                                                  ("defghij", "succeeded", "")])
    lines = text.splitlines()
    assert lines[0].split() == ["job", "state", "error"]
    assert lines[1].endswith(long_error.rstrip()) and lines[2].split() == ["defghij", "succeeded"]
    assert lines[1].index("failed") == lines[2].index("succeeded") == lines[0].index("state")


def test_print_json_turns_non_finite_numbers_into_null(capsys: pytest.CaptureFixture[str]) -> None:
    print_json({"a": float("nan"), "b": [1.0, float("inf")], "c": (1, "x")})
    assert json.loads(capsys.readouterr().out) == {"a": None, "b": [1.0, None], "c": [1, "x"]}


def test_lazy_parser_adds_arguments_only_when_its_command_is_parsed() -> None:
    calls: list[str] = []

    def populate(p: argparse.ArgumentParser) -> None:
        calls.append("populated")
        p.add_argument("--k", type=int, required=True)

    parser = argparse.ArgumentParser(prog="t")
    sub = parser.add_subparsers(dest="command", parser_class=LazyArgumentParser)
    sub.add_parser("heavy", populate=populate)
    sub.add_parser("light")
    assert parser.parse_args(["light"]).command == "light" and calls == []
    assert parser.parse_args(["heavy", "--k", "3"]).k == 3 and calls == ["populated"]
    assert parser.parse_args(["heavy", "--k", "4"]).k == 4 and calls == ["populated"]


def test_json_log_lines_carry_job_task_site_and_outcome() -> None:
    fmt = JsonFormatter()
    record = logging.LogRecord("dpfed.site_agent.runner", logging.INFO, __file__, 1,
                               "[TaskRunner.run] %s outcome=%s epsilon=%g", (
                                   "task=j1/pca job=j1 kind=pca", "charged", 1.0), None)
    record.site = "hospital-a"
    out = json.loads(fmt.format(record))
    assert out["job_id"] == "j1" and out["task_id"] == "j1/pca" and out["kind"] == "pca"
    assert out["outcome"] == "charged" and out["site"] == "hospital-a"
    assert out["level"] == "INFO" and out["time"].endswith("Z") and "\n" not in fmt.format(record)
    refused = logging.LogRecord("x", logging.WARNING, __file__, 1,
                                "job=j2 outcome=refused: budget", (), None)
    assert json.loads(fmt.format(refused))["outcome"] == "refused"
    plain = json.loads(fmt.format(logging.LogRecord("x", logging.INFO, __file__, 1, "hello", (),
                                                    None)))
    assert set(plain) == {"time", "level", "logger", "message"}
