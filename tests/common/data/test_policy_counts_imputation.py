"""The DP releases of what a row policy did and of the observed means for imputation.

Each sensitivity is checked by a search over extreme schema-valid (and invalid) records pushed
through the real encoding (``encode_table``) and the real site statistic; each noise scale by
a statistical test that also runs against a planted copy with the wrong sensitivity.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.encoding import EncodedTable, RowPolicy, encode_table
from dpfed.common.data.imputation import dp_means, observed_sums, observed_sums_mechanism
from dpfed.common.data.policy_counts import (
    dropped_fraction_warning,
    policy_count_names,
    policy_counts,
    policy_counts_mechanism,
    policy_counts_sensitivity,
)
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.privacy.mechanisms import GaussianMechanism, gaussian_sigma
from tests.support.schemas import row_policy_schema

SCHEMA = row_policy_schema("drop-row")
POLICY = RowPolicy(missing="drop", out_of_range="drop")
#: Every value each column can take that the encoding treats differently.
VALUES = {"a": ["-5", "5", "9", "", "abc"], "b": ["0", "1", ""],
          "w": ["x", "zzz", ""], "d": ["2020-01-01", "", "never"]}


def records() -> pd.DataFrame:
    return pd.DataFrame(list(itertools.product(*VALUES.values())), columns=list(VALUES))


def counts_of(row: pd.Series) -> np.ndarray:
    _, report = encode_table(SCHEMA, row.to_frame().T, policy=POLICY)
    return policy_counts(report, SCHEMA)


def test_names_match_the_vector() -> None:
    _, report = encode_table(SCHEMA, records(), policy=POLICY)
    v = policy_counts(report, SCHEMA)
    names = policy_count_names(SCHEMA)
    assert len(names) == v.size == 3 + 4 + 1
    assert names[-1] == "w: other"


def test_policy_counts_sensitivity_search_reaches_the_bound() -> None:
    rows = records()
    vectors = np.array([counts_of(r) for _, r in rows.iterrows()])
    diffs = vectors[:, None, :] - vectors[None, :, :]
    worst = float(np.sqrt(np.max(np.einsum("ijk,ijk->ij", diffs, diffs))))
    bound = policy_counts_sensitivity(SCHEMA)
    assert worst <= bound + 1e-12
    assert worst == pytest.approx(bound)  # tight for this schema: sqrt(2 + 4 + 1)
    # The counts of a whole table are the sum over its rows (so single rows are the search).
    _, report = encode_table(SCHEMA, rows, policy=POLICY)
    np.testing.assert_array_equal(policy_counts(report, SCHEMA), vectors.sum(axis=0))


def noise_std(mechanism: GaussianMechanism, exact: np.ndarray, seed: int) -> float:
    rng = np.random.default_rng(seed)
    draws = np.array([mechanism.release(exact, rng) - exact for _ in range(2000)])
    return float(draws.std())


@pytest.mark.parametrize("planted", [False, True])
def test_policy_counts_noise_scale(planted: bool) -> None:
    _, report = encode_table(SCHEMA, records(), policy=POLICY)
    exact = policy_counts(report, SCHEMA)
    mech = policy_counts_mechanism(SCHEMA, 1.0, 1e-5)
    if planted:  # a copy that forgot the per-column entries: sensitivity sqrt(2)
        mech = GaussianMechanism(1.0, 1e-5, np.sqrt(2))
    expected = gaussian_sigma(1.0, 1e-5, np.sqrt(7))
    ok = abs(noise_std(mech, exact, 3) / expected - 1) < 0.05
    assert ok != planted
    assert mech.cost().epsilon == 1.0


def encoded(rows: list[tuple[str, str]]) -> EncodedTable:
    frame = pd.DataFrame(rows, columns=["a", "b"]).assign(w="x", d="2020-01-01")
    schema = Schema((SCHEMA.column("a"), SCHEMA.column("b"), SCHEMA.column("w"),
                     SCHEMA.column("d")))
    enc, _ = encode_table(schema, frame, policy=POLICY)
    return enc


def test_observed_sums_sensitivity_search() -> None:
    # Column b may be missing; a is complete. Replace one row of a fixed base table.
    base = [("1", "0.5"), ("-2", "")]
    choices = list(itertools.product(["-5", "5", "0"], ["0", "1", "", "0.5"]))
    sums = [observed_sums([encoded([*base, r])], SCHEMA, ["a", "b"]) for r in choices]
    worst = max(float(np.linalg.norm(x - y)) for x, y in itertools.product(sums, sums))
    mech = observed_sums_mechanism(2, 1.0, 1e-5)
    assert worst <= mech.sensitivity + 1e-12
    assert worst == pytest.approx(mech.sensitivity)  # 2 sqrt(2): every bound swapped
    got = observed_sums([encoded(base)], SCHEMA, ["a", "b"])
    np.testing.assert_allclose(got, [1 / 5 - 2 / 5, 0.0, 2.0, 1.0])


@pytest.mark.parametrize("planted", [False, True])
def test_observed_sums_noise_scale(planted: bool) -> None:
    exact = observed_sums([encoded([("1", "0.5")])], SCHEMA, ["a", "b"])
    mech = observed_sums_mechanism(2, 1.0, 1e-5)
    if planted:  # a copy that took the per-column sensitivity 2 for the whole vector
        mech = GaussianMechanism(1.0, 1e-5, 2.0)
    ok = abs(noise_std(mech, exact, 5) / gaussian_sigma(1.0, 1e-5, 2 * np.sqrt(2)) - 1) < 0.05
    assert ok != planted


def test_dp_means_post_processing_and_hostile_releases() -> None:
    schema = Schema.from_toml("[[columns]]\nname='n'\ntype='continuous'\nmin=0\nmax=100\n"
                              "integer=true\n[[columns]]\nname='x'\ntype='continuous'\nmin=-1\n"
                              "max=1\n")
    # Two sites: scaled sums 30 and -10 over 100 + 100 observed values of n.
    means = dp_means(schema, ["n", "x"], [np.array([30.0, 5.0, 100.0, 0.2]),
                                          np.array([-10.0, 1e9, 100.0, 0.0])])
    assert means["n"] == 55.0  # 50 + 50 * 0.1
    assert means["x"] == 1.0  # clipped: a count below 1 counts as 1
    with pytest.raises(ValidationError, match="finite"):
        dp_means(schema, ["n"], [np.array([np.nan, 1.0])])
    with pytest.raises(ValidationError, match="shape"):
        dp_means(schema, ["n"], [np.zeros(3)])
    with pytest.raises(ValidationError, match="continuous or date"):
        observed_sums([], SCHEMA, ["w"])


def test_dropped_fraction_warning() -> None:
    _, report = encode_table(SCHEMA, records(), policy=POLICY)
    warning = dropped_fraction_warning(report, 0.5)
    assert warning is not None and "would be dropped" in warning and "'a'" in warning
    assert dropped_fraction_warning(report, 1.0) is None
    clean, _ = encode_table(SCHEMA, records().iloc[:1], policy=POLICY)
    _, ok = encode_table(SCHEMA, records().iloc[:1], policy=POLICY)
    assert clean.n_rows == 1 and dropped_fraction_warning(ok, 0.0) is None
