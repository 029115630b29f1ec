"""The evaluation holdout: public size, keyed uniform positions, independent of the data."""

from __future__ import annotations

import numpy as np
import pytest

from dpfed.common.errors import ValidationError
from dpfed.common.evaluation import holdout
from dpfed.common.evaluation.holdout import (
    MAX_HOLDOUT_ROWS,
    holdout_positions,
    holdout_size,
    job_key,
    position_mask,
    training_count,
)

SECRET = bytes(range(32))


def test_size_is_a_public_function_of_the_row_count() -> None:
    assert [holdout_size(n) for n in (0, 4, 5, 49, 1500)] == [0, 0, 1, 9, 300]
    assert holdout_size(10**7) == MAX_HOLDOUT_ROWS
    assert training_count(1500) == 1200
    with pytest.raises(ValidationError, match="n_rows"):
        holdout_size(-1)


def test_positions_are_keyed_deterministic_and_of_the_stated_size() -> None:
    a = holdout_positions(job_key(SECRET, "job-1"), 1000)
    assert a.size == 200 and np.all(np.diff(a) > 0) and a.min() >= 0 and a.max() < 1000
    assert np.array_equal(a, holdout_positions(job_key(SECRET, "job-1"), 1000))
    assert not np.array_equal(a, holdout_positions(job_key(SECRET, "job-2"), 1000))
    other = bytes(32)
    assert not np.array_equal(a, holdout_positions(job_key(other, "job-1"), 1000))
    big = holdout_positions(job_key(SECRET, "j"), 5_000_000)  # O(size), whatever N
    assert big.size == MAX_HOLDOUT_ROWS and big.max() < 5_000_000
    with pytest.raises(ValidationError, match="32 bytes"):
        job_key(b"short", "j")


def inclusion_counts(n: int, keys: int) -> np.ndarray:
    counts = np.zeros(n)
    for k in range(keys):
        counts[holdout_positions(job_key(SECRET, f"job-{k}"), n)] += 1
    return counts


def test_every_position_is_equally_likely_to_be_held_out() -> None:
    # Floyd's algorithm draws a uniform subset: each of 20 positions is held out with
    # probability 4/20 over keys. 3000 keys: 600 +- 22 per position; allow 5 sd.
    counts = inclusion_counts(20, 3000)
    assert counts.sum() == 3000 * 4
    assert np.abs(counts - 600).max() < 5 * np.sqrt(3000 * 0.2 * 0.8)


def test_uniformity_check_catches_a_biased_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    # Broken copy: the keyed integer ignores its bound's upper half (positions late in the
    # table are held out less often).
    real = holdout._keyed_below
    monkeypatch.setattr(holdout, "_keyed_below",
                        lambda key, index, bound: real(key, index, max(1, bound // 2)))
    counts = inclusion_counts(20, 3000)
    assert np.abs(counts - 600).max() >= 5 * np.sqrt(3000 * 0.2 * 0.8)


def test_position_mask_marks_the_positions_of_one_chunk() -> None:
    pos = np.array([0, 3, 7, 8, 15])
    assert position_mask(pos, 0, 5).tolist() == [True, False, False, True, False]
    assert position_mask(pos, 5, 5).tolist() == [False, False, True, True, False]
    assert not position_mask(pos, 16, 4).any()
