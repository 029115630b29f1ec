"""End to end with real processes: the federated ``synth`` job over mTLS gRPC.

Coordinator and sites run as separate processes with SQLite ledgers; the coordinator is
SIGKILLed between rounds (after the links round) and during the pairs round, and restarted; a
site drops between rounds.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpfed.aggregator.client import Coordinator
from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.aggregator.synth_model import SynthModel
from dpfed.common.data.schema import ContinuousColumn, Schema
from dpfed.common.errors import JobFailedError, ValidationError
from dpfed.common.transport.protocol import JobSpec
from tests.e2e.federations import (
    charged_events,
    killed_and_resumed,
    roomy_settings,
    running,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


#: The rounds of a default (generative, site-level) synth job, sorted.
ROUNDS = ["links", "pair_scores", "pairs", "pca"]


def ledger_tasks(fed: LocalFederation, site_id: str) -> list[str]:
    return [e.task_id for e in charged_events(fed, site_id)]


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=1500, features=8, seed=5, min_sites=2,
        task_deadline_s=60, resume_wait_s=45, mixed=True,
        settings=roomy_settings(allowed_jobs=("pca", "synth", "synth_rows", "synth_eval")))
    yield from running(federation)



def test_generative_synthesis_end_to_end(fed: LocalFederation, tmp_path: Path) -> None:
    schema = Schema.load(fed.schema_path)
    with fed.analyst() as coord:
        frame, model = coord.synthesize(epsilon=4.0, delta=1e-5, rows=5000, evaluate_rows=800)
        job = coord.jobs(1)[0]
    # --evaluate: every site wrote its own report; nothing was charged for it.
    for s in fed.site_ids:
        report = fed.site_dir(s) / "evaluations" / job.job_id / "synth_evaluation.html"
        assert report.exists() and "not sent anywhere" in report.read_text()
    assert job.summary["evaluated_sites"] == fed.site_ids
    # --evaluate: every site held out min(N/5, 20000) rows from every round and trained on
    # the rest (the public training count); the model records which sites each round used.
    assert [(s["n_rows"], s["n_holdout"]) for s in model.metadata["sites"]] == [(1200, 300)] * 3
    assert model.metadata["n_rows_total"] == 3600
    assert model.metadata["rounds"] == dict.fromkeys(
        ("links", "pca", "pair_scores", "pairs"), fed.site_ids)
    assert job.state == "succeeded" and [s.status for s in job.sites] == ["ok"] * 3
    assert list(frame.columns) == list(schema.names) and len(frame) == 5000
    for col in schema.columns:
        if isinstance(col, ContinuousColumn):
            assert frame[col.name].between(col.min, col.max).all()
        else:
            assert isinstance(frame[col.name].dtype, pd.CategoricalDtype)
    # One charge per site per round (four rounds), with the split the plan states.
    plan = {p["round"]: p for p in model.metadata["plan"]}
    for s in fed.site_ids:
        events = charged_events(fed, s)
        assert sorted(e.task_id.split("/")[-1] for e in events) == ROUNDS
        for e in events:
            assert e.epsilon == pytest.approx(plan[e.task_id.split("/")[-1]]["epsilon"])
    assert sum(p["epsilon"] for p in plan.values()) == pytest.approx(4.0)
    assert plan["pairs"]["epsilon"] == pytest.approx(0.48)  # the default split: 12 %
    # The pair rounds chose a forest of column pairs; the model corrects rows towards their
    # DP 2-way tables, and the file keeps the correction.
    edges = model.metadata["pair_edges"]
    assert len(edges) == len(schema.columns) - 1 == job.summary["pairs"]  # a spanning tree
    assert model.pair_correction is not None and model.pair_correction.edges == [
        tuple(e) for e in edges]
    assert model.metadata["pair_edge_columns"] == [[schema.names[a], schema.names[b]]
                                                   for a, b in edges]
    # The model round-trips through a file and samples more rows without the coordinator.
    path = model.save(tmp_path / "model.npz")
    again = SynthModel.load(path)
    assert len(again.sample(1234)) == 1234
    assert again.pair_correction is not None and again.pair_correction.edges == (
        model.pair_correction.edges)
    # Pooled real marginals vs synthetic marginals (eps=4: close).
    real = pd.concat([pd.read_csv(p) for p in fed.data_paths.values()])
    for col in schema.columns:
        if not isinstance(col, ContinuousColumn):
            r = real[col.name].astype(str).value_counts(normalize=True)
            f = frame[col.name].astype(str).value_counts(normalize=True)
            tvd = 0.5 * sum(abs(r.get(k, 0.0) - f.get(k, 0.0)) for k in set(r.index) | set(f.index))
            assert tvd < 0.08, (col.name, tvd)


def test_row_aligned_releases_one_row_per_real_row(fed: LocalFederation) -> None:
    with fed.analyst() as coord:
        frame, model = coord.synthesize(epsilon=6.0, delta=1e-5, mode="row-aligned")
        with pytest.raises(ValidationError, match="--rows"):
            coord.synthesize(epsilon=6.0, delta=1e-5, mode="row-aligned", rows=10)
    assert len(frame) == 4500 and model.n_rows_fixed == 4500
    for s in fed.site_ids:
        assert sorted(t.split("/")[-1] for t in ledger_tasks(fed, s)) == [
            "factors", "links", "pca"]


def test_coordinator_killed_between_rounds_resumes_with_one_charge_per_round(
        fed: LocalFederation) -> None:
    # hospital-3 is frozen: round 1 completes at two sites, then the coordinator dies.
    fed.signal("hospital-3", signal.SIGSTOP)
    final = killed_and_resumed(
        fed, JobSpec("synth", 2.0, 1e-5, {}, min_sites=3),
        lambda: wait_until(lambda: len(ledger_tasks(fed, "hospital-1")) == 1 and
                           len(ledger_tasks(fed, "hospital-2")) == 1, 60,
                           "two sites to charge round 1"),
        before_restart=lambda: fed.signal("hospital-3", signal.SIGCONT))
    with fed.analyst() as coord:
        model = coord.synth_result(final)
    assert final.state == "succeeded", final.error
    for s in fed.site_ids:
        tasks = ledger_tasks(fed, s)
        assert sorted(tasks) == [f"{final.job_id}/{r}" for r in ROUNDS], tasks
    assert len(model.sample(100)) == 100


def test_coordinator_killed_during_the_pairs_round_resumes_with_the_same_pairs_task(
        fed: LocalFederation) -> None:
    """SIGKILL the coordinator as soon as a site has paid for the ``pairs`` round.

    The resumed job re-sends ``pair_scores`` (every site answers from its ledger) and must
    derive the same forest of pairs from those answers, so that its ``pairs`` task is identical
    to the one that site already answered: a site refuses a changed task under a task id it
    has charged, which would fail the job. One charge per site per round, and a model with
    pair tables.
    """
    final = killed_and_resumed(
        fed, JobSpec("synth", 2.0, 1e-5, {}, min_sites=3),
        lambda: wait_until(lambda: any(task.endswith("/pairs") for task in
                                       ledger_tasks(fed, "hospital-1")), 90, "the pairs charge"))
    with fed.analyst() as coord:
        model = coord.synth_result(final)
    assert final.state == "succeeded", final.error
    for s in fed.site_ids:
        assert sorted(ledger_tasks(fed, s)) == [f"{final.job_id}/{r}" for r in ROUNDS], s
    assert model.pair_correction is not None and model.metadata["pair_edges"]
    assert model.metadata["rounds"]["pairs"] == fed.site_ids


def test_site_without_budget_for_every_round_is_left_out_before_any_charge(
        tmp_path: Path) -> None:
    # hospital-3's budget covers rounds 1-3 only (links 1.2, pca 0.5, pair_scores 0.06 of
    # epsilon 2): it would refuse the pairs round after paying for three. It is left out
    # before the first charge instead (its remaining budget is checked against every round),
    # and the job runs with the quorum (min_sites=2): every round from two sites.
    fed = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=1500, features=8, seed=6, min_sites=2,
        task_deadline_s=60, mixed=True,
        settings=roomy_settings(allowed_jobs=("pca", "synth")))
    fed.write_site_config("hospital-3", SiteSettings(
        budget_epsilon=1.8, budget_delta=0.1, connect_timeout_s=30,
        allowed_jobs=("pca", "synth"), accountant="basic"))  # basic: the rounds add up
    fed.start_coordinator()
    fed.start_sites()
    try:
        fed.wait_for_sites()
        with fed.analyst() as coord:
            job = coord.submit(JobSpec("synth", 2.0, 1e-5, {}, min_sites=2))
        assert job.state == "succeeded", job.error
        statuses = {s.site_id: (s.status, s.reason) for s in job.sites}
        assert statuses["hospital-1"][0] == statuses["hospital-2"][0] == "ok"
        assert statuses["hospital-3"][0] == "refused"
        assert "budget" in statuses["hospital-3"][1]
        assert ledger_tasks(fed, "hospital-3") == []
        with fed.analyst() as coord:
            model = coord.synth_result(job)
        two = ["hospital-1", "hospital-2"]
        assert model.metadata["rounds"] == {"links": two, "pca": two, "pair_scores": two,
                                            "pairs": two}
        assert model.metadata["n_rows_total"] == 3000  # the sites of the last round
        assert job.summary["sites"] == 2 and model.pair_correction is not None
        # With min_sites=3 the same situation fails the job (quorum), naming the quorum.
        with fed.analyst() as coord:
            failed = coord.submit(JobSpec("synth", 2.0, 1e-5, {}, min_sites=3))
        assert failed.state == "failed" and "min_sites=3" in failed.error
        assert "nothing was charged" in failed.error and ledger_tasks(fed, "hospital-3") == []
    finally:
        fed.stop_all()


def test_late_site_gets_no_later_round_and_policy_sites_send_a_dp_summary(
        tmp_path: Path) -> None:
    # hospital-3 connects while round 1 is under way (hospital-2 is frozen, so round 1 waits
    # for it): it must not be sent round 2, computed from sums it took no part in. hospital-1's
    # policy allows DP evaluation summaries; hospital-2's does not.
    from dpfed.aggregator.synth_report import synth_report
    from dpfed.common.evaluation.site_holdout import KEY_FILE

    settings = roomy_settings(allowed_jobs=("pca", "synth", "synth_eval"))
    fed = LocalFederation.create(tmp_path / "fed", n_sites=3, rows=1500, features=8, seed=7,
                                 min_sites=2, task_deadline_s=60, mixed=True, settings=settings)
    fed.write_site_config("hospital-1", roomy_settings(
        allowed_jobs=("pca", "synth", "synth_eval"), evaluation_summary="dp"))
    fed.start_coordinator()
    fed.start_site("hospital-1")
    fed.start_site("hospital-2")
    outcome: dict[str, object] = {}
    try:
        fed.wait_for_sites(2)
        fed.signal("hospital-2", signal.SIGSTOP)

        def submit() -> None:
            try:
                with fed.analyst(timeout=180) as coord:
                    outcome["result"] = coord.synthesize(
                        epsilon=3.0, delta=1e-5, rows=2000, min_sites=2, evaluate_rows=500,
                        evaluate_summary=(0.5, 1e-6))
            except Exception as exc:  # noqa: BLE001 -- reported below
                outcome["error"] = exc

        t = threading.Thread(target=submit, daemon=True)
        t.start()
        wait_until(lambda: len(ledger_tasks(fed, "hospital-1")) == 1, 60,
                    "hospital-1 to charge round 1")
        fed.start_site("hospital-3")

        def third_connected() -> bool:
            with fed.analyst() as coord:
                return any(s.site_id == "hospital-3" and s.connected and s.row_count > 0
                           for s in coord.sites())

        wait_until(third_connected, 60, "hospital-3 to connect")
        fed.signal("hospital-2", signal.SIGCONT)
        t.join(180)
        assert "error" not in outcome, outcome.get("error")
        _frame, model = outcome["result"]  # type: ignore[misc]
        two = ["hospital-1", "hospital-2"]
        assert model.metadata["rounds"] == dict.fromkeys(
            ("links", "pca", "pair_scores", "pairs"), two)
        assert ledger_tasks(fed, "hospital-3") == []
        assert not (fed.site_dir("hospital-3") / "evaluations").exists()
        # The DP summary: asked of hospital-1 only, charged there before it left.
        ev = model.metadata["evaluation"]
        assert ev["local_report_sites"] == two and ev["summary_sites_asked"] == ["hospital-1"]
        summary = ev["summaries"]["hospital-1"]
        assert list(ev["summaries"]) == ["hospital-1"]
        assert (summary["n_train"], summary["n_holdout"], summary["epsilon"]) == (1200, 300, 0.5)
        assert all(abs(v) < 1.0 for v in summary["tvd"].values())
        assert sorted(t.split("/")[-1] for t in ledger_tasks(fed, "hospital-1")) == [
            "evaluate_summary", "links", "pair_scores", "pairs", "pca"]
        assert sorted(t.split("/")[-1] for t in ledger_tasks(fed, "hospital-2")) == ROUNDS
        for s in two:
            assert (fed.site_dir(s) / KEY_FILE).exists()
        html = synth_report(model, model.sample(500))
        assert "Evaluation at the sites" in html and "hospital-1" in html
        # --plan lists the summary's charge at hospital-1 only; `dpfed sites` shows the policy.
        import subprocess
        import sys

        kit = fed.certs / "analysts" / "analyst"
        conn = ["--coordinator", fed.address, "--ca", str(kit / "ca.pem"), "--cert",
                str(kit / "analyst.pem"), "--key", str(kit / "analyst.key")]
        dpfed = [sys.executable, "-m", "dpfed.aggregator.cli"]
        plan = subprocess.run([*dpfed, "synth", "--epsilon", "2", "--delta", "1e-5", "--plan",
                               "--evaluate", "--evaluate-summary-epsilon", "0.25", *conn],
                              capture_output=True, text=True, timeout=120)
        assert plan.returncode == 0, plan.stderr
        lines = plan.stdout.splitlines()
        assert any(x.startswith("hospital-1") and "evaluate_summary" in x and "0.25" in x
                   for x in lines), plan.stdout
        assert sum("evaluate_summary: not asked" in x for x in lines) == 2
        sites = subprocess.run([*dpfed, "sites", *conn], capture_output=True, text=True,
                               timeout=60)
        assert "eval summary" in sites.stdout
        row = next(x for x in sites.stdout.splitlines() if x.startswith("hospital-1"))
        assert row.rstrip().endswith("dp")
    finally:
        fed.stop_all()


def test_budget_too_small_for_the_cells_fails_before_any_charge(fed: LocalFederation) -> None:
    with fed.analyst() as coord, pytest.raises(JobFailedError, match="--epsilon"):
        coord.synthesize(epsilon=0.001, delta=1e-9, rows=10)
    for s in fed.site_ids:
        assert ledger_tasks(fed, s) == []


def test_rows_out_of_range_is_refused_before_submission(fed: LocalFederation) -> None:
    with fed.analyst() as coord:
        for bad in (0, -5, 10**12):
            with pytest.raises(ValidationError, match="--rows"):
                coord.synthesize(epsilon=1.0, delta=1e-5, rows=bad)
        for pairs, groups, flag in ((-1, None, "--pairs"), (2, 1, "--pair-groups")):
            with pytest.raises(ValidationError, match=flag):
                coord.synthesize(epsilon=1.0, delta=1e-5, rows=10, pairs=pairs,
                                 pair_groups=groups)
        assert coord.jobs(5) == []
    assert np.all([ledger_tasks(fed, s) == [] for s in fed.site_ids])


def test_cli_synth_plan_run_and_sample(fed: LocalFederation, tmp_path: Path) -> None:
    import subprocess
    import sys

    import pyarrow.parquet as pq

    kit = fed.certs / "analysts" / "analyst"
    conn = ["--coordinator", fed.address, "--ca", str(kit / "ca.pem"), "--cert",
            str(kit / "analyst.pem"), "--key", str(kit / "analyst.key")]
    dpfed = [sys.executable, "-m", "dpfed.aggregator.cli"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*dpfed, *args], capture_output=True, text=True, timeout=180,
                              cwd=tmp_path)

    plan = run("synth", "--epsilon", "2", "--delta", "1e-5", "--plan", *conn)
    assert plan.returncode == 0, plan.stderr
    rows = [line.split() for line in plan.stdout.splitlines() if line.startswith("hospital")]
    assert [r[1:3] for r in rows[:4]] == [["links", "1.2"], ["pca", "0.5"],
                                          ["pair_scores", "0.06"], ["pairs", "0.24"]]
    assert len(rows) == 12 and "--pairs" in plan.stdout  # 3 sites x 4 rounds
    no_pairs = run("synth", "--epsilon", "2", "--delta", "1e-5", "--plan", "--pairs", "0",
                   *conn)
    assert no_pairs.returncode == 0, no_pairs.stderr
    rows = [line.split() for line in no_pairs.stdout.splitlines()
            if line.startswith("hospital")]
    assert [r[1:3] for r in rows[:2]] == [["links", "1.6"], ["pca", "0.4"]] and len(rows) == 6
    for bad_args, flag in ((("--pairs", "-1"), "--pairs"), (("--pair-groups", "99"),
                                                             "--pair-groups"),
                           (("--mode", "row-aligned", "--pairs", "2"), "--pairs")):
        refused = run("synth", "--epsilon", "2", "--delta", "1e-5", "--plan", *bad_args,
                      *conn)
        assert refused.returncode != 0 and flag in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    zcdp = run("synth", "--epsilon", "2", "--delta", "1e-5", "--plan", "--composition", "zcdp",
               *conn)
    assert zcdp.returncode == 0, zcdp.stderr
    assert "--composition zcdp" in zcdp.stdout and "(2, 1e-05)-DP by zCDP composition" in (
        zcdp.stdout)
    # these sites' ledgers use the basic accountant: none would take part, each is named
    assert zcdp.stdout.count("not taking part: hospital-") == 3
    assert "'zcdp' accountant" in zcdp.stdout
    rows = [line.split()[1:] for line in zcdp.stdout.splitlines()
            if line.startswith("(every site)")]
    assert [r[1] for r in rows[:4]] == ["links", "pca", "pair_scores", "pairs"]
    assert sum(float(r[2]) for r in rows[:4]) > 3.0  # each round's own epsilon; rho adds
    secure_zcdp = run("synth", "--epsilon", "2", "--delta", "1e-5", "--plan", "--composition",
                      "zcdp", "--aggregation", "secure", *conn)
    assert secure_zcdp.returncode == 0, secure_zcdp.stderr
    assert "at most its share of rho" in secure_zcdp.stdout
    assert "(2, 1e-05)-DP by zCDP composition" in secure_zcdp.stdout
    summary_plan = run("synth", "--epsilon", "2", "--delta", "1e-5", "--plan", "--evaluate",
                       "--evaluate-summary-epsilon", "0.3", *conn)
    assert summary_plan.returncode == 0, summary_plan.stderr
    assert summary_plan.stdout.count("evaluate_summary: not asked") == 3  # no site allows it
    assert "holds out" in summary_plan.stdout
    no_eval = run("synth", "--epsilon", "2", "--delta", "1e-5", "--plan",
                  "--evaluate-summary-epsilon", "0.3", *conn)
    assert no_eval.returncode != 0 and "--evaluate" in no_eval.stderr
    assert "Traceback" not in no_eval.stderr
    assert all(ledger_tasks(fed, s) == [] for s in fed.site_ids)  # --plan charges nothing
    bad = run("synth", "--epsilon", "2", "--delta", "1e-5", "--rows", "0", *conn)
    assert bad.returncode != 0 and "--rows" in bad.stderr and "Traceback" not in bad.stderr
    ok = run("synth", "--epsilon", "3", "--delta", "1e-5", "--rows", "3000", "--out",
             "t.csv", "--evaluate", "--evaluate-rows", "300", "--pairs", "2",
             "--pair-groups", "4", *conn)
    assert ok.returncode == 0, ok.stderr
    assert all(list((fed.site_dir(s) / "evaluations").glob("*/synth_evaluation.html"))
               for s in fed.site_ids)
    assert len(pd.read_csv(tmp_path / "t.csv")) == 3000
    assert (tmp_path / "synth_model.npz").exists() and (tmp_path / "report.html").exists()
    cli_model = SynthModel.load(tmp_path / "synth_model.npz")
    assert len(cli_model.metadata["pair_edges"]) == 2 and cli_model.metadata["pair_groups"] == 4
    assert "Column pairs (DP 2-way marginals)" in (tmp_path / "report.html").read_text()
    more = run("synth-sample", "synth_model.npz", "--rows", "7777", "--out", "more.parquet")
    assert more.returncode == 0, more.stderr
    assert pq.read_table(tmp_path / "more.parquet").num_rows == 7777
    nomodel = run("synth-sample", "missing.npz", "--rows", "5", "--out", "x.parquet")
    assert nomodel.returncode == 4 and "no such model file" in nomodel.stderr, nomodel.stderr


def test_simulate_job_synth_leaves_every_output(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "sim"
    run = subprocess.run([sys.executable, "-m", "dpfed.aggregator.cli", "simulate", "--job",
                          "synth", "--sites", "2", "--rows", "1500", "--features", "8",
                          "--epsilon", "3", "--synth-rows", "4000", "--seed", "2", "--out",
                          str(out)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (out / "synth.parquet").exists() and (out / "synth_model.npz").exists()
    html = (out / "report.html").read_text()
    assert "data:image/png" in html and "Column pairs (DP 2-way marginals)" in html
    assert "column pairs 7" in run.stdout  # 8 columns: a spanning tree of 7 pairs
    for site in ("hospital-1", "hospital-2"):
        assert list((out / "sites" / site / "evaluations").glob("*/synth_evaluation.html"))
    model = SynthModel.load(out / "synth_model.npz")
    assert model.sample(10).shape == (10, 8)
    # The demo schema's whole-unit columns (age, blood pressure) come out as whole numbers.
    integer = [c.name for c in model.schema.columns
               if isinstance(c, ContinuousColumn) and c.integer]
    assert "age" in integer
    rows = pd.read_parquet(out / "synth.parquet")
    for name in integer:
        assert rows[name].dtype == np.int64, name  # written as integers, not 37.0


def test_zcdp_composition_charges_the_jobs_rho_and_leaves_basic_ledgers_out(
        tmp_path: Path) -> None:
    """``composition=zcdp``: the rounds' rhos at a zcdp site add up to the job's rho.

    hospital-1 and -2 account in zCDP, hospital-3 in basic epsilon: hospital-3 is refused
    (it would be charged about 1.7 epsilon) and charged nothing, in the first run and after
    the coordinator is SIGKILLed once the zcdp sites paid for round 1 and restarted (the
    resumed job waits for two *zcdp* sites, not any two). Every round the zcdp sites charge
    is the analytic Gaussian at the plan's (epsilon_i, delta_i), whose rho is the round's
    share of the job's; the four together convert back to at most the job's (epsilon, delta).
    """
    from dpfed.common.job_params import SYNTH_PAIRS_DEFAULT_SPLIT
    from dpfed.common.privacy.accounting import rho_for_epsilon, zcdp_to_epsilon

    zcdp = roomy_settings(allowed_jobs=("synth",), accountant="zcdp")
    fed = LocalFederation.create(tmp_path / "fed", n_sites=3, rows=1500, features=8, seed=9,
                                 min_sites=2, task_deadline_s=60, resume_wait_s=45,
                                 mixed=True, settings=roomy_settings(allowed_jobs=("synth",)))
    for site in ("hospital-1", "hospital-2"):
        fed.write_site_config(site, zcdp)
    fed.start_coordinator()
    fed.start_sites()
    eps, delta = 1.0, 1e-6
    port = fed.port

    def submit() -> None:
        try:
            with fed.analyst() as coord:
                coord.submit(Coordinator.synth_spec(epsilon=eps, delta=delta,
                                                    composition="zcdp", min_sites=2))
        except Exception:  # noqa: BLE001, S110 -- the stream dies with the coordinator
            pass

    try:
        fed.wait_for_sites()
        t = threading.Thread(target=submit, daemon=True)
        t.start()
        wait_until(lambda: all(len(ledger_tasks(fed, s)) >= 1
                                for s in ("hospital-1", "hospital-2")), 60,
                    "the zcdp sites to pay for round 1")
        fed.signal("coordinator", signal.SIGKILL)
        fed.wait("coordinator")
        t.join(30)
        fed.start_coordinator(port=port)
        with fed.analyst() as coord:
            job = coord.watch(coord.jobs(1)[0].job_id)
            assert job.state == "succeeded", job.error
            model = coord.synth_result(job)
        outcome = {s.site_id: (s.status, s.reason) for s in job.sites}
        # The resumed run may finish before hospital-3 dials back in; if it saw it, it refused it.
        if "hospital-3" in outcome:
            assert outcome["hospital-3"][0] == "refused"
            assert "'zcdp' accountant" in outcome["hospital-3"][1]
        assert charged_events(fed, "hospital-3") == []
        rho_job = rho_for_epsilon(eps, delta)
        shares = {name: e for name, (e, _d) in SYNTH_PAIRS_DEFAULT_SPLIT.items()}
        for site in ("hospital-1", "hospital-2"):
            events = charged_events(fed, site)
            assert [e.task_id for e in events] == [f"{job.job_id}/{r}" for r in shares]
            for e in events:
                # The ledger's rho is the noise actually drawn: sensitivity^2 / (2 sigma^2).
                assert e.rho == pytest.approx(e.sensitivity ** 2 / (2 * e.noise_scale ** 2),
                                              rel=1e-9)
                assert e.rho <= shares[e.task_id.split("/")[-1]] * rho_job
            total = sum(e.rho for e in events)
            assert rho_job * (1 - 1e-6) <= total <= rho_job
            assert zcdp_to_epsilon(total, delta) <= eps
            # Each round's own epsilon is honest and larger than its basic share.
            assert sum(e.epsilon for e in events) > 1.5 * eps
        assert model.metadata["params"]["composition"] == "zcdp"
        assert len(model.sample(50)) == 50
        # With every site connected, a second job names the reason hospital-3 is left out.
        fed.wait_for_sites()
        with fed.analyst() as coord:
            again = coord.submit(Coordinator.synth_spec(epsilon=eps, delta=delta,
                                                        composition="zcdp", min_sites=2))
        assert again.state == "succeeded", again.error
        refused = {s.site_id: s.reason for s in again.sites if s.status == "refused"}
        assert list(refused) == ["hospital-3"] and "'zcdp' accountant" in refused["hospital-3"]
        assert charged_events(fed, "hospital-3") == []
        from dpfed.aggregator.synth_report import synth_report
        html = synth_report(model, model.sample(300))
        assert "zCDP composition" in html and "rho" in html
    finally:
        fed.stop_all()
