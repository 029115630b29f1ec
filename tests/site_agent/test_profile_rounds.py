"""The ``profile`` kind's two releases through the real site code: sensitivity, noise, ledger.

The searches replace one row of a table by every extreme record the encoding treats
differently (each column at its bounds, beyond them, missing, unparsable, undeclared) and push
both tables through the round's own ``prepare`` (the site's encoder and row policy included),
measuring how far the released vector moves before noise; each also runs against a planted
copy with half the stated sensitivity, which the search must catch. The noise tests check the
drawn sd against the stated calibration (and catch a planted half-sd copy); the runner test
charges a real ledger once and replays the stored bytes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from dpfed.aggregator.jobs.profile import means_with_sd, missing_rates, suggested_impute
from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.encoding import EncodedTable, EncodingReport, RowPolicy, encode_table
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.jobs import profile
from dpfed.common.jobs.contract import Ask, Budget, Site
from dpfed.common.jobs.profile import KIND, MEANS, POLICY, ProfileParams
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.privacy.mechanisms import GaussianMechanism, gaussian_sigma
from dpfed.common.transport.protocol import Refusal, Task, TaskResult
from dpfed.common.transport.wire import result_from_bytes
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner
from tests.support.schemas import row_policy_schema
from tests.support.tables import ZeroNoise, cost_of, produced

SCHEMA = row_policy_schema("category")
POLICY_RULES = RowPolicy(missing="drop", out_of_range="drop")
#: Every value each column can take that the encoding treats differently.
VALUES = {"a": ["-5", "5", "9", "", "abc"], "b": ["0", "1", ""],
          "w": ["x", "zzz", ""], "d": ["2020-01-01", "2020-12-31", "", "never"]}
BASE = pd.DataFrame([("1", "0.5", "y", "2020-06-01"), ("-2", "", "x", ""),
                     ("", "1", "q", "2020-02-02")], columns=list(VALUES))


class PolicyFrame:
    """A site's table in memory, read through the site's encoder under ``POLICY_RULES``."""

    def __init__(self, frame: pd.DataFrame) -> None:
        self.frame = frame

    @property
    def schema(self) -> Schema:
        return SCHEMA

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        for start in range(0, len(self.frame), 2):
            yield encode_table(SCHEMA, self.frame.iloc[start:start + 2], policy=POLICY_RULES)


def task(release: str, **params: Any) -> Task:
    return Task(f"j/{release}", "j", "profile", 1.0, 1e-5,
                {"columns": ["a", "d"], **params, "release": release})


def released(release: str, frame: pd.DataFrame) -> tuple[np.ndarray, float]:
    rnd = POLICY if release == "policy" else MEANS
    r = rnd.prepare(task(release), Site(PolicyFrame(frame)))
    return produced(r, ZeroNoise()).arrays["counts" if release == "policy" else "sums"], \
        cost_of(r).sensitivity


def worst_replacement(release: str) -> tuple[float, float]:
    vectors = []
    stated = 0.0
    for record in itertools.product(*VALUES.values()):
        table = BASE.copy()
        table.loc[0] = list(record)
        v, stated = released(release, table)
        vectors.append(v)
    x = np.array(vectors)
    diffs = x[:, None, :] - x[None, :, :]
    return float(np.sqrt(np.max(np.einsum("ijk,ijk->ij", diffs, diffs)))), stated


@pytest.mark.parametrize("release,bound", [("policy", math.sqrt(2 + 4 + 1)),
                                           ("means", 2 * math.sqrt(2))])
def test_sensitivity_search_reaches_the_stated_bound_and_catches_a_planted_copy(
        release: str, bound: float, monkeypatch: pytest.MonkeyPatch) -> None:
    worst, stated = worst_replacement(release)
    assert stated == pytest.approx(bound)
    assert worst <= stated + 1e-12
    assert worst == pytest.approx(stated)  # tight: the search finds the worst case
    name = "counts_mechanism" if release == "policy" else "sums_mechanism"
    honest = getattr(profile, name)
    monkeypatch.setattr(profile, name, lambda *a: GaussianMechanism(
        1.0, 1e-5, honest(*a).sensitivity / 2))  # planted: half the sensitivity
    assert worst > released(release, BASE)[1] * 1.5


@pytest.mark.parametrize("planted", [False, True])
@pytest.mark.parametrize("release", ["policy", "means"])
def test_noise_matches_the_stated_calibration(release: str, planted: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    exact, sens = released(release, BASE)
    if planted:
        name = "counts_mechanism" if release == "policy" else "sums_mechanism"
        monkeypatch.setattr(profile, name, lambda *a: GaussianMechanism(1.0, 1e-5, sens / 2))
    rnd = POLICY if release == "policy" else MEANS
    rng = np.random.default_rng(11)
    key = "counts" if release == "policy" else "sums"
    pending = rnd.prepare(task(release), Site(PolicyFrame(BASE)))
    draws = np.concatenate([produced(pending, rng).arrays[key] - exact for _ in range(400)])
    ok = abs(float(draws.std()) / gaussian_sigma(1.0, 1e-5, sens) - 1) < 0.05
    assert ok != planted


def test_parameters_are_checked_before_anything_is_charged() -> None:
    with pytest.raises(ValidationError, match="--aggregation 'secure' is not available"):
        KIND.canonical({"aggregation": "secure"}, 1.0, 1e-5, SCHEMA)
    with pytest.raises(ValidationError, match="--columns: 'w' is not a continuous or date"):
        KIND.canonical({"columns": "a,w"}, 1.0, 1e-5, SCHEMA)
    with pytest.raises(ValidationError, match="--delta must be > 0"):
        KIND.canonical({}, 1.0, 0.0, SCHEMA)
    assert KIND.canonical({}, 1.0, 1e-5, SCHEMA) == {"columns": ["a", "b", "d"]}
    params = KIND.parse({"columns": "a,d"}, SCHEMA)
    assert [(r.name, r.epsilon, r.delta) for r in KIND.plan(params, 1.0, 1e-5)] == [
        ("policy", 0.5, 5e-6), ("means", 0.5, 5e-6)]
    only = KIND.parse({"columns": []}, SCHEMA)
    assert [(r.name, r.epsilon) for r in KIND.plan(only, 1.0, 1e-5)] == [("policy", 1.0)]
    with pytest.raises(ValidationError, match="release 'policy' or 'means'"):
        MEANS.prepare(task("policy"), Site(PolicyFrame(BASE)))


def test_the_real_runner_charges_once_replays_and_refuses_secure(tmp_path: Path) -> None:
    csv = tmp_path / "data.csv"
    BASE.to_csv(csv, index=False)
    source = open_data_source(spec_from_path(csv, policy=POLICY_RULES), SCHEMA)
    runner = TaskRunner(source, Ledger(tmp_path / "ledger.sqlite", BudgetPolicy(5.0, 1e-4)),
                        ("profile",))
    secure = runner.run(task("policy", aggregation="secure"))
    assert isinstance(secure, Refusal) and "--aggregation" in secure.reason
    assert runner.ledger.events() == []
    first = runner.run(task("policy"))
    assert isinstance(first, bytes)
    result = result_from_bytes(first)
    assert result.metadata["n_rows"] == 2 and result.arrays["counts"].shape == (8,)
    assert runner.run(task("policy")) == first  # a retried task replays its bytes
    assert isinstance(runner.run(task("means")), bytes)
    assert [e.mechanism for e in runner.ledger.events()] == ["gaussian", "gaussian"]


def ask(columns: list[str]) -> Ask[ProfileParams, None]:
    params = KIND.parse({"columns": columns}, SCHEMA)
    return Ask(params, SCHEMA, None, Budget(0.5, 5e-6))


def test_coordinator_checks_hostile_releases_and_pools_what_a_user_reads() -> None:
    a = ask(["a", "d"])
    honest = TaskResult("j/policy", cost_of(POLICY.prepare(task("policy"), Site(
        PolicyFrame(BASE)))), {"counts": np.zeros(8)}, {"n_rows": 2})
    POLICY.check(honest, a)
    for bad in (np.full(8, 1e300), np.zeros(7)):
        with pytest.raises(ProtocolError):
            POLICY.check(TaskResult("j/policy", honest.spend, {"counts": bad},
                                    {"n_rows": 2}), a)
    with pytest.raises(ProtocolError, match="beyond"):
        MEANS.check(TaskResult("j/means", honest.spend, {"sums": np.array([1e9, 0, 1, 1.0])},
                               {"n_rows": 2}), a)
    # two sites: 100 kept rows each, 10 dropped; column a missing in 20 + 0 rows read
    counts = POLICY.pool({s: TaskResult("t", honest.spend, {"counts": np.array(
        [10.0, 0, 0, m, 0, 0, 0, 0])}, {"n_rows": 100}) for s, m in (("s1", 20.0), ("s2", 0.0))},
        a)
    assert missing_rates(SCHEMA, counts)[0] == pytest.approx(20 / 220)
    # 100 observed values of a at its centre + 2.5, of d at its upper bound
    sums = MEANS.pool({"s1": TaskResult("t", honest.spend, {"sums": np.array(
        [50.0, 100.0, 100.0, 100.0])}, {"n_rows": 100})}, a)
    means, sds = means_with_sd(SCHEMA, sums)
    assert means[0] == pytest.approx(2.5) and sds[0] > 0
    assert suggested_impute(SCHEMA, "d", float(means[1])) == "2020-12-31"


def test_the_printed_tables_and_the_report_read_a_result_file() -> None:
    from dpfed.aggregator.profile_report import profile_report, profile_text
    from dpfed.aggregator.result_file import encode_result

    meta = {"job_id": "j", "epsilon": 1.0, "delta": 1e-5, "count_names": ["dropped: missing"],
            "columns": ["a"], "policy_sigma": 2.5, "policy_epsilon": 0.5, "policy_delta": 5e-6,
            "sites": [{"site_id": "s1", "n_rows": 9}], "mean_columns": ["d"],
            "means_epsilon": 0.5, "means_delta": 5e-6, "impute": {"d": "2020-12-31"}}
    data = encode_result({"policy_counts": np.array([[3.25]]), "missing_rate": np.array([0.5]),
                          "means": np.array([18627.0]), "mean_sd": np.array([1.5])}, meta)
    text = profile_text(data)
    assert "noise sd 2.5" in text and "3.2" in text and "50.00%" in text
    assert "2020-12-31" in text and "impute" in text
    assert "2020-12-31" in profile_report(data).render()
