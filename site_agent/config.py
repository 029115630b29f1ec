"""The site agent's configuration (``site.toml``) and its validation.

Example (paths are relative to the file)::

    [coordinator]
    address = "coordinator.example.org:50051"
    # server_name = "coordinator.example.org"   # TLS name, when dialling an IP address
    connect_timeout_s = 120     # give up (exit 6) if never connected within this (<= 30 days)
    keepalive_s = 10            # a silent coordinator link is dropped (and redialled) within this

    [tls]
    ca = "kit/ca.pem"
    cert = "kit/site.pem"
    key = "kit/site.key"
    revocation_list = "kit/revoked.toml"  # from 'dpfed certs': revoked certificates and the
                                          # federation's sites; re-read when it changes

    [data]
    path = "data/patients.csv"  # .csv/.tsv, .parquet, or an SQLite file with table/query
    schema = "schema.toml"
    # format = "csv"  table = "patients"  query = "SELECT ..."  delimiter = ","
    # PostgreSQL instead of path (docs/data-sources.md):
    # format = "postgres"
    # conninfo = "host=warehouse.example.org dbname=omop user=dpfed_reader sslmode=verify-full"
    # password_env = "DPFED_PG_PASSWORD"   # or password_file = "pg_password" (or ~/.pgpass)
    # table = "cdm.dpfed_features"         # or query = "SELECT ..."
    chunk_rows = 65536          # rows read at once (1 to 10 000 000)
    on_missing = "error"        # error | drop: a missing value in a column the schema
                                # declares complete (no 'missing' key) stops / drops the row
    on_invalid = "drop"         # drop | error
    on_out_of_range = "clip"    # clip | drop | error
    warn_dropped_fraction = 0.01  # dpfed-site check and the log warn above this share dropped

    [ledger]
    path = "ledger.sqlite"

    [budget]
    epsilon = 10.0
    delta = 1e-5                # in [1e-300, 1)
    accountant = "pld"          # pld (tight, default) | basic | zcdp

    [budget.analysts]           # optional: the most epsilon each analyst may spend here
    alice = 2.0                 # (same accountant and delta as the total; ids as certified)

    [studies.diabetes-2027]     # optional: a study's own cap (jobs run with --study NAME)
    epsilon = 3.0               # within budget.epsilon; same accountant and delta
    expires = 2027-06-30        # the last day (UTC) its jobs may spend

    [policy]
    allowed_jobs = ["pca"]
    max_epsilon_per_task = 2.0
    secure_aggregation = "allowed"   # off | allowed | required
    secure_min_participants = 2      # refuse secure rounds with fewer verified sites
    secure_tolerated_colluders = 1   # other parties (coordinator counted) that may collude
    secure_tolerated_dropouts = 0    # sites that may vanish mid-sum (each adds more noise)
    evaluation_summary = "none"      # none | dp: release a DP summary of synth evaluations
    approval = "auto"                # auto | manual: jobs wait for 'dpfed-site approve ID'

    [policy.approval_kinds]          # optional: per task kind, wins over policy.approval
                                     # ("secagg": the tasks of secure rounds)
    synth_rows = "manual"

    [policy.approval_analysts]       # optional: per analyst, wins over the kind's rule
    alice = "auto"

    [logging]
    level = "INFO"
    format = "text"             # text | json (one JSON event per line)
    # file = "site.log"

    [metrics]                   # Prometheus endpoint, plain HTTP (docs/operations.md)
    enabled = false             # off by default on a site
    listen = "127.0.0.1:9465"   # loopback by default
    # port_file = "metrics.port"  # write the bound port here once serving

The site's identity is the id in its certificate; it is deliberately not a config key.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpfed.common.cli_support import check_address
from dpfed.common.data.encoding import RowPolicy
from dpfed.common.errors import ConfigError, ValidationError
from dpfed.common.jobs.registry import SECURE_TASK_KIND, default_task_kinds, task_kinds
from dpfed.common.logs import LOG_FORMATS
from dpfed.common.metrics import MetricsConfig, metrics_config
from dpfed.common.privacy.accounting import DEFAULT_ACCOUNTANT, BudgetPolicy
from dpfed.common.secagg.policy import SecureAggregationPolicy
from dpfed.common.toml_config import Section, TlsConfig, read_toml, tls_from_section
from dpfed.common.transport.grpc_options import (
    DEFAULT_KEEPALIVE_S,
    MAX_KEEPALIVE_S,
    MIN_KEEPALIVE_S,
)
from dpfed.common.transport.identity import check_principal_id
from dpfed.common.validation import MIN_DELTA
from dpfed.site_agent.agent_status import ledger_file
from dpfed.site_agent.approvals import ApprovalPolicy, check_mode
from dpfed.site_agent.ledger import StudyBudget

log = logging.getLogger(__name__)

DATA_FORMATS: tuple[str, ...] = ("csv", "parquet", "sqlite", "postgres", "duckdb", "omop")
#: Values of ``policy.evaluation_summary``: "dp" lets the site release a DP summary of its
#: synthetic-data evaluation (task kind ``synth_eval_dp``, charged to its ledger).
EVALUATION_SUMMARY_CHOICES: tuple[str, ...] = ("none", "dp")
#: The task kind a site runs (and advertises) when ``evaluation_summary = "dp"``.
EVALUATION_SUMMARY_KIND = "synth_eval_dp"
#: Ranges of numeric keys (besides the privacy parameters' own): beyond them a value passes
#: start-up only to break every task later.
MAX_CONNECT_TIMEOUT_S = 30 * 86400.0
MAX_CHUNK_ROWS = 10_000_000
MAX_PARTICIPANTS = 10_000


#: Default of ``[data] warn_dropped_fraction``.
DEFAULT_WARN_DROPPED_FRACTION = 0.01


@dataclass(frozen=True)
class DataConfig:
    """Where the site's table lives and how problem rows are handled.

    ``path`` is None for PostgreSQL, which has ``conninfo`` and at most one of
    ``password_env`` (the name of an environment variable) or ``password_file``.
    """

    path: Path | None
    schema: Path
    format: str | None = None
    table: str | None = None
    query: str | None = None
    delimiter: str | None = None  # None: from the file extension (tab for .tsv, else ",")
    chunk_rows: int = 65536
    row_policy: RowPolicy = RowPolicy()
    conninfo: str | None = None
    password_env: str | None = None
    password_file: Path | None = None
    #: Warn (log, ``dpfed-site check``) when more than this share of the rows read is dropped.
    warn_dropped_fraction: float = DEFAULT_WARN_DROPPED_FRACTION

    def password(self) -> str | None:
        """Read the PostgreSQL password from its variable or file (None: libpq's own ways).

        Raises
        ------
        ConfigError
            The variable is unset or the file unreadable.
        """
        if self.password_env is not None:
            value = os.environ.get(self.password_env)
            if value is None:
                raise ConfigError(f"data.password_env names the environment variable "
                                  f"{self.password_env!r}, which is not set")
            return value
        if self.password_file is not None:
            try:
                mode = self.password_file.stat().st_mode
                text = self.password_file.read_text(encoding="utf-8")
            except OSError as exc:
                raise ConfigError(f"data.password_file {self.password_file}: cannot be read "
                                  f"({exc.strerror})") from None
            if mode & 0o077:
                log.warning("[SiteConfig] data.password_file %s can be read by other users; "
                            "chmod 600 it", self.password_file)
            return text.rstrip("\r\n")
        return None


_PASSWORD_IN_CONNINFO = re.compile(
    r"(?:^|\s)password\s*=|[?&]password=|\A\s*postgres(?:ql)?://[^/@\s]*:[^/@\s]*@",
    re.IGNORECASE)


@dataclass(frozen=True)
class SiteConfig:
    """Everything ``dpfed-site`` needs to run."""

    source: str
    coordinator_address: str
    server_name: str | None
    connect_timeout_s: float
    tls: TlsConfig | None
    data: DataConfig
    ledger_path: Path
    budget: BudgetPolicy
    allowed_jobs: tuple[str, ...]
    secure: SecureAggregationPolicy = SecureAggregationPolicy()
    log_level: str = "INFO"
    log_file: Path | None = None
    log_format: str = "text"
    #: Test/demo only: derive noise deterministically from this seed and the task id. Never
    #: reachable from the network; the agent logs a warning when it is set.
    deterministic_noise_seed: int | None = None
    #: The site's copy of the federation's revocation list (``revoked.toml``), if any.
    revocation_list: Path | None = None
    #: Per-analyst epsilon caps (analyst id -> epsilon), within the total budget.
    analyst_budgets: dict[str, float] = field(default_factory=dict)
    keepalive_s: float = DEFAULT_KEEPALIVE_S
    #: ``policy.evaluation_summary``: "dp" releases DP summaries of synth evaluations.
    evaluation_summary: str = "none"
    metrics: MetricsConfig = MetricsConfig(enabled=False, listen="127.0.0.1:9465")
    #: The studies this site holds budgets for (``[studies.NAME]``).
    studies: dict[str, StudyBudget] = field(default_factory=dict)
    #: Which tasks wait for the data steward's approval (``policy.approval`` and its rules).
    approval: ApprovalPolicy = ApprovalPolicy()

    @property
    def advertised_kinds(self) -> tuple[str, ...]:
        """``allowed_jobs`` plus the kinds other policy keys enable (the DP summary)."""
        if self.evaluation_summary == "dp":
            return (*self.allowed_jobs, EVALUATION_SUMMARY_KIND)
        return self.allowed_jobs

    @property
    def insecure(self) -> bool:
        """True when TLS is disabled (development only)."""
        return self.tls is None


def load_site_config(path: str | Path, overrides: dict[str, Any] | None = None) -> SiteConfig:
    """Read and validate ``site.toml``; ``overrides`` (from flags) win over the file.

    Recognised overrides: ``coordinator``, ``data``, ``ledger``, ``log_level``, ``log_format``,
    ``insecure``.

    Raises
    ------
    ConfigError
        Naming the file and key, for anything missing or invalid.
    """
    overrides = overrides or {}
    p = Path(path)
    doc = read_toml(p)
    source = str(p)
    root = Section(doc, "", source, p.resolve().parent)

    coord = root.section("coordinator")
    file_address = coord.string("address")  # always read: the strict key check needs it
    address = overrides.get("coordinator") or file_address
    if not address:
        raise ConfigError(
            f"{source}: no coordinator address: set [coordinator] address = \"host:port\" "
            "or pass --coordinator HOST:PORT")
    where = "--coordinator" if overrides.get("coordinator") else f"{source}: coordinator.address"
    check_address(address, where)
    server_name = coord.string("server_name") or None
    timeout = coord.number("connect_timeout_s", 120.0, positive=True,
                           maximum=MAX_CONNECT_TIMEOUT_S, unit=" seconds (30 days)")
    keepalive_s = coord.number("keepalive_s", DEFAULT_KEEPALIVE_S)
    if keepalive_s is None or not MIN_KEEPALIVE_S <= keepalive_s <= MAX_KEEPALIVE_S:
        raise ConfigError(f"{source}: coordinator.keepalive_s must be between "
                          f"{MIN_KEEPALIVE_S:g} and {MAX_KEEPALIVE_S:g} seconds, "
                          f"got {keepalive_s!r}")
    coord.check_unknown()

    tls_section = root.section("tls")
    insecure = bool(overrides.get("insecure")) or tls_section.boolean("insecure", False)
    tls = tls_from_section(tls_section, insecure)
    revocation_list = tls_section.path("revocation_list")
    if revocation_list is not None and tls is None:
        raise ConfigError(f"{source}: tls.revocation_list needs TLS (remove insecure)")
    tls_section.check_unknown()

    data = root.section("data", required=True)
    fmt = data.string("format")
    if fmt is not None and fmt not in DATA_FORMATS:
        raise ConfigError(f"{source}: data.format must be one of {DATA_FORMATS}, got {fmt!r}")
    postgres = fmt == "postgres"
    file_data = data.path("path", required=not overrides.get("data") and not postgres)
    data_path = Path(overrides["data"]) if overrides.get("data") else file_data
    schema_path = data.path("schema", required=True)
    conninfo = data.string("conninfo")
    password_env = data.string("password_env") or None
    password_file = data.path("password_file")
    plaintext_ok = data.boolean("allow_password_in_conninfo", False)
    if postgres:
        if data_path is not None:
            raise ConfigError(f"{source}: a postgres data source has no data.path (or --data);"
                              " it reads from data.conninfo")
        if not conninfo:
            raise ConfigError(f"{source}: data.format = \"postgres\" needs data.conninfo, e.g. "
                              "\"host=db.example.org dbname=omop user=dpfed_reader\"")
        if password_env is not None and password_file is not None:
            raise ConfigError(f"{source}: give at most one of data.password_env and "
                              "data.password_file")
        if _PASSWORD_IN_CONNINFO.search(conninfo) and not plaintext_ok:
            raise ConfigError(f"{source}: data.conninfo holds a password in plain text; put it "
                              "in an environment variable (data.password_env), a file "
                              "(data.password_file) or ~/.pgpass instead")
    elif conninfo is not None or password_env is not None or password_file is not None:
        raise ConfigError(f"{source}: data.conninfo, data.password_env and data.password_file "
                          "apply only to format = \"postgres\"")
    try:
        row_policy = RowPolicy(
            missing=data.string("on_missing", "error") or "error",
            invalid=data.string("on_invalid", "drop") or "drop",
            out_of_range=data.string("on_out_of_range", "clip") or "clip",
        )
    except ValidationError as exc:
        raise ConfigError(f"{source}: [data] {exc}") from None
    warn_dropped = data.number("warn_dropped_fraction", DEFAULT_WARN_DROPPED_FRACTION)
    if warn_dropped is None or not 0.0 <= warn_dropped <= 1.0:
        raise ConfigError(f"{source}: data.warn_dropped_fraction must be a share between 0 and "
                          f"1, got {warn_dropped!r}")
    delimiter = data.string("delimiter")
    if delimiter is not None and len(delimiter) != 1:
        raise ConfigError(f"{source}: data.delimiter must be one character, got {delimiter!r}")
    assert (data_path is not None or postgres) and schema_path is not None
    data_cfg = DataConfig(
        path=data_path, schema=schema_path, format=fmt, table=data.string("table") or None,
        query=data.string("query") or None, delimiter=delimiter,
        chunk_rows=data.integer("chunk_rows", 65536, minimum=1, maximum=MAX_CHUNK_ROWS) or 65536,
        row_policy=row_policy,
        conninfo=conninfo, password_env=password_env, password_file=password_file,
        warn_dropped_fraction=warn_dropped,
    )
    data.check_unknown()

    ledger = root.section("ledger")
    file_ledger = ledger_file(ledger)
    ledger_path = Path(overrides["ledger"]) if overrides.get("ledger") else file_ledger
    ledger.check_unknown()

    budget = root.section("budget", required=True)
    policy = root.section("policy")
    try:
        budget_policy = BudgetPolicy(
            epsilon=budget.number("epsilon", required=True) or 0.0,
            delta=budget.number("delta", required=True, minimum=MIN_DELTA) or 0.0,
            accountant=budget.string("accountant", DEFAULT_ACCOUNTANT) or DEFAULT_ACCOUNTANT,
            max_epsilon_per_task=policy.number("max_epsilon_per_task", None, positive=True),
        )
    except ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    analyst_budgets = _analyst_budgets(budget.section("analysts"), budget_policy)
    budget.check_unknown()
    studies = _studies(root.section("studies"), budget_policy)
    # The task kinds of the registered job kinds; the opt-in ones (``synth_rows``: one noisy
    # release per real row) only when listed.
    allowed = policy.str_list("allowed_jobs", list(default_task_kinds()))
    if EVALUATION_SUMMARY_KIND in allowed:
        raise ConfigError(f"{source}: policy.allowed_jobs: {EVALUATION_SUMMARY_KIND!r} is "
                          "enabled by policy.evaluation_summary = \"dp\", not by allowed_jobs")
    summary = policy.string("evaluation_summary", "none") or "none"
    if summary not in EVALUATION_SUMMARY_CHOICES:
        raise ConfigError(f"{source}: policy.evaluation_summary must be one of "
                          f"{', '.join(EVALUATION_SUMMARY_CHOICES)}, got {summary!r}")
    known = [k for k in task_kinds() if k != EVALUATION_SUMMARY_KIND]
    unknown_kinds = sorted(set(allowed) - set(known))
    if unknown_kinds:
        raise ConfigError(f"{source}: policy.allowed_jobs has unknown job kind(s) {unknown_kinds}; "
                          f"known: {known}")
    try:
        secure = SecureAggregationPolicy(
            mode=policy.string("secure_aggregation", "allowed") or "allowed",
            min_participants=policy.integer("secure_min_participants", 2, minimum=2,
                                            maximum=MAX_PARTICIPANTS) or 2,
            tolerated=policy.integer("secure_tolerated_colluders", 1, minimum=0,
                                     maximum=MAX_PARTICIPANTS) or 0,
            tolerated_dropouts=policy.integer("secure_tolerated_dropouts", 0, minimum=0,
                                              maximum=MAX_PARTICIPANTS) or 0,
            federation_list=revocation_list,
        )
    except ValidationError as exc:
        raise ConfigError(f"{source}: [policy] {exc}") from None
    approval = _approval_policy(policy, known)
    policy.check_unknown()

    logging_section = root.section("logging")
    file_level = logging_section.string("level", "INFO") or "INFO"
    level = overrides.get("log_level") or file_level
    if level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"{source}: logging.level must be DEBUG, INFO, WARNING or ERROR, "
                          f"got {level!r}")
    log_file = logging_section.path("file")
    file_format = logging_section.string("format", "text") or "text"  # read even if overridden
    log_format = overrides.get("log_format") or file_format
    if log_format not in LOG_FORMATS:
        raise ConfigError(f"{source}: logging.format must be one of {', '.join(LOG_FORMATS)}, "
                          f"got {log_format!r}")
    logging_section.check_unknown()

    testing = root.section("testing")
    seed = testing.integer("deterministic_noise_seed", None, minimum=0)
    testing.check_unknown()
    metrics = metrics_config(root.section("metrics"), enabled=False, listen="127.0.0.1:9465")
    root.check_unknown()
    assert ledger_path is not None and timeout is not None
    return SiteConfig(
        source=source, coordinator_address=address, server_name=server_name,
        connect_timeout_s=timeout, tls=tls, data=data_cfg, ledger_path=ledger_path,
        budget=budget_policy, allowed_jobs=tuple(allowed), secure=secure,
        log_level=level.upper(), log_file=log_file, deterministic_noise_seed=seed,
        revocation_list=revocation_list, analyst_budgets=analyst_budgets,
        keepalive_s=keepalive_s, log_format=log_format, evaluation_summary=summary,
        metrics=metrics, approval=approval, studies=studies,
    )


def _analyst_budgets(section: Section, total: BudgetPolicy) -> dict[str, float]:
    """Read ``[budget.analysts]``: analyst id -> epsilon cap, each in (0, budget.epsilon]."""
    caps: dict[str, float] = {}
    for name in list(section.data):
        try:
            check_principal_id(name, "analyst")
        except ValidationError as exc:
            raise ConfigError(f"{section.source}: [{section.name}] {exc}") from None
        cap = section.number(name, required=True, positive=True)
        assert cap is not None
        if cap > total.epsilon:
            raise ConfigError(f"{section.source}: {section.name}.{name} = {cap:g} exceeds "
                              f"budget.epsilon = {total.epsilon:g}; a share cannot be larger "
                              "than the whole")
        caps[name] = cap
    section.check_unknown()
    return caps


def _approval_policy(policy: Section, known_kinds: list[str]) -> ApprovalPolicy:
    """Read ``policy.approval`` and its ``[policy.approval_kinds]`` / ``[..._analysts]`` rules."""
    default = check_mode(policy.string("approval", "auto"), f"{policy.source}: policy.approval")
    kinds_section = policy.section("approval_kinds")
    kinds = {}
    for kind in list(kinds_section.data):
        where = f"{policy.source}: policy.approval_kinds.{kind}"
        if kind not in (*known_kinds, SECURE_TASK_KIND):
            raise ConfigError(f"{where}: unknown task kind {kind!r}; known: "
                              f"{[*known_kinds, SECURE_TASK_KIND]}")
        kinds[kind] = check_mode(kinds_section.get(kind), where)
    kinds_section.check_unknown()
    analysts_section = policy.section("approval_analysts")
    analysts = {}
    for name in list(analysts_section.data):
        where = f"{policy.source}: policy.approval_analysts.{name}"
        _check_id_key(name, "analyst", where)
        analysts[name] = check_mode(analysts_section.get(name), where)
    analysts_section.check_unknown()
    return ApprovalPolicy(default, kinds, analysts)


def _studies(section: Section, total: BudgetPolicy) -> dict[str, StudyBudget]:
    """Read ``[studies.NAME]``: each study's epsilon cap and its last day (``expires``)."""
    studies: dict[str, StudyBudget] = {}
    for name in list(section.data):
        where = f"{section.source}: studies.{name}"
        _check_id_key(name, "study", where)
        study = section.section(name)
        cap = study.number("epsilon", required=True, positive=True)
        assert cap is not None
        if cap > total.epsilon:
            raise ConfigError(f"{where}.epsilon = {cap:g} exceeds budget.epsilon = "
                              f"{total.epsilon:g}; a study's cap cannot be larger than the whole")
        raw = study.get("expires", required=True)
        if isinstance(raw, datetime.datetime) or not isinstance(raw, datetime.date | str):
            raise ConfigError(f"{where}.expires must be a date (2027-06-30 or \"2027-06-30\"), "
                              f"got {raw!r}")
        try:
            expires = raw if isinstance(raw, datetime.date) else datetime.date.fromisoformat(raw)
        except ValueError:
            raise ConfigError(f"{where}.expires must be a date (2027-06-30 or "
                              f"\"2027-06-30\"), got {raw!r}") from None
        study.check_unknown()
        studies[name] = StudyBudget(cap, expires)
    section.check_unknown()
    return studies


def _check_id_key(name: str, role: str, where: str) -> None:
    """Raise ConfigError at ``where`` unless the key ``name`` is a valid ``role`` id."""
    try:
        check_principal_id(name, role)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {exc}") from None
