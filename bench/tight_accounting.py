"""What a site's ledger claims against what its releases really cost together.

For each job kind's default plan (the events one site is charged, built with the library's own
cost functions, as the site handlers build them; the pca job's rounds as a submission settles
them for 3 sites x 1000 rows with pld ledgers, site-level in GDP shares, secure with the
secure norm histogram), and for a mixed ledger of 30 events, this
prints side by side, at the job's (or the ledger's) delta:

``basic``   the old default ledger: the sum of the rounds' epsilons (their deltas sum to delta)
``zcdp``    the zCDP ledger: summed rho converted at delta (Canonne, Kamath & Steinke 2020)
``pld``     the tight accountant (the new default, dpfed.common.privacy.spent.Spent)
``exact``   an independent composition by Google's dp_accounting: Gaussian rounds by their
            analytic composed Gaussian, Laplace by its PLD, SVT and other pure releases by
            randomized response; a Skellam round by the Gaussian of the same variance (a lower
            bound on its exact cost, so the Skellam ratios are upper bounds); a secure discrete
            Laplace round by dp_accounting's discrete Laplace PLD at its integer L1 sensitivity

and the ratios claim / exact. Job (epsilon, delta) = (1, 1e-6) unless --epsilon/--delta.

Run: ``python bench/tight_accounting.py [--epsilon 1] [--delta 1e-6]``.
"""

from __future__ import annotations

import argparse
import math

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution as oracle_pld

from dpfed.common.data.demo_data import generate_demo
from dpfed.common.job_params import SYNTH_PAIRS_DEFAULT_SPLIT
from dpfed.common.jobs.params import ConnectedSite
from dpfed.common.jobs.registry import job_kind
from dpfed.common.pca.centring import centred_pca_mechanism, mean_sum_mechanism
from dpfed.common.pca.clipping import norm_histogram_mechanism
from dpfed.common.privacy.accounting import PrivacyCost, zcdp_to_epsilon
from dpfed.common.privacy.mechanisms import GaussianMechanism
from dpfed.common.privacy.spent import Spent, event_loss
from dpfed.common.queries.svt import SVTCalibration
from dpfed.common.secagg.linear_sum import choose_linear_scale, plan_linear
from dpfed.common.secagg.secure_sum import plan_counts, plan_gram, plan_row_sum, plan_scores
from dpfed.common.synth.link_release import link_round_cost
from dpfed.common.synth.pair_marginals import pair_table_mechanism, score_mechanism

N_ROWS, FEATURES, SITES = 1000, 20, ["a", "b", "c"]


def secure_cost(plan: object) -> PrivacyCost:
    """The event a site records for a secure round (site_agent/handlers/secagg.py)."""
    cal = plan.calibration  # type: ignore[attr-defined]
    n, t = len(plan.participants), plan.tolerated  # type: ignore[attr-defined]
    return PrivacyCost(cal.epsilon, cal.delta, cal.cost().rho, f"secure-skellam[n={n},t={t}]",
                       cal.l2_sensitivity, math.sqrt(plan.share))  # type: ignore[attr-defined]


def pca_plan(eps: float, delta: float, **raw: object) -> list[tuple[str, float, float]]:
    """The pca job's rounds as a submission now settles them (3 pld sites x N_ROWS rows)."""
    schema = generate_demo(1, 10, FEATURES, seed=1)[0]
    kind = job_kind("pca")
    canonical = kind.canonical({"n_components": 5, **raw}, eps, delta, schema)
    settled = kind.settle(canonical, eps, delta, schema,
                          [ConnectedSite(N_ROWS, "pld") for _ in SITES])
    return [(r.name, r.epsilon, r.delta)
            for r in kind.plan(kind.parse(settled, schema), eps, delta)]


def pca_site(eps: float, delta: float) -> list[PrivacyCost]:
    out = []
    for name, e, d in pca_plan(eps, delta):
        if name == "mean":
            out.append(mean_sum_mechanism(e, d).cost())
        elif name == "norms":
            out.append(norm_histogram_mechanism(e, d).cost())
        else:
            out.append(centred_pca_mechanism(N_ROWS, e, d).cost())
    return out


