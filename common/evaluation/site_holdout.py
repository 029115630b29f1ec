"""The site's evaluation holdout for a synthesis job: its secret, and the training-rows view.

A ``synth`` job that asks for an evaluation (``evaluate_rows > 0`` in its parameters) makes
every site hold out ``holdout_size(N_s)`` of its rows from every round of that job
(:mod:`dpfed.common.evaluation.holdout`). The choice is keyed by a secret kept in the site's
state directory (``synth_holdout.key`` beside the ledger, created on first use, mode 0600),
so only the site knows which rows are held out, and the same rows are held out in every
round, after a restart and in the evaluation.

:class:`TrainingRows` is the site's table minus the holdout, as a ``DataAccess``: every round
handler reads it instead of the full table; :func:`split_rows` returns both parts for the
evaluation. Both read the row positions in the source's order, which must be stable across a
job's passes (a file is; an SQL ``query`` should ``ORDER BY`` a row key).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dpfed.common.data.encoding import EncodedTable, EncodingReport
from dpfed.common.data.schema import Schema
from dpfed.common.errors import DataError, ValidationError
from dpfed.common.evaluation.holdout import (
    KEY_BYTES,
    holdout_positions,
    position_mask,
)

if TYPE_CHECKING:  # the rounds import this module; the protocol is only a type here
    from dpfed.common.jobs.contract import DataAccess

log = logging.getLogger(__name__)

#: File name of the site's holdout secret, in the ledger's directory.
KEY_FILE = "synth_holdout.key"


def site_secret(state_dir: Path) -> bytes:
    """Return the site's holdout secret, creating it (32 random bytes, mode 0600) if absent."""
    path = Path(state_dir) / KEY_FILE
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "wb") as fh:
                fh.write(os.urandom(KEY_BYTES))
                fh.flush()
                os.fsync(fh.fileno())
            log.info("created the synthesis holdout secret %s", path)
        secret = path.read_bytes()
    except OSError as exc:
        log.error("cannot keep the holdout secret %s: %s", path, exc)
        raise ValidationError("the site cannot keep its evaluation holdout secret (details "
                              "are in the site's log)") from None
    if len(secret) != KEY_BYTES:
        raise ValidationError(f"{path} is not a holdout secret ({len(secret)} bytes, expected "
                              f"{KEY_BYTES}); remove it to make a new one")
    return secret


def count_rows(data: DataAccess) -> int:
    """Return the number of valid rows (the recorded count if the source keeps one)."""
    known = getattr(data, "row_count", None)
    if isinstance(known, int) and known > 0:
        return known
    return sum(t.n_rows for t, _ in data.iter_chunks())


class TrainingRows:
    """The site's rows minus the job's holdout (a :class:`DataAccess`).

    Parameters
    ----------
    data : DataAccess
        The site's whole table.
    key : bytes
        The job's holdout key (:func:`dpfed.common.evaluation.holdout.job_key`).
    """

    def __init__(self, data: DataAccess, key: bytes) -> None:
        self.data = data
        self.n_total = count_rows(data)
        self.positions = holdout_positions(key, self.n_total)

    @property
    def schema(self) -> Schema:
        """The federation schema."""
        return self.data.schema

    @property
    def n_holdout(self) -> int:
        """Rows held out (public: a function of the public row count)."""
        return int(self.positions.size)

    def iter_parts(self) -> Iterator[tuple[EncodedTable, EncodedTable, EncodingReport]]:
        """Stream (training part, held-out part, report) of every chunk."""
        start = 0
        for table, report in self.data.iter_chunks():
            held = position_mask(self.positions, start, table.n_rows)
            start += table.n_rows
            if start > self.n_total:
                break
            yield _rows(table, ~held), _rows(table, held), report
        self._check_count(start)

    def _check_count(self, seen: int) -> None:
        if seen != self.n_total:
            raise DataError(f"the data changed during the task ({seen} valid rows, "
                            f"{self.n_total} expected); the holdout cannot be kept")

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        """Stream the training rows only."""
        start = 0
        for table, report in self.data.iter_chunks():
            held = position_mask(self.positions, start, table.n_rows)
            start += table.n_rows
            if start > self.n_total:
                break
            yield (_rows(table, ~held) if held.any() else table), report
        self._check_count(start)


def _rows(table: EncodedTable, mask: np.ndarray) -> EncodedTable:
    return table.take(mask)


def split_rows(data: DataAccess, key: bytes) -> tuple[EncodedTable, EncodedTable]:
    """Return (training rows, held-out rows) of the whole table (the evaluation's two parts)."""
    view = TrainingRows(data, key)
    train, held = [], []
    for t, h, _ in view.iter_parts():
        train.append(t)
        held.append(h)
    if not train:
        raise DataError("the site has no valid rows to evaluate against")
    return EncodedTable.concatenate(train), EncodedTable.concatenate(held)
