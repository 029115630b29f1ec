"""The ``synth`` job's pair rounds (generative mode, ``pairs > 0``): scores, then 2-way tables.

``pair_scores`` releases a dependence score of every candidate column pair on the pair grid
of the DP proportions (the links, digest checked); the coordinator picks a forest of pairs
from the pooled scores. ``pairs`` releases the 2-way tables of the chosen edges (task
parameter ``pair_edges``, each checked: a candidate, no pair twice, at most the job's
``pairs``). The grid, the candidates and the edges are public (functions of the DP
proportions and of the earlier noisy scores). Privacy: docs/privacy.md ("DP pair tables in
synthesis"); secure forms in docs/secure-aggregation.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfed.common.errors import ProtocolError, ValidationError
from dpfed.common.job_params import SynthParams
from dpfed.common.jobs.contract import (
    Ask,
    Contribution,
    DataAccess,
    Release,
    Request,
    SecureSum,
    Site,
    SumEncoding,
    SumRound,
)
from dpfed.common.jobs.release import noisy_release, planned_contribution, require_rows
from dpfed.common.jobs.synth_rounds import (
    LinksInput,
    SynthRound,
    base_params,
    cells_schema,
    check_links,
    secure_base,
    secure_params,
    site_params,
    training_rows,
)
from dpfed.common.synth.missing_cells import CellRows
from dpfed.common.synth.pair_marginals import (
    MAX_GROUPS,
    MAX_PAIR_CELLS,
    SCORE_SENSITIVITY,
    Pair,
    PairGrid,
    PairTableAccumulator,
    check_pairs,
    dependence_scores,
    pair_table_mechanism,
    score_mechanism,
)
from dpfed.common.transport.protocol import Task, TaskResult
from dpfed.common.validation import check_int

#: Per-entry replace-one bound ``b`` of the floored dependence scores (the ``scores`` plan's
#: ``row_norm``); a site's scores lie in ``[0, b N_s]``.
SCORE_BOUND = int(SCORE_SENSITIVITY)
#: Largest |value| a noisy pair score or table cell may have (counts of at most ~1e9 rows).
MAX_PAIR_VALUE = 1e12
#: Largest training row count a site may report with a pair release.
MAX_SITE_ROWS = 10 ** 10


@dataclass(frozen=True)
class PairInput:
    """What the pair rounds are asked with.

    The links, the grid, its candidate pairs, and (round ``pairs``) the chosen edges.
    """

    links: LinksInput
    grid: PairGrid
    candidates: list[Pair]
    edges: list[Pair]

    def with_edges(self, edges: list[Pair]) -> PairInput:
        """Return the same, with the chosen edges."""
        return PairInput(self.links, self.grid, self.candidates, edges)


@dataclass(frozen=True)
class PairTables:
    """The pooled noisy tables of the edges, concatenated in edge order.

    With the public pooled row count, and the noise's standard deviation on every cell (in
    counts).
    """

    total: np.ndarray
    n_rows: int
    noise_sd: float


def check_pair_edges(raw: Any, candidates: list[Pair], n_columns: int,
                     most: int) -> list[Pair]:
    """Validate the ``pair_edges`` a ``pairs`` task carries (ValidationError naming them).

    A non-empty list of at most ``most`` ``[parent, child]`` pairs of column indices, no
    pair twice, each one of ``candidates`` (:meth:`PairGrid.candidate_pairs`, either order).
    """
    if not isinstance(raw, list) or not raw:
        raise ValidationError("the pairs round needs pair_edges: a non-empty list of "
                              "[parent, child] column indices")
    if len(raw) > most:
        raise ValidationError(f"pair_edges has {len(raw)} pairs; this job measures at most "
                              f"{most}")
    if not all(isinstance(e, list) for e in raw):
        raise ValidationError("pair_edges must be a list of [parent, child] column indices")
    edges = check_pairs(raw, n_columns)
    allowed = set(candidates)
    for a, b in edges:
        if (min(a, b), max(a, b)) not in allowed:
            raise ValidationError(f"pair_edges names ({a}, {b}), which is not a candidate pair "
                                  f"(unknown column or a table of more than {MAX_PAIR_CELLS} "
                                  "cells)")
    return edges


def pair_candidates(grid: PairGrid) -> list[Pair]:
    """Return the candidate pairs; refuse (ValidationError) a schema that has none."""
    candidates = grid.candidate_pairs()
    if not candidates:
        raise ValidationError(f"no column pair has a table of at most {MAX_PAIR_CELLS} cells; "
                              "the pair rounds do not apply to this schema")
    return candidates


def exact_pair_tables(grid: PairGrid, pairs: list[Pair], data: DataAccess
                      ) -> PairTableAccumulator:
    """Return the exact 2-way tables of ``pairs`` over ``data``'s rows (site-internal)."""
    acc = PairTableAccumulator(grid, pairs)
    for table, _report in CellRows(data, grid.schema).iter_chunks():
        acc.add(table)
    return acc


