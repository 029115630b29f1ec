"""Dropout recovery end to end with real processes over mTLS: eight sites, two SIGKILLed once
they have dealt their shares (the coordinator announced the masked sum), and the secure PCA
still completes with the six survivors, each charged once with noise sized for the drops; the
result matches the pooled data."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.aggregator.simulate import pooled_reference
from dpfed.common.data.schema import Schema
from dpfed.common.pca.dppca import captured_energy, top_components
from tests.e2e.federations import charged_events, roomy_settings, running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

KILLED = ("hospital-3", "hospital-6")


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=8, rows=600, features=5, seed=11, min_sites=4,
        task_deadline_s=60, resume_wait_s=10,
        settings=roomy_settings(secure_tolerated_dropouts=2))
    yield from running(federation)


def test_two_sites_killed_after_dealing_leave_a_secure_pca_that_completes(
        fed: LocalFederation) -> None:
    killed: list[str] = []

    def on_event(event: object) -> None:
        message = str(getattr(event, "message", ""))
        if "attempt 1:" in message and "dropouts" in message and not killed:
            for site in KILLED:  # they dealt shares; the masked sum is being collected
                fed.signal(site, signal.SIGKILL)
                killed.append(site)

    with fed.analyst(timeout=120.0) as coord:
        result = coord.pca(2, epsilon=1000.0, delta=1e-5, aggregation="secure",
                           centering="none", min_sites=4, on_event=on_event)
    assert killed == list(KILLED)
    secure = result.metadata["secure"]
    assert secure["attempts"] == 1  # recovered, not retried
    assert secure["participants"] == fed.site_ids and secure["tolerated_dropouts"] == 2
    survivors = secure["survivors"]
    assert set(fed.site_ids) - set(KILLED) <= set(survivors)
    for site in fed.site_ids:
        events = charged_events(fed, site)
        if site in KILLED:
            assert len(events) <= 1  # charged only if it masked before it died
        else:  # each survivor charged exactly once, noise sized for n - t - d
            assert [e.mechanism for e in events] == ["secure-skellam[n=8,t=1,d=2]"]
    schema = Schema.load(fed.schema_path)
    paths = [fed.data_paths[s] for s in survivors]
    reference = pooled_reference(schema, paths, centred=False).matrix
    exact = top_components(reference, 2)
    assert captured_energy(result.components_, reference) / captured_energy(
        exact, reference) > 0.99
