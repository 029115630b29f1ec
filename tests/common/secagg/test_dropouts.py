"""The pieces of dropout recovery without sites: the threshold's split-view argument checked
exhaustively, sealed shares that only their recipient opens, the plan's noise share and
mechanism with tolerated drops, and the policy summary that carries them."""

from __future__ import annotations

import os

import pytest

from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.secagg.dropouts import (
    Dealt,
    RoundKeys,
    deal,
    open_share,
    threshold,
)
from dpfed.common.secagg.graph import drop_capacity
from dpfed.common.secagg.masking import MaskContext
from dpfed.common.secagg.policy import SecureAggregationPolicy
from dpfed.common.secagg.secure_sum import SecureSumPlan, plan_gram
from dpfed.common.secagg.shamir import reconstruct

CTX = MaskContext("job", "gram-sum-1", "job/gram-sum-1")


def test_no_two_views_can_each_gather_the_threshold_and_colluders_cannot_rebuild() -> None:
    for n in range(2, 80):
        for t in range(n):
            big_t = threshold(n, t)
            # two views backed by T signatures each need 2T <= h + 2t' <= n + t signers
            assert 2 * big_t > n + t and big_t > t
            d = drop_capacity(n, n - 1, t)  # the complete graph
            if d >= 0:
                assert n - d >= big_t and n - t - d >= 1


def test_a_planted_majority_threshold_is_caught() -> None:
    def majority(n: int, t: int) -> int:  # ignores the colluders: t of them sign both views
        return n // 2 + 1

    assert any(2 * majority(n, t) <= n + t for n in range(3, 20) for t in range(1, n))


def test_sealed_shares_open_only_for_their_recipient_and_rebuild_the_secrets() -> None:
    ids = ["a", "b", "c", "d"]
    keys = {s: RoundKeys.generate() for s in ids}
    publics = {s: keys[s].public for s in ids}
    seed = os.urandom(32)
    dealt, own, _commit = deal(keys["a"], seed, own_id="a", publics=publics, context=CTX,
                               threshold_=3)
    assert sorted(dealt) == ["b", "c", "d"]
    opened = {s: open_share(keys[s], dealt[s], own_id=s, dealer="a",
                            dealer_public=publics["a"], context=CTX) for s in ("b", "c")}
    assert reconstruct({1: own, 2: opened["b"][0], 3: opened["c"][0]}, threshold=3) == seed
    rebuilt = reconstruct({2: opened["b"][1], 3: opened["c"][1], 4: open_share(
        keys["d"], dealt["d"], own_id="d", dealer="a", dealer_public=publics["a"],
        context=CTX)[1]}, threshold=3)
    assert rebuilt == keys["a"].mask_secret()
    with pytest.raises(ProtocolError, match="do not decrypt"):  # sealed for b, opened by c
        open_share(keys["c"], dealt["b"], own_id="c", dealer="a", dealer_public=publics["a"],
                   context=CTX)
    with pytest.raises(ProtocolError, match="do not decrypt"):  # another round
        open_share(keys["b"], dealt["b"], own_id="b", dealer="a", dealer_public=publics["a"],
                   context=MaskContext("job", "gram-sum-2", "job/gram-sum-2"))
    forged = Dealt(dealt["b"].sealed, dealt["c"].commit_self, dealt["b"].commit_key)
    with pytest.raises(ProtocolError, match="commitments"):
        open_share(keys["b"], forged, own_id="b", dealer="a", dealer_public=publics["a"],
                   context=CTX)


def test_the_share_and_mechanism_account_for_the_drops() -> None:
    plan = plan_gram(dim=3, total_rows=1000, epsilon=1.0, delta=1e-6,
                     participants=[f"s{i}" for i in range(8)], tolerated=1)
    drops = SecureSumPlan(*[getattr(plan, f) for f in (
        "statistic", "dim", "scale", "bound", "mu_total", "tolerated", "participants",
        "calibration")], 2)
    assert drops.share == pytest.approx(plan.mu_total / 5)
    assert plan.share == pytest.approx(plan.mu_total / 7)
    assert drops.cost().mechanism == "secure-skellam[n=8,t=1,d=2]"
    assert plan.cost().mechanism == "secure-skellam[n=8,t=1]"
    with pytest.raises(ValidationError, match="no honest survivor"):
        SecureSumPlan(*[getattr(plan, f) for f in (
            "statistic", "dim", "scale", "bound", "mu_total", "tolerated", "participants",
            "calibration")], 7)


def test_the_policy_summary_carries_the_tolerated_drops() -> None:
    policy = SecureAggregationPolicy("allowed", 4, 1, tolerated_dropouts=2)
    assert policy.summary() == "allowed, min 4 sites, t=1, d=2"
    assert SecureAggregationPolicy.from_summary(policy.summary()) == policy
    assert SecureAggregationPolicy("allowed", 2, 1).summary() == "allowed, min 2 sites, t=1"
    with pytest.raises(ValidationError, match="not a secure-aggregation policy summary"):
        SecureAggregationPolicy.from_summary("allowed, min 4 sites, t=1, x=2")
    with pytest.raises(ValidationError, match="secure_tolerated_dropouts"):
        SecureAggregationPolicy("allowed", 4, 1, tolerated_dropouts=-1)
