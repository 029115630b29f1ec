"""Default centred PCA through the real job against ``--centering none --clip-norm 1``.

The DPdisPCA paper's set-up (Imtiaz & Sarwate 2018; as bench/pca_centring.py): D = 200,
S = 10 sites x N_s = 1000 rows in the unit ball (200 continuous columns declared in [-1, 1],
so the box bound is sqrt(200)), K = 50, R = 100 (2K), delta = 0.01, epsilon in {0.5, 1, 5}.
Quality: the captured variance ``tr(V_K^T C V_K) / tr(U_K^T C U_K)``, C the covariance of the
pooled rows about their true mean and U_K its top-K eigenvectors.

Every job runs in-process through the code a real job runs: the parameters are validated
(:meth:`JobKind.canonical`) and settled on the sites' public row counts and ``pld`` ledgers
(:meth:`JobKind.settle`, as the coordinator does at submission), then the coordinator's
:func:`dpfed.aggregator.jobs.pca.run` drives :class:`dpfed.aggregator.jobs.job.Job`, whose
dispatcher hands each task (through its wire bytes) to the round the site agent would pick
(:func:`dpfed.common.jobs.registry.site_round`): ``prepare`` on the site's encoded table,
then ``produce`` with a production generator; answers are checked and pooled by the job.
Only the network and the ledgers are left out (bench/pca_centring.py has the library calls).

Rows: ``none, clip 1`` (``--centering none --clip-norm 1``: one round), ``default`` (the
settled default: centred, ``clip_norm auto``), and ``default, first plan`` (the same job
without a split: the fixed 10/10/80 split and the box-bounded mean of jobs made before).

Then the same jobs on the demo data (3 sites x 20,000 rows, 20 columns, K = 5, delta = 1e-5),
against the pooled covariance of the rows scaled by the schema's bounds.

Run: ``python bench/pca_job_centring.py [--runs 5] [--demo-runs 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from dpfed.aggregator.federation import Federation
from dpfed.aggregator.jobs import pca as pca_job
from dpfed.aggregator.jobs.job import Job
from dpfed.aggregator.jobs.outgoing import OutgoingTask
from dpfed.common.data.encoding import EncodedTable, EncodingReport
from dpfed.common.data.schema import Schema
from dpfed.common.jobs.contract import Ask, Pooled, Round, Site, SumRound
from dpfed.common.jobs.params import ConnectedSite
from dpfed.common.jobs.registry import job_kind, site_round
from dpfed.common.pca.dppca import captured_energy, top_components
from dpfed.common.privacy.accounting import BudgetStatus
from dpfed.common.privacy.rng import production_rng
from dpfed.common.transport.protocol import JobSpec, Task, TaskResult
from dpfed.common.transport.wire import (
    result_from_bytes,
    result_to_bytes,
    task_from_bytes,
    task_to_bytes,
)

D, S, N_S, K, DELTA = 200, 10, 1000, 50, 0.01
EPSILONS = (0.5, 1.0, 5.0)


class SiteRows:
    """One site's encoded rows as the site reads them (schema + chunked pass)."""

    def __init__(self, table: EncodedTable) -> None:
        self.table = table

    @property
    def schema(self) -> Schema:
        return self.table.schema

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        yield self.table, EncodingReport()


