"""The ``synth`` job kind: federated DP synthesis with the latent factor model.

Rounds, in order: ``links`` and ``pca`` (:mod:`dpfed.common.jobs.synth_rounds`), then in
generative mode with ``pairs > 0`` ``pair_scores`` and ``pairs``
(:mod:`dpfed.common.jobs.synth_pairs`), or in row-aligned mode ``factors``; with an
evaluation, ``evaluate`` and ``evaluate_summary`` (:mod:`dpfed.common.jobs.synth_evaluation`).
The coordinator fits the model (:mod:`dpfed.aggregator.jobs.synth`); docs/synthesis.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.job_params import SynthParams
from dpfed.common.jobs.contract import JobKind
from dpfed.common.jobs.synth_evaluation import EVALUATE, EVALUATE_SUMMARY
from dpfed.common.jobs.synth_pairs import PAIR_SCORES, PAIRS
from dpfed.common.jobs.synth_rounds import FACTORS, LATENT, LINKS
from dpfed.common.privacy.skellam import skellam_calibrate
from dpfed.common.synth.link_release import (
    expected_proportion_error,
    secure_link_row_norm,
    secure_link_weights,
)
from dpfed.common.synth.pair_marginals import (
    NOISY_PAIR_TABLES,
    expected_pair_table_error,
    pair_table_mechanism,
    typical_pair_cells,
)

KIND: JobKind[SynthParams] = JobKind(
    name="synth", params=SynthParams,
    rounds=(LINKS, LATENT, PAIR_SCORES, PAIRS, FACTORS, EVALUATE, EVALUATE_SUMMARY),
    run="dpfed.aggregator.jobs.synth:run", summary="DP synthetic data from a latent factor model")


#: Largest expected L1 error of a column's pooled DP proportions a job may start with.
MAX_PROPORTION_ERROR = 0.5


def counts_sigma(groups: int, epsilon: float, delta: float) -> float:
    """Return the Skellam noise's standard deviation on every cell of a secure counts sum.

    ``groups`` is the number ``C`` of histograms (or tables) every row adds one count to
    (L2 sensitivity ``sqrt(2 C)``, L1 ``2 C``; budget checks before anything runs).
    """
    return math.sqrt(skellam_calibrate(epsilon, delta, math.sqrt(2.0 * groups),
                                       2.0 * groups).mu)


def pooled_counts_sigma(schema: Schema, n_bins: int, epsilon: float,
                        delta: float, resolution: str = "bins") -> np.ndarray:
    """Return the Skellam noise's standard deviation on each column's pooled counts (secure links).

    The weighted counts' sensitivities are those of counts with ``C = row_norm^2`` groups;
    column ``j``'s counts are divided by its weight ``m_j``.
    """
    groups = round(secure_link_row_norm(schema, n_bins, resolution) ** 2)
    return np.asarray(counts_sigma(groups, epsilon, delta)
                      / secure_link_weights(schema, n_bins, resolution))


def check_budget_for_cells(schema: Schema, params: SynthParams, epsilon: float, delta: float,
                           row_counts: list[int]) -> None:
    """Refuse budgets whose histograms would be mostly noise (before anything is charged)."""
    eps, dlt = params.plan(epsilon, delta)[0][1:]
    # Judged at the bins: under the fine layout the estimate falls back to a bin wherever its
    # leaves are noise, and the bins carry 4/5 of the column's budget (noise sd x 5/4).
    pooled = (pooled_counts_sigma(schema, params.n_bins, eps, dlt, "bins")
              if params.secure else None)
    name, err = expected_proportion_error(schema, params.n_bins, epsilon=eps, delta=dlt,
                                          row_counts=row_counts, pooled_sigma=pooled,
                                          resolution="bins")
    if params.resolution == "fine":
        err *= 1.25
    if err > MAX_PROPORTION_ERROR:
        raise ValidationError(
            f"--epsilon {epsilon:g} / --delta {delta:g} are too small for this schema's cells: "
            f"the DP histogram of {name!r} would have an expected L1 error of {err:.2f} on "
            f"its proportions with {sum(row_counts)} rows at {len(row_counts)} site(s) "
            f"(limit {MAX_PROPORTION_ERROR}); raise --epsilon/--delta or lower --n-bins")


def pair_noise(params: SynthParams, epsilon: float, delta: float,
               n_sites: int) -> Callable[[int], float]:
    """Return ``K ->`` the summed noise's standard deviation per cell of ``K`` pair tables.

    Public: the pairs round's calibration at its (epsilon, delta) -- site level ``sqrt(S)``
    times one site's Gaussian sigma, secure the Skellam sum's -- which the pair gate
    (:func:`dpfed.common.synth.pipeline.pair_forest`) compares the noisy scores with.
    """
    if params.secure:
        return lambda k: counts_sigma(k, epsilon, delta)
    return lambda k: pair_table_mechanism(k, epsilon, delta).sigma * math.sqrt(n_sites)


def pair_noise_note(schema: Schema, params: SynthParams, epsilon: float, delta: float,
                    row_counts: list[int]) -> str | None:
    """Return a warning when the pair tables would be mostly noise at this budget, else None.

    Computed from public numbers only (schema, budget split, the sites' row counts): the
    expected L1 error of a typical pair table above
    :data:`~dpfed.common.synth.pair_marginals.NOISY_PAIR_TABLES`. The job still runs as
    planned (the correction then keeps the model's tables for most pairs).
    """
    if not params.pair_rounds or not row_counts or min(row_counts) < 1:
        return None
    k = params.max_pairs(len(schema.columns))
    cells = typical_pair_cells(schema, params.n_bins, params.pair_groups)
    if k == 0 or cells == 0:
        return None
    eps, dlt = {n: (e, d) for n, e, d in params.plan(epsilon, delta)}["pairs"]
    sigma = pair_noise(params, eps, dlt, len(row_counts))(k)
    err = expected_pair_table_error(cells, sigma, sum(row_counts))
    if err <= NOISY_PAIR_TABLES:
        return None
    return (f"at this budget a typical pair table ({cells} cells, {sum(row_counts)} rows at "
            f"{len(row_counts)} site(s)) has an expected L1 error of {err:.2f} on its "
            "proportions: mostly noise, so the correction will keep the model's tables for "
            "most pairs; --pairs 0 gives that budget back to the marginals"
            + ("" if params.secure else
               " (--aggregation secure adds the noise once instead of at every site)"))
