"""Secure rounds against a coordinator that holds revoked (or unlisted) site kits (issue 19).

Real ``dpfed-site`` processes connect over mTLS to a hostile coordinator
(:mod:`tests.e2e.rogue_coordinator`) that speaks the real protocol with the federation's
coordinator certificate. It signs ephemeral keys with kits the federation revoked (or with a
certificate the CA issued outside the federation's site list) and puts them beside a real site
in a secure round: were the site to contribute, the coordinator would cancel every pair mask
it knows and recover the site's Gram matrix under a fraction of the noise the ledger records.
The site must refuse before anything is charged; an honest round between the real sites in
the same set-up still goes through.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.common.data.schema import Schema
from dpfed.common.pca.features import UnitBallMap
from dpfed.common.transport.certs import (
    certificate_pem,
    load_ca,
    make_certificate,
    private_key_pem,
    revoke_certificate,
)
from dpfed.common.transport.protocol import Refusal, TaskResult
from tests.e2e.federations import charged_events, roomy_settings
from tests.e2e.rogue_coordinator import RogueCoordinator, sign_as
from tests.support.secure_driver import SumDriver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

JOB = "20260101T000000-bad001"
REAL = ("hospital-1", "hospital-2")
Rogue = tuple[LocalFederation, RogueCoordinator]


@pytest.fixture
async def rogue(tmp_path: Path) -> AsyncIterator[Rogue]:
    fed = LocalFederation.create(tmp_path / "fed", n_sites=4, rows=300, features=4, seed=3,
                                 settings=roomy_settings())
    for site_id in ("hospital-3", "hospital-4"):  # `dpfed certs revoke site/...`
        revoke_certificate(fed.certs, role="site", name=site_id)
    # A certificate the CA signed for an id that is not on the federation's list.
    ca_cert, ca_key = load_ca(fed.certs)
    cert, key = make_certificate(ca_cert, ca_key, role="site", name="hospital-9")
    kit = fed.certs / "sites" / "hospital-9"
    kit.mkdir()
    (kit / "site.pem").write_bytes(certificate_pem(cert))
    (kit / "site.key").write_bytes(private_key_pem(key))
    coordinator = RogueCoordinator(fed.certs)
    fed.port = await coordinator.start()
    for site_id in REAL:
        fed.start_site(site_id)
    try:
        await coordinator.wait_for(*REAL)
        yield fed, coordinator
    finally:
        # off the event loop: the rogue coordinator serves the sites' goodbyes meanwhile
        await asyncio.to_thread(fed.stop_all)
        await coordinator.stop()


async def secure_round(fed: LocalFederation, coordinator: RogueCoordinator, attempt: int,
                       participants: list[str]) -> dict[str, TaskResult | Refusal]:
    """Run one secure Gram sum: real sites sign their own keys, the others are forged.

    Returns each real site's refusal of the shares stage (where every peer is verified), or
    its contribution when the whole sum went through.
    """
    driver = SumDriver(coordinator.ask, job_id=JOB, sum_round=f"pca-sum-{attempt}",
                       dim=UnitBallMap(Schema.load(fed.schema_path)).n_features,
                       total_rows=300 * len(participants))
    real = [s for s in participants if s in REAL]
    await driver.keys(real)
    relayed = driver.relayed()
    for site_id in set(participants) - set(real):
        relayed.update(sign_as(fed.certs, site_id, driver.context))
    await driver.shares(sorted(participants), 1, relayed=relayed, sites=real)
    if driver.refusals.get("shares"):
        return {s: driver.refusals["shares"].get(s) or driver.answers["shares"][s]
                for s in real}
    plan = driver.plan(sorted(participants), 1, 0)
    await driver.contribute(plan)
    await driver.confirm(sorted(participants), sorted(participants))
    await driver.unmask(sorted(participants), sorted(participants))
    driver.decode(plan)
    return dict(driver.answers["contribute"])


def refused(answer: TaskResult | Refusal, *words: str) -> bool:
    return (isinstance(answer, Refusal) and answer.code == "invalid"
            and all(w in answer.reason for w in words))


async def test_two_revoked_peers_and_t_1_are_refused_before_any_charge(rogue: Rogue) -> None:
    fed, coordinator = rogue
    answers = await secure_round(fed, coordinator, 1, ["hospital-1", "hospital-3", "hospital-4"])
    print(f"\nthe site's answer: {answers['hospital-1']}")
    assert refused(answers["hospital-1"], "secure round refused", "'hospital-3'",
                   "'hospital-4'", "revoked")
    assert charged_events(fed, "hospital-1") == []


async def test_one_revoked_or_one_unlisted_peer_is_refused_and_an_honest_round_passes(
        rogue: Rogue) -> None:
    fed, coordinator = rogue
    one_revoked = await secure_round(fed, coordinator, 1,
                                     ["hospital-1", "hospital-2", "hospital-3"])
    assert all(refused(a, "'hospital-3'", "revoked") for a in one_revoked.values()), one_revoked
    unlisted = await secure_round(fed, coordinator, 2, ["hospital-1", "hospital-2", "hospital-9"])
    assert all(refused(a, "'hospital-9'", "not one of the federation's sites")
               for a in unlisted.values()), unlisted
    for site_id in REAL:
        assert charged_events(fed, site_id) == []
    honest = await secure_round(fed, coordinator, 3, ["hospital-1", "hospital-2"])
    for site_id, answer in honest.items():
        assert isinstance(answer, TaskResult), answer
        (event,) = charged_events(fed, site_id)
        assert event.mechanism == "secure-skellam[n=2,t=1]"
