"""MST and AIM, the strongest public DP synthesizers, on the benchmark tables: cached outputs.

Runs in its own bench environment, never in the project's: MST and AIM are built on
private-pgm (``mbi``, JAX), which dpfed does not depend on and CI never installs::

    bash bench/envs/dp_baselines/setup.sh                 # once: bench/envs/dp_baselines/.venv
    OPENBLAS_NUM_THREADS=1 bench/envs/dp_baselines/.venv/bin/python bench/dp_baselines.py \
        --tables rwm1984 --eps 1 --runs 3 --out bench/results/baselines

Every run's synthetic table (as many rows as there are training rows) is written to
``<out>/<table>/<method>-eps<e>-run<r>.parquet`` with its wall time in a ``.json`` beside it,
and runs already there are skipped, so the slow baselines run once (one process per table
and epsilon: private-pgm's JAX programs run out of memory in long processes) and
``bench/synth_suite.py`` scores them with every dpfed method against the same holdout.

Data: the tables of ``bench/real_tables.py``, split by ``split_sites`` (``--holdout 0.3``,
seed 7) into a real holdout and the training rows (the pooled rows of the 4 sites; the same
rows for the IID and the non-IID split).

Methods, at the same (epsilon, delta) (delta 1e-6) under dpfed's replace-one relation:

``MST``
    McKenna, Miklau & Sheldon (2021), the NIST 2018 winner generalised: one third of rho
    measures every 1-way marginal (Gaussian), one third picks a maximum spanning tree of 2-way
    marginals with the exponential mechanism (weights: L1 error of the 1-way model's estimate),
    one third measures the tree's 2-way marginals; private-pgm's mirror descent fits a graphical
    model, which is sampled. Faithful to ``mechanisms/mst.py`` of private-pgm (domain
    compression of rare 1-way cells included);
``AIM``
    McKenna, Mullins, Sheldon & Miklau (2022): 1-way marginals first, then rounds that each
    pick (exponential mechanism, 10 % of the round's rho) the worst-approximated marginal of
    the workload's downward closure whose model stays under ``--aim-model-size`` MB, measure it
    (Gaussian, 90 %), refit, and halve the noise when a measurement barely moved the model,
    until the budget is spent. Faithful to ``mechanisms/aim.py``. The workload is all 2-way
    marginals. A wall-clock limit (``--aim-time-limit``) stops it between rounds: the model is
    then sampled as it stands (it has spent less than the budget, so it is still private) and
    the run is marked unfinished with the fraction of rho spent. Two departures from the
    reference code, neither changing what is released: the candidates' model marginals come
    from an exact numpy variable elimination (mbi's ``model.project`` compiles a JAX program
    per candidate per round), and the model of the last round is sampled without the
    reference's extra final refit.

Neighbouring relation. dpfed uses replace-one (bounded DP). The published MST and AIM are
analysed under add/remove: a marginal's L2 sensitivity is 1 and the L1-error quality of the
exponential mechanism has sensitivity 1. Under replace-one one row moves one count down and
another up, so a marginal's L2 sensitivity is sqrt(2) and an L1 error moves by up to 2: MST and
AIM are *converted* (Gaussian noise times sqrt(2), exponential-mechanism sensitivities times 2,
the same zCDP accounting: rho from (epsilon, delta) by the Canonne-Kamath-Steinke conversion
private-pgm uses, ``dpfed.common.privacy.accounting.rho_for_epsilon``), so they carry the same
(epsilon, delta) guarantee as dpfed. ``--relation add-remove`` runs them as published.

Binning: every continuous column on dpfed's coarse cells (:class:`Discretiser`): whole numbers
for integer columns of at most 128 of them, else the bounds as point cells and ``--bins``
(32) equal-width bins; decoded uniformly inside a cell.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy.cluster.hierarchy import DisjointSet
from scipy.special import logsumexp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    import jax
    import networkx as nx

    # private-pgm compiles many small programs: a persistent cache only costs disk here, and
    # float32 is enough below 10^5 rows (mbi warns about both on import).
    jax.config.update("jax_enable_compilation_cache", False)
    warnings.filterwarnings("ignore", message="JAX is running in float32 mode")
    from mbi import Dataset, Domain, LinearMeasurement, estimation, junction_tree
except ImportError:
    raise SystemExit("bench/dp_baselines.py runs in its own environment: bash "
                     "bench/envs/dp_baselines/setup.sh, then bench/envs/dp_baselines/.venv/bin/"
                     "python bench/dp_baselines.py") from None

from real_tables import TABLES, load_table, split_sites  # noqa: E402

from dpfed.common.data.encoding import encode_table  # noqa: E402
from dpfed.common.data.schema import ContinuousColumn, OrdinalColumn, Schema  # noqa: E402
from dpfed.common.privacy.accounting import rho_for_epsilon  # noqa: E402
from dpfed.common.synth.column_cells import column_cells, sub_bins  # noqa: E402

# --------------------------------------------------------------------------- relation


@dataclass(frozen=True)
class Relation:
    """Sensitivities of MST's and AIM's releases under one neighbouring relation.

    ``l2``: L2 sensitivity of one marginal (count vector); ``l1_error``: sensitivity of the
    quality ``||x - xhat||_1`` (x the true marginal, xhat fixed by earlier releases).
    """

    name: str
    l2: float
    l1_error: float


ADD_REMOVE = Relation("add-remove", 1.0, 1.0)
REPLACE_ONE = Relation("replace-one", math.sqrt(2.0), 2.0)


def exponential_mechanism(q: np.ndarray, eps: float, sensitivity: float,
                          rng: np.random.Generator) -> int:
    """Non-monotonic exponential mechanism: P(i) ~ exp(eps q_i / (2 sensitivity)).

    It is eps-DP, hence eps^2/8-zCDP (bounded range; Cesar & Rogers 2021), which is how both
    MST and AIM account for it.
    """
    scores = 0.5 * eps / sensitivity * np.asarray(q, dtype=float)
    return int(rng.choice(q.size, p=np.exp(scores - logsumexp(scores))))


# --------------------------------------------------------------------------- discretisation


class Discretiser:
    """Schema-typed frames <-> integer codes over a public domain: dpfed's coarse cells.

    A continuous column's codes are the coarse cells of dpfed's "fine" layout
    (:func:`dpfed.common.synth.column_cells.column_cells`): one per whole number for an
    integer column of at most 128 whole numbers, else the two bounds as point cells and
    ``bins`` equal-width bins between them -- the same cells dpfed's link round releases at its
    first level, so every method sees the same public binning. Decoding draws a value
    uniformly inside the cell (an integer column's whole numbers evenly; a bound: the bound).
    """

    def __init__(self, schema: Schema, bins: int) -> None:
        self.schema = schema
        self.bins = bins
        sub = sub_bins(schema, bins)
        self.cells = {c.name: column_cells(c, bins, sub, "fine") for c in schema.columns
                      if isinstance(c, ContinuousColumn)}
        sizes = []
        for col in schema.columns:
            if isinstance(col, ContinuousColumn):
                sizes.append(self.cells[col.name].n_coarse)
            else:
                sizes.append(col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories)
        self.domain = Domain(tuple(schema.names), tuple(int(s) for s in sizes))

    def to_dataset(self, frame: pd.DataFrame) -> Dataset:
        table, _ = encode_table(self.schema, frame)
        codes = {}
        for col in self.schema.columns:
            v = table.columns[col.name]
            codes[col.name] = (self.cells[col.name].coarse_codes(v)
                               if isinstance(col, ContinuousColumn) else v.astype(int))
        return Dataset(codes, self.domain)

    def to_frame(self, data: Dataset, rng: np.random.Generator) -> pd.DataFrame:
        out: dict[str, Any] = {}
        for col in self.schema.columns:
            c = np.asarray(data.data[col.name]).astype(int)
            if isinstance(col, ContinuousColumn):
                cells = self.cells[col.name]
                # A leaf of the coarse cell in proportion to its width (whole numbers: count),
                # then a position inside it: uniform over the coarse cell.
                weight = np.where(cells.prior > 0, cells.prior, 0.0)
                leaves = np.empty(c.size, dtype=np.intp)
                for cell in np.unique(c):
                    members = np.flatnonzero(cells.coarse == cell)
                    w = weight[members]
                    w = w / w.sum() if w.sum() > 0 else np.full(w.size, 1.0 / w.size)
                    rows = np.flatnonzero(c == cell)
                    leaves[rows] = rng.choice(members, size=rows.size, p=w)
                out[col.name] = cells.values(leaves, rng.random(c.size))
            else:
                labels = col.levels if isinstance(col, OrdinalColumn) else col.categories
                out[col.name] = np.asarray(labels, dtype=object)[c]
        return pd.DataFrame(out)


# --------------------------------------------------------------------------- MST


def _measure(data: Dataset, cliques: list[tuple[str, ...]], sigma: float,
             rng: np.random.Generator) -> list[Any]:
    """Gaussian measurements of ``cliques`` with weights of unit L2 norm (rho = l2^2/2 sigma^2)."""
    weights = np.ones(len(cliques)) / math.sqrt(len(cliques))
    out = []
    for proj, wgt in zip(cliques, weights, strict=True):
        x = data.project(proj).datavector()
        y = x + rng.normal(0.0, sigma / wgt, x.size)
        out.append(LinearMeasurement(y, proj, sigma / wgt))
    return out


def _fit(domain: Domain, measurements: list[Any], iters: int, warm_start: Any = None) -> Any:
    """private-pgm's mirror descent (the estimator both reference mechanisms use)."""
    return estimation.MirrorDescent().estimate(domain, measurements, iters=iters,
                                               warm_start=warm_start)


def _compress_domain(data: Dataset, measurements: list[Any]
                     ) -> tuple[Dataset, list[Any], dict[str, np.ndarray]]:
    """MST's post-processing: the 1-way cells measured under 3 sigma are merged into one cell.

    ``mapping[col][i]`` is the compressed code of code ``i``; private-pgm's
    ``LinearMeasurement.compress`` re-expresses a measurement on the merged cells (their sum
    over sqrt(count), as MST does) and ``Dataset.decompress`` undoes the merge by sampling a
    code of the merged group uniformly.
    """
    mapping: dict[str, np.ndarray] = {}
    for m in measurements:
        sup = np.asarray(m.noisy_measurement) >= 3 * m.stddev
        if not sup.all():
            codes = np.full(sup.size, int(sup.sum()))
            codes[sup] = np.arange(int(sup.sum()))
            mapping[m.clique[0]] = codes
    new = [m.compress(mapping, data.domain) for m in measurements]
    return data.compress(mapping), new, mapping


def _mst_select(data: Dataset, rho: float, log: list[Any], rel: Relation,
                rng: np.random.Generator, iters: int) -> list[tuple[str, ...]]:
    est = _fit(data.domain, log, iters)
    candidates = list(itertools.combinations(data.domain.attributes, 2))
    weights = {}
    for a, b in candidates:
        xhat = np.asarray(est.project([a, b]).datavector())
        x = data.project([a, b]).datavector()
        weights[a, b] = float(np.linalg.norm(x - xhat, 1))
    tree = nx.Graph()
    tree.add_nodes_from(data.domain.attributes)
    ds = DisjointSet(data.domain.attributes)
    r = len(list(nx.connected_components(tree)))
    eps = math.sqrt(8 * rho / (r - 1))
    for _ in range(r - 1):
        candidates = [e for e in candidates if not ds.connected(*e)]
        wgts = np.array([weights[e] for e in candidates])
        e = candidates[exponential_mechanism(wgts, eps, rel.l1_error, rng)]
        tree.add_edge(*e)
        ds.merge(*e)
    return [tuple(e) for e in tree.edges]


def mst(data: Dataset, rho: float, rel: Relation, rng: np.random.Generator,
        iters: int = 10_000) -> Dataset:
    """MST at rho-zCDP under ``rel`` (rho/3 each: 1-way, tree selection, 2-way)."""
    sigma = rel.l2 * math.sqrt(3.0 / (2.0 * rho))
    log1 = _measure(data, [(c,) for c in data.domain], sigma, rng)
    small, log1, mapping = _compress_domain(data, log1)
    cliques = _mst_select(small, rho / 3.0, log1, rel, rng, iters=2500)
    log2 = _measure(small, cliques, sigma, rng)
    est = _fit(small.domain, log1 + log2, iters)
    return est.synthetic_data(rows=data.records).decompress(mapping)


# --------------------------------------------------------------------------- AIM


def _powerset(cl: tuple[str, ...]) -> list[tuple[str, ...]]:
    return [c for r in range(1, len(cl) + 1) for c in itertools.combinations(cl, r)]


def _downward_closure(cliques: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    out: set[tuple[str, ...]] = set()
    for cl in cliques:
        out.update(_powerset(cl))
    return sorted(out, key=len)


def _compile_workload(workload: list[tuple[str, ...]]) -> dict[tuple[str, ...], float]:
    return {cl: float(sum(len(set(cl) & set(w)) for w in workload))
            for cl in _downward_closure(workload)}


def _model_marginals(model: Any, cliques: list[tuple[str, ...]]) -> dict[tuple[str, ...],
                                                                       np.ndarray]:
    """Exact marginals of the fitted graphical model on ``cliques`` (variable elimination).

    The same computation as private-pgm's ``model.project`` (log-potentials, sum-product with a
    greedy elimination order, normalised to the model's total), in numpy: mbi compiles a JAX
    program per (model structure, clique), which on this machine costs about a second per
    candidate per round -- most of AIM's run time -- and changes no number.
    """
    domain = model.domain
    base = [(tuple(f.domain.attributes), np.asarray(f.values, dtype=float))
            for f in model.potentials.tables.values()]
    base = [(attrs, np.exp(v - v.max())) for attrs, v in base]
    letters = {a: chr(ord("a") + i) for i, a in enumerate(domain.attributes)}

    def product(factors: list[tuple[tuple[str, ...], np.ndarray]],
                keep: tuple[str, ...]) -> np.ndarray:
        spec = ",".join("".join(letters[a] for a in attrs) for attrs, _ in factors)
        out = np.einsum(spec + "->" + "".join(letters[a] for a in keep),
                        *[v for _, v in factors], optimize=True)
        return out / max(float(out.max()), 1e-300)

    result = {}
    for cl in cliques:
        factors = list(base)
        todo = [a for a in domain.attributes if a not in cl]
        while todo:
            def cost(z: str, fs: list[tuple[tuple[str, ...], np.ndarray]] = factors) -> int:
                union = {a for attrs, _ in fs if z in attrs for a in attrs}
                return math.prod(domain[a] for a in union)
            z = min(todo, key=cost)
            todo.remove(z)
            inv = [f for f in factors if z in f[0]]
            factors = [f for f in factors if z not in f[0]]
            keep = tuple(dict.fromkeys(a for attrs, _ in inv for a in attrs if a != z))
            factors.append((keep, product(inv, keep)))
        joint = product(factors, tuple(cl))
        result[cl] = (joint / joint.sum() * float(model.total)).ravel()
    return result


@dataclass
class AIMResult:
    """AIM's synthetic codes, whether it finished, the rho it spent and its rounds."""

    data: Dataset
    finished: bool
    rho_used: float
    rounds: int


def aim(data: Dataset, rho: float, rel: Relation, rng: np.random.Generator, *, degree: int,
        max_model_size: float, max_iters: int, time_limit: float) -> AIMResult:
    """AIM at rho-zCDP under ``rel``; stops between rounds after ``time_limit`` seconds."""
    start = time.perf_counter()
    workload = list(itertools.combinations(data.domain.attributes, degree))
    candidates = _compile_workload(workload)
    answers = {cl: data.project(cl).datavector() for cl in candidates}
    oneway = [cl for cl in candidates if len(cl) == 1]
    rounds = 16 * len(data.domain)
    # ``sigma`` is the noise multiplier in units of the relation's L2 sensitivity: a
    # measurement at noise rel.l2 * sigma costs 1 / (2 sigma^2) whatever the relation.
    sigma = math.sqrt(rounds / (2 * 0.9 * rho))
    epsilon = math.sqrt(8 * 0.1 * rho / rounds)
    measurements = []
    rho_used = len(oneway) * 0.5 / sigma ** 2
    for cl in oneway:
        x = answers[cl]
        measurements.append(LinearMeasurement(x + rng.normal(0, rel.l2 * sigma, x.size), cl,
                                              stddev=rel.l2 * sigma))
    model = _fit(data.domain, measurements, max_iters)
    t, terminate, finished = 0, False, True
    while not terminate:
        if time.perf_counter() - start > time_limit:
            finished = False
            break
        t += 1
        if rho - rho_used < 2 * (0.5 / sigma ** 2 + 1.0 / 8 * epsilon ** 2):
            remaining = rho - rho_used
            sigma = math.sqrt(1 / (2 * 0.9 * remaining))
            epsilon = math.sqrt(8 * 0.1 * remaining)
            terminate = True
        rho_used += 1.0 / 8 * epsilon ** 2 + 0.5 / sigma ** 2
        size_limit = max_model_size * rho_used / rho
        free = set(_downward_closure(list(model.cliques)))
        small = {cl: w for cl, w in candidates.items()
                 if cl in free or junction_tree.hypothetical_model_size(
                     data.domain, list(model.cliques) + [cl]) <= size_limit}
        std = rel.l2 * sigma
        keys = list(small)
        est = _model_marginals(model, keys)
        errors = np.array([small[cl] * (np.linalg.norm(answers[cl] - est[cl], 1)
                                        - math.sqrt(2 / math.pi) * std * data.domain.size(cl))
                           for cl in keys])
        sens = rel.l1_error * max(abs(w) for w in small.values())
        cl = keys[exponential_mechanism(errors, epsilon, sens, rng)]
        n = data.domain.size(cl)
        x = answers[cl]
        measurements.append(LinearMeasurement(x + rng.normal(0, std, n), cl, stddev=std))
        z = est[cl]
        model = _fit(data.domain, measurements, max_iters, warm_start=model)
        w = _model_marginals(model, [cl])[cl]
        print(f"    AIM round {t}: {cl} ({n} cells), rho {rho_used / rho:.0%}, "
              f"{time.perf_counter() - start:.0f}s", flush=True)
        if np.linalg.norm(w - z, 1) <= std * math.sqrt(2 / math.pi) * n:
            sigma /= 2
            epsilon *= 2
    return AIMResult(model.synthetic_data(rows=data.records), finished, rho_used, t)


# --------------------------------------------------------------------------- runner


SEED = 7
HOLDOUT = 0.3
BINS = 32


def run_path(out: Path, table: str, method: str, eps: float, run: int) -> Path:
    """Where one baseline run's synthetic rows are cached."""
    return out / table / f"{method.lower()}-eps{eps:g}-run{run}.parquet"


def run_table(name: str, epsilons: list[float], delta: float, rel: Relation,
              args: argparse.Namespace) -> None:
    """Run (or skip, when cached) every method, epsilon and run of one table."""
    schema, frame, _target = load_table(name)
    sites, holdout = split_sites(frame, 4, iid=True, seed=args.seed, holdout=args.holdout)
    train = pd.concat(sites, ignore_index=True)
    disc = Discretiser(schema, args.bins)
    data = disc.to_dataset(train)
    print(f"== {name}: {len(train)} training rows, {len(holdout)} holdout rows, MST/AIM domain "
          f"{disc.domain.size():.3g} cells", flush=True)
    for eps in epsilons:
        rho = rho_for_epsilon(eps, delta)
        for run in range(args.runs):
            for method in args.methods:
                path = run_path(args.out, name, method, eps, run)
                if path.exists() or (method == "mst" and run >= args.mst_runs):
                    continue
                key = [args.seed, int(round(eps * 1000)), {"mst": 1, "aim": 2}[method], run]
                rng = np.random.default_rng(key)
                np.random.seed(np.random.SeedSequence(key).generate_state(1))  # mbi's sampler
                start = time.perf_counter()
                meta: dict[str, Any] = {"table": name, "method": method, "epsilon": eps,
                                        "delta": delta, "run": run, "relation": rel.name}
                if method == "mst":
                    syn = disc.to_frame(mst(data, rho, rel, rng, iters=args.mst_iters), rng)
                    meta["finished"] = True
                else:
                    res = aim(data, rho, rel, rng, degree=2, max_model_size=args.aim_model_size,
                              max_iters=args.aim_iters, time_limit=args.aim_time_limit)
                    syn = disc.to_frame(res.data, rng)
                    meta.update(finished=res.finished, rho_spent=res.rho_used / rho,
                                rounds=res.rounds)
                meta["seconds"] = time.perf_counter() - start
                path.parent.mkdir(parents=True, exist_ok=True)
                syn.to_parquet(path.with_suffix(".partial"))
                path.with_suffix(".partial").replace(path)
                path.with_suffix(".json").write_text(json.dumps(meta))
                print(f"   {name} eps {eps:g} run {run} {method}: {meta['seconds']:.0f}s"
                      + ("" if meta["finished"] else " (AIM stopped at its time limit)"),
                      flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", nargs="+", default=list(TABLES), choices=TABLES)
    ap.add_argument("--eps", nargs="+", type=float, default=[0.5, 1.0, 5.0])
    ap.add_argument("--delta", type=float, default=1e-6)
    ap.add_argument("--runs", type=int, default=3, help="runs (fresh noise) per method")
    ap.add_argument("--mst-runs", type=int, default=3,
                    help="at most this many of them for MST (it is slower than AIM here)")
    ap.add_argument("--methods", nargs="+", choices=("mst", "aim"), default=["mst", "aim"])
    ap.add_argument("--relation", choices=("replace-one", "add-remove"),
                    default="replace-one", help="MST/AIM's neighbouring relation (module doc)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/baselines"))
    ap.add_argument("--bins", type=int, default=BINS)
    ap.add_argument("--holdout", type=float, default=HOLDOUT)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--mst-iters", type=int, default=10_000)
    ap.add_argument("--aim-model-size", type=float, default=80.0, help="MB (AIM's default)")
    ap.add_argument("--aim-iters", type=int, default=1000)
    ap.add_argument("--aim-time-limit", type=float, default=1800.0, help="seconds per AIM run")
    args = ap.parse_args()
    rel = REPLACE_ONE if args.relation == "replace-one" else ADD_REMOVE
    for name in args.tables:
        run_table(name, args.eps, args.delta, rel, args)


if __name__ == "__main__":
    main()
