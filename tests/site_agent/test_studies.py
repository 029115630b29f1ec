"""Study budgets at the site: the cap and the expiry are checked with the charge, a study the
site does not hold is refused, and bad ``[studies.NAME]`` values name the key."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest

from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.errors import BudgetExceededError, ConfigError
from dpfed.common.privacy.accounting import BudgetPolicy, PrivacyCost
from dpfed.common.transport.protocol import Refusal, RefusalCode, Task
from dpfed.common.transport.wire import budget_from_proto, budget_to_proto
from dpfed.site_agent.config import load_site_config
from dpfed.site_agent.ledger import Ledger, StudyBudget
from dpfed.site_agent.runner import TaskRunner
from tests.common.test_config import SITE, write
from tests.site_agent.test_approvals import CountingData
from tests.support.schemas import AGE_BMI

DIGEST = "ab" * 32
TODAY = datetime.now(UTC).date()


def ledger(tmp_path: Path, **studies: StudyBudget) -> Ledger:
    return Ledger(tmp_path / "ledger.sqlite", BudgetPolicy(5.0, 1e-4, accountant="basic"),
                  studies=studies)


def charge(led: Ledger, task_id: str, epsilon: float, study: str = "") -> bytes:
    return led.charge_and_release(
        task_id=task_id, job_id="job", kind="pca", payload_digest=DIGEST,
        cost=PrivacyCost(epsilon, 0.0, epsilon ** 2 / 2, "laplace", 1.0, 1.0),
        release=lambda: b"released", study=study).result


def test_a_study_cap_refuses_what_would_exceed_it(tmp_path: Path) -> None:
    led = ledger(tmp_path, trial=StudyBudget(1.5, TODAY + timedelta(days=30)))
    charge(led, "t1", 1.0, "trial")
    with pytest.raises(BudgetExceededError, match="study 'trial' would exceed its budget"):
        charge(led, "t2", 1.0, "trial")
    charge(led, "t3", 1.0)  # outside the study: only the total applies
    assert [e.task_id for e in led.events()] == ["t1", "t3"]
    assert led.studies() == {"t1": "trial"}
    [study] = led.status().studies
    assert (study.name, study.status.epsilon_spent, study.status.epsilon_remaining) == (
        "trial", 1.0, 0.5)
    assert [r.reason for r in led.refusals()] == ["budget_exceeded"]
    # The study's status travels with the site's budget report.
    assert budget_from_proto(budget_to_proto(led.status())) == led.status()


def test_an_expired_or_unknown_study_is_refused(tmp_path: Path) -> None:
    led = ledger(tmp_path, old=StudyBudget(4.0, TODAY - timedelta(days=1)),
                 today=StudyBudget(4.0, TODAY))
    charge(led, "t0", 0.5, "today")  # the last day still counts
    with pytest.raises(BudgetExceededError, match=f"study 'old' expired at this site on "
                                                  f"{(TODAY - timedelta(days=1)).isoformat()}"):
        charge(led, "t1", 0.5, "old")
    with pytest.raises(BudgetExceededError, match="no budget for study 'other'"):
        led.check_study("other")
    assert [e.task_id for e in led.events()] == ["t0"]
    assert StudyBudget(1.0, date(2027, 6, 30)).expired(date(2027, 7, 1))
    assert not StudyBudget(1.0, date(2027, 6, 30)).expired(date(2027, 6, 30))


def test_the_runner_refuses_an_expired_study_before_reading_rows(tmp_path: Path) -> None:
    csv = tmp_path / "data.csv"
    csv.write_text("age,bmi\n" + "".join(f"{20 + i % 60},{15 + i % 40}\n" for i in range(50)))
    counted = CountingData(open_data_source(spec_from_path(csv), AGE_BMI))
    led = ledger(tmp_path, old=StudyBudget(4.0, TODAY - timedelta(days=1)))
    runner = TaskRunner(counted, led, ("pca",))
    params = {"n_components": 1, "rank": 2, "centering": "none", "clip_norm": "schema"}
    refused = runner.run(Task("j/pca", "j", "pca", 1.0, 1e-5, params, study="old"))
    assert isinstance(refused, Refusal) and refused.code is RefusalCode.BUDGET_EXCEEDED
    assert "study 'old' expired" in refused.reason
    assert counted.passes == 0 and led.events() == []
    # The same task without a study has the digest it had before studies existed.
    plain = Task("j/pca", "j", "pca", 1.0, 1e-5, params)
    assert plain.digest() == Task("j/pca", "j", "pca", 1.0, 1e-5, params, study="x").digest()


def test_studies_from_site_toml(tmp_path: Path) -> None:
    text = SITE + ("\n[studies.trial]\nepsilon = 2.0\nexpires = 2027-06-30\n"
                   "\n[studies.other]\nepsilon = 1.0\nexpires = \"2028-01-31\"\n")
    cfg = load_site_config(write(tmp_path, text))
    assert cfg.studies == {"trial": StudyBudget(2.0, date(2027, 6, 30)),
                           "other": StudyBudget(1.0, date(2028, 1, 31))}


@pytest.mark.parametrize("extra, match", [
    ("[studies.trial]\nexpires = 2027-06-30\n", "missing required key studies.trial.epsilon"),
    ("[studies.trial]\nepsilon = 20.0\nexpires = 2027-06-30\n",
     "studies.trial.epsilon = 20 exceeds budget.epsilon = 10"),
    ("[studies.trial]\nepsilon = -1\nexpires = 2027-06-30\n", "studies.trial.epsilon must be"),
    ("[studies.trial]\nepsilon = 1\n", "missing required key studies.trial.expires"),
    ("[studies.trial]\nepsilon = 1\nexpires = \"next june\"\n",
     "studies.trial.expires must be a date"),
    ("[studies.trial]\nepsilon = 1\nexpires = 2027-06-30T00:00:00\n",
     "studies.trial.expires must be a date"),
    ("[studies.trial]\nepsilon = 1\nexpires = 2027-06-30\ncap = 3\n",
     r"unknown key\(s\) \['cap'\] in \[studies.trial\]"),
    ("[studies.\"a b\"]\nepsilon = 1\nexpires = 2027-06-30\n", "studies.a b: study id must be"),
])
def test_bad_study_values_name_the_key(tmp_path: Path, extra: str, match: str) -> None:
    path = write(tmp_path, SITE + "\n" + extra)
    with pytest.raises(ConfigError, match=match) as info:
        load_site_config(path)
    assert str(path) in str(info.value)
