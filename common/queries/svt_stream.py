"""SVT over a query *stream* split into batches, with explicit (storable) session state.

:class:`dpfed.common.queries.svt.SparseVector` keeps its noisy threshold in memory; a site
must keep it across batches and restarts, so here the state is plain data
(:class:`SessionState`) that the site stores durably, and each batch is a pure step
(:func:`answer_batch`) from (state, true answers, fresh noise) to (transcript, new state).
The mechanism is exactly Lyu, Su & Li (2017), Alg. 1, as in :mod:`dpfed.common.queries.svt`,
with the calibration of :class:`~dpfed.common.queries.svt.SVTCalibration`.

Under replace-one (the system's relation) a counting query has sensitivity 1, but a *set* of
counting queries is not monotonic (a replaced row can move one count down and another up), so
the non-monotonic query noise ``Lap(2 c / eps_2)`` is used unless the analyst asks for
monotonic noise and the site verifies that the session's queries form a chain
(:meth:`dpfed.common.queries.query_language.CompiledQuerySet.one_directional`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.queries.svt import SVTCalibration
from dpfed.common.validation import check_epsilon, check_int

__all__ = ["MAX_CUTOFF", "MAX_THRESHOLD", "BatchOutcome", "SVTSessionParams", "SessionState",
           "answer_batch", "open_session"]

#: Largest cut-off c (the query noise grows linearly with c; beyond this SVT is useless).
MAX_CUTOFF = 1000
#: Largest |T| accepted (counts of at most ~1e12 rows).
MAX_THRESHOLD = 1e12
#: Counting queries under replace-one.
COUNT_SENSITIVITY = 1.0


def _real(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValidationError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValidationError(f"{name} must be finite, got {value!r}")
    return v


@dataclass(frozen=True)
class SVTSessionParams:
    """The public parameters of one SVT session, fixed when it opens.

    Attributes
    ----------
    threshold : float
        Public threshold T (|T| <= 1e12; chosen by the analyst, never from the data).
    cutoff : int
        c, the number of "above" answers after which the session halts (1..1000).
    epsilon : float
        The session's whole cost eps_1 + eps_2 (+ eps_3), charged when it opens.
    numeric_epsilon : float or None
        eps_3 for fresh-noise values of the positive queries (part of ``epsilon``).
    monotonic : bool
        Use the monotonic query noise; only valid if every batch's queries, with all
        earlier ones, form a chain (the site checks).
    """

    threshold: float
    cutoff: int
    epsilon: float
    numeric_epsilon: float | None = None
    monotonic: bool = False

    def __post_init__(self) -> None:
        t = _real(self.threshold, "threshold")
        if abs(t) > MAX_THRESHOLD:
            raise ValidationError(f"threshold must be within +-{MAX_THRESHOLD:g}, got {t!r}")
        c = check_int(self.cutoff, "cutoff", minimum=1, maximum=MAX_CUTOFF)
        eps = check_epsilon(self.epsilon)
        eps3 = None
        if self.numeric_epsilon is not None:
            eps3 = check_epsilon(self.numeric_epsilon, "numeric_epsilon")
            if eps3 >= eps:
                raise ValidationError(
                    f"numeric_epsilon ({eps3:g}) must be smaller than the session's epsilon "
                    f"({eps:g}), which also pays for the above/below transcript")
        if not isinstance(self.monotonic, bool):
            raise ValidationError(f"monotonic must be true or false, got {self.monotonic!r}")
        object.__setattr__(self, "threshold", t)
        object.__setattr__(self, "cutoff", c)
        object.__setattr__(self, "epsilon", eps)
        object.__setattr__(self, "numeric_epsilon", eps3)

    @property
    def calibration(self) -> SVTCalibration:
        """Alg. 1's noise scales for a transcript budget of ``epsilon - numeric_epsilon``.

        Privacy
        -------
        Replace-one; counting queries (Delta = 1); non-monotonic noise unless ``monotonic``.
        Transcript (eps_1 + eps_2)-DP, values eps_3-DP (Lyu et al. 2017, Alg. 1); total
        ``epsilon``.
        """
        eps3 = self.numeric_epsilon or 0.0
        return SVTCalibration(self.epsilon - eps3, self.cutoff, COUNT_SENSITIVITY,
                              self.monotonic, self.numeric_epsilon)

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any], epsilon: float) -> SVTSessionParams:
        """Read threshold/cutoff/numeric_epsilon/monotonic from job params."""
        if "threshold" not in params:
            raise ValidationError("svt needs a threshold T")
        return cls(params["threshold"], params.get("cutoff", 1), epsilon,
                   params.get("numeric_epsilon"), params.get("monotonic", False))

    def to_mapping(self) -> dict[str, Any]:
        """Canonical form."""
        out: dict[str, Any] = {"threshold": self.threshold, "cutoff": self.cutoff,
                               "monotonic": self.monotonic}
        if self.numeric_epsilon is not None:
            out["numeric_epsilon"] = self.numeric_epsilon
        return out


@dataclass(frozen=True)
class SessionState:
    """A session's secret and public state (the site stores it durably).

    ``noisy_threshold`` = T + rho is secret: never logged, never sent.
    """

    noisy_threshold: float
    n_examined: int = 0
    n_positives: int = 0


@dataclass(frozen=True)
class BatchOutcome:
    """What one batch releases, and the state after it.

    Attributes
    ----------
    above : ndarray of bool
        One flag per *examined* query of the batch (queries after the cut-off are not).
    values : ndarray of float or None
        Fresh-noise values where ``above`` (NaN elsewhere); None when eps_3 was not paid.
    state : SessionState
        The state after the batch.
    halted : bool
        The cut-off has been reached.
    """

    above: np.ndarray
    values: np.ndarray | None
    state: SessionState
    halted: bool


def open_session(params: SVTSessionParams, rng: np.random.Generator) -> SessionState:
    """Alg. 1 step 1: draw rho ~ Lap(Delta/eps_1) once for the whole stream."""
    rho = float(rng.laplace(0.0, params.calibration.threshold_scale))
    return SessionState(params.threshold + rho)


def answer_batch(params: SVTSessionParams, state: SessionState, answers: np.ndarray,
                 rng: np.random.Generator) -> BatchOutcome:
    """Alg. 1 steps 2-3 for the next queries of the stream.

    Each examined query gets fresh ``nu ~ Lap(query_scale)`` and is "above" iff
    ``q + nu >= T + rho``; the session halts after its c-th "above" (counted over all
    batches). Positive queries get a value with fresh ``Lap(c Delta / eps_3)`` noise when
    eps_3 is paid (never ``q + nu``).
    """
    cal = params.calibration
    q = np.asarray(answers, dtype=np.float64)
    if q.ndim != 1 or not np.all(np.isfinite(q)):
        raise ValidationError("answers must be a finite 1-D array")
    remaining = cal.cutoff - state.n_positives
    if remaining <= 0 or q.size == 0:
        return BatchOutcome(np.zeros(0, dtype=bool), None if cal.numeric_scale is None
                            else np.zeros(0), state, remaining <= 0)
    nu = rng.laplace(0.0, cal.query_scale, size=q.size)        # Alg. 1 step 2
    above_all: np.ndarray = np.asarray((q + nu) >= state.noisy_threshold)
    before: np.ndarray = np.cumsum(above_all, dtype=np.int64) - above_all
    examined: np.ndarray = before < remaining                              # Alg. 1 step 3: cut-off
    n_exam = int(examined.sum())
    above = above_all[:n_exam].copy()
    values = None
    if cal.numeric_scale is not None:
        eta = rng.laplace(0.0, cal.numeric_scale, size=n_exam)  # fresh noise, never nu
        values = np.where(above, q[:n_exam] + eta, np.nan)
    positives = state.n_positives + int(above.sum())
    new = SessionState(state.noisy_threshold, state.n_examined + n_exam, positives)
    return BatchOutcome(above, values, new, positives >= cal.cutoff)
