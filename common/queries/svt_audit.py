"""The SVT side of the empirical-epsilon audit: transcripts as outputs, pattern events.

:func:`svt_sampler` adapts :func:`dpfed.common.queries.svt.sparse_vector_runs` (the production
SVT) to :func:`dpfed.common.privacy.audit.audit`, encoding each run with :func:`svt_outputs`;
:func:`svt_pattern_events` and :func:`svt_value_events` are event selectors over those
transcripts. It lives with the SVT code so that the privacy core imports no algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.privacy.audit import Event, EventSelector, Sampler
from dpfed.common.queries.svt import sparse_vector_runs
from dpfed.common.validation import check_int

__all__ = [
    "SVT_ABOVE",
    "SVT_BELOW",
    "SVT_NOT_EXAMINED",
    "svt_outputs",
    "svt_pattern_codes",
    "svt_pattern_events",
    "svt_sampler",
    "svt_value_events",
]

# SVT output status codes in the encoding of :func:`svt_outputs`.
SVT_ABOVE, SVT_BELOW, SVT_NOT_EXAMINED = 1.0, 0.0, -1.0
_MAX_PATTERN_QUERIES = 39  # 3^39 < 2^63: base-3 pattern codes fit in int64


def svt_outputs(positive: np.ndarray, n_examined: np.ndarray,
                values: np.ndarray | None = None) -> np.ndarray:
    """Encode SVT transcripts as a float array, one row per run.

    Columns 0..k-1 hold the status of each query: 1.0 "above", 0.0 "below", -1.0 not
    examined (after the cut-off). With ``values``, columns k..2k-1 hold the released value
    of each positive query and NaN elsewhere.
    """
    pos = np.asarray(positive, dtype=bool)
    if pos.ndim != 2:
        raise ValidationError(f"positive must be 2-D (runs x queries), got shape {pos.shape}")
    n, k = pos.shape
    examined = np.arange(k) < np.asarray(n_examined).reshape(n, 1)
    status = np.where(pos, SVT_ABOVE, np.where(examined, SVT_BELOW, SVT_NOT_EXAMINED))
    if values is None:
        return status
    vals = np.asarray(values, dtype=np.float64)
    if vals.shape != pos.shape:
        raise ValidationError(f"values must have shape {pos.shape}, got {vals.shape}")
    return np.hstack([status, np.where(pos, vals, np.nan)])


def svt_sampler(*, threshold: float, epsilon: float, cutoff: int = 1, sensitivity: float = 1.0,
                monotonic: bool = False, numeric_epsilon: float | None = None) -> Sampler:
    """Adapt :func:`dpfed.common.queries.svt.sparse_vector_runs` (the production SVT) to the audit.

    The input x is the vector of true query answers; outputs use :func:`svt_outputs`.
    """

    def sample(x: Any, n: int, rng: np.random.Generator) -> np.ndarray:
        runs = sparse_vector_runs(x, n, threshold=threshold, epsilon=epsilon, cutoff=cutoff,
                                  sensitivity=sensitivity, monotonic=monotonic,
                                  numeric_epsilon=numeric_epsilon, rng=rng)
        return svt_outputs(runs.positive, runs.n_examined, runs.values)

    return sample


# --------------------------------------------------------------------------- SVT events


def svt_pattern_codes(outputs: np.ndarray, n_queries: int) -> np.ndarray:
    """Return one int64 code per run for its whole above/below/not-examined transcript."""
    k = check_int(n_queries, "n_queries", minimum=1, maximum=_MAX_PATTERN_QUERIES)
    status = np.asarray(outputs)[:, :k]
    digits = np.rint(status).astype(np.int64) + 1  # {-1, 0, 1} -> {0, 1, 2}
    return np.asarray(digits @ (3 ** np.arange(k, dtype=np.int64)), dtype=np.int64)


def _pattern_name(code: int, k: int) -> str:
    symbols = {0: "-", 1: "F", 2: "T"}  # not examined, below, above
    return "".join(symbols[(code // 3**i) % 3] for i in range(k))


def _frequent_codes(outputs_1: np.ndarray, outputs_2: np.ndarray, k: int,
                    limit: int) -> list[int]:
    codes = np.concatenate([svt_pattern_codes(outputs_1, k), svt_pattern_codes(outputs_2, k)])
    uniq, freq = np.unique(codes, return_counts=True)
    order = np.argsort(-freq, kind="stable")[:limit]
    return [int(c) for c in uniq[order]]


class _CodeCache:
    """Pattern codes of the most recent batch, so a family of events computes them once."""

    def __init__(self, k: int) -> None:
        self._k = k
        self._outputs: np.ndarray | None = None
        self._codes = np.empty(0, dtype=np.int64)

    def codes(self, outputs: np.ndarray) -> np.ndarray:
        if self._outputs is not outputs:  # identity: holding the array prevents id reuse
            self._codes = svt_pattern_codes(outputs, self._k)
            self._outputs = outputs
        return self._codes


def _pattern_event(code: int, k: int, cache: _CodeCache) -> Event:
    return Event(f"pattern {_pattern_name(code, k)}", lambda out: cache.codes(out) == code)


def svt_pattern_events(n_queries: int, *, max_patterns: int = 256) -> EventSelector:
    """Select events "the transcript is exactly P" for the most frequent observed patterns."""
    k = check_int(n_queries, "n_queries", minimum=1, maximum=_MAX_PATTERN_QUERIES)
    limit = check_int(max_patterns, "max_patterns", minimum=1)

    def select(outputs_1: np.ndarray, outputs_2: np.ndarray) -> Sequence[Event]:
        cache = _CodeCache(k)
        return [_pattern_event(c, k, cache)
                for c in _frequent_codes(outputs_1, outputs_2, k, limit)]

    return select


def svt_value_events(n_queries: int, *, max_patterns: int = 16,
                     n_thresholds: int = 8) -> EventSelector:
    """Select events on SVT transcripts with released values (outputs of width 2k).

    For each of the ``max_patterns`` most frequent patterns P: the event "pattern = P", and
    for every positive query i of P and ``n_thresholds`` quantiles t of its value among the
    selection runs with pattern P, the events "pattern = P and value_i >= t" and
    "pattern = P and value_i < t".
    """
    k = check_int(n_queries, "n_queries", minimum=1, maximum=_MAX_PATTERN_QUERIES)
    limit = check_int(max_patterns, "max_patterns", minimum=1)
    n_t = check_int(n_thresholds, "n_thresholds", minimum=1)

    def select(outputs_1: np.ndarray, outputs_2: np.ndarray) -> Sequence[Event]:
        if outputs_1.ndim != 2 or outputs_1.shape[1] != 2 * k:
            raise ValidationError(
                f"svt_value_events needs outputs of width 2*n_queries={2 * k}, "
                f"got shape {outputs_1.shape}"
            )
        pooled = np.concatenate([outputs_1, outputs_2])
        codes = svt_pattern_codes(pooled, k)
        events: list[Event] = []
        cache = _CodeCache(k)
        for code in _frequent_codes(outputs_1, outputs_2, k, limit):
            events.append(_pattern_event(code, k, cache))
            rows = pooled[codes == code]
            name = _pattern_name(code, k)
            for i in np.flatnonzero(rows[0, :k] == SVT_ABOVE):
                qs = np.unique(np.quantile(rows[:, k + i], np.linspace(0.02, 0.98, n_t)))
                for t in qs:
                    for above in (True, False):
                        events.append(_value_event(code, k, int(i), float(t), above=above,
                                                   name=name, cache=cache))
        return events

    return select


def _value_event(code: int, k: int, i: int, t: float, *, above: bool, name: str,
                 cache: _CodeCache) -> Event:
    op = ">=" if above else "<"

    def contains(out: np.ndarray) -> np.ndarray:
        match = cache.codes(out) == code
        value = np.where(match, out[:, k + i], 0.0)  # NaN only where the pattern differs
        hit = value >= t if above else value < t
        return np.asarray(match & hit)

    return Event(f"pattern {name} and value[{i}] {op} {t:.4g}", contains)
