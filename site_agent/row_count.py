"""The site's row count N_s, learnt from a full pass after the agent has connected.

N_s -- the number of rows kept under the site's row policy -- is public under the
replace-one relation and travels in Hello, but it takes a full pass over the table to know
exactly (which rows a policy drops depends on every value). The agent therefore no longer
scans its table before connecting (9 s at 5M CSV rows, 43 s at p = 5000): it checks the
columns and a sample of rows, connects with ``row_count = 0`` ("not counted yet"), counts on
its task thread right after connecting, and sends an updated Hello on the same stream
(docs/data-sources.md, "Start-up"). Any complete pass -- the count or a task's -- records
the count, so the first task never waits for a second pass.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from dpfed.common.data.data_sources import DataSource
from dpfed.common.data.encoding import EncodedTable, EncodingReport
from dpfed.common.data.policy_counts import dropped_fraction_warning
from dpfed.common.data.schema import Schema

log = logging.getLogger(__name__)


class CountedData:
    """A :class:`DataSource` seen by the task handlers, remembering its row count.

    Parameters
    ----------
    source : DataSource
        The opened (column-checked) source.
    warn_dropped_fraction : float
        Log a warning when the first pass drops more than this share of the rows read
        (``[data] warn_dropped_fraction``; counts stay in the local log).
    """

    def __init__(self, source: DataSource, warn_dropped_fraction: float = 0.01) -> None:
        self.source = source
        self.warn_dropped_fraction = warn_dropped_fraction
        self._lock = threading.Lock()
        self._row_count: int | None = None
        self.report: EncodingReport | None = None

    @property
    def schema(self) -> Schema:
        """The federation schema (see :class:`~dpfed.site_agent.handlers.base.DataAccess`)."""
        return self.source.schema

    @property
    def row_count(self) -> int | None:
        """Rows kept by the last complete pass, or None before any pass finished."""
        with self._lock:
            return self._row_count

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        """Stream the source's chunks; a pass read to the end records the row count."""
        total = EncodingReport()
        for table, report in self.source.iter_chunks():
            total.merge(report)
            yield table, report
        self._record(total)

    def _record(self, total: EncodingReport) -> None:
        with self._lock:
            previous, self._row_count = self._row_count, total.rows_kept
            self.report = total
        if previous is None:
            log.info("[CountedData] data %s: %s", self.source.describe(), total.summary())
            warning = dropped_fraction_warning(total, self.warn_dropped_fraction)
            if warning is not None:
                log.warning("[CountedData] %s", warning)
            if total.rows_kept == 0:
                log.warning("[CountedData] no valid rows: every task will be refused until "
                            "the data is fixed")
        elif previous != total.rows_kept:
            log.warning("[CountedData] the data changed while the site ran: %d valid rows, "
                        "%d before; the coordinator is told at the next connection",
                        total.rows_kept, previous)

    def ensure_counted(self) -> bool:
        """Count the rows with one pass unless a pass already did; True if this call counted."""
        if self.row_count is not None:
            return False
        for _ in self.iter_chunks():
            pass
        return True
