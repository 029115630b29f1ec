"""A site's table in memory, as rounds read it (the ``DataAccess`` of a site)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pandas as pd
import pyarrow as pa

from dpfed.common.data.encoding import (
    EncodedTable,
    EncodingReport,
    encode_table,
    frame_to_arrow,
)
from dpfed.common.data.schema import Schema
from dpfed.common.jobs.contract import NewCharge, Release, Site
from dpfed.common.privacy.accounting import PrivacyCost
from dpfed.common.transport.protocol import TaskResult
from dpfed.common.transport.wire import result_from_bytes


class FrameData:
    """Rows from a DataFrame, validated and encoded by the site's own encoder (clipping
    included), streamed in chunks of ``chunk_rows`` rows (None: one chunk). The frame becomes
    an Arrow table once, at the first pass (as a site's file is read by Arrow), and each pass
    encodes its slices; assigning ``frame`` starts over, so a test replaces the frame rather
    than editing it after a pass."""

    def __init__(self, schema: Schema, frame: pd.DataFrame, chunk_rows: int | None = 7) -> None:
        self._schema = schema
        self._chunk = chunk_rows
        self.frame = frame

    @property
    def frame(self) -> pd.DataFrame:
        return self._frame

    @frame.setter
    def frame(self, frame: pd.DataFrame) -> None:
        self._frame = frame
        self._arrow: pa.Table | None = None

    @property
    def schema(self) -> Schema:
        return self._schema

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        if self._arrow is None:
            self._arrow = frame_to_arrow(self._schema, self.frame)
        step = self._chunk or max(len(self.frame), 1)
        for start in range(0, len(self.frame), step):
            yield encode_table(self._schema, self._arrow.slice(start, step), row_offset=start)


def site(schema: Schema, frame: pd.DataFrame, **kwargs: Any) -> Site:
    """A :class:`Site` over ``frame`` (unbound: no ledger beside it)."""
    return Site(FrameData(schema, frame, **kwargs))


class ZeroNoise:
    """A generator stand-in whose every normal draw is 0: a release IS its statistic."""

    def standard_normal(self, size: Any = None) -> np.ndarray:
        return np.zeros(size)


def cost_of(release: Release) -> PrivacyCost:
    """The new charge a release asks for."""
    assert isinstance(release.charge, NewCharge), release.charge
    return release.charge.cost


def produced(release: Release, rng: Any) -> TaskResult:
    """The answer a release produces with ``rng`` (decoded if it keeps its own bytes)."""
    out = release.produce(cast(np.random.Generator, rng))
    return result_from_bytes(out) if isinstance(out, bytes) else out