def pca_secure(eps: float, delta: float) -> list[PrivacyCost]:
    out = []
    kw = {"total_rows": 3 * N_ROWS, "participants": SITES, "tolerated": 1}
    for name, e, d in pca_plan(eps, delta, aggregation="secure"):
        if name == "norms":
            plan = plan_counts(dim=41, row_norm=1.0, epsilon=e, delta=d, **kw)
        else:
            plan = (plan_row_sum if name == "mean" else plan_gram)(
                dim=FEATURES, epsilon=e, delta=d, **kw)
        out.append(secure_cost(plan))
    return out


def synth_site(eps: float, delta: float) -> list[PrivacyCost]:
    schema = generate_demo(1, 100, 12, seed=1, mixed=True)[0]
    share = SYNTH_PAIRS_DEFAULT_SPLIT
    out = [link_round_cost(schema, eps * share["links"][0], delta * share["links"][1]),
           centred_pca_mechanism(N_ROWS, eps * share["pca"][0], delta * share["pca"][1]).cost(),
           score_mechanism(66, eps * share["pair_scores"][0],
                           delta * share["pair_scores"][1]).cost(),
           pair_table_mechanism(11, eps * share["pairs"][0], delta * share["pairs"][1]).cost()]
    return out


def synth_secure(eps: float, delta: float) -> list[PrivacyCost]:
    share = SYNTH_PAIRS_DEFAULT_SPLIT
    kw = {"total_rows": 3 * N_ROWS, "participants": SITES, "tolerated": 1}
    plans = [plan_counts(dim=120, row_norm=math.sqrt(12), epsilon=eps * share["links"][0],
                         delta=delta * share["links"][1], **kw),
             plan_gram(dim=FEATURES, epsilon=eps * share["pca"][0],
                       delta=delta * share["pca"][1], **kw),
             plan_scores(dim=66, row_norm=2.0, epsilon=eps * share["pair_scores"][0],
                         delta=delta * share["pair_scores"][1], **kw),
             plan_counts(dim=11 * 16, row_norm=math.sqrt(11), epsilon=eps * share["pairs"][0],
                         delta=delta * share["pairs"][1], **kw)]
    return [secure_cost(p) for p in plans]


def query_site(eps: float, delta: float) -> list[PrivacyCost]:
    mech = GaussianMechanism(eps, delta, sensitivity=math.sqrt(2.0))
    return [PrivacyCost.gaussian(eps, delta, sigma=mech.sigma, sensitivity=mech.sensitivity,
                                 mechanism="matrix-gaussian")]


def query_secure(eps: float, delta: float) -> list[PrivacyCost]:
    return [secure_cost(plan_counts(dim=64, row_norm=1.0, epsilon=eps, delta=delta,
                                    total_rows=3 * N_ROWS, participants=SITES, tolerated=1))]


def query_secure_dlaplace(eps: float, delta: float) -> list[PrivacyCost]:
    """The default secure query (``secure_noise = auto``) on a 64-cell marginal: the job's
    ranking picks the distributed discrete Laplace there (pure epsilon, ``delta`` unused)."""
    identity = np.eye(64)
    scale = choose_linear_scale(identity, total_rows=3 * N_ROWS, epsilon=eps, delta=delta,
                                n_participants=len(SITES), noise="dlaplace")
    plan = plan_linear(identity, scale=scale, epsilon=eps, delta=delta, participants=SITES,
                       tolerated=1, noise="dlaplace").plan
    return [plan.cost()]


def svt(eps: float, delta: float) -> list[PrivacyCost]:
    return [SVTCalibration(eps, cutoff=3).cost()]


def laplace(eps: float, sens: float = 2.0) -> PrivacyCost:
    return PrivacyCost.pure(eps, mechanism="matrix-laplace", sensitivity=sens,
                            noise_scale=sens / eps)


