"""``dpfed-site check`` and the site log warn when the row policy would drop many rows."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.encoding import RowPolicy
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ConfigError
from dpfed.site_agent.cli import main
from dpfed.site_agent.config import load_site_config
from dpfed.site_agent.row_count import CountedData
from tests.support.site_files import check_site


def site_files(tmp_path: Path, *, warn: float | None, on_missing: str = "drop") -> Path:
    rows = ["age,ward"] + [f"{40 + i % 30},a" for i in range(90)] + ["NA,b"] * 10
    (tmp_path / "data.csv").write_text("\n".join(rows) + "\n")
    extra = "" if warn is None else f"warn_dropped_fraction = {warn}\n"
    return check_site(tmp_path, tmp_path / "data.csv", f"on_missing = \"{on_missing}\"\n{extra}")


def test_check_warns_above_the_threshold(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    config = site_files(tmp_path, warn=None)  # default 0.01: 10 of 100 dropped
    main(["check", "--config", str(config), "--timeout", "1"])
    out = capsys.readouterr().out
    assert "warning data: 10 of 100 rows (10.0%) would be dropped" in out
    assert "columns with problem values: ['age']" in out
    assert "ok      data:" in out and "90 valid rows" in out
    config = site_files(tmp_path, warn=0.2)
    main(["check", "--config", str(config), "--timeout", "1"])
    assert "warning data" not in capsys.readouterr().out


def test_check_fails_on_missing_values_by_default(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    config = site_files(tmp_path, warn=None, on_missing="error")
    main(["check", "--config", str(config), "--timeout", "1"])
    out = capsys.readouterr().out
    assert "FAILED  data:" in out and "declares complete" in out
    text = config.read_text().replace('on_missing = "error"\n', "")
    config.write_text(text)
    assert load_site_config(config).data.row_policy == RowPolicy(missing="error")


def test_bad_threshold_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="warn_dropped_fraction must be a share"):
        load_site_config(site_files(tmp_path, warn=1.5))


def test_first_count_logs_the_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    site_files(tmp_path, warn=None)
    source = open_data_source(spec_from_path(tmp_path / "data.csv",
                                             policy=RowPolicy(missing="drop")),
                              Schema.load(tmp_path / "schema.toml"))
    caplog.set_level(logging.WARNING, logger="dpfed.site_agent.row_count")
    CountedData(source, 0.05).ensure_counted()
    assert any("would be dropped" in r.getMessage() for r in caplog.records)
