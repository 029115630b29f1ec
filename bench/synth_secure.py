"""Federated synthesis under secure aggregation vs site-level: quality at the same budget.

Data: the 11 mixed columns of bench/synth_federated.py (4 continuous, 3 ordinal, 4 nominal,
from a latent Gaussian with a factor structure), split at random over 4 sites, plus a holdout
of real rows. At epsilon 0.5, 1 and 5 per site (delta 1e-6, the job's default split), on the
same sites' rows in every run:

* ``site``: the job's site-level rounds (each site's Gaussian histograms, each site's DP-PCA
  factor, combined) -- ``fit_federated`` of bench/synth_federated.py;
* ``secure``: the job's secure rounds run in-process with the real code: every site's
  ``synth_counts`` and ``synth_latent`` sources (the site-agent code), its Skellam share and its
  pairwise masks (real X25519 keys signed with certificates from dpfed's CA); the coordinator
  decodes only the sums and post-processes them exactly as the job does;
* ``1site``: the site-level pipeline on the pooled rows as ONE site (what a trusted curator
  running the same mechanism would get; the ceiling secure aggregation aims at);
* ``indep``: every column from its own DP histogram (the floor: no joint structure).

Metrics against the holdout (bench/synth_federated.py's): ``tvd1`` mean 1-way TVD, ``tvd2``
mean 2-way TVD over all column pairs, ``corr`` mean |correlation difference|; each the mean
over ``--runs`` runs. Printed side by side with the ratios secure / site and secure / 1site,
and the floor's tvd2 measured in the same run.

Usage: ``python bench/synth_secure.py [--quick] [--runs N] [--rows-per-site N]``
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
from cryptography import x509
from cryptography.hazmat.primitives import serialization

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from synth_federated import (  # noqa: E402
    BINS,
    SCHEMA,
    SPLIT,
    fit_federated,
    independent_marginals,
    make_data,
    tvds,
)

from dpfed.aggregator.jobs.pca_secure import decompose_second_moment  # noqa: E402
from dpfed.aggregator.jobs.secure_rounds import symmetric_from_upper  # noqa: E402
from dpfed.aggregator.synth_model import SynthModel  # noqa: E402
from dpfed.common.data.encoding import EncodedTable, EncodingReport, encode_table  # noqa: E402
from dpfed.common.data.schema import Schema  # noqa: E402
from dpfed.common.evaluation.utility_metrics import table_correlation_error  # noqa: E402
from dpfed.common.job_params import SynthParams  # noqa: E402
from dpfed.common.secagg.keys import generate_ephemeral, sign_ephemeral  # noqa: E402
from dpfed.common.secagg.masking import MaskContext  # noqa: E402
from dpfed.common.secagg.messages import plan_params  # noqa: E402
from dpfed.common.secagg.secure_sum import decode_sum, plan_for, site_contribution  # noqa: E402
from dpfed.common.synth.factor_model import dp_second_moment  # noqa: E402
from dpfed.common.synth.generative import fit_factor_model  # noqa: E402
from dpfed.common.synth.link_release import (  # noqa: E402
    histogram_sizes,
    links_digest,
    links_from_proportions,
    proportions_from_histograms,
)
from dpfed.common.synth.links import default_clip_norm, latent_dim  # noqa: E402
from dpfed.common.transport.certs import init_federation  # noqa: E402
from dpfed.common.transport.protocol import Task  # noqa: E402
from dpfed.site_agent.handlers.secagg_sources import ContributionBuilder  # noqa: E402
from dpfed.site_agent.handlers.synth_secure import (  # noqa: E402
    synth_counts_contribution,
    synth_latent_contribution,
)


class Table:
    """One site's rows as the site sources read them (schema + chunked pass)."""

    def __init__(self, table: EncodedTable) -> None:
        self.table = table

    @property
    def schema(self) -> Schema:
        return SCHEMA

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        yield self.table, EncodingReport()


