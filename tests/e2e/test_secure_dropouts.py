"""Dropout recovery end to end with real processes over mTLS: ten sites on a sparse neighbour
graph (each masks with and deals shares to 8 of the 9 others), two SIGKILLed once they have
dealt their shares (the coordinator announced the masked sum), and the secure PCA still
completes with the eight survivors, each charged once with noise sized for the drops; the
result matches the pooled data. And six real sites facing a hostile coordinator that shows
them different survivor sets reveal nothing."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.aggregator.simulate import pooled_reference
from dpfed.common.data.schema import Schema
from dpfed.common.pca.dppca import captured_energy, top_components
from dpfed.common.pca.features import UnitBallMap
from tests.e2e.federations import (
    charged_events,
    released_results,
    ring_uniformity_p,
    roomy_settings,
    running,
)
from tests.e2e.rogue_coordinator import RogueCoordinator
from tests.support.secure_driver import SumDriver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

KILLED = ("hospital-3", "hospital-8")


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        # ten sites, t = 1, d = 2: the smallest federation whose sum runs on a sparse graph
        # (degree 8 < 9; docs/secure-aggregation.md, "The neighbour graph")
        tmp_path / "fed", n_sites=10, rows=400, features=5, seed=11, min_sites=8,
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
        # one secure round (no automatic clip radius first): the drops happen in it
        result = coord.pca(2, epsilon=1000.0, delta=1e-5, aggregation="secure",
                           centering="none", clip_norm="schema", min_sites=8,
                           on_event=on_event)
    assert killed == list(KILLED)
    secure = result.metadata["secure"]
    assert secure["attempts"] == 1  # recovered, not retried
    assert secure["participants"] == sorted(fed.site_ids)
    assert secure["tolerated_dropouts"] == 2
    assert secure["neighbours"] == 8  # sparse: every site masked with 8 of the 9 others
    survivors = secure["survivors"]
    assert set(fed.site_ids) - set(KILLED) <= set(survivors)
    masked: list[np.ndarray] = []
    for site in fed.site_ids:
        events = charged_events(fed, site)
        if site in KILLED:
            assert len(events) <= 1  # charged only if it masked before it died
        else:  # each survivor charged exactly once, noise sized for n - t - d
            assert [e.mechanism for e in events] == ["secure-skellam[n=10,t=1,d=2]"]
            masked.append(released_results(fed, site)[0].arrays["masked"])
    # What the coordinator received from the survivors (each ledger keeps the bytes its site
    # sent) is uniform in the ring: their inputs stay masked (a survivor's self-mask is removed
    # only from the sum, with the other survivors' revealed shares). 8 x 15 values, 16 cells.
    assert ring_uniformity_p(np.concatenate(masked), bits=4) > 1e-6
    schema = Schema.load(fed.schema_path)
    paths = [fed.data_paths[s] for s in survivors]
    reference = pooled_reference(schema, paths, centred=False).matrix
    exact = top_components(reference, 2)
    assert captured_energy(result.components_, reference) / captured_energy(
        exact, reference) > 0.99


@pytest.fixture
async def rogue(tmp_path: Path) -> AsyncIterator[tuple[LocalFederation, RogueCoordinator]]:
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=6, rows=300, features=4, seed=3,
        settings=roomy_settings(secure_tolerated_dropouts=2))
    coordinator = RogueCoordinator(federation.certs)
    federation.port = await coordinator.start()
    for site_id in federation.site_ids:
        federation.start_site(site_id)
    try:
        await coordinator.wait_for(*federation.site_ids)
        yield federation, coordinator
    finally:
        # off the event loop: the rogue coordinator serves the sites' goodbyes meanwhile
        await asyncio.to_thread(federation.stop_all)
        await coordinator.stop()


async def test_a_coordinator_showing_sites_different_sets_gets_no_share(
        rogue: tuple[LocalFederation, RogueCoordinator]) -> None:
    """Six real site processes, a hostile coordinator: to unmask hospital-6 it tells three
    sites that hospital-6 dropped (they would reveal its key) and the other three that it
    survived (they would reveal its self-mask). Every site refuses before revealing a share."""
    fed, coordinator = rogue
    sites = fed.site_ids
    driver = SumDriver(coordinator.ask, job_id="20260101T000000-split1",
                       dim=UnitBallMap(Schema.load(fed.schema_path)).n_features,
                       total_rows=300 * len(sites))
    await driver.keys(sites)
    await driver.shares(sites, 1)
    plan = driver.plan(sites, 1, 2)
    await driver.contribute(plan)
    assert sorted(driver.answers["contribute"]) == sites  # every site masked and was charged
    target = "hospital-6"
    rest = [s for s in sites if s != target]
    await driver.confirm(sites, rest, sites=rest[:3])
    first = dict(driver.answers["confirm"])
    await driver.confirm(sites, sites, sites=[*rest[3:], target])
    second = dict(driver.answers["confirm"])
    assert len(first) == len(second) == 3  # each site signs the one view it is shown
    signatures = {k: v for r in (*first.values(), *second.values()) for k, v in r.arrays.items()}
    await driver.unmask(sites, rest, sites=rest[:3], signatures=signatures)
    await driver.unmask(sites, sites, sites=[*rest[3:], target], signatures=signatures)
    assert driver.answers["unmask"] == {}  # not one share revealed
    for s in sites:
        assert "showed sites different sets" in driver.refusals["unmask"][s].reason
        assert [e.mechanism for e in charged_events(fed, s)] == ["secure-skellam[n=6,t=1,d=2]"]


@pytest.fixture
def liar(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=4, rows=600, features=4, seed=7, min_sites=4,
        task_deadline_s=60, resume_wait_s=10, settings=roomy_settings())
    federation.start_coordinator()
    try:
        for site_id in federation.site_ids:
            if site_id != LIAR:
                federation.start_site(site_id)
        federation._spawn(LIAR, ["-m", "tests.support.lying_site", "--config",
                                 str(federation.site_config(LIAR)), "--coordinator",
                                 federation.address])
        federation.wait_for_sites()
        yield federation
    finally:
        federation.stop_all()


LIAR = "hospital-1"  # sorts first: its shares are the first an interpolation would take


def test_garbage_shares_from_one_site_are_not_used(liar: LocalFederation) -> None:
    """Four sites, t = 1 (threshold 3); hospital-1 reveals random bytes for every share. The
    coordinator checks each share against its dealer's commitment and rebuilds every mask from
    the three honest reveals: the secure PCA matches the pooled data."""
    with liar.analyst(timeout=120.0) as coord:
        result = coord.pca(2, epsilon=1000.0, delta=1e-5, aggregation="secure",
                           centering="none", min_sites=4)
    assert result.metadata["secure"]["attempts"] == 1
    schema = Schema.load(liar.schema_path)
    reference = pooled_reference(schema, list(liar.data_paths.values()), centred=False).matrix
    exact = top_components(reference, 2)
    assert captured_energy(result.components_, reference) / captured_energy(
        exact, reference) > 0.99