class InProcessJob(Job[Any]):
    """A :class:`Job` whose dispatcher runs every task at in-process sites (module docstring).

    A secure round is one in-process secure sum (as bench/secure_synth_round.py): each site's
    contribution from the round's own code, its Skellam share and pairwise masks under real
    signed keys (``fed``), decoded and checked as the coordinator does.
    """

    def __init__(self, spec: JobSpec, schema: Schema, tables: Mapping[str, EncodedTable],
                 fed: Path | None = None, tolerated: int = 0) -> None:
        kind = job_kind(spec.kind)
        self.fed = fed
        self.tolerated = tolerated
        sessions = [SimpleNamespace(site_id=s, hello=SimpleNamespace(
            row_count=t.n_rows, allowed_kinds=("pca", "secagg"), max_epsilon_per_task=None,
            budget=BudgetStatus("pld", 1e6, 0.5, 0.0, 0.0, 0.0, 0),
            secure_policy=f"allowed, min 2 sites, t={tolerated}"))
            for s, t in tables.items()]
        super().__init__(job_id="bench", spec=spec, kind=kind,
                         params=kind.parse(spec.params, schema), federation=Federation(schema),
                         registry=SimpleNamespace(  # type: ignore[arg-type]
                             connected=lambda: sessions,
                             get=lambda s: next(x for x in sessions if x.site_id == s)),
                         emit=lambda *_: None)
        self.sites = {s: Site(SiteRows(t)) for s, t in tables.items()}

    async def release(self, rnd: Round[Any, Any, Any], inputs: Any, *,
                      among: Collection[str] | None = None) -> Pooled[Any]:
        """A site-level round through :meth:`dispatch`; a secure one summed in-process.

        The sites' pairwise masks cancel in the sum (no self-masks: no site drops here); the
        decoded sum is checked and pooled by the round's own code, as the coordinator does.
        """
        if not self.planned(rnd.name).secure:
            return await super().release(rnd, inputs, among=among)
        from secure_aggregation import masked_shares

        from dpfed.aggregator.jobs.secure_rounds import _plan
        from dpfed.common.jobs.contract import SecureSum
        from dpfed.common.secagg.masking import MaskContext
        from dpfed.common.secagg.messages import plan_params
        from dpfed.common.secagg.secure_sum import decode_integer_sum

        assert isinstance(rnd, SumRound) and self.fed is not None
        self._start()
        budget = self.budget(rnd.name)
        ask = Ask(self.params, self.federation.schema, inputs, budget)
        enc = rnd.encoding(ask)
        ids = sorted(self.sites)
        total = sum(int(s.data.table.n_rows) for s in self.sites.values())  # type: ignore[attr-defined]
        planned = await _plan(rnd, enc, budget, ids, self.tolerated, total)
        plan = planned.plan
        task = Task(f"bench/{rnd.name}-sum-1", "bench", "secagg", budget.epsilon, budget.delta,
                    {"stage": "contribute", "sum_round": f"{rnd.name}-sum-1", **dict(enc.params),
                     **plan_params(plan, row_norm=enc.row_norm)}, dict(enc.arrays))
        rng = production_rng()
        given = {s: rnd.contribution(task_from_bytes(task_to_bytes(task)), self.sites[s], ids,
                                     self.tolerated) for s in ids}
        computed = {s: g.compute(rng) for s, g in given.items()}
        ctx = MaskContext("bench", plan.statistic, f"bench/{rnd.name}/{rng.integers(1 << 30)}")
        masked = masked_shares({s: c[0] for s, c in computed.items()}, plan, self.fed, ctx, rng)
        rows = {s: int(computed[s][1]) for s in ids}
        summed_int = decode_integer_sum(masked, plan)
        rnd.check_sum(summed_int, planned, sum(rows.values()), enc)
        summed = SecureSum(summed_int.astype(np.float64) / plan.scale ** plan.degree, plan, rows,
                           1, planned.detail, rnd.secure_releases)
        value = rnd.pool_secure(summed, ask)
        return Pooled(rnd.name, value, budget, rows, dict.fromkeys(ids, plan.cost()), {},
                      summed)

    async def dispatch(self, outgoing: OutgoingTask, *, only: Collection[str] | None = None,
                       progress: tuple[float, float] = (0.0, 0.9),
                       quorum: int | None = None) -> dict[str, TaskResult]:
        del progress, quorum
        self._start()
        task = Task(f"bench/{outgoing.round_name}", "bench", outgoing.kind,
                    outgoing.budget.epsilon, outgoing.budget.delta, dict(outgoing.params),
                    dict(outgoing.arrays))
        results = {}
        for site_id, site in self.sites.items():
            if only is not None and site_id not in only:
                continue
            received = task_from_bytes(task_to_bytes(task))
            release = site_round(received).prepare(received, site)
            answer = release.produce(production_rng())
            assert isinstance(answer, TaskResult)
            answer = result_from_bytes(result_to_bytes(answer))
            if outgoing.check is not None:
                outgoing.check(answer)
            results[site_id] = answer
        return results


