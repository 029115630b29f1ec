"""The coordinator's validation of ``query --aggregation secure`` (before anything is sent or
charged) and the client's parameters."""

from __future__ import annotations

from typing import Any

import pytest

from dpfed.aggregator.federation import Federation
from dpfed.common.data.demo_data import demo_model
from dpfed.common.errors import ValidationError
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


@pytest.mark.parametrize(("params", "delta", "match"), [
    ({**BASE, "aggregation": "secure"}, 0.0, "needs delta"),
    ({**BASE, "aggregation": "secure", "noise": "laplace"}, 1e-6, "not 'laplace'"),
    ({**BASE, "aggregation": "pooled"}, 1e-6, "aggregation must be one of"),
])
def test_secure_query_bad_input(params: dict[str, Any], delta: float, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        _validate(params, delta)
