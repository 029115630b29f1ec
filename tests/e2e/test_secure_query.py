"""A secure ``query`` job end to end with real processes over mTLS: the answers match the pooled
truth within their stated standard errors (one pooled noise draw), with Skellam and with the
distributed discrete Laplace a new job chooses for a small marginal (charged (epsilon, 0) as
``secure-dlaplace[n=3,t=1]``, and no "secure no better" warning); every site is charged once
with the secure mechanism recorded, and the CLI reports the mode, participants, t and the
guarantee."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.aggregator.query_report import query_report
from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.schema import Schema
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.queries.query_language import compile_query_set
from dpfed.common.queries.workload_spec import build_workload
from dpfed.common.transport.wire import result_from_bytes
from dpfed.site_agent.ledger import Ledger
from tests.e2e.federations import running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=1500, features=8, seed=11, min_sites=3,
        task_deadline_s=60, resume_wait_s=10, mixed=True,
        settings=SiteSettings(budget_epsilon=100.0, budget_delta=0.01, connect_timeout_s=30))
    yield from running(federation)


def _pooled(fed: LocalFederation, raw: object) -> np.ndarray:
    schema = Schema.load(fed.schema_path)
    q = compile_query_set(schema, raw)
    total = 0
    for s in fed.site_ids:
        src = open_data_source(spec_from_path(fed.data_paths[s]), schema)
        total = total + q.counts(t for t, _ in src.iter_chunks())[0]
    return np.asarray(total, dtype=np.float64)


def test_secure_query_matches_the_pooled_truth_within_its_standard_errors(
        fed: LocalFederation) -> None:
    with fed.analyst() as coord:
        ranges = coord.query(["age"], bins={"age": 16}, workload="all_range", epsilon=1.0,
                             delta=1e-5, aggregation="secure", secure_noise="skellam")
        marginal = coord.query(["ward", "severity"], workload="marginals", k=2, epsilon=1.0,
                               delta=1e-5, aggregation="secure")
        site_level = coord.query(["age"], bins={"age": 16}, workload="all_range", epsilon=1.0,
                                 delta=1e-5, noise="gaussian", aggregation="site")
    modes = site_level.metadata["aggregation_comparison"]  # secure would have been better,
    # with the discrete Laplace a new secure job would choose: better than its Skellam
    assert modes["expected_rmse_other_mode"] < 0.9 * site_level.expected_rmse * 1.01 / np.sqrt(2)
    assert "secure aggregation would give" in query_report(site_level).render()
    # the ranges rank best under Skellam; the small marginal under the distributed discrete
    # Laplace (Pólya shares), which the new job chose itself
    for result, raw, noise in ((ranges, [{"per": "age", "bins": 16}], "skellam"),
                               (marginal, [{"cross": ["ward", "severity"]}], "dlaplace")):
        m = result.metadata
        assert m["aggregation"] == "secure" and result.noise == noise
        assert m["secure"]["mechanism"] == noise
        secure = m["secure"]
        assert secure["participants"] == fed.site_ids and secure["tolerated_colluders"] == 1
        assert secure["attempts"] == 1 and "DP" in secure["guarantee"]
        truth = _pooled(fed, raw)
        w = dict(m["workload"])
        if w["kind"] != "marginals":
            w.pop("k", None)
        true_answers = build_workload(result.domain, w).answer(truth)
        z = (result.arrays["answers"] - true_answers) / result.arrays["answer_std_error"]
        assert np.max(np.abs(z)) < 5.0, np.max(np.abs(z))
        zc = (result.arrays["x_hat"] - truth) / result.arrays["x_std_error"]
        assert 0.1 < float(np.mean(zc ** 2)) < 4.0  # the stated errors are the real ones
        # one pooled draw: the stated error is far below site-level noise from 3 sites
        assert m["expected_rmse"] < result.identity_expected_rmse * 1.5
        # the result (and its report) says what site-level aggregation would have given,
        # with its best strategy under its own noise
        modes = m["aggregation_comparison"]
        assert (modes["n_sites"], modes["tolerated"]) == (3, 1)
        assert modes["secure_over_site_noise"] == pytest.approx(
            m["expected_rmse"] / modes["expected_rmse_other_mode"])
        # never worse than the same strategy's noise of its family from 3 sites (the discrete
        # Laplace's variance is at most the Laplace's; Skellam's is 1.01^2 the Gaussian's)
        assert modes["expected_rmse_other_mode"] <= m["expected_rmse"] * np.sqrt(2) * (
            1.0001 if noise == "dlaplace" else 1 / 1.01)
        assert "Aggregation modes: expected error with 3 site(s), t=1: secure" in (
            query_report(result).render())
    # the marginal's identity strategy: three site-level Laplace draws (L1 sensitivity 2) per
    # answer, against one pooled discrete Laplace of 3/2 its variance (t = 1): secure wins,
    # and no warning (it fired while secure meant Skellam)
    modes = marginal.metadata["aggregation_comparison"]
    assert modes["expected_rmse_other_mode"] == pytest.approx(np.sqrt(3 * 2 * 2.0 ** 2))
    assert "WARNING" not in modes["sentence"]
    assert modes["secure_over_site_noise"] == pytest.approx(np.sqrt(1.5 / 3), rel=0.02)
    for site in fed.site_ids:
        with Ledger(fed.ledger_path(site), BudgetPolicy(1e6, 0.5)) as ledger:
            events = ledger.events()
            mechanisms = [result_from_bytes(ledger.stored_result(e.task_id)).spend.mechanism
                          for e in events]
        # one charge per site and job: the contribution (the key exchange charges nothing);
        # then the site-level job's own release
        assert mechanisms[:2] == ["secure-skellam[n=3,t=1]", "secure-dlaplace[n=3,t=1]"]
        assert len(mechanisms) == 3 and "secure" not in mechanisms[2]
        assert [e.epsilon for e in events] == [1.0, 1.0, 1.0]
        assert [e.delta for e in events][:2] == [1e-5, 0.0]  # the discrete Laplace: pure
    _cli_reports_mode_participants_and_guarantee(fed)  # same federation: one start-up


def _conn(fed: LocalFederation) -> list[str]:
    kit = fed.certs / "analysts" / "analyst"
    return ["--coordinator", fed.address, "--ca", str(kit / "ca.pem"), "--cert",
            str(kit / "analyst.pem"), "--key", str(kit / "analyst.key")]


def _cli_reports_mode_participants_and_guarantee(fed: LocalFederation) -> None:
    base = [sys.executable, "-m", "dpfed.aggregator.cli", "query", "--columns", "ward",
            "--epsilon", "1", "--aggregation", "secure"]
    out = subprocess.run([*base, "--delta", "1e-5", "--json", *_conn(fed)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["aggregation"] == "secure" and doc["noise"] == "dlaplace"  # a 1-way count
    assert doc["secure"]["participants"] == fed.site_ids
    text = subprocess.run([*base, "--delta", "1e-5", *_conn(fed)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert text.returncode == 0 and "secure aggregation: 3 participants" in text.stdout
    assert "tolerating 1 colluding" in text.stdout
    bad = subprocess.run([*base, "--secure-noise", "skellam", *_conn(fed)], capture_output=True,
                         text=True, timeout=120, check=False)  # Skellam without --delta:
    # refused with the flag named, no traceback
    assert bad.returncode != 0 and "--delta" in bad.stderr and "Traceback" not in bad.stderr