def schema_of(n_features: int) -> Schema:
    """``n_features`` continuous columns declared in [-1, 1] (u = x: the scaling is 1)."""
    return Schema.from_toml("".join(
        f'[[columns]]\nname = "x{j:03d}"\ntype = "continuous"\nmin = -1\nmax = 1\n'
        for j in range(n_features)))


def make_sites(rng: np.random.Generator) -> list[np.ndarray]:
    """The paper's generator widened to D = 200 (bench/dppca_utility.py), max row norm 1."""
    spectrum = np.concatenate([np.linspace(10, 1, 20), 0.5 * rng.random(D - 20)])
    basis = np.linalg.qr(rng.standard_normal((D, D)))[0]
    x = (rng.standard_normal((S * N_S, D)) * np.sqrt(spectrum)) @ basis.T
    x /= np.linalg.norm(x, axis=1).max()
    return np.split(x, S)


def covariance(x: np.ndarray) -> np.ndarray:
    """The covariance of the rows ``x`` about their true mean."""
    centred = x - x.mean(axis=0)
    return np.asarray(centred.T @ centred / len(x))


def paper_data(rng: np.random.Generator, schema: Schema
               ) -> tuple[list[np.ndarray], dict[str, EncodedTable], np.ndarray, float]:
    """One run's sites, their tables, the pooled covariance and its best top-K energy."""
    sites = make_sites(rng)
    cov = covariance(np.vstack(sites))
    return sites, tables_of(schema, sites), cov, captured_energy(top_components(cov, K), cov)


def tables_of(schema: Schema, sites: list[np.ndarray]) -> dict[str, EncodedTable]:
    names = [c.name for c in schema.columns]
    return {f"h{i + 1:02d}": EncodedTable(schema, {n: x[:, j] for j, n in enumerate(names)},
                                          len(x))
            for i, x in enumerate(sites)}


def run_job(schema: Schema, tables: Mapping[str, EncodedTable], epsilon: float, delta: float,
            params: dict[str, Any], accountant: str = "pld", fed: Path | None = None,
            tolerated: int = 0, settle: bool = True) -> tuple[np.ndarray, dict[str, Any]]:
    """Validate, settle (unless not ``settle``) and run one pca job: components, metadata.

    Secure sums tolerate ``tolerated`` colluders (the sites' policy).
    """
    kind = job_kind("pca")
    settled = kind.canonical(params, epsilon, delta, schema)
    if settle:
        facts = [ConnectedSite(t.n_rows, accountant, tolerated) for t in tables.values()]
        settled = kind.settle(settled, epsilon, delta, schema, facts)
    job = InProcessJob(JobSpec("pca", epsilon, delta, settled), schema, tables, fed, tolerated)
    out = asyncio.run(pca_job.run(job))
    return np.asarray(out.arrays["components"]), dict(out.metadata)


def first_plan(schema: Schema, tables: Mapping[str, EncodedTable], epsilon: float,
               delta: float, params: dict[str, Any]) -> np.ndarray:
    """The same job without settling (no split): the plan of jobs made before."""
    kind = job_kind("pca")
    canonical = kind.canonical(params, epsilon, delta, schema)
    job = InProcessJob(JobSpec("pca", epsilon, delta, canonical), schema, tables)
    return np.asarray(asyncio.run(pca_job.run(job)).arrays["components"])