def floored_scores(scores: np.ndarray, n_rows: int) -> np.ndarray:
    """Return dependence scores floored to int64 and clipped into ``[0, SCORE_BOUND * N_s]``.

    Privacy
    -------
    Replace-one at this site, ``N_s`` public. A score moves by at most 2; so does its floor
    (``floor x - floor y < x - y + 1 <= 3``, an integer); clipping to the public range (it
    only absorbs floating-point slack) is 1-Lipschitz with the same bounds on both
    neighbours and never increases the change. The range is what the ``scores`` plan's
    no-wrap check assumes.
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or not np.all(np.isfinite(s)):
        raise ValidationError("dependence scores must be a finite vector")
    top = SCORE_BOUND * check_int(n_rows, "n_rows", minimum=0)
    if s.size and (float(s.min()) < 0.0 or float(s.max()) > top * (1.0 + 1e-6) + 1.0):
        raise ValidationError(f"dependence scores outside their range [0, {top}] (the link "
                              "proportions are not distributions)")
    return np.clip(np.floor(s), 0, top).astype(np.int64)


def _grid(task: Task, site: Site, params: SynthParams, digest: Any
          ) -> tuple[PairGrid, np.ndarray]:
    """Check the links the task carries and build the pair grid from their proportions."""
    if params.mode != "generative":
        raise ValidationError(f"the pair rounds run only in generative mode, got mode "
                              f"{params.mode!r}")
    if len(site.data.schema.columns) < 2:
        raise ValidationError("the pair rounds need a schema of at least 2 columns")
    check_links(site.data.schema, params, digest, task.arrays)
    proportions = np.asarray(task.arrays["link_proportions"], dtype=np.float64)
    return (PairGrid.from_proportions(cells_schema(site.data.schema, params), proportions,
                                      params.n_bins,
                                      params.pair_groups, params.resolution), proportions)


def _secure_grid(task: Task, site: Site, params: SynthParams) -> tuple[PairGrid, np.ndarray]:
    found = _grid(task, site, params, task.params.get("links_digest"))
    groups = check_int(task.params.get("pair_groups"), "pair_groups", minimum=2,
                       maximum=MAX_GROUPS)
    if groups != params.pair_groups:
        raise ValidationError(f"pair_groups {groups} differs from the job's "
                              f"{params.pair_groups}; refusing")
    return found


def _check_vector(result: TaskResult, array: str, size: int, what: str) -> None:
    n = result.metadata.get("n_rows")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= MAX_SITE_ROWS:
        raise ProtocolError(f"result lacks a valid n_rows (1..{MAX_SITE_ROWS:.0e})")
    check_pooled(result.arrays.get(array), size, what)


def check_pooled(value: Any, size: int, what: str) -> np.ndarray:
    """Return ``value`` if it is a finite float64 vector of ``size`` entries within bounds."""
    if (not isinstance(value, np.ndarray) or value.shape != (size,) or value.dtype != np.float64
            or not np.all(np.isfinite(value))
            or float(np.abs(value).max(initial=0.0)) > MAX_PAIR_VALUE):
        raise ProtocolError(f"expected finite float64 {what} of shape ({size},) with |x| <= "
                            f"{MAX_PAIR_VALUE:g}")
    return value


class PairScores(SynthRound, SumRound[SynthParams, PairInput, np.ndarray]):
    """``pair_scores``: ``sum |n_ab - N_s p_a p_b|`` of every candidate pair.

    Privacy: each of the ``P`` scores moves by at most 2 under replace-one (one count down and
    one up in the pair's table; the independence table is public): L2 ``2 sqrt(P)``,
    analytic Gaussian (:func:`dpfed.common.synth.pair_marginals.score_mechanism`); secure:
    the ``scores`` statistic of the floored scores, ``b = 2``.
    """

    name = "pair_scores"
    task_kind = "synth"
    source = "synth_pair_scores"
    statistic = "scores"
    secure_releases = ("a masked integer vector of floored dependence scores (one per "
                       "candidate column pair) with a share of Skellam noise; only the pooled "
                       "total is decoded -> the chosen pairs")

    def prepare(self, task: Task, site: Site) -> Release:
        """Prepare the exact scores over the training rows, priced."""
        extra, params = site_params(task, site)
        n_rows, scores = exact_scores(task, site, params, extra.get("links_digest"))
        require_rows(n_rows)
        mech = score_mechanism(scores.shape[0], task.epsilon, task.delta)
        return noisy_release(task, mech.cost(),
                             lambda rng: {"pair_scores": mech.release(scores, rng)},
                             {"n_rows": n_rows, "round": self.name, "noise_sigma": mech.sigma})

    def contribution(self, task: Task, site: Site, participants: list[str],
                     tolerated: int) -> Contribution:
        """Return the floored scores (links digest checked first)."""
        params = secure_params(task, site)
        grid, proportions = _secure_grid(task, site, params)
        candidates = pair_candidates(grid)
        data = training_rows(task, site, params)

        def compute(_plan: Any, _rng: np.random.Generator) -> tuple[np.ndarray, int]:
            acc = exact_pair_tables(grid, candidates, data)
            scores = dependence_scores(acc.counts, grid, candidates, proportions, acc.n_rows)
            return floored_scores(scores, acc.n_rows), acc.n_rows

        return planned_contribution(task, participants, tolerated, statistic=self.statistic,
                                    dim=len(candidates), row_norm=float(SCORE_BOUND),
                                    compute=compute)

    def request(self, ask: Ask[SynthParams, PairInput]) -> Request:
        """Return the job's parameters, the round, the links."""
        links = ask.inputs.links
        return Request({**base_params(ask.params, ask.schema), "round": self.name,
                        "links_digest": links.digest}, links.arrays)

    def check(self, result: TaskResult, ask: Ask[SynthParams, PairInput]) -> None:
        """One finite score per candidate."""
        _check_vector(result, "pair_scores", len(ask.inputs.candidates), "pair scores")

    def pool(self, results: Mapping[str, TaskResult],
             ask: Ask[SynthParams, PairInput]) -> np.ndarray:
        """Return the sum of the sites' scores."""
        return np.asarray(np.sum([results[s].arrays["pair_scores"] for s in sorted(results)],
                                 axis=0))

    def encoding(self, ask: Ask[SynthParams, PairInput]) -> SumEncoding:
        """Integer scores with the per-entry bound ``b``."""
        if not ask.inputs.candidates:
            raise ValidationError("no candidate column pair: the pair rounds have nothing to "
                                  "score")
        return SumEncoding(dim=len(ask.inputs.candidates), row_norm=SCORE_SENSITIVITY,
                           params=_secure_pair_params(self.source, ask), arrays=ask.inputs.links
                           .arrays)

    def pool_secure(self, summed: SecureSum, ask: Ask[SynthParams, PairInput]) -> np.ndarray:
        """Return the pooled scores."""
        return check_pooled(np.asarray(summed.value, dtype=np.float64),
                            len(ask.inputs.candidates), "pooled pair scores")


class PairTableRound(SynthRound, SumRound[SynthParams, PairInput, PairTables]):
    """``pairs``: the 2-way tables of the chosen edges, concatenated in edge order.

    Privacy: one count down and one up in each of the ``K`` tables under replace-one: L2
    ``sqrt(2 K)``, analytic Gaussian (:func:`dpfed.common.synth.pair_marginals.
    pair_table_mechanism`); secure: the ``counts`` statistic with one group per edge.
    """

    name = "pairs"
    task_kind = "synth"
    source = "synth_pairs"
    statistic = "counts"
    secure_releases = ("a masked exact count vector (the chosen pairs' 2-way tables) with a "
                       "share of Skellam noise; only the pooled total is decoded -> the DP pair "
                       "tables")

    def prepare(self, task: Task, site: Site) -> Release:
        """Prepare the exact tables of the edges, priced."""
        extra, params = site_params(task, site)
        n_rows, tables, edges = exact_tables(task, site, params, extra)
        require_rows(n_rows)
        mech = pair_table_mechanism(len(edges), task.epsilon, task.delta)
        values = np.asarray(tables, dtype=np.float64)
        return noisy_release(task, mech.cost(),
                             lambda rng: {"pair_tables": mech.release(values, rng)},
                             {"n_rows": n_rows, "round": self.name, "noise_sigma": mech.sigma})

    def contribution(self, task: Task, site: Site, participants: list[str],
                     tolerated: int) -> Contribution:
        """Return the exact tables (links digest and edges checked first)."""
        params = secure_params(task, site)
        grid, _proportions = _secure_grid(task, site, params)
        d = len(site.data.schema.columns)
        edges = check_pair_edges(task.params.get("pair_edges"), pair_candidates(grid), d,
                                 params.max_pairs(d))
        data = training_rows(task, site, params)

        def compute(_plan: Any, _rng: np.random.Generator) -> tuple[np.ndarray, int]:
            acc = exact_pair_tables(grid, edges, data)
            return acc.counts, acc.n_rows

        return planned_contribution(task, participants, tolerated, statistic=self.statistic,
                                    dim=sum(grid.cells(e) for e in edges),
                                    row_norm=math.sqrt(len(edges)), compute=compute)

    def request(self, ask: Ask[SynthParams, PairInput]) -> Request:
        """Return the job's parameters, the round, the links and the edges."""
        links = ask.inputs.links
        return Request({**base_params(ask.params, ask.schema), "round": self.name,
                        "links_digest": links.digest,
                        "pair_edges": [[a, b] for a, b in ask.inputs.edges]}, links.arrays)

    def check(self, result: TaskResult, ask: Ask[SynthParams, PairInput]) -> None:
        """One finite count per cell of the edges' tables."""
        cells = sum(ask.inputs.grid.cells(e) for e in ask.inputs.edges)
        _check_vector(result, "pair_tables", cells, "pair tables")

    def pool(self, results: Mapping[str, TaskResult],
             ask: Ask[SynthParams, PairInput]) -> PairTables:
        """Return the sum of the sites' tables; the noise of S site draws."""
        sites = sorted(results)
        b = ask.budget
        return PairTables(
            np.asarray(np.sum([results[s].arrays["pair_tables"] for s in sites], axis=0)),
            sum(int(results[s].metadata["n_rows"]) for s in sites),
            pair_table_mechanism(len(ask.inputs.edges), b.epsilon, b.delta).sigma
            * math.sqrt(len(sites)))

    def encoding(self, ask: Ask[SynthParams, PairInput]) -> SumEncoding:
        """Return counts with one group (table) per edge: every row adds one to a cell of each."""
        edges = check_pairs(ask.inputs.edges, len(ask.schema.columns))
        if not edges:
            raise ValidationError("the pairs round needs at least one edge")
        cells = tuple(ask.inputs.grid.cells(e) for e in edges)
        return SumEncoding(dim=sum(cells), row_norm=math.sqrt(len(edges)),
                           params={**_secure_pair_params(self.source, ask),
                                   "pair_edges": [[int(a), int(b)] for a, b in edges]},
                           arrays=ask.inputs.links.arrays, groups=cells)

    def pool_secure(self, summed: SecureSum, ask: Ask[SynthParams, PairInput]) -> PairTables:
        """Return the pooled tables; the sum's Skellam noise (counts: scale 1)."""
        cells = sum(ask.inputs.grid.cells(e) for e in ask.inputs.edges)
        total = check_pooled(np.asarray(summed.value, dtype=np.float64), cells,
                             "pooled pair tables")
        return PairTables(total, summed.n_rows_total,
                          math.sqrt(summed.plan.pooled_variance))


def _secure_pair_params(source: str, ask: Ask[SynthParams, PairInput]) -> dict[str, Any]:
    return {**secure_base(ask.params, ask.schema, source),
            "links_digest": ask.inputs.links.digest, "pair_groups": int(ask.params.pair_groups)}


def exact_scores(task: Task, site: Site, params: SynthParams, digest: Any
                 ) -> tuple[int, np.ndarray]:
    """Return the exact dependence scores of the candidate pairs over the training rows."""
    grid, proportions = _grid(task, site, params, digest)
    candidates = pair_candidates(grid)
    acc = exact_pair_tables(grid, candidates, training_rows(task, site, params))
    return acc.n_rows, dependence_scores(acc.counts, grid, candidates, proportions,
                                         acc.n_rows)


def exact_tables(task: Task, site: Site, params: SynthParams, extra: Mapping[str, Any]
                 ) -> tuple[int, np.ndarray, list[Pair]]:
    """Return the exact tables of the task's edges over the training rows, and the edges."""
    grid, _proportions = _grid(task, site, params, extra.get("links_digest"))
    d = len(site.data.schema.columns)
    edges = check_pair_edges(extra.get("pair_edges"), pair_candidates(grid), d,
                             params.max_pairs(d))
    acc = exact_pair_tables(grid, edges, training_rows(task, site, params))
    return acc.n_rows, acc.counts, edges


PAIR_SCORES = PairScores()
PAIRS = PairTableRound()
