"""site.toml / aggregator.toml validation: every error names the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpfed.aggregator.config import load_aggregator_config
from dpfed.common.errors import ConfigError
from dpfed.site_agent.config import load_site_config

SITE = """
[coordinator]
address = "coord.example.org:50051"

[tls]
ca = "kit/ca.pem"
cert = "kit/site.pem"
key = "kit/site.key"

[data]
path = "data/patients.csv"
schema = "schema.toml"

[ledger]
path = "ledger.sqlite"

[budget]
epsilon = 10.0
delta = 1e-5

[policy]
allowed_jobs = ["pca"]
max_epsilon_per_task = 2.0
"""

AGG = """
[server]
listen = "0.0.0.0:50051"
[tls]
ca = "ca.pem"
cert = "coordinator.pem"
key = "coordinator.key"
[federation]
schema = "schema.toml"
[jobs]
min_sites = 2
"""


def write(tmp_path: Path, text: str, name: str = "site.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_valid_site_config_resolves_relative_paths(tmp_path: Path) -> None:
    cfg = load_site_config(write(tmp_path, SITE))
    assert cfg.coordinator_address == "coord.example.org:50051"
    assert cfg.data.path == tmp_path / "data/patients.csv"
    assert cfg.tls is not None and cfg.tls.key == tmp_path / "kit/site.key"
    assert cfg.budget.epsilon == 10.0 and cfg.budget.max_epsilon_per_task == 2.0
    assert cfg.allowed_jobs == ("pca",) and cfg.connect_timeout_s == 120.0
    over = load_site_config(write(tmp_path, SITE), {"coordinator": "other:1", "ledger": "/x.db"})
    assert over.coordinator_address == "other:1" and str(over.ledger_path) == "/x.db"


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.replace('address = "coord.example.org:50051"\n', ""),
     "no coordinator address.*--coordinator"),
    (lambda s: s.replace("coord.example.org:50051", "coord.example.org"), "must be host:port"),
    (lambda s: s.replace("[budget]\nepsilon = 10.0", "[budget]\nepsilon = -1"),
     "budget.epsilon must be finite and > 0, got -1.0"),
    (lambda s: s.replace("delta = 1e-5", "delta = 2"), r"budget.delta must be in the open"),
    (lambda s: s.replace('["pca"]', '["pca", "kmeans"]'), r"unknown job kind\(s\) \['kmeans'\]"),
    (lambda s: s.replace("[ledger]", "[ledger]\nsync = false"),
     r"unknown key\(s\) \['sync'\] in \[ledger\]"),
    (lambda s: s.replace('cert = "kit/site.pem"\n', ""), "missing required key tls.cert"),
    (lambda s: s.replace("[data]\n", "[data]\non_invalid = \"skip\"\n"),
     "on_invalid must be one of 'drop', 'error'"),
    (lambda s: s.replace("[data]\n", "[data]\ndelimiter = \";;\"\n"),
     "data.delimiter must be one character"),
    (lambda s: s.replace("[budget]", "[budgets]"), r"missing required table \[budget\]"),
    (lambda s: s + "\n[policy2]\n", r"unknown key\(s\) \['policy2'\] in the top level"),
    (lambda s: s.replace("10.0", "'ten'", 1), "must be a finite number"),
    (lambda s: s + "[[", "not valid TOML"),
    (lambda s: s.replace("max_epsilon_per_task",
                         'evaluation_summary = "yes"\nmax_epsilon_per_task'),
     "policy.evaluation_summary must be one of none, dp, got 'yes'"),
    (lambda s: s.replace('["pca"]', '["pca", "synth_eval_dp"]'),
     "'synth_eval_dp' is enabled by policy.evaluation_summary"),
])
def test_site_config_errors_name_the_key(tmp_path: Path, edit, match: str) -> None:  # type: ignore[no-untyped-def]
    path = write(tmp_path, edit(SITE))
    with pytest.raises(ConfigError, match=match) as info:
        load_site_config(path)
    assert str(path) in str(info.value)


def test_evaluation_summary_policy_adds_the_summary_kind(tmp_path: Path) -> None:
    assert load_site_config(write(tmp_path, SITE)).advertised_kinds == ("pca",)
    cfg = load_site_config(write(tmp_path, SITE.replace(
        "max_epsilon_per_task", 'evaluation_summary = "dp"\nmax_epsilon_per_task')))
    assert cfg.evaluation_summary == "dp" and cfg.allowed_jobs == ("pca",)
    assert cfg.advertised_kinds == ("pca", "synth_eval_dp")


def test_missing_site_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_site_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_site_config(tmp_path)


def test_insecure_mode_needs_no_certificates(tmp_path: Path) -> None:
    text = SITE.replace('ca = "kit/ca.pem"\ncert = "kit/site.pem"\nkey = "kit/site.key"',
                        "insecure = true")
    assert load_site_config(write(tmp_path, text)).insecure


def test_aggregator_config(tmp_path: Path) -> None:
    cfg = load_aggregator_config(write(tmp_path, AGG, "agg.toml"))
    assert cfg.listen == "0.0.0.0:50051" and cfg.min_sites == 2
    assert cfg.store_path == tmp_path / "store" and cfg.task_deadline_s == 600.0
    over = load_aggregator_config(write(tmp_path, AGG, "agg.toml"),
                                  {"listen": "127.0.0.1:0", "store": "/tmp/s"})
    assert over.listen == "127.0.0.1:0" and str(over.store_path) == "/tmp/s"
    cases = [(AGG.replace("min_sites = 2", "min_sites = 0"), "jobs.min_sites must be >= 1"),
             (AGG.replace("[federation]\nschema", "[federation]\nschemas"),
              "missing required key federation.schema"),
             (AGG.replace("[jobs]", "[jobs]\nquorum = 3"), r"unknown key\(s\) \['quorum'\]"),
             (AGG.replace("0.0.0.0:50051", "localhost"), "must be host:port")]
    for text, match in cases:
        with pytest.raises(ConfigError, match=match):
            load_aggregator_config(write(tmp_path, text, "agg.toml"))
