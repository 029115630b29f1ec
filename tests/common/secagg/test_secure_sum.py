"""A secure sum end to end in-process: four sites with real keys and certificates, the decoded
pooled statistic, its noise variance against the plan (a half-share copy is caught), the
sensitivity of rounded rows found by search (a copy that ignores rounding is caught), and every
policy refusal."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from scipy import stats

from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.job_params import SYNTH_PAIRS_DEFAULT_SPLIT
from dpfed.common.privacy.composition import round_rho, split_budget
from dpfed.common.secagg.keys import generate_ephemeral, sign_ephemeral
from dpfed.common.secagg.masking import MaskContext
from dpfed.common.secagg.secure_sum import (
    SecureSumPlan,
    decode_sum,
    integer_gram_upper,
    integer_row_sum,
    plan_for,
    plan_from_scale,
    plan_gram,
    plan_row_sum,
    plan_within_rho,
    site_contribution,
)
from tests.common.secagg.conftest import SITES

CTX = MaskContext("job-7", "pca", "job-7/pca")


def _run(fed: Path, plan: SecureSumPlan, stats_by_site: dict[str, np.ndarray],
         rng: np.random.Generator, *, share_factor: float = 1.0) -> dict[str, np.ndarray]:
    ca = x509.load_pem_x509_certificate((fed / "ca.pem").read_bytes())
    keys = {s: generate_ephemeral() for s in plan.participants}
    signed = {}
    for s in plan.participants:
        kit = fed / "sites" / s
        signing = serialization.load_pem_private_key((kit / "site.key").read_bytes(), None)
        signed[s] = sign_ephemeral(site_id=s, public_key=keys[s][1], context=CTX,
                                   signing_key=signing,  # type: ignore[arg-type]
                                   certificate_pem=(kit / "site.pem").read_bytes())
    effective = plan
    if share_factor != 1.0:  # planted: every site adds a fraction of its share
        effective = SecureSumPlan(plan.statistic, plan.dim, plan.scale, plan.bound,
                                  plan.mu_total * share_factor, plan.tolerated,
                                  plan.participants, plan.calibration)
    return {s: site_contribution(stats_by_site[s], plan=effective, own_id=s,
                                 own_key=keys[s][0], signed_keys=signed, context=CTX, ca=ca,
                                 min_participants=2, tolerated=0, rng=rng)
            for s in plan.participants}


def _rows(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.normal(size=(n, d)) @ np.diag(np.linspace(2, 0.2, d))
    return x / np.maximum(1.0, np.linalg.norm(x, axis=1))[:, None]


def test_decoded_sum_is_the_pooled_gram_at_high_epsilon(fed: Path) -> None:
    rng = np.random.default_rng(11)
    d, n = 6, 500
    data = {s: _rows(rng, n, d) for s in SITES}
    plan = plan_gram(dim=d, total_rows=4 * n, epsilon=5000.0, delta=1e-6, participants=SITES)
    stat = {s: integer_gram_upper([data[s][:200], data[s][200:]], plan, rng) for s in SITES}
    decoded = decode_sum(_run(fed, plan, stat, rng), plan)
    pooled = sum(x.T @ x for x in data.values())[np.triu_indices(d)]
    assert np.max(np.abs(decoded - pooled)) / (4 * n) < 2e-3


def _noise_p_value(fed: Path, factor: float) -> float:
    rng = np.random.default_rng(12)
    d = 30
    plan = plan_row_sum(dim=d, total_rows=1000, epsilon=1.0, delta=1e-5, participants=SITES)
    draws = []
    for _ in range(40):
        stat = {s: np.zeros(d, dtype=np.int64) for s in SITES}
        decoded = decode_sum(_run(fed, plan, stat, rng, share_factor=factor), plan)
        draws.append(decoded * plan.scale)  # back to integer units: pure noise
    noise = np.concatenate(draws)
    chi = float(np.sum(noise ** 2) / plan.mu_total)
    return float(2 * min(stats.chi2.cdf(chi, noise.size), stats.chi2.sf(chi, noise.size)))


def test_sum_carries_the_planned_variance_and_half_shares_are_caught(fed: Path) -> None:
    assert _noise_p_value(fed, 1.0) > 1e-3
    assert _noise_p_value(fed, 0.5) < 1e-6


def _extreme_rows(d: int) -> list[np.ndarray]:
    rows = []
    for i in range(d):
        for sign in (1.0, -1.0):
            e = np.zeros(d)
            e[i] = sign
            rows.append(e)
    rows.append(np.full(d, 1 / math.sqrt(d)))
    rows.append(np.zeros(d))
    return rows


def _max_change(plan: SecureSumPlan, stat_fn, rng: np.random.Generator) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    worst2 = worst1 = 0.0
    rows = _extreme_rows(plan.dim)
    for x in rows:
        for y in rows:
            for _ in range(5):  # the rounding is random: try several draws
                a = stat_fn([x[None, :]], plan, rng).astype(np.float64)
                b = stat_fn([y[None, :]], plan, rng).astype(np.float64)
                worst2 = max(worst2, float(np.linalg.norm(a - b)))
                worst1 = max(worst1, float(np.abs(a - b).sum()))
    return worst2, worst1


@pytest.mark.parametrize("statistic", ["gram", "row_sum"])
def test_searched_sensitivity_stays_within_the_plan(statistic: str) -> None:
    rng = np.random.default_rng(13)
    d = 4
    make = plan_gram if statistic == "gram" else plan_row_sum
    fn = integer_gram_upper if statistic == "gram" else integer_row_sum
    plan = make(dim=d, total_rows=100, epsilon=1.0, delta=1e-5, participants=SITES[:2])
    l2, l1 = plan.calibration.l2_sensitivity, plan.calibration.l1_sensitivity
    worst2, worst1 = _max_change(plan, fn, rng)
    assert worst2 <= l2 * (1 + 1e-12) and worst1 <= l1 * (1 + 1e-12)
    # A copy that ignores the rounding (sensitivity from the real scale alone) is exceeded.
    degree = 2 if statistic == "gram" else 1
    naive = (math.sqrt(2.0) if degree == 2 else 2.0) * plan.scale ** degree
    assert worst2 > naive


def test_policy_refusals(fed: Path) -> None:
    rng = np.random.default_rng(14)
    plan = plan_row_sum(dim=3, total_rows=10, epsilon=1.0, delta=1e-5, participants=SITES[:2])
    stat = {s: np.zeros(3, dtype=np.int64) for s in plan.participants}
    ca = x509.load_pem_x509_certificate((fed / "ca.pem").read_bytes())
    key, _ = generate_ephemeral()
    common = {"plan": plan, "own_id": SITES[0], "own_key": key, "signed_keys": {},
              "context": CTX, "ca": ca, "rng": rng}
    with pytest.raises(ValidationError, match="requires at least 3"):
        site_contribution(stat[SITES[0]], min_participants=3, tolerated=0, **common)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="colluding"):
        site_contribution(stat[SITES[0]], min_participants=2, tolerated=1, **common)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="do not match"):
        site_contribution(stat[SITES[0]], min_participants=2, tolerated=0, **common)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="more than 2 participants"):
        plan_row_sum(dim=3, total_rows=10, epsilon=1.0, delta=1e-5, participants=SITES[:2],
                     tolerated=2)
    masked = _run(fed, plan, stat, rng)
    masked.pop(SITES[1])
    with pytest.raises(ProtocolError, match="retry the round"):
        decode_sum(masked, plan)


def test_tolerating_colluders_raises_each_share() -> None:
    a = plan_row_sum(dim=3, total_rows=10, epsilon=1.0, delta=1e-5, participants=SITES)
    b = plan_row_sum(dim=3, total_rows=10, epsilon=1.0, delta=1e-5, participants=SITES,
                     tolerated=2)
    assert b.share == pytest.approx(a.share * 2)
    assert b.share * (4 - 2) == pytest.approx(b.mu_total)


@pytest.mark.parametrize(("statistic", "dim", "row_norm"), [
    ("weighted_counts", 300, math.sqrt(600.0)), ("gram", 27, 1.0), ("scores", 45, 2.0),
    ("counts", 200, math.sqrt(10.0))])
def test_a_zcdp_round_is_planned_to_spend_its_rho_share_and_no_more(
        statistic: str, dim: int, row_norm: float) -> None:
    """``plan_within_rho``: the charge (the zCDP rho of the planned noise) is within 0.1 % below
    the round's share; the sites, given only the plan's epsilon, recompute the same noise. The
    plan at the Gaussian's epsilon for the share is charged 95-100 % of it (the exact
    calibration costs what the Gaussian costs; 85 % with the former RDP calibration); the
    epsilon is raised by what is left."""
    shares = [(n, e, d) for n, (e, d) in SYNTH_PAIRS_DEFAULT_SPLIT.items()]
    for eps in (0.5, 2.0, 8.0):
        for _name, e, d in split_budget(eps, 1e-6, shares, "zcdp"):
            rho = round_rho(e, d)
            kw = {"dim": dim, "total_rows": 6000, "delta": d, "participants": SITES,
                  "tolerated": 1, "row_norm": row_norm}
            plan = plan_within_rho(statistic, epsilon=e, rho=rho, **kw)
            charged = plan.calibration.cost().rho
            assert 0.999 * rho <= charged <= rho
            at_e = plan_for(statistic, epsilon=e, **kw).calibration.cost().rho
            if at_e < 0.95 * rho:
                assert plan.calibration.epsilon > e
            else:  # at e the charge is already close to the share (the exact calibration,
                # or its rho cap): epsilon is kept or raised by the last per cent
                assert plan.calibration.epsilon >= e and at_e >= 0.95 * rho
            again = plan_from_scale(statistic, dim=dim, scale=plan.scale, row_norm=row_norm,
                                    epsilon=plan.calibration.epsilon, delta=d,
                                    participants=SITES, tolerated=1)
            assert again == plan
