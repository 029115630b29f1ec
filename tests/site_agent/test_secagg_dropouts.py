"""Dropout recovery and the consistency check at real sites (TaskRunner, real ledgers, real
certificates from the project's CA tool), the coordinator's side driven by hand through its own
checks and recovery: sites that vanish after dealing their shares leave a sum that still
decodes with every survivor charged once; a late site stays masked; a coordinator that shows
sites different sets, or relays too few or forged signatures, is refused before any reveal;
tampered shares are refused before the charge and never used by the coordinator."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.errors import ProtocolError
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.secagg.dropouts import (
    RevealRecord,
    commitment,
    mask_public,
    recovery_correction,
)
from dpfed.common.secagg.masking import derive_pair_seed, mask_stream
from dpfed.common.secagg.messages import signed_key_from_arrays
from dpfed.common.secagg.policy import SecureAggregationPolicy
from dpfed.common.secagg.secure_sum import SecureSumPlan
from dpfed.common.secagg.shamir import reconstruct
from dpfed.common.transport.certs import init_federation
from dpfed.common.transport.protocol import Refusal, Task
from dpfed.site_agent.handlers import default_handlers
from dpfed.site_agent.handlers.secagg import SecureAggregationHandler, SiteIdentity
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner
from tests.support.schemas import AGE_BMI as SCHEMA
from tests.support.secure_driver import SumDriver, runner_ask

SITES = [f"hospital-{i}" for i in range(1, 7)]
ROWS = 200


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fed") / "f"
    init_federation(root, coordinator_hosts=["localhost"], sites=SITES, analysts=[])
    return root


def _runner(tmp_path: Path, site: str, fed: Path) -> TaskRunner:
    csv = tmp_path / f"{site}.csv"
    rng = np.random.default_rng(int(site.rsplit("-", 1)[1]))
    pd.DataFrame({"age": rng.uniform(0, 100, ROWS), "bmi": rng.uniform(10, 60, ROWS)}).to_csv(
        csv, index=False)
    kit = fed / "sites" / site
    handler = SecureAggregationHandler(
        SiteIdentity.load(kit / "ca.pem", kit / "site.pem", kit / "site.key"),
        SecureAggregationPolicy(min_participants=2, tolerated=1, tolerated_dropouts=2,
                                federation_list=kit / "revoked.toml"))
    return TaskRunner(open_data_source(spec_from_path(csv), SCHEMA),
                      Ledger(tmp_path / f"{site}.sqlite", BudgetPolicy(1e5, 1e-2)),
                      ("pca", "secagg"), handlers={**default_handlers(), "secagg": handler})


@pytest.fixture
def runners(tmp_path: Path, fed: Path) -> dict[str, TaskRunner]:
    return {s: _runner(tmp_path, s, fed) for s in SITES}


def _driver(runners: dict[str, TaskRunner]) -> SumDriver:
    return SumDriver(runner_ask(runners), epsilon=1000.0, total_rows=ROWS * len(SITES))


def _exact(runners: dict[str, TaskRunner], driver: SumDriver, plan: SecureSumPlan,
           site: str) -> np.ndarray:
    """The site's exact integer Gram (fresh randomised rounding) through the round's code."""
    return driver.exact_gram(runners[site].data, plan)


def test_two_sites_vanishing_after_dealing_leave_a_sum_that_decodes(
        runners: dict[str, TaskRunner]) -> None:
    driver = _driver(runners)
    gone = ("hospital-2", "hospital-5")
    plan, total = asyncio.run(driver.run(SITES, tolerated=1, wanted_drops=2,
                                         vanish_after_shares=gone))
    survivors = [s for s in SITES if s not in gone]
    assert plan.dropouts == 2 and sorted(driver.answers["contribute"]) == survivors
    # the survivors' pooled Gram, within noise and rounding
    reference = sum(_exact(runners, driver, plan, s) for s in survivors)
    scale = ROWS * len(survivors) * plan.bound ** 2
    assert np.max(np.abs(total - reference)) / scale < 2e-3
    for s in SITES:
        events = runners[s].ledger.events()
        if s in gone:
            assert events == []
        else:  # charged once, with noise sized for n - t - d honest survivors
            (event,) = events
            assert event.mechanism == "secure-skellam[n=6,t=1,d=2]"
            assert event.noise_scale == pytest.approx((plan.mu_total / 3) ** 0.5)


def test_a_late_site_is_never_unmasked(runners: dict[str, TaskRunner]) -> None:
    driver = _driver(runners)
    late = "hospital-4"
    plan, _total = asyncio.run(driver.run(SITES, tolerated=1, wanted_drops=2,
                                          vanish_after_shares=(late,)))
    participants = list(plan.participants)
    survivors = sorted(driver.answers["contribute"])
    # the late site's masked vector arrives after the sum was unmasked without it
    late_answer = asyncio.run(driver.contribute(plan, sites=[late]))[late]
    masked = late_answer.arrays["masked"]
    # The coordinator rebuilt the late site's mask key from the reveals: it strips every
    # pairwise mask of that site -- and is left with the self-mask, which nobody revealed.
    keys = driver.answers["keys"]
    publics = {s: mask_public(signed_key_from_arrays(keys[s].arrays, s).public_key)
               for s in participants}
    position = {s: x for x, s in enumerate(participants, start=1)}
    key_shares = {position[r]: a.arrays[f"key/{late}"].tobytes()
                  for r, a in driver.answers["unmask"].items()}
    key = X25519PrivateKey.from_private_bytes(
        reconstruct(key_shares, threshold=driver.recovery(plan).threshold))
    residual = masked.copy()
    for peer in participants:
        if peer != late:
            stream = mask_stream(derive_pair_seed(key, publics[peer], own_id=late, peer_id=peer,
                                                  context=driver.context), plan.n_values)
            residual = residual - stream if late < peer else residual + stream
    exact = _exact(runners, driver, plan, late)
    # Unmasked, every entry would be within noise of the statistic; with the self-mask left it
    # is a uniform ring element (all three within 2^40 of it: probability 2^-69).
    diff = np.abs(residual.view(np.int64).astype(np.float64) - exact)
    assert np.max(diff) > 2.0 ** 40
    # every survivor refuses to sign (and so to reveal for) a view with the late site in it
    signed = asyncio.run(driver.confirm(participants, sorted([*survivors, late])))
    assert sorted(signed) == [late]  # one signature, far below the threshold of 4
    for s in survivors:
        reason = driver.refusals["confirm"][s].reason
        assert "already signed other participant and survivor sets" in reason


def test_a_coordinator_showing_different_sets_is_refused_before_any_reveal(
        runners: dict[str, TaskRunner]) -> None:
    driver = _driver(runners)
    target = "hospital-6"

    async def go() -> None:
        await driver.keys(SITES)
        await driver.shares(SITES, 1)
        plan = driver.plan(SITES, 1, 2)
        await driver.contribute(plan)  # everyone contributed, the target too
        rest = [s for s in SITES if s != target]
        # to unmask the target: tell half it dropped (key shares), half it survived (self)
        half_a, half_b = rest[:3], [*rest[3:], target]
        await driver.confirm(SITES, rest, sites=half_a)
        signed_a = dict(driver.answers["confirm"])
        await driver.confirm(SITES, SITES, sites=half_b)
        signed_b = dict(driver.answers["confirm"])
        sigs = {k: v for r in (*signed_a.values(), *signed_b.values())
                for k, v in r.arrays.items()}
        only_a = {k: v for r in signed_a.values() for k, v in r.arrays.items()}
        # (1) each half with only its own half's signatures: too few signed its view
        await driver.unmask(SITES, rest, sites=half_a, signatures=only_a)
        assert driver.answers["unmask"] == {}
        assert all("revealing needs 4" in driver.refusals["unmask"][s].reason for s in half_a)
        # (2) every signature relayed: the other half's do not sign this site's sets
        await driver.unmask(SITES, rest, sites=half_a, signatures=sigs)
        await driver.unmask(SITES, SITES, sites=half_b, signatures=sigs)
        assert driver.answers["unmask"] == {}
        for s in SITES:
            assert "showed sites different sets" in driver.refusals["unmask"][s].reason
        # (3) a site asked to sign the other view refuses: one view per sum
        await driver.confirm(SITES, SITES, sites=half_a)
        assert all("already signed" in driver.refusals["confirm"][s].reason for s in half_a)

    asyncio.run(go())


def test_tampered_or_misaddressed_shares_are_refused_before_the_charge(
        runners: dict[str, TaskRunner]) -> None:
    driver = _driver(runners)

    async def go() -> None:
        await driver.keys(SITES)
        await driver.shares(SITES, 1)
        shares = driver.answers["shares"]
        # the coordinator flips a bit of one sealed share addressed to hospital-1
        tampered = dict(shares["hospital-3"].arrays)
        sealed = tampered["sealed/hospital-1"].copy()
        sealed[20] ^= 1
        tampered["sealed/hospital-1"] = sealed
        driver.answers["shares"] = {**shares, "hospital-3": dataclasses.replace(
            shares["hospital-3"], arrays=tampered)}
        await driver.contribute(driver.plan(SITES, 1, 2), sites=["hospital-1", "hospital-2"])
        assert sorted(driver.answers["contribute"]) == ["hospital-2"]
        reason = driver.refusals["contribute"]["hospital-1"].reason
        assert "'hospital-3' do not decrypt" in reason
        assert runners["hospital-1"].ledger.events() == []

    asyncio.run(go())


def test_the_coordinator_never_uses_a_share_that_fails_its_commitment(
        runners: dict[str, TaskRunner]) -> None:
    driver = _driver(runners)
    plan, honest = asyncio.run(driver.run(SITES, tolerated=1, wanted_drops=2,
                                          vanish_after_shares=("hospital-3",)))
    survivors = sorted(driver.answers["contribute"])
    # hospital-1 (the first share the interpolation would use) reveals garbage shares
    liar = driver.answers["unmask"]["hospital-1"]
    garbage = {k: np.frombuffer(bytes(66), np.uint8).copy() + 1 for k in liar.arrays}
    driver.answers["unmask"]["hospital-1"] = dataclasses.replace(liar, arrays=garbage)
    again = driver.decode(plan)  # the liar's shares are skipped: still the same sum
    np.testing.assert_array_equal(again, honest)
    # a planted coordinator that trusts every revealed share is wrong, or fails
    recovery = driver.recovery(plan)
    revealed = {r: {k.split("/")[0]: {} for k in a.arrays} for r, a in recovery.revealed.items()}
    trusting: dict[tuple[str, str, str], bytes] = {}
    for r, a in recovery.revealed.items():
        for name, arr in a.arrays.items():
            kind, owner = name.split("/", 1)
            revealed[r].setdefault(kind, {})[owner] = arr.tobytes()
            trusting[(owner, r, kind)] = commitment(driver.context, owner, r, kind,
                                                    arr.tobytes())
    publics = {s: mask_public(signed_key_from_arrays(driver.answers["keys"][s].arrays,
                                                     s).public_key) for s in SITES}
    results = driver.answers["contribute"]
    summed = sum((results[s].arrays["masked"] for s in survivors),
                 start=np.zeros(plan.n_values, np.uint64))
    try:
        wrong = summed - recovery_correction(
            n_values=plan.n_values, order=SITES, survivors=survivors, mask_publics=publics,
            revealed=revealed, commitments=trusting, threshold_=recovery.threshold,
            context=driver.context)
        assert not np.array_equal(wrong.view(np.int64), honest)
    except ProtocolError:
        pass  # the garbage rebuilt a key that does not match: also not the sum


def test_a_reveal_of_both_kinds_for_one_site_is_refused() -> None:
    record = RevealRecord()
    record.allow(["a", "b"], ["c"])
    record.allow(["a", "b"], ["c"])  # the same reveal again is fine
    with pytest.raises(Exception, match="both masks"):
        record.allow(["a", "c"], ["b"])
    with pytest.raises(Exception, match="both survivor and dropped"):
        RevealRecord().allow(["a"], ["a"])
    assert record.kinds == {"a": "self", "b": "self", "c": "key"}


def test_too_many_drops_are_refused_by_the_survivors(runners: dict[str, TaskRunner]) -> None:
    driver = _driver(runners)

    async def go() -> None:
        await driver.keys(SITES)
        await driver.shares(SITES, 1)
        plan = driver.plan(SITES, 1, 2)
        await driver.contribute(plan, sites=SITES[:3])  # three vanished: one more than d
        await driver.confirm(SITES, SITES[:3])
        assert driver.answers["confirm"] == {}
        assert all("needs at least 4" in r.reason for r in driver.refusals["confirm"].values())

    asyncio.run(go())


def test_a_stage_without_the_keys_stage_is_refused(runners: dict[str, TaskRunner]) -> None:
    answer = runners["hospital-1"].run(Task(
        "j/x-unmask-1", "j", "secagg", 0.0, 0.0,
        {"stage": "unmask", "job_id": "j", "sum_round": "x-sum-1", "sum_task_id": "j/x-sum-1",
         "participants": SITES, "survivors": SITES}))
    assert isinstance(answer, Refusal) and "no ephemeral key" in answer.reason
