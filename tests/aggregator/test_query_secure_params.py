"""The coordinator's validation of ``query --aggregation secure`` (before anything is sent or
charged) and the client's parameters."""

from __future__ import annotations

from typing import Any

import pytest

from dpfed.aggregator.federation import Federation
from dpfed.common.data.demo_data import demo_model
from dpfed.common.errors import ValidationError
from dpfed.common.jobs.contract import Ask, Budget
from dpfed.common.jobs.query import QUERY, choose
from dpfed.common.jobs.registry import job_kind
from dpfed.common.transport.protocol import JobSpec

FED = Federation(demo_model(12, seed=0, mixed=True).schema)
BASE: dict[str, Any] = {"domain": {"columns": ["ward"]}, "workload": "identity"}


def validate(kind: str, spec: JobSpec, federation: Federation) -> dict[str, object]:
    """The canonical parameters of ``spec`` (what the coordinator stores and sends)."""
    return job_kind(kind).canonical(spec.params, spec.epsilon, spec.delta, federation.schema)


def _validate(params: dict[str, Any], delta: float) -> dict[str, Any]:
    return validate("query", JobSpec("query", 1.0, delta, params), FED)


def test_secure_is_recorded_in_the_canonical_parameters_and_site_level_unchanged() -> None:
    assert _validate({**BASE, "aggregation": "secure"}, 1e-6)["aggregation"] == "secure"
    site = _validate({**BASE, "aggregation": "site"}, 0.0)
    assert "aggregation" not in site and site == _validate(BASE, 0.0)


def test_new_secure_jobs_choose_their_noise_and_stored_ones_keep_skellam() -> None:
    """A new job stores ``secure_noise = "auto"`` (and may run pure epsilon); a job stored
    before the discrete Laplace existed has no key, parses as Skellam and re-serialises to the
    same mapping (its tasks replay byte-identically)."""
    new = _validate({**BASE, "aggregation": "secure"}, 0.0)
    assert new["secure_noise"] == "auto"
    kind = job_kind("query")
    stored = {**BASE, "aggregation": "secure", "noise": "auto", "strategy": "auto",
              "workload": {"kind": "identity"}, "reconstruction": "least_squares"}
    old = kind.parse(stored, FED.schema)
    assert old.secure_noise == "skellam" and old.secure_noises(1e-6) == ("gaussian",)
    assert kind.parse(stored, FED.schema).to_mapping() == old.to_mapping()
    assert "secure_noise" not in old.to_mapping()
    assert kind.parse(new, FED.schema).secure_noises(1e-6) == ("laplace", "gaussian")
    assert kind.parse(new, FED.schema).secure_noises(0.0) == ("laplace",)


@pytest.mark.parametrize(("params", "delta", "match"), [
    ({**BASE, "aggregation": "secure", "secure_noise": "skellam"}, 0.0, "needs delta"),
    ({**BASE, "aggregation": "secure", "secure_noise": "dlaplace"}, 1e-6, "delta must be 0"),
    ({**BASE, "aggregation": "secure", "secure_noise": "gaussian"}, 1e-6, "secure_noise must"),
    ({**BASE, "aggregation": "secure", "noise": "laplace"}, 1e-6, "site-level noise"),
    ({**BASE, "aggregation": "pooled"}, 1e-6, "aggregation must be one of"),
])
def test_secure_query_bad_input(params: dict[str, Any], delta: float, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        _validate(params, delta)


def _secure_task(raw: dict[str, Any], delta: float) -> tuple[str, dict[str, Any], Budget]:
    """The noise a secure query picks, its secure-sum task parameters and its task budget."""
    params = job_kind("query").parse(raw, FED.schema)
    budget = Budget(1.0, delta)
    chosen = choose(params, params.workload_in(FED.schema), budget, draws=1, secure=True)
    ask = Ask(params, FED.schema, chosen, QUERY.task_budget(budget, chosen))
    return chosen.pick.noise, dict(QUERY.encoding(ask).params), ask.budget


def test_stored_secure_queries_send_the_same_skellam_task_and_new_ones_the_discrete_laplace(
        ) -> None:
    """A stored job (no ``secure_noise``) ranks Skellam only and its secure-sum task carries
    no noise key -- the task the sites stored before, so a resumed job replays it; a new job
    on the same marginal picks the discrete Laplace, names it, and charges no delta."""
    raw = {"domain": {"columns": ["ward", "severity"]},
           "workload": {"kind": "marginals", "k": 2}, "aggregation": "secure"}
    noise, params, budget = _secure_task(raw, 1e-6)
    assert noise == "gaussian" and "noise" not in params and budget.delta == 1e-6
    assert set(params) == {"source", "domain", "strategy"}
    noise, params, budget = _secure_task(_validate(raw, 1e-6), 1e-6)
    assert noise == "laplace" and params["noise"] == "dlaplace" and budget.delta == 0.0