def secure_round(source: ContributionBuilder, statistic: str, params: dict[str, object],
                 arrays: dict[str, np.ndarray], tables: list[Table], ids: list[str],
                 fed: Path, eps: float, delta: float,
                 rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """One secure sum through the sites' real source code; return (decoded sum, N)."""
    n = sum(t.table.n_rows for t in tables)
    dim, row_norm = ((sum(histogram_sizes(SCHEMA, BINS)), math.sqrt(len(SCHEMA.columns)))
                     if statistic == "counts" else (latent_dim(SCHEMA), 1.0))
    plan = plan_for(statistic, dim=dim, total_rows=n, epsilon=eps, delta=delta,
                    participants=ids, row_norm=row_norm)
    task = Task("bench/sum", "bench", "secagg", eps, delta,
                {**params, **plan_params(plan, row_norm=row_norm)}, arrays)
    given = [source(task, t, ids, 0) for t in tables]
    assert all(g.plan == plan for g in given)  # each site recomputed the coordinator's plan
    ctx = MaskContext("bench", statistic, f"bench/{statistic}/{rng.integers(1 << 30)}")
    ca = x509.load_pem_x509_certificate((fed / "ca.pem").read_bytes())
    keys = {s: generate_ephemeral() for s in ids}
    signed = {}
    for s in ids:
        kit = fed / "sites" / s
        signing = serialization.load_pem_private_key((kit / "site.key").read_bytes(), None)
        signed[s] = sign_ephemeral(site_id=s, public_key=keys[s][1], context=ctx,
                                   signing_key=signing,  # type: ignore[arg-type]
                                   certificate_pem=(kit / "site.pem").read_bytes())
    masked = {}
    for s, g in zip(ids, given, strict=True):
        stat, _ = g.compute(rng)
        masked[s] = site_contribution(stat, plan=plan, own_id=s, own_key=keys[s][0],
                                      signed_keys=signed, context=ctx, ca=ca,
                                      min_participants=2, tolerated=0, rng=rng)
    return decode_sum(masked, plan), n


def fit_secure(tables: list[EncodedTable], ids: list[str], fed: Path, eps: float,
               delta: float, rng: np.random.Generator) -> SynthModel:
    """The job's secure rounds (sites' real sources), then the job's post-processing."""
    job = SynthParams.from_mapping({"n_bins": BINS, "aggregation": "secure"},
                                   latent_dim=latent_dim(SCHEMA)).to_mapping()
    base = {"job": job, "schema_digest": SCHEMA.digest()}
    sites = [Table(t) for t in tables]
    el, dl = SPLIT["links"][0] * eps, SPLIT["links"][1] * delta
    ep, dp = SPLIT["pca"][0] * eps, SPLIT["pca"][1] * delta
    counts, n = secure_round(synth_counts_contribution, "counts", base, {}, sites, ids, fed, el, dl,
                             rng)
    props = proportions_from_histograms(counts, SCHEMA, BINS, n_rows=n)
    links = links_from_proportions(SCHEMA, props, BINS)
    digest = links_digest(SCHEMA, props, BINS, "quantile")
    upper, n = secure_round(synth_latent_contribution, "gram", {**base, "links_digest": digest},
                            {"link_proportions": props}, sites, ids, fed, ep, dp, rng)
    dim = links.dim
    est = decompose_second_moment(symmetric_from_upper(upper, dim) / n, dim)
    clip = default_clip_norm(dim)
    fm, corr = fit_factor_model(est, links, clip_norm=clip, rng=rng)
    dpc = dp_second_moment(est, dim)
    d = np.sqrt(np.diag(dpc))
    return SynthModel.build(SCHEMA, mode="generative", continuous_link="quantile", n_bins=BINS,
                            proportions=props, factor_model=fm, dp_correlation=dpc / np.outer(d, d),
                            rng=rng, latent_correlation=corr)


def scores(syn: pd.DataFrame, holdout: pd.DataFrame) -> dict[str, float]:
    t1, t2, _ = tvds(holdout, syn)
    return {"tvd1": t1, "tvd2": t2, "corr": table_correlation_error(holdout, syn, SCHEMA).mean_abs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 run, 2,000 rows per site")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rows-per-site", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    runs = 1 if args.quick else args.runs
    per = 2000 if args.quick else args.rows_per_site
    n_sites, delta, epsilons = 4, 1e-6, [0.5, 1.0, 5.0]
    ids = [f"site-{i}" for i in range(n_sites)]
    print(f"synth: {n_sites} sites x {per} rows, {len(SCHEMA.columns)} columns "
          f"({sum(histogram_sizes(SCHEMA, BINS))} histogram cells, latent dimension "
          f"{latent_dim(SCHEMA)}), delta {delta:g}, {runs} run(s); metrics vs a real holdout")
    results: dict[tuple[str, float], list[dict[str, float]]] = {}
    seconds = {"site": 0.0, "secure": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        fed = Path(tmp) / "fed"
        init_federation(fed, coordinator_hosts=["localhost"], sites=ids, analysts=[])
        for run in range(runs):
            frame, _ = make_data((n_sites + 1) * per, args.seed + run)
            train, holdout = frame.iloc[:n_sites * per], frame.iloc[n_sites * per:]
            parts = np.array_split(np.random.default_rng(run).permutation(len(train)), n_sites)
            tables = [encode_table(SCHEMA, train.iloc[np.sort(p)])[0] for p in parts]
            pooled, _ = encode_table(SCHEMA, train)
            n = len(train)
            for eps in epsilons:
                rng = np.random.default_rng(1000 * run + int(eps * 10))
                t0 = time.perf_counter()
                site = fit_federated(tables, eps, delta, rng)
                seconds["site"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                secure = fit_secure(tables, ids, fed, eps, delta, rng)
                seconds["secure"] += time.perf_counter() - t0
                one = fit_federated([pooled], eps, delta, rng)
                floor = independent_marginals(tables, eps, delta, n, rng)
                for name, syn in (("site", site.sample(n, rng=rng)),
                                  ("secure", secure.sample(n, rng=rng)),
                                  ("1site", one.sample(n, rng=rng)), ("indep", floor)):
                    results.setdefault((name, eps), []).append(scores(syn, holdout))
            print(f"  run {run + 1}/{runs} done", flush=True)

    def mean(name: str, eps: float, key: str) -> float:
        return float(np.mean([r[key] for r in results[(name, eps)]]))

    print(f"\n{'eps':>5} {'metric':>6} {'site':>8} {'secure':>8} {'1site':>8} {'indep':>8} "
          f"{'secure/site':>12} {'secure/1site':>13}")
    for eps in epsilons:
        for key in ("tvd1", "tvd2", "corr"):
            v = {m: mean(m, eps, key) for m in ("site", "secure", "1site", "indep")}
            print(f"{eps:>5g} {key:>6} {v['site']:>8.4f} {v['secure']:>8.4f} "
                  f"{v['1site']:>8.4f} {v['indep']:>8.4f} "
                  f"{v['secure'] / v['site']:>12.2f} {v['secure'] / v['1site']:>13.2f}")
    fits = runs * len(epsilons)
    print(f"\nfit time per job (4 sites in-process, 1 core): site-level "
          f"{seconds['site'] / fits:.2f} s, secure {seconds['secure'] / fits:.2f} s "
          f"(ratio {seconds['secure'] / max(seconds['site'], 1e-9):.2f})")


if __name__ == "__main__":
    main()
