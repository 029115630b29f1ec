"""The ``synth`` job under secure aggregation end to end: coordinator and three sites as real
processes over mTLS with SQLite ledgers. The secure job produces a model whose metadata states
the mode; every site is charged once per round with the secure mechanism; the row-aligned mode
with secure aggregation is refused before anything is charged; a site whose policy requires
secure aggregation refuses the site-level job's rounds but takes part in the secure one; under
zCDP composition the secure rounds fit a zcdp ledger holding exactly the job's budget."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.aggregator.synth_report import synth_report
from dpfed.common.data.schema import Schema
from dpfed.common.errors import JobFailedError, ValidationError
from dpfed.common.privacy.accounting import rho_for_epsilon, zcdp_to_epsilon
from dpfed.common.privacy.composition import round_rho
from dpfed.common.privacy.skellam import skellam_rho
from dpfed.common.transport.protocol import JobSpec
from tests.e2e.federations import (
    charged_events,
    killed_and_resumed,
    roomy_settings,
    running,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STRICT = "hospital-3"


def ledger_events(fed: LocalFederation, site_id: str) -> list[tuple[str, str]]:
    return [(e.task_id.split("/")[-1], e.mechanism) for e in charged_events(fed, site_id)]


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=1500, features=6, seed=7, min_sites=2,
        task_deadline_s=60, resume_wait_s=45, mixed=True,
        settings=roomy_settings(allowed_jobs=("synth", "synth_rows", "synth_eval")))
    config = federation.site_config(STRICT)
    config.write_text(config.read_text().replace(
        "[policy]\n", "[policy]\nsecure_aggregation = \"required\"\n"))
    yield from running(federation)


def test_secure_synthesis_end_to_end(fed: LocalFederation, tmp_path: Path) -> None:
    schema = Schema.load(fed.schema_path)
    kit = fed.certs / "analysts" / "analyst"
    conn = ["--coordinator", fed.address, "--ca", str(kit / "ca.pem"), "--cert",
            str(kit / "analyst.pem"), "--key", str(kit / "analyst.key")]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dpfed.aggregator.cli", "synth", *args,
                               *conn], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)

    plan = cli("--epsilon", "2", "--delta", "1e-5", "--aggregation", "secure", "--plan")
    assert plan.returncode == 0, plan.stderr
    assert "aggregation secure" in plan.stdout and "is a secure sum" in plan.stdout
    bad = cli("--epsilon", "2", "--delta", "1e-5", "--mode", "row-aligned", "--aggregation",
              "secure")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "--mode row-aligned cannot run with --aggregation secure" in bad.stderr
    with fed.analyst() as coord:
        policies = {s.site_id: s.secure_policy for s in coord.sites()}
        assert policies[STRICT].startswith("required")
        # refused before anything runs or is charged, naming both flags
        with pytest.raises(ValidationError, match="--mode row-aligned.*--aggregation secure"):
            coord.synth_model(epsilon=4.0, delta=1e-5, mode="row-aligned",
                              aggregation="secure")
        frame, model = coord.synthesize(epsilon=4.0, delta=1e-5, rows=3000,
                                        aggregation="secure")
        secure_job = coord.jobs(1)[0]
    assert secure_job.state == "succeeded" and secure_job.summary["aggregation"] == "secure"
    assert list(frame.columns) == list(schema.names) and len(frame) == 3000
    meta = model.metadata
    assert meta["aggregation"] == "secure" and meta["n_rows_total"] == 4500
    secure = meta["secure"]
    assert secure["participants"] == fed.site_ids and secure["tolerated_colluders"] == 1
    assert set(secure["rounds"]) == {"links", "pca", "pair_scores", "pairs"}
    assert secure["rounds"]["links"]["statistic"] == "weighted_counts"
    assert secure["rounds"]["links"]["scale"] == 1.0
    assert secure["rounds"]["pca"]["statistic"] == "gram"
    assert secure["rounds"]["pair_scores"]["statistic"] == "scores"
    assert secure["rounds"]["pairs"]["statistic"] == "counts"
    assert meta["pair_edges"] and model.pair_correction is not None
    assert all(sum(s[f"{r}_epsilon"] for r in ("links", "pca", "pair_scores", "pairs"))
               == pytest.approx(4.0) for s in meta["sites"])
    # one charge per site per round, recorded as the secure mechanism
    for s in fed.site_ids:
        assert ledger_events(fed, s) == [
            (f"{r}-sum-1", "secure-skellam[n=3,t=1]")
            for r in ("links", "pca", "pair_scores", "pairs")]
    html = synth_report(model, frame.head(500))
    assert "Aggregation: secure" in html and "t = 1" in html

    # The same federation, site-level: the strict site refuses, the others run the job.
    with fed.analyst() as coord:
        site_frame, site_model = coord.synthesize(epsilon=4.0, delta=1e-5, rows=500)
        site_job = coord.jobs(1)[0]
    assert site_model.metadata["aggregation"] == "site" and "secure" not in site_model.metadata
    outcome = {s.site_id: s for s in site_job.sites}
    assert outcome[STRICT].status == "refused"
    assert "requires secure aggregation" in outcome[STRICT].reason
    assert len(ledger_events(fed, STRICT)) == 4  # still only the secure job's charges
    for s in fed.site_ids[:2]:
        assert [t for t, _m in ledger_events(fed, s)][4:] == ["links", "pca", "pair_scores",
                                                             "pairs"]
    assert len(site_frame) == 500


def test_secure_synthesis_resumes_after_a_coordinator_kill_with_one_charge_per_round(
        fed: LocalFederation) -> None:
    """SIGKILL the coordinator once every site paid for the secure links sum; restart it.

    The resumed job re-sends the keys round (each site still holds its ephemeral key for that
    sum task and signs nothing new), then the identical contribute task, which every site
    answers from its ledger: one secure charge per site per round, and a model.
    """
    final = killed_and_resumed(
        fed, JobSpec("synth", 3.0, 1e-5, {"aggregation": "secure"}, min_sites=3),
        lambda: wait_until(lambda: all([r for r, _m in ledger_events(fed, s)][:1] == [
            "links-sum-1"] for s in fed.site_ids), 90, "the sites to pay for the links sum"))
    with fed.analyst() as coord:
        model = coord.synth_result(final)
    assert final.state == "succeeded", final.error
    assert model.metadata["aggregation"] == "secure"
    for s in fed.site_ids:
        events = ledger_events(fed, s)
        assert [r for r, _m in events] == [f"{r}-sum-1" for r in (
            "links", "pca", "pair_scores", "pairs")], events
        assert all(m.startswith("secure-skellam[n=3,") for _r, m in events)
    assert len(model.sample(500)) == 500


def test_secure_synthesis_under_zcdp_fits_a_budget_of_exactly_the_jobs_rho(
        tmp_path: Path) -> None:
    """``--aggregation secure --composition zcdp`` at sites whose zcdp ledgers hold exactly the
    job's (epsilon, delta): all four secure rounds are charged (each Skellam round's rho is at
    most its share, so the last one still fits) and the rhos add up to at most the job's. A
    zcdp site with half that budget is left out before the first round (it would have paid
    for some sums and refused a later one), charged nothing -- and stays out when the
    coordinator is SIGKILLed mid-job and resumes it (the decision is kept in the job store;
    deciding again would add it to the re-sent sums, whose changed tasks the other sites
    refuse); a second job is refused up front by every site, charging nothing."""
    eps, delta = 2.0, 1e-5
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=1500, features=6, seed=11, min_sites=2,
        task_deadline_s=60, mixed=True,
        settings=roomy_settings(allowed_jobs=("synth",), accountant="zcdp",
                                budget_epsilon=eps, budget_delta=delta))
    federation.write_site_config("hospital-3", roomy_settings(
        allowed_jobs=("synth",), accountant="zcdp", budget_epsilon=eps / 2,
        budget_delta=delta))
    full = ["hospital-1", "hospital-2"]
    for fed in running(federation):
        # the coordinator is SIGKILLed once the first sites paid for the pca sum; the resumed
        # job replays the paid sums from the ledgers (nothing is charged twice: the budgets
        # hold exactly one job) and finishes
        job = killed_and_resumed(
            fed, JobSpec("synth", eps, delta, {"aggregation": "secure", "composition": "zcdp"},
                         min_sites=2),
            lambda f=fed: wait_until(lambda: any(e.task_id.endswith("/pca-sum-1") for e in
                                                 charged_events(f, "hospital-1")), 90,
                                     "the pca sum's charge"))
        assert job.state == "succeeded", job.error
        with fed.analyst() as coord:
            model = coord.synth_result(job)
            frame = model.sample(1000)
            with pytest.raises(JobFailedError, match="budget_exceeded"):
                coord.synthesize(epsilon=eps, delta=delta, rows=100, aggregation="secure",
                                 composition="zcdp")
        outcome = {s.site_id: s for s in job.sites}
        assert outcome["hospital-3"].status == "refused"
        assert "budget_exceeded: the job needs rho=" in outcome["hospital-3"].reason
        assert charged_events(fed, "hospital-3") == []
        assert len(frame) == 1000 and model.metadata["params"]["composition"] == "zcdp"
        assert model.metadata["secure"]["participants"] == full
        rounds = model.metadata["secure"]["rounds"]
        for s in full:
            events = [e for e in charged_events(fed, s) if e.task_id.split("/")[-1].startswith(
                ("links-", "pca-", "pair_scores-", "pairs-"))]
            names = [e.task_id.split("/")[-1] for e in events]
            assert names == [f"{r}-sum-1" for r in ("links", "pca", "pair_scores",
                                                     "pairs")], names  # nothing for job 2
            first_job = events[:4]
            assert all(e.mechanism.startswith("secure-skellam[n=2,") for e in first_job)
            total = sum(e.rho for e in first_job)
            assert total <= rho_for_epsilon(eps, delta)
            assert zcdp_to_epsilon(total, delta) <= eps
            for e, (name, share) in zip(first_job, _rho_shares(model.metadata), strict=True):
                # planned to spend its share (not the ~85 % a calibration to its epsilon gives)
                assert 0.99 * share <= e.rho <= share * (1 + 1e-9), name
                r = rounds[name]
                assert e.epsilon == pytest.approx(r["epsilon"])  # the Skellam's own epsilon
                assert e.rho == pytest.approx(skellam_rho(r["noise_variance_integer"],
                                                          r["l2_sensitivity_integer"],
                                                          r["l1_sensitivity_integer"]))


def _rho_shares(meta: dict[str, object]) -> list[tuple[str, float]]:
    plan = meta["plan"]
    assert isinstance(plan, list)
    return [(p["round"], round_rho(p["epsilon"], p["delta"])) for p in plan]
