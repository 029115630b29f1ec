"""Empirical lower bounds on a mechanism's epsilon (a black-box privacy audit).

The audit runs a mechanism many times on each input of a neighbouring pair (x1, x2), counts
how often its output falls in each event E of a family, and turns the counts into a *lower
confidence bound* on epsilon:

    epsilon >= ln((P[M(x_a) in E] - delta) / P[M(x_b) in E])    for (a, b) = (1, 2), (2, 1),

which every (epsilon, delta)-DP mechanism satisfies for every event. Probabilities are
replaced by Clopper-Pearson bounds (lower for the numerator, upper for the denominator,
``scipy.stats.beta``), with a union bound over all 4 one-sided bounds of every tested event,
so the reported ``epsilon_lcb`` is below the true epsilon with probability >= ``confidence``
(for a mechanism that is not DP at the claimed level, it exceeds the claim). This is the
estimator DP-Sniper reports (Bichsel et al., S&P 2021) with the event search of StatDP
(Ding et al., CCS 2018) replaced by fixed or pre-selected event families.

An audit can show a violation; it cannot prove privacy (violations hidden in tiny
probabilities escape it; arXiv 2411.16516). That is why every audit in the tests also runs
against a deliberately broken copy of the mechanism that it must flag.

Event families
--------------
*Fixed a priori*: pass a sequence of :class:`Event` (e.g. :func:`threshold_events` at
thresholds derived from the *claimed* noise scale). All ``n_samples`` are used for testing.

*Selected on a first batch*: pass an event selector (e.g. :func:`quantile_thresholds`,
:func:`dpfed.common.queries.svt_audit.svt_pattern_events`, optionally ranked by
:func:`top_events`) and
``selection_samples > 0``. The selector sees only a first, independent batch; the chosen
events are then tested on ``n_samples`` fresh draws, and the union bound covers only the
chosen events. Selection therefore never invalidates the confidence level.

Outputs
-------
A *sampler* is ``sampler(x, n, rng) -> ndarray`` returning the outputs of ``n`` independent
runs on input ``x`` along axis 0 (vectorised). :func:`additive_noise_sampler` adapts
:class:`dpfed.common.privacy.mechanisms.LaplaceMechanism` / ``GaussianMechanism``;
:func:`svt_sampler`
adapts :func:`dpfed.common.queries.svt.sparse_vector_runs` using the SVT output encoding of
:func:`svt_outputs`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from scipy import stats

from dpfed.common.errors import ValidationError
from dpfed.common.privacy.rng import resolve_rng
from dpfed.common.validation import check_int, check_probability

__all__ = [
    "AuditResult",
    "Event",
    "EventEstimate",
    "EventSelector",
    "Sampler",
    "additive_noise_sampler",
    "audit",
    "clopper_pearson",
    "quantile_thresholds",
    "threshold_events",
    "top_events",
]

Sampler = Callable[[Any, int, np.random.Generator], np.ndarray]



@dataclass(frozen=True)
class Event:
    """A set of outputs, given as a vectorised membership test.

    Attributes
    ----------
    name : str
        A readable description (``"y >= 1.5"``, ``"pattern TBX"``).
    contains : callable
        ``contains(outputs) -> bool ndarray`` of shape (n,) for a batch of n outputs.
    """

    name: str
    contains: Callable[[np.ndarray], np.ndarray]


class EventSelector(Protocol):
    """Chooses events from a selection batch: ``selector(outputs_1, outputs_2) -> events``."""

    def __call__(self, outputs_1: np.ndarray, outputs_2: np.ndarray, /) -> Sequence[Event]:
        """Return the events to test, chosen from the two selection batches."""
        ...


@dataclass(frozen=True)
class EventEstimate:
    """The epsilon evidence of one event in one direction.

    ``epsilon_lcb = ln((p_a_lcb - delta) / p_b_ucb)`` (``-inf`` when ``p_a_lcb <= delta``);
    ``epsilon_point`` is the same with the empirical frequencies. ``direction`` is ``"1/2"``
    when a = x1, b = x2, else ``"2/1"``.
    """

    event: str
    direction: str
    count_a: int
    count_b: int
    n_samples: int
    p_a_lcb: float
    p_b_ucb: float
    epsilon_lcb: float
    epsilon_point: float


@dataclass(frozen=True)
class AuditResult:
    """Outcome of :func:`audit`.

    Attributes
    ----------
    epsilon_lcb : float
        max(0, best epsilon_lcb over tested events and both directions): with probability
        >= confidence the mechanism is not (epsilon, delta)-DP for any epsilon below this.
    epsilon_point : float
        The point estimate of the event achieving ``epsilon_lcb`` (not a bound).
    best : EventEstimate or None
        That event (None when no event gave positive evidence).
    estimates : tuple of EventEstimate
        Every tested event and direction.
    n_samples, selection_samples : int
        Test draws per input, and selection draws per input (0 for a fixed family).
    n_events : int
        Number of tested events (the union bound covers 4 * n_events one-sided bounds).
    confidence, delta : float
        As given.
    """

    epsilon_lcb: float
    epsilon_point: float
    best: EventEstimate | None
    estimates: tuple[EventEstimate, ...]
    n_samples: int
    selection_samples: int
    n_events: int
    confidence: float
    delta: float


# --------------------------------------------------------------------------- statistics


def clopper_pearson(counts: np.ndarray, n: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Return exact one-sided Clopper-Pearson (lower, upper) bounds, each at level ``alpha``.

    ``lower = Beta^-1(alpha; k, n-k+1)`` (0 when k = 0) and
    ``upper = Beta^-1(1-alpha; k+1, n-k)`` (1 when k = n).
    """
    k = np.asarray(counts, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        lower = np.where(k > 0, stats.beta.ppf(alpha, k, n - k + 1), 0.0)
        upper = np.where(k < n, stats.beta.ppf(1.0 - alpha, k + 1, n - k), 1.0)
    return np.asarray(lower, dtype=np.float64), np.asarray(upper, dtype=np.float64)


def _log_ratio(p_a: np.ndarray, p_b: np.ndarray, delta: float) -> np.ndarray:
    """ln((p_a - delta) / p_b), -inf where p_a <= delta, +inf where p_b = 0 < p_a - delta."""
    num = p_a - delta
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log(num) - np.log(p_b)
    out = np.where(num <= 0, -np.inf, out)
    return np.asarray(out, dtype=np.float64)


def _count(events: Sequence[Event], sampler: Sampler, x: Any, n: int, batch_size: int,
           rng: np.random.Generator) -> np.ndarray:
    """Return how many of n fresh runs of the sampler on x fall in each event."""
    counts = np.zeros(len(events), dtype=np.int64)
    done = 0
    while done < n:
        m = min(batch_size, n - done)
        outputs = _draw(sampler, x, m, rng)
        for j, event in enumerate(events):
            counts[j] += int(np.count_nonzero(_membership(event, outputs, m)))
        done += m
    return counts


def _draw(sampler: Sampler, x: Any, n: int, rng: np.random.Generator) -> np.ndarray:
    outputs = np.asarray(sampler(x, n, rng))
    if outputs.ndim == 0 or outputs.shape[0] != n:
        raise ValidationError(
            f"sampler must return n={n} outputs along axis 0, got shape {outputs.shape}"
        )
    return outputs


def _membership(event: Event, outputs: np.ndarray, n: int) -> np.ndarray:
    mask = np.asarray(event.contains(outputs))
    if mask.shape != (n,) or mask.dtype != np.bool_:
        raise ValidationError(
            f"event {event.name!r} must return a bool array of shape ({n},), "
            f"got {mask.dtype} {mask.shape}"
        )
    return mask


# --------------------------------------------------------------------------- the audit


def audit(sampler: Sampler, neighbour_pair: tuple[Any, Any],
          events: Sequence[Event] | EventSelector, *, n_samples: int,
          selection_samples: int = 0, confidence: float = 0.99, delta: float = 0.0,
          batch_size: int = 100_000, rng: np.random.Generator | None = None) -> AuditResult:
    """Estimate a lower confidence bound on the epsilon of a mechanism.

    Parameters
    ----------
    sampler : callable
        ``sampler(x, n, rng) -> ndarray`` with n independent outputs of the mechanism on
        input x along axis 0.
    neighbour_pair : (x1, x2)
        Two neighbouring inputs (chosen to stress the mechanism).
    events : sequence of Event, or EventSelector
        A fixed family, or a selector run on a first batch of ``selection_samples`` draws per
        input; the selected events are then tested on fresh draws.
    n_samples : int
        Test draws per input (>= 1).
    selection_samples : int
        Draws per input for event selection; required (> 0) with a selector, 0 otherwise.
    confidence : float
        Joint confidence level in (0, 1) of all the bounds (union bound).
    delta : float
        The delta the mechanism claims, in [0, 1); 0 for pure epsilon-DP.
    batch_size : int
        Runs drawn per sampler call (bounds memory).
    rng : numpy.random.Generator or None
        Randomness for the sampler; seed it in tests.

    Returns
    -------
    AuditResult
        ``epsilon_lcb`` and the evidence behind it.
    """
    n = check_int(n_samples, "n_samples", minimum=1)
    n_sel = check_int(selection_samples, "selection_samples", minimum=0)
    conf = check_probability(confidence, "confidence")
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0.0 <= delta < 1.0:
        raise ValidationError(f"delta must be in [0, 1), got {delta!r}")
    dl = float(delta)
    batch = check_int(batch_size, "batch_size", minimum=1)
    if not (isinstance(neighbour_pair, tuple) and len(neighbour_pair) == 2):
        raise ValidationError("neighbour_pair must be a tuple (x1, x2)")
    x1, x2 = neighbour_pair
    gen = resolve_rng(rng)

    if callable(events) and not isinstance(events, Sequence):
        if n_sel == 0:
            raise ValidationError("selection_samples must be > 0 when events is a selector")
        chosen = list(events(_draw(sampler, x1, n_sel, gen), _draw(sampler, x2, n_sel, gen)))
    else:
        if n_sel != 0:
            raise ValidationError(
                "selection_samples must be 0 with a fixed event family (nothing to select)"
            )
        chosen = list(events)
    if not chosen or not all(isinstance(e, Event) for e in chosen):
        raise ValidationError("events must give at least one Event")

    counts_1 = _count(chosen, sampler, x1, n, batch, gen)
    counts_2 = _count(chosen, sampler, x2, n, batch, gen)
    # Union bound: lower and upper bounds of P1(E) and P2(E) for every event.
    alpha = (1.0 - conf) / (4 * len(chosen))
    lo_1, up_1 = clopper_pearson(counts_1, n, alpha)
    lo_2, up_2 = clopper_pearson(counts_2, n, alpha)

    estimates: list[EventEstimate] = []
    for direction, ca, cb, lo_a, up_b in (("1/2", counts_1, counts_2, lo_1, up_2),
                                          ("2/1", counts_2, counts_1, lo_2, up_1)):
        lcb = _log_ratio(lo_a, up_b, dl)
        point = _log_ratio(ca / n, cb / n, dl)
        for j, event in enumerate(chosen):
            estimates.append(EventEstimate(event.name, direction, int(ca[j]), int(cb[j]), n,
                                           float(lo_a[j]), float(up_b[j]), float(lcb[j]),
                                           float(point[j])))
    best = max(estimates, key=lambda e: e.epsilon_lcb)
    if best.epsilon_lcb <= 0.0:
        return AuditResult(0.0, 0.0, None, tuple(estimates), n, n_sel, len(chosen), conf, dl)
    return AuditResult(best.epsilon_lcb, best.epsilon_point, best, tuple(estimates), n, n_sel,
                       len(chosen), conf, dl)


# --------------------------------------------------------------------------- scalar events


def _scalar(outputs: np.ndarray) -> np.ndarray:
    if outputs.ndim == 2 and outputs.shape[1] == 1:
        return outputs[:, 0]
    if outputs.ndim != 1:
        raise ValidationError(f"threshold events need scalar outputs, got shape {outputs.shape}")
    return outputs


def threshold_events(thresholds: Sequence[float] | np.ndarray) -> tuple[Event, ...]:
    """Return the events {y >= t} and {y < t} for each threshold (scalar outputs)."""
    ts = [float(t) for t in thresholds]
    if not ts or not all(math.isfinite(t) for t in ts):
        raise ValidationError("thresholds must be a non-empty sequence of finite numbers")
    events: list[Event] = []
    for t in ts:
        events.append(Event(f"y >= {t:.6g}", _scalar_test(t, above=True)))
        events.append(Event(f"y < {t:.6g}", _scalar_test(t, above=False)))
    return tuple(events)


def _scalar_test(t: float, *, above: bool) -> Callable[[np.ndarray], np.ndarray]:
    def contains(outputs: np.ndarray) -> np.ndarray:
        y = _scalar(outputs)
        return np.asarray(y >= t if above else y < t)

    return contains


def quantile_thresholds(n_thresholds: int = 50, *, lower: float = 0.001,
                        upper: float = 0.999) -> EventSelector:
    """Select :func:`threshold_events` at evenly spaced quantiles of the pooled selection batch.

    Quantile levels run from ``lower`` to ``upper``; duplicates (discrete outputs) collapse.
    """
    k = check_int(n_thresholds, "n_thresholds", minimum=1)
    lo = check_probability(lower, "lower")
    hi = check_probability(upper, "upper")
    if lo >= hi:
        raise ValidationError(f"lower must be < upper, got {lo} and {hi}")

    def select(outputs_1: np.ndarray, outputs_2: np.ndarray) -> Sequence[Event]:
        pooled = np.concatenate([_scalar(outputs_1), _scalar(outputs_2)])
        qs = np.unique(np.quantile(pooled, np.linspace(lo, hi, k)))
        return threshold_events([float(q) for q in qs])

    return select


def top_events(family: Sequence[Event] | EventSelector, n_events: int, *,
               delta: float = 0.0, ranking_alpha: float = 0.05) -> EventSelector:
    """Rank a family (fixed, or itself selected) on the selection batch and keep the best.

    Each candidate is scored by ``max`` over both directions of ``ln((p_a_lcb - delta) /
    p_b_ucb)`` with Clopper-Pearson bounds at ``ranking_alpha`` on the selection counts, so
    rare events with noisy ratios do not crowd out well-supported ones. Testing fewer events
    makes the union bound of the final test cheaper.
    """
    keep = check_int(n_events, "n_events", minimum=1)
    alpha = check_probability(ranking_alpha, "ranking_alpha")

    def select(outputs_1: np.ndarray, outputs_2: np.ndarray) -> Sequence[Event]:
        if callable(family) and not isinstance(family, Sequence):
            candidates = list(family(outputs_1, outputs_2))
        else:
            candidates = list(family)
        if len(candidates) <= keep:
            return candidates
        n1, n2 = outputs_1.shape[0], outputs_2.shape[0]
        c1 = np.array([np.count_nonzero(_membership(e, outputs_1, n1)) for e in candidates])
        c2 = np.array([np.count_nonzero(_membership(e, outputs_2, n2)) for e in candidates])
        lo1, up1 = clopper_pearson(c1, n1, alpha)
        lo2, up2 = clopper_pearson(c2, n2, alpha)
        score = np.maximum(_log_ratio(lo1, up2, delta), _log_ratio(lo2, up1, delta))
        order = np.argsort(-score, kind="stable")[:keep]
        return [candidates[int(i)] for i in order]

    return select


# --------------------------------------------------------------------------- samplers


def additive_noise_sampler(mechanism: Any) -> Sampler:
    """Adapt a mechanism with a vectorised ``release(value, rng)`` (Laplace, Gaussian).

    The sampler releases ``x`` n times at once: ``mechanism.release(broadcast(x), rng)``;
    outputs have shape (n,) for scalar x, (n, *x.shape) otherwise.
    """
    if not callable(getattr(mechanism, "release", None)):
        raise ValidationError("mechanism must have a release(value, rng) method")

    def sample(x: Any, n: int, rng: np.random.Generator) -> np.ndarray:
        base = np.asarray(x, dtype=np.float64)
        batch = np.broadcast_to(base, (n, *base.shape)).copy()
        return np.asarray(mechanism.release(batch, rng))

    return sample