def demo(runs: int) -> None:
    """The demo data (3 sites x 20,000 rows, 20 columns, K = 5, delta = 1e-5), same jobs."""
    from dpfed.common.data.demo_data import generate_demo
    from dpfed.common.data.encoding import encode_table
    from dpfed.common.pca.features import UnitBallMap

    schema, frames = generate_demo(3, 20_000, 20, seed=0)
    tables = {f"hospital-{i + 1}": encode_table(schema, f)[0] for i, f in enumerate(frames)}
    cov = covariance(np.vstack([UnitBallMap(schema).scaled(t) for t in tables.values()]))
    k = 5
    best = captured_energy(top_components(cov, k), cov)
    import tempfile

    from dpfed.common.transport.certs import init_federation

    fed = Path(tempfile.mkdtemp()) / "fed"
    init_federation(fed, coordinator_hosts=["localhost"], sites=list(tables), analysts=[])
    names = ["default", "default, first plan", "none, clip schema", "secure (auto)",
             "secure, clip schema"]
    print(f"\ndemo data: 3 sites x 20000 rows, 20 columns, K={k}, delta=1e-5, {runs} runs; "
          "captured variance of the pooled covariance / non-private")
    print(f"{'epsilon':>8}" + "".join(f"{n:>22}" for n in names))
    for eps in EPSILONS:
        vals: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(runs):
            vals["default"].append(captured_energy(run_job(
                schema, tables, eps, 1e-5, {"n_components": k})[0], cov) / best)
            vals["default, first plan"].append(captured_energy(first_plan(
                schema, tables, eps, 1e-5, {"n_components": k}), cov) / best)
            vals["none, clip schema"].append(captured_energy(run_job(
                schema, tables, eps, 1e-5, {"n_components": k, "centering": "none",
                                            "clip_norm": "schema"})[0], cov) / best)
            for name, clip in (("secure (auto)", "auto"), ("secure, clip schema", "schema")):
                vals[name].append(captured_energy(run_job(
                    schema, tables, eps, 1e-5, {"n_components": k, "aggregation": "secure",
                                                "clip_norm": clip}, fed=fed)[0], cov) / best)
        print(f"{eps:>8g}" + "".join(f"{np.mean(vals[n]):>22.3f}" for n in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=2018)
    ap.add_argument("--demo-runs", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    schema = schema_of(D)
    started = time.perf_counter()
    names = ["none, clip 1", "default", "default, first plan"]
    results: dict[tuple[str, float], list[float]] = {}
    splits: dict[float, Any] = {}
    for _ in range(a.runs):
        _sites, tables, cov, best = paper_data(rng, schema)
        for eps in EPSILONS:
            comps = {"none, clip 1": run_job(schema, tables, eps, DELTA, {
                "n_components": K, "centering": "none", "clip_norm": 1.0})[0]}
            comps["default"], meta = run_job(schema, tables, eps, DELTA, {"n_components": K})
            splits[eps] = (meta.get("split"), meta.get("composition"), meta["clip_norm"])
            comps["default, first plan"] = first_plan(schema, tables, eps, DELTA,
                                                      {"n_components": K})
            for name in names:
                results.setdefault((name, eps), []).append(
                    captured_energy(comps[name], cov) / best)
    if not a.runs:
        demo(a.demo_runs)
        return
    print(f"D={D}, S={S}, N_s={N_S}, K={K}, R={2 * K}, delta={DELTA}, {a.runs} runs, pld "
          "ledgers; captured variance / non-private (mean, min over runs)\n")
    print(f"{'epsilon':>8}" + "".join(f"{n:>24}" for n in names) + f"{'default - none':>17}")
    for eps in EPSILONS:
        cells = [f"{np.mean(results[(n, eps)]):.3f} ({np.min(results[(n, eps)]):.3f})"
                 for n in names]
        gap = np.mean(results[("default", eps)]) - np.mean(results[("none, clip 1", eps)])
        print(f"{eps:>8g}" + "".join(f"{c:>24}" for c in cells) + f"{gap:>+17.3f}")
    print("\nthe default's settled split (shares of mu^2 and of delta) and clip radius:")
    for eps in EPSILONS:
        split, composition, clip = splits[eps]
        shares = ", ".join(f"{n} {e:.3f}/{d:.2f}" for n, (e, d) in split.items())
        print(f"  epsilon {eps:g}: {composition}: {shares}; clip radius {clip:.3f} (last run)")
    print(f"({time.perf_counter() - started:.0f}s; box bound {math.sqrt(D):.1f})")
    if a.demo_runs:
        demo(a.demo_runs)


if __name__ == "__main__":
    main()