def mixed_ledger(eps: float, delta: float) -> list[PrivacyCost]:
    """30 events: jobs at different budgets, as a site might see over a month."""
    d = delta / 10
    events: list[PrivacyCost] = []
    events += pca_site(0.5 * eps, d) + pca_site(0.25 * eps, d)  # 6
    events += synth_site(eps, d)  # 4
    events += pca_secure(0.5 * eps, d)  # 2
    events += synth_secure(0.5 * eps, d)  # 4
    events += query_site(0.2 * eps, d) + query_site(0.1 * eps, d)  # 2
    events += [laplace(0.1 * eps), laplace(0.2 * eps), laplace(0.05 * eps)]  # 3
    events += svt(0.3 * eps, 0) + svt(0.2 * eps, 0)  # 2
    events += query_secure(0.2 * eps, d)  # 1
    events += pca_site(0.4 * eps, d) + synth_site(0.3 * eps, d)  # 7 -> 31 - 1 below
    return events[:30]


def exact_epsilon(events: list[PrivacyCost], delta: float) -> float:
    mu2 = 0.0
    other: oracle_pld.PrivacyLossDistribution | None = None
    for c in events:
        pair = event_loss(c)
        if pair.method in ("gaussian", "skellam"):
            mu = c.sensitivity / c.noise_scale if pair.method == "gaussian" else (
                c.sensitivity / math.sqrt(c.noise_scale ** 2 * _honest(c.mechanism)))
            mu2 += mu * mu
            continue
        if c.mechanism.startswith("secure-dlaplace["):
            # the honest total is DLap(alpha) plus independent noise, alpha = e^(-eps/D1)
            part = oracle_pld.from_discrete_laplace_mechanism(
                c.epsilon / c.sensitivity, sensitivity=int(round(c.sensitivity)),
                value_discretization_interval=1e-5)
        elif pair.method == "laplace":
            part = oracle_pld.from_laplace_mechanism(c.noise_scale, sensitivity=c.sensitivity,
                                                     value_discretization_interval=1e-5)
        else:
            part = oracle_pld.from_privacy_parameters(
                dp_accounting.pld.common.DifferentialPrivacyParameters(c.epsilon, c.delta),
                value_discretization_interval=1e-5)
        other = part if other is None else other.compose(part)
    if other is None:
        return float(dp_accounting.get_epsilon_gaussian(1 / math.sqrt(mu2), delta))
    if mu2 > 0:
        other = other.compose(oracle_pld.from_gaussian_mechanism(
            1 / math.sqrt(mu2), value_discretization_interval=1e-5))
    return float(other.get_epsilon_for_delta(delta))


def _honest(mechanism: str) -> int:
    if mechanism == "skellam":
        return 1
    inner = mechanism[mechanism.index("[") + 1:-1]
    n, t = (int(x.split("=")[1]) for x in inner.split(","))
    return n - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-6)
    a = ap.parse_args()
    eps, delta = a.epsilon, a.delta
    plans = {"pca (site-level)": pca_site, "pca (secure, t=1)": pca_secure,
             "synth (site-level)": synth_site, "synth (secure, t=1)": synth_secure,
             "query (site-level)": query_site, "query (secure, t=1, skellam)": query_secure,
             "query (secure, t=1, dlaplace)": query_secure_dlaplace,
             "svt": svt, "mixed ledger (30 events)": mixed_ledger}
    print(f"job (epsilon, delta) = ({eps:g}, {delta:g}); claim / exact at the job's delta\n")
    print(f"{'plan':28s} {'events':>6s} {'basic':>9s} {'zcdp':>9s} {'pld':>9s} {'exact':>9s} "
          f"{'basic/ex':>9s} {'zcdp/ex':>9s} {'pld/ex':>9s}")
    for name, build in plans.items():
        events = build(eps, delta)
        spent = Spent.of(events)
        basic = spent.epsilon_sum if spent.delta_sum <= delta * (1 + 1e-9) else math.inf
        zcdp = zcdp_to_epsilon(spent.rho_sum, delta)
        tight = spent.epsilon(delta)
        exact = exact_epsilon(events, delta)
        print(f"{name:28s} {len(events):6d} {basic:9.4f} {zcdp:9.4f} {tight:9.4f} {exact:9.4f} "
              f"{basic / exact:9.3f} {zcdp / exact:9.3f} {tight / exact:9.3f}")


if __name__ == "__main__":
    main()
