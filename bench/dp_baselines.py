"""dpfed's synthesizer against the best public DP synthesizers, MST and AIM, on real tables.

Runs in its own bench environment, never in the project's: MST and AIM are built on
private-pgm (``mbi``, JAX), which dpfed does not depend on and CI never installs::

    bash bench/envs/dp_baselines/setup.sh                 # once: bench/envs/dp_baselines/.venv
    OPENBLAS_NUM_THREADS=1 bench/envs/dp_baselines/.venv/bin/python bench/dp_baselines.py \
        --tables flchain health_insurance --eps 0.5 1 2 5

Data: the real tables of ``bench/real_tables.py`` (flchain, health_insurance), split by
``split_sites`` into a real holdout (20 %) and 4 IID site tables; the pooled site tables are the
training rows every central method sees. Every method writes as many rows as there are training
rows; every metric is measured against the holdout (``Metrics`` of ``bench/synth_quality.py``).

Methods, all at the same nominal (epsilon, delta) (delta 1e-6 by default):

``indep``
    every column from its own DP histogram, all of the budget (dpfed's Gaussian histogram
    release; ``independent_marginals`` of ``bench/synth_quality.py``);
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
    marginals (``--aim-degree 3`` for all 3-way ones, as in the paper's experiments; much
    slower). A wall-clock limit (``--aim-time-limit``) stops it between rounds: the model is
    then sampled as it stands (it has spent less than the budget, so it is still private) and
    the row is marked ``AIM*`` with the fraction of rho spent -- AIM did not finish. Two
    departures from the reference code, neither changing what is released: the candidates'
    model marginals come from an exact numpy variable elimination (mbi's ``model.project``
    compiles a JAX program per candidate per round, most of AIM's time here), and the model
    of the last round is sampled without the reference's extra final refit;
``central``
    dpfed's central ``FactorModelSynthesizer`` on the pooled training rows (the ``synth``
    job's pipeline with one site, the job's default budget split and bins);
``fed-iid``
    the same pipeline over the 4 IID sites, each spending the full (epsilon, delta) on its own
    rows (parallel composition, as in the federation).
``central+pairs`` / ``fed-iid+pairs``
    the same with the job's two pair rounds (``pair_scores``, ``pairs``: DP 2-way tables of a
    spanning forest of column pairs and the correction fitting generated rows to them) at the
    job's default split with pairs (``dpfed.common.job_params.SYNTH_PAIRS_DEFAULT_SPLIT``);
    ``central+pairs`` is ``FactorModelSynthesizer`` with its default ``pairs``, ``central``
    the same with ``pairs=0`` (the job's split without pairs, ``SYNTH_DEFAULT_SPLIT``).
    ``--pairs``, ``--pair-groups`` and ``--pairs-share`` change them.
``secure-iid`` / ``secure-iid+pairs``
    the job with ``--aggregation secure`` over the 4 IID sites, without and with the pair
    rounds (the sites' real secure sources, Skellam shares and masks, in-process;
    ``fit_secure`` of ``bench/secure_synth_round.py``); ``--no-secure`` skips them.
``central+pairs zcdp`` / ``fed-iid+pairs zcdp``
    ``central+pairs`` and ``fed-iid+pairs`` with the job's rounds composed in zCDP (``dpfed
    synth --composition zcdp``: every round its share of the rho the (epsilon, delta) converts
    to, as MST and AIM spend theirs).
``secure-iid+pairs zcdp``
    ``secure-iid+pairs`` composed in zCDP (``dpfed synth --aggregation secure --composition
    zcdp``: every secure round's Skellam noise calibrated to its epsilon and to at most its
    share of rho).

dpfed's rows of an epsilon run before MST and AIM (they are there when AIM is cut short).
``--methods`` with no name runs dpfed's rows and ``indep`` only. private-pgm's JAX programs
can run out of memory in a long process: run one process per table (and epsilon) when MST and
AIM are repeated.

Neighbouring relation. dpfed uses replace-one (bounded DP): a neighbouring table has the same
number of rows and one row changed. The published MST and AIM are analysed under add/remove
(unbounded DP): a marginal's L2 sensitivity is 1 and the L1-error quality of the exponential
mechanism has sensitivity 1 (``wgt`` for AIM). Under replace-one one row moves one count down
and another up, so a marginal's L2 sensitivity is sqrt(2) and an L1 error moves by up to 2. By
default (``--relation replace-one``) MST and AIM are *converted*: their Gaussian noise is
multiplied by sqrt(2) and their exponential-mechanism sensitivities by 2, and the zCDP
accounting (rho from (epsilon, delta) by the Canonne-Kamath-Steinke conversion, the one
private-pgm uses, ``dpfed.common.privacy.accounting.rho_for_epsilon``) is otherwise unchanged,
so every row is (epsilon, delta)-DP under replace-one -- the same guarantee as dpfed's rows.
``--relation add-remove`` runs the originals as published (the same nominal epsilon under their
own relation: weaker than replace-one at that epsilon, which favours them); ``both`` runs both.

Continuous columns are discretised for MST/AIM on public bins from the schema bounds
(``--bins`` equal-width bins, 32 by default, never from the data) and decoded by sampling
uniformly inside the bin.

``--repeats R`` runs ``indep`` and dpfed's methods R times with fresh noise (they take
seconds) and prints the mean, with the standard deviation of tvd2 and auc; MST and AIM run once
unless ``--repeat-baselines``. A summary of tvd2 / auc / seconds per epsilon closes the run.

Metrics (``bench/synth_quality.py``): ``tvd1`` mean 1-way TVD (20 bins), ``tvd2``/``tvd2max``
mean/max 2-way TVD over all column pairs (5 bins), ``corr`` mean |correlation difference|,
``auc`` of a logistic regression for the table's binary target trained on the synthetic rows
and tested on the holdout (``real`` row: trained on the training rows), ``dcr`` (1 = synthetic
rows are as close to the training rows as fresh rows are; < 1 closer), ``nndr``, ``s`` wall
time of fitting and sampling. After each table the ratios of every dpfed method to AIM (and to
MST): ``tvd2``, ``auc`` and time -- the issue's goal is tvd2 ratio <= 1, auc ratio >= 1 and
time ratio <= 0.01.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
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
from secure_synth_round import federation, fit_secure  # noqa: E402
from synth_quality import (  # noqa: E402
    NO_PAIRS_SPLIT,
    Metrics,
    add_pair_arguments,
    fit_central,
    fit_federated,
    independent_marginals,
    pairs_split,
)

import dpfed  # noqa: E402
from dpfed.common.data.encoding import encode_table  # noqa: E402
from dpfed.common.data.schema import ContinuousColumn, OrdinalColumn, Schema  # noqa: E402
from dpfed.common.privacy.accounting import rho_for_epsilon  # noqa: E402
from dpfed.common.synth.quantile_link import DEFAULT_BINS, snap_to_whole  # noqa: E402

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
    """Schema-typed frames <-> integer codes over a public domain (continuous: equal bins)."""

    def __init__(self, schema: Schema, bins: int) -> None:
        self.schema = schema
        self.bins = bins
        sizes = []
        for col in schema.columns:
            if isinstance(col, ContinuousColumn):
                sizes.append(bins)
            else:
                sizes.append(col.n_levels if isinstance(col, OrdinalColumn) else col.n_categories)
        self.domain = Domain(tuple(schema.names), tuple(int(s) for s in sizes))

    def to_dataset(self, frame: pd.DataFrame) -> Dataset:
        table, _ = encode_table(self.schema, frame)
        codes = {}
        for col in self.schema.columns:
            v = table.columns[col.name]
            if isinstance(col, ContinuousColumn):
                w = (col.max - col.min) / self.bins
                codes[col.name] = np.clip(((v - col.min) / w).astype(int), 0, self.bins - 1)
            else:
                codes[col.name] = v.astype(int)
        return Dataset(codes, self.domain)

    def to_frame(self, data: Dataset, rng: np.random.Generator) -> pd.DataFrame:
        out: dict[str, Any] = {}
        for col in self.schema.columns:
            c = np.asarray(data.data[col.name]).astype(int)
            if isinstance(col, ContinuousColumn):
                w = (col.max - col.min) / self.bins
                drawn = col.min + (c + rng.random(c.size)) * w
                # Integer columns: whole numbers, bin by bin, exactly as dpfed decodes them.
                out[col.name] = snap_to_whole(col, drawn, self.bins) if col.integer else drawn
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


# --------------------------------------------------------------------------- bench


DPFED_BINS = DEFAULT_BINS  # the job's default bins per continuous column
DPFED_METHODS = ("central", "fed-iid", "central+pairs", "fed-iid+pairs", "central+pairs zcdp",
                 "fed-iid+pairs zcdp", "secure-iid", "secure-iid+pairs",
                 "secure-iid+pairs zcdp")
SITE_IDS = [f"site-{i}" for i in range(4)]
HEADER = ("method", "tvd1", "tvd2", "tvd2max", "corr", "auc", "dcr", "nndr", "s")
METRICS = HEADER[1:]
Method = Callable[[np.random.Generator], tuple[pd.DataFrame, str]]


def show(row: dict[str, Any]) -> None:
    cells = [row["method"]] + [f"{row[k]:.4f}" for k in HEADER[1:-1]] + [f"{row['s']:.1f}"]
    spread = ""
    if row.get("runs", 1) > 1:
        spread = (f"  (x{row['runs']}: sd tvd2 {row['tvd2_sd']:.4f}, auc {row['auc_sd']:.4f})")
    print(" ".join([f"{cells[0]:>22}"] + [f"{c:>8}" for c in cells[1:]]) + spread, flush=True)


def run_table(name: str, epsilons: list[float], delta: float, relations: list[Relation],
              args: argparse.Namespace) -> list[dict[str, Any]]:
    schema, frame, target = load_table(name)
    sites, holdout = split_sites(frame, 4, iid=True, seed=args.seed)
    train = pd.concat(sites, ignore_index=True)
    n = len(train)
    disc = Discretiser(schema, args.bins)
    data = disc.to_dataset(train)
    pooled, _ = encode_table(schema, train)
    site_tables = [encode_table(schema, s)[0] for s in sites]
    print(f"\n== {name}: {n} training rows (4 IID sites), {len(holdout)} holdout rows, "
          f"{len(schema.columns)} columns, target {target!r}, delta {delta:g}; MST/AIM domain "
          f"{disc.domain.size():.3g} cells ({args.bins} bins per continuous column)")
    most = "columns - 1" if args.pairs is None else args.pairs
    print(f"   dpfed from {Path(dpfed.__file__).resolve().parent}; central(+pairs): "
          f"FactorModelSynthesizer (pairs=0 / its default); +pairs split {args.pair_split}, "
          f"pairs {most}, pair_groups {args.pair_groups}; without pairs {dict(NO_PAIRS_SPLIT)}")

    metrics = Metrics(schema, target, train, holdout, DPFED_BINS)
    fed_dir: Path = args.fed_dir

    def ev(method: str, syn: pd.DataFrame, seconds: float) -> dict[str, Any]:
        return metrics.evaluate(method, syn, seconds)

    real = ev("real (train rows)", train.iloc[:len(holdout)], 0.0)
    real["auc"] = metrics.auc(train)
    rows: list[dict[str, Any]] = []
    for eps in epsilons:
        rho = rho_for_epsilon(eps, delta)
        print(f"\n-- {name}, epsilon {eps:g} (rho {rho:.4f}-zCDP for MST/AIM)")
        print(" ".join([f"{'method':>22}"] + [f"{h:>8}" for h in HEADER[1:]]))
        show(real)
        methods: list[tuple[str, Method, bool]] = []  # (name, run, cheap: repeated)

        def indep(rng: np.random.Generator, _eps: float = eps) -> tuple[pd.DataFrame, str]:
            syn, _ = independent_marginals(schema, [pooled], _eps, delta, n, DPFED_BINS, rng)
            return syn, "indep"

        methods.append(("indep", indep, True))
        for rel in relations:
            tag = "" if len(relations) == 1 else f" ({rel.name})"

            def run_mst(rng: np.random.Generator, _rel: Relation = rel, _rho: float = rho,
                        _tag: str = tag) -> tuple[pd.DataFrame, str]:
                return disc.to_frame(mst(data, _rho, _rel, rng, iters=args.mst_iters),
                                     rng), "MST" + _tag

            def run_aim(rng: np.random.Generator, _rel: Relation = rel, _rho: float = rho,
                        _tag: str = tag) -> tuple[pd.DataFrame, str]:
                res = aim(data, _rho, _rel, rng, degree=args.aim_degree,
                          max_model_size=args.aim_model_size, max_iters=args.aim_iters,
                          time_limit=args.aim_time_limit)
                if res.finished:
                    return disc.to_frame(res.data, rng), "AIM" + _tag
                print(f"    AIM did not finish within {args.aim_time_limit:.0f}s: {res.rounds} "
                      f"rounds, {res.rho_used / _rho:.0%} of rho spent; the row shows the model "
                      "as it stood", flush=True)
                return disc.to_frame(res.data, rng), f"AIM*({res.rho_used / _rho:.0%})" + _tag

            if "mst" in args.methods:
                methods.append(("MST", run_mst, False))
            if "aim" in args.methods:
                methods.append(("AIM", run_aim, False))

        def central(rng: np.random.Generator, _eps: float = eps) -> tuple[pd.DataFrame, str]:
            fm = fit_central(schema, train, _eps, delta, NO_PAIRS_SPLIT, DPFED_BINS, rng)
            return fm.sample(n), "central"

        def fed(rng: np.random.Generator, _eps: float = eps) -> tuple[pd.DataFrame, str]:
            model = fit_federated(schema, site_tables, _eps, delta, NO_PAIRS_SPLIT, DPFED_BINS,
                                  rng)
            return model.sample(n, rng=rng), "fed-iid"

        def central_pairs(rng: np.random.Generator, _eps: float = eps
                          ) -> tuple[pd.DataFrame, str]:
            fm = fit_central(schema, train, _eps, delta, args.pair_split, DPFED_BINS, rng,
                             pairs=args.pairs, pair_groups=args.pair_groups)
            return fm.sample(n), "central+pairs"

        def fed_pairs(rng: np.random.Generator, _eps: float = eps) -> tuple[pd.DataFrame, str]:
            model = fit_federated(schema, site_tables, _eps, delta, args.pair_split, DPFED_BINS,
                                  rng, pairs=args.pairs, pair_groups=args.pair_groups)
            return model.sample(n, rng=rng), "fed-iid+pairs"

        def central_zcdp(rng: np.random.Generator, _eps: float = eps
                         ) -> tuple[pd.DataFrame, str]:
            fm = fit_central(schema, train, _eps, delta, args.pair_split, DPFED_BINS, rng,
                             pairs=args.pairs, pair_groups=args.pair_groups,
                             composition="zcdp")
            return fm.sample(n), "central+pairs zcdp"

        def fed_zcdp(rng: np.random.Generator, _eps: float = eps) -> tuple[pd.DataFrame, str]:
            model = fit_federated(schema, site_tables, _eps, delta, args.pair_split, DPFED_BINS,
                                  rng, pairs=args.pairs, pair_groups=args.pair_groups,
                                  composition="zcdp")
            return model.sample(n, rng=rng), "fed-iid+pairs zcdp"

        def secure(rng: np.random.Generator, _eps: float = eps) -> tuple[pd.DataFrame, str]:
            model = fit_secure(schema, site_tables, SITE_IDS, fed_dir, _eps, delta, rng,
                               n_bins=DPFED_BINS, split=NO_PAIRS_SPLIT, pairs=0)
            return model.sample(n, rng=rng), "secure-iid"

        def secure_pairs(rng: np.random.Generator, _eps: float = eps
                         ) -> tuple[pd.DataFrame, str]:
            model = fit_secure(schema, site_tables, SITE_IDS, fed_dir, _eps, delta, rng,
                               n_bins=DPFED_BINS, split=args.pair_split, pairs=args.pairs,
                               pair_groups=args.pair_groups)
            return model.sample(n, rng=rng), "secure-iid+pairs"

        def secure_zcdp(rng: np.random.Generator, _eps: float = eps
                        ) -> tuple[pd.DataFrame, str]:
            model = fit_secure(schema, site_tables, SITE_IDS, fed_dir, _eps, delta, rng,
                               n_bins=DPFED_BINS, split=args.pair_split, pairs=args.pairs,
                               pair_groups=args.pair_groups, composition="zcdp")
            return model.sample(n, rng=rng), "secure-iid+pairs zcdp"

        # dpfed's methods first: their rows are there even when AIM is cut short.
        ours: list[tuple[str, Method, bool]] = [
            ("central", central, True), ("fed-iid", fed, True),
            ("central+pairs", central_pairs, True), ("fed-iid+pairs", fed_pairs, True),
            ("central+pairs zcdp", central_zcdp, True), ("fed-iid+pairs zcdp", fed_zcdp, True)]
        if not args.no_secure:
            ours += [("secure-iid", secure, True), ("secure-iid+pairs", secure_pairs, True),
                     ("secure-iid+pairs zcdp", secure_zcdp, True)]
        methods = methods[:1] + ours + methods[1:]
        here = []
        for index, (_name, run, cheap) in enumerate(methods):
            runs = []
            for r in range(args.repeats if cheap or args.repeat_baselines else 1):
                key = [args.seed, int(round(eps * 1000)), index, r]
                rng = np.random.default_rng(key)
                np.random.seed(np.random.SeedSequence(key).generate_state(1))  # mbi's sampler
                t = time.perf_counter()
                syn, label = run(rng)
                runs.append(ev(label, syn, time.perf_counter() - t))
            row: dict[str, Any] = {"method": runs[-1]["method"], "table": name, "eps": eps,
                                   "runs": len(runs)}
            row.update({k: float(np.mean([x[k] for x in runs])) for k in METRICS})
            row.update({f"{k}_sd": float(np.std([x[k] for x in runs], ddof=1))
                        if len(runs) > 1 else 0.0 for k in METRICS})
            show(row)
            here.append(row)
        ratios(here)
        rows.extend(here)
    return rows


def ratios(rows: list[dict[str, Any]]) -> None:
    """dpfed's methods against AIM and MST (of every relation run): tvd2, auc, time."""
    refs = [r for r in rows if r["method"].startswith(("AIM", "MST"))]
    ours = [r for r in rows if r["method"] in DPFED_METHODS]
    for ref in refs:
        print(f"  vs {ref['method']}: " + "; ".join(
            f"{r['method']} tvd2 x{r['tvd2'] / ref['tvd2']:.2f}, auc x{r['auc'] / ref['auc']:.2f}"
            f", time x{r['s'] / max(ref['s'], 1e-9):.3f}" for r in ours), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", nargs="+", default=list(TABLES), choices=TABLES)
    ap.add_argument("--eps", nargs="+", type=float, default=[0.5, 1.0, 2.0, 5.0])
    ap.add_argument("--delta", type=float, default=1e-6)
    ap.add_argument("--relation", choices=("replace-one", "add-remove", "both"),
                    default="replace-one", help="MST/AIM's neighbouring relation (module doc)")
    ap.add_argument("--methods", nargs="*", choices=("mst", "aim"), default=["mst", "aim"],
                    help="which public baselines to run (dpfed's methods always run)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs (fresh noise) of indep and dpfed's methods; rows show the mean")
    ap.add_argument("--repeat-baselines", action="store_true",
                    help="repeat MST and AIM --repeats times too (slow)")
    ap.add_argument("--bins", type=int, default=32, help="bins per continuous column (MST/AIM)")
    ap.add_argument("--mst-iters", type=int, default=10_000)
    ap.add_argument("--aim-degree", type=int, default=2, choices=(2, 3))
    ap.add_argument("--aim-model-size", type=float, default=80.0, help="MB (AIM's default)")
    ap.add_argument("--aim-iters", type=int, default=1000)
    ap.add_argument("--aim-time-limit", type=float, default=900.0, help="seconds per AIM run")
    ap.add_argument("--seed", type=int, default=7)
    add_pair_arguments(ap, secure_rows="secure-iid, secure-iid+pairs, secure-iid+pairs zcdp")
    ap.add_argument("--pairs-share", type=float, default=None,
                    help="epsilon share of the pairs round (+pairs rows); the links round gives "
                         "or takes the difference to the job's default split")
    args = ap.parse_args()
    try:
        args.pair_split = pairs_split(args.pairs_share)
    except ValueError as exc:
        raise SystemExit(f"--pairs-share: {exc}") from None
    relations = {"replace-one": [REPLACE_ONE], "add-remove": [ADD_REMOVE],
                 "both": [REPLACE_ONE, ADD_REMOVE]}[args.relation]
    with tempfile.TemporaryDirectory() as tmp:
        args.fed_dir = federation(Path(tmp), SITE_IDS)
        rows = [r for name in args.tables for r in run_table(name, args.eps, args.delta,
                                                              relations, args)]
    summary(rows)


def summary(rows: list[dict[str, Any]]) -> None:
    """One line per table and method: tvd2 / auc / seconds at every epsilon run."""
    epsilons = sorted({r["eps"] for r in rows})
    print("\nSummary: tvd2 / auc / seconds per epsilon")
    print(" ".join([f"{'table':>16}", f"{'method':>22}"]
                   + [f"{'eps ' + format(e, 'g'):>22}" for e in epsilons]))
    for table in dict.fromkeys(r["table"] for r in rows):
        names = dict.fromkeys(r["method"].split("*")[0] for r in rows if r["table"] == table)
        for method in names:
            cells = []
            for e in epsilons:
                hit = [r for r in rows if r["table"] == table and r["eps"] == e
                       and r["method"].split("*")[0] == method]
                cells.append("-" if not hit else
                             f"{hit[0]['tvd2']:.3f}/{hit[0]['auc']:.2f}/{hit[0]['s']:.0f}"
                             + ("*" if "*" in hit[0]["method"] else ""))
            print(" ".join([f"{table:>16}", f"{method:>22}"] + [f"{c:>22}" for c in cells]))
    print("(* AIM stopped at its time limit before spending its budget)", flush=True)


if __name__ == "__main__":
    main()
