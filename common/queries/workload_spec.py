"""The ``query`` job's workload, strategy choice and answer names, from public information only.

An analyst's workload is one of ``identity``, ``all_range``, ``prefix`` (1-column ordered
domains), ``marginals`` (``k``-way, over the domain's columns) or ``custom`` (an explicit
``m x n`` matrix from a ``.npy``/CSV file). :func:`build_workload` checks the request's shape --
cells, queries, matrix entries -- against the limits below *before* it builds any matrix, so an
oversized request is refused in microseconds, not after gigabytes of allocation
(docs/hardening.md, "What an analyst may ask"). :func:`choose_strategy` ranks the candidate
strategies by their closed-form expected RMSE under the replace-one sensitivities of
:mod:`dpfed.common.queries.federated_matrix` (the library's ``best_strategy`` prices the
add/remove-one sensitivity, which ranks strategies differently).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpfed.common.array_files import check_npy_header
from dpfed.common.errors import ValidationError
from dpfed.common.queries.federated_matrix import (
    MAX_CELLS_NAMED,
    MAX_CELLS_OPTIMIZED,
    NAMED_STRATEGIES,
    SiteMatrixRelease,
)
from dpfed.common.queries.matrix_mechanism import optimize_strategy, squared_error, strategy
from dpfed.common.queries.query_language import Domain
from dpfed.common.queries.workloads import (
    Workload,
    all_range_workload,
    custom_workload,
    identity_workload,
    marginal_workload,
    prefix_workload,
)

__all__ = ["MAX_CUSTOM_ENTRIES", "MAX_QUERY_CELLS", "STRATEGY_CHOICES", "WORKLOAD_KINDS",
           "StrategyPick", "build_workload", "check_query_domain", "choose_strategy",
           "load_workload_matrix", "marginal_query_count", "query_names"]

WORKLOAD_KINDS: tuple[str, ...] = ("identity", "all_range", "prefix", "marginals", "custom")
STRATEGY_CHOICES: tuple[str, ...] = ("auto", *NAMED_STRATEGIES, "optimized")
#: Largest custom workload (m * n entries) accepted in a job's parameters (it travels, is
#: stored and is echoed in the job's state as JSON numbers: 200,000 is about 2 MB).
MAX_CUSTOM_ENTRIES = 200_000
#: Largest number of queries answered per job (all ranges over 1024 cells is 524800).
MAX_WORKLOAD_QUERIES = 600_000
#: Largest domain of a query job: the most cells any strategy supports (identity, h2, ...).
MAX_QUERY_CELLS = MAX_CELLS_NAMED


def marginal_query_count(shape: Sequence[int], k: int) -> int:
    """Return how many queries all ``k``-way marginals over ``shape`` are (no matrix built)."""
    return sum(math.prod(shape[a] for a in subset)
               for subset in itertools.combinations(range(len(shape)), k))


def check_query_domain(domain: Domain) -> None:
    """Refuse a domain larger than any strategy supports, from its shape alone."""
    n = domain.n_cells
    if n > MAX_QUERY_CELLS:
        shape = " x ".join(f"{c} ({s})" for c, s in zip(domain.columns, domain.shape,
                                                          strict=True))
        raise ValidationError(
            f"domain: {shape} is {n:,} cells; a query job supports at most {MAX_QUERY_CELLS:,} "
            "(the largest domain any strategy supports): use fewer --columns or fewer --bins")


def build_workload(domain: Domain, spec: Mapping[str, Any]) -> Workload:
    """Validate a workload spec against the domain (raises ValidationError naming the field).

    Every size is checked from the spec's shape before a matrix is built.
    """
    kind = spec.get("kind")
    check_query_domain(domain)
    n = domain.n_cells
    if kind not in WORKLOAD_KINDS:
        raise ValidationError(f"workload must be one of {list(WORKLOAD_KINDS)}, got {kind!r}")
    extra = sorted(set(spec) - {"kind", "k", "matrix"})
    if extra:
        raise ValidationError(f"unknown workload field(s) {extra}")
    if kind in ("all_range", "prefix") and len(domain.columns) != 1:
        raise ValidationError(f"workload {kind!r} needs an ordered one-column domain, got "
                              f"columns {list(domain.columns)} (use identity or marginals)")
    if kind == "identity":
        return identity_workload(n)
    if kind == "all_range":
        m = n * (n + 1) // 2
        if m > MAX_WORKLOAD_QUERIES:
            raise ValidationError(f"all_range over {n} cells has {m} queries; at most "
                                  f"{MAX_WORKLOAD_QUERIES}")
        return all_range_workload(n)
    if kind == "prefix":
        return prefix_workload(n)
    if kind == "marginals":
        k = spec.get("k")
        d = len(domain.columns)
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= d:
            raise ValidationError(f"marginals needs k in 0..{d} (the domain has {d} column(s)), "
                                  f"got {k!r}")
        m = marginal_query_count(domain.shape, k)
        if m > MAX_WORKLOAD_QUERIES:
            raise ValidationError(f"{k}-way marginals over {n} cells are {m} queries; at most "
                                  f"{MAX_WORKLOAD_QUERIES} (use a smaller --k or fewer --bins)")
        return marginal_workload(domain.shape, k)
    raw = spec.get("matrix")
    rows = len(raw) if isinstance(raw, list | tuple) else 0
    if rows * n > MAX_CUSTOM_ENTRIES:  # from the request's shape, before any array is made
        raise ValidationError(f"custom workload has {rows} rows over {n} cells ({rows * n} "
                              f"entries); at most {MAX_CUSTOM_ENTRIES}")
    try:
        w = np.asarray(raw, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValidationError("custom workload matrix must be a list of numeric rows") from None
    if w.ndim != 2 or w.shape[1] != n or w.shape[0] < 1:
        raise ValidationError(f"custom workload must have shape (m, {n}) for this domain of "
                              f"{n} cells, got {w.shape}")
    if w.size > MAX_CUSTOM_ENTRIES:
        raise ValidationError(f"custom workload has {w.size} entries; at most "
                              f"{MAX_CUSTOM_ENTRIES}")
    if not np.all(np.isfinite(w)):
        raise ValidationError("custom workload entries must be finite")
    return custom_workload(w, domain=domain.shape)


def load_workload_matrix(path: str | Path) -> list[list[float]]:
    """Read a custom workload from ``.npy`` (no pickles) or CSV (one query per row)."""
    p = Path(path)
    try:
        if p.suffix.lower() == ".npy":
            with open(p, "rb") as fh:  # the header's shape first: nothing big is allocated
                check_npy_header(fh, f"--workload-file {p}", 8 * MAX_CUSTOM_ENTRIES)
            w = np.load(p, allow_pickle=False)
        else:
            w = np.loadtxt(p, delimiter=",", ndmin=2)
    except (OSError, ValueError) as exc:
        raise ValidationError(f"--workload-file {p}: cannot read a numeric matrix ({exc})"
                              ) from None
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2:
        raise ValidationError(f"--workload-file {p}: expected a 2-D matrix, got {w.ndim}-D")
    if w.size > MAX_CUSTOM_ENTRIES:
        raise ValidationError(f"--workload-file {p}: {w.size} entries; at most "
                              f"{MAX_CUSTOM_ENTRIES}")
    return [[float(v) for v in row] for row in w]


def query_names(domain: Domain, workload: Workload, marginal_k: int = 0) -> list[str]:
    """Return a readable name for every workload answer, in the order of ``Workload.answer``.

    ``marginal_k`` is the marginal order of a ``marginals`` workload.
    """
    cells = domain.cell_names()
    kind = workload.kind
    if kind == "identity":
        return cells
    if kind == "prefix":
        return [f"{cells[0]} .. {c}" for c in cells]
    if kind == "all_ranges":
        i, j = np.triu_indices(len(cells))
        return [f"{cells[a]} .. {cells[b]}" for a, b in zip(i.tolist(), j.tolist(), strict=True)]
    if kind == "marginals":
        names: list[str] = []
        for subset in itertools.combinations(range(len(domain.columns)), marginal_k):
            labels = [[f"{domain.columns[a]}={lab}" for lab in domain.labels[a]] for a in subset]
            if not labels:
                names.append("total")
                continue
            names.extend(" & ".join(p) for p in itertools.product(*labels))
        return names
    return [f"q{i}" for i in range(workload.n_queries)]


@dataclass(frozen=True, eq=False)
class StrategyPick:
    """The chosen strategy and noise, with the ranking of every candidate (expected RMSE)."""

    name: str
    noise: str
    matrix: np.ndarray
    rmse: float
    identity_rmse: float
    ranking: tuple[tuple[str, str, float], ...]


def _candidate_matrix(name: str, workload: Workload, noise: str) -> np.ndarray:
    if name == "optimized":
        return optimize_strategy(workload, noise=noise).matrix
    return strategy(name, workload.n)


def _limit(name: str) -> int:
    return MAX_CELLS_OPTIMIZED if name == "optimized" else MAX_CELLS_NAMED


def check_domain_for(name: str, n: int) -> None:
    """Raise if ``n`` cells exceed what strategy ``name`` supports (with the reason)."""
    if name == "auto":
        name = "identity"
    if n > _limit(name):
        why = ("the coordinator optimises an (n + p) x n matrix and sends it to every site"
               if name == "optimized" else
               "each site builds the k x n matrix and its exact replace-one sensitivity "
               "(O(k n^2) work)")
        raise ValidationError(f"the domain has {n} cells; strategy {name!r} supports at most "
                              f"{_limit(name)} because {why}")


def choose_strategy(workload: Workload, *, strategy_name: str, noises: Sequence[str],
                    epsilon: float, delta: float, n_sites: int,
                    variance_factors: Mapping[str, float] | None = None) -> StrategyPick:
    """Rank candidates by expected per-query RMSE under replace-one; pick the best.

    ``strategy_name="auto"`` tries every strategy the domain size allows (``prefix`` and
    ``h2`` only make sense on ordered domains but are valid anywhere); otherwise only the
    named one (plus identity, for the comparison). ``variance_factors``: a noise's variance
    over its site-level release's (default 1; a secure sum's Skellam slack).
    """
    n = workload.n
    if strategy_name == "auto":
        names = [s for s in (*NAMED_STRATEGIES, "optimized") if n <= _limit(s)]
    else:
        check_domain_for(strategy_name, n)
        names = [strategy_name]
    scored: list[tuple[float, str, str, np.ndarray]] = []
    identity_rmse = math.inf
    eye = np.eye(n)
    for noise in noises:
        d = delta if noise == "gaussian" else 0.0
        factor = n_sites * (variance_factors or {}).get(noise, 1.0)
        id_var = SiteMatrixRelease(eye, epsilon, d, noise).noise_variance
        id_rmse = math.sqrt(factor * id_var * squared_error(workload, eye) / workload.n_queries)
        identity_rmse = min(identity_rmse, id_rmse)
        for name in names:
            a = eye if name == "identity" else _candidate_matrix(name, workload, noise)
            var = SiteMatrixRelease(a, epsilon, d, noise).noise_variance
            try:
                se = squared_error(workload, a)
            except ValidationError:
                continue  # the strategy cannot answer this workload without bias
            scored.append((math.sqrt(factor * var * se / workload.n_queries), name, noise, a))
    if not scored:
        raise ValidationError(f"strategy {strategy_name!r} cannot answer this workload")
    scored.sort(key=lambda t: t[0])
    rmse, name, noise, a = scored[0]
    return StrategyPick(name, noise, a, rmse, identity_rmse,
                        tuple((nm, nz, r) for r, nm, nz, _ in scored))
