"""Typed results of the ``svt`` and ``query`` jobs, read from their result files.

Both are ``.npz`` files in the project's result format (:mod:`dpfed.aggregator.result_file`)
whose metadata names the job ``kind``; the classes expose the tables analysts look at as
pandas DataFrames and write them as CSV.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

import numpy as np
import pandas as pd

from dpfed.aggregator.result_file import decode_result, encode_result
from dpfed.common.data.schema import Schema
from dpfed.common.errors import ValidationError
from dpfed.common.queries.query_language import Domain, parse_domain
from dpfed.common.queries.workload_spec import build_workload, query_names


def _check_kind(metadata: dict[str, Any], kind: str) -> None:
    if metadata.get("kind") != kind:
        raise ValidationError(f"not a {kind} result file (its kind is "
                              f"{metadata.get('kind')!r})")


class _ResultFile:
    """What both result classes share: the result-file format, CSV of their main table.

    Subclasses are frozen dataclasses with ``arrays`` and ``metadata``, name their ``KIND``
    and return the table a ``.csv`` path gets from :meth:`csv_table`.
    """

    KIND: ClassVar[str]
    arrays: dict[str, np.ndarray]
    metadata: dict[str, Any]

    def csv_table(self) -> pd.DataFrame:
        """Return the table written when a ``.csv`` path is given to :meth:`save`."""
        raise NotImplementedError

    def to_bytes(self) -> bytes:
        """Serialize to the result-file format."""
        return encode_result(self.arrays, self.metadata)

    def save(self, path: str | Path) -> Path:
        """Write the ``.npz`` result (or the main table as CSV if ``path`` ends in ``.csv``)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.suffix.lower() == ".csv":
            self.csv_table().to_csv(p, index=False)
        else:
            p.write_bytes(self.to_bytes())
        return p

    @classmethod
    def from_bytes(cls, data: bytes | str) -> Self:
        """Read a result file (bytes or path)."""
        arrays, metadata = decode_result(data)
        _check_kind(metadata, cls.KIND)
        return cls(arrays, metadata)  # type: ignore[call-arg]

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read a result file from disk."""
        return cls.from_bytes(str(path))


@dataclass(frozen=True)
class SVTJobResult(_ResultFile):
    """One SVT batch across the federation.

    Attributes
    ----------
    arrays : dict
        ``above`` (sites x queries: 1 above, 0 below, -1 not examined after the cut-off),
        ``values`` (released values or NaN), ``n_above``, ``n_examined``, ``value_sum``,
        ``value_std_error``.
    metadata : dict
        Job id, session, action, queries, sites, parameters.
    """

    KIND: ClassVar[str] = "svt"
    arrays: dict[str, np.ndarray]
    metadata: dict[str, Any]

    def csv_table(self) -> pd.DataFrame:
        """Return the per-query table."""
        return self.table

    @property
    def session(self) -> str:
        """The session id (the id of the job that opened it); pass it to continue."""
        return str(self.metadata["session"])

    @property
    def halted_sites(self) -> list[str]:
        """Sites whose session reached its cut-off (they answer no further queries)."""
        return [s["site_id"] for s in self.metadata.get("sites", []) if s.get("halted")]

    @property
    def table(self) -> pd.DataFrame:
        """One row per query: how many sites (and which) answered above, and value sums."""
        names = list(self.metadata.get("queries", []))
        site_ids = list(self.metadata.get("site_ids", []))
        above = self.arrays["above"]
        which = [", ".join(s for i, s in enumerate(site_ids) if above[i, q] == 1)
                 for q in range(len(names))]
        return pd.DataFrame({
            "query": names,
            "sites_above": self.arrays["n_above"].astype(int),
            "sites_examined": self.arrays["n_examined"].astype(int),
            "which_sites": which,
            "value_sum": self._where_valued(self.arrays["value_sum"]),
            "value_std_error": self._where_valued(self.arrays["value_std_error"]),
        })

    def _where_valued(self, column: np.ndarray) -> np.ndarray:
        """``column`` with NaN for the queries no site released a value for."""
        n_valued = self.arrays.get("n_valued")
        if n_valued is None:  # a result file written before the masks existed
            return column
        return np.where(n_valued > 0, column, np.nan)

    @property
    def values(self) -> np.ndarray:
        """Released values, sites x queries (NaN where a site released none)."""
        released = self.arrays.get("value_released")
        if released is None:
            return self.arrays["values"]
        return np.where(released, self.arrays["values"], np.nan)

    @property
    def sites(self) -> pd.DataFrame:
        """One row per site: session progress after this batch."""
        return pd.DataFrame(self.metadata.get("sites", []))


@dataclass(frozen=True)
class QueryJobResult(_ResultFile):
    """A workload answered by the matrix mechanism across the federation.

    Attributes
    ----------
    arrays : dict
        ``x_hat`` and ``x_std_error`` (the estimated pooled histogram), ``answers`` and
        ``answer_std_error`` (the workload), optionally ``workload_matrix``.
    metadata : dict
        Domain, workload, chosen strategy and noise, expected errors, sites.
    """

    KIND: ClassVar[str] = "query"
    arrays: dict[str, np.ndarray]
    metadata: dict[str, Any]

    def csv_table(self) -> pd.DataFrame:
        """Return the workload answers."""
        return self.answers

    @property
    def domain(self) -> Domain:
        """The histogram domain."""
        schema = Schema.from_toml(self.metadata["schema_toml"])
        d = self.metadata["domain"]
        return parse_domain(schema, d["columns"], d.get("bins") or None)

    @property
    def strategy(self) -> str:
        """The strategy the sites used."""
        return str(self.metadata["strategy"])

    @property
    def noise(self) -> str:
        """``laplace`` or ``gaussian`` (site level), ``skellam`` or ``dlaplace`` (secure)."""
        return str(self.metadata["noise"])

    @property
    def expected_rmse(self) -> float:
        """Closed-form per-query RMSE of the chosen strategy for this workload."""
        return float(self.metadata["expected_rmse"])

    @property
    def identity_expected_rmse(self) -> float:
        """The same for the identity strategy (the baseline)."""
        return float(self.metadata["identity_expected_rmse"])

    @property
    def histogram(self) -> pd.DataFrame:
        """``cell, estimate, std_error`` for the pooled histogram."""
        return pd.DataFrame({"cell": self.domain.cell_names(), "estimate": self.arrays["x_hat"],
                             "std_error": self.arrays["x_std_error"]})

    @property
    def answers(self) -> pd.DataFrame:
        """``query, estimate, std_error`` for every workload query."""
        domain = self.domain
        w = dict(self.metadata["workload"])
        if w["kind"] == "custom":
            w["matrix"] = self.arrays["workload_matrix"].tolist()
        if w["kind"] != "marginals":
            w.pop("k", None)
        workload = build_workload(domain, w)
        names = query_names(domain, workload, int(self.metadata["workload"].get("k", 0)))
        return pd.DataFrame({"query": names, "estimate": self.arrays["answers"],
                             "std_error": self.arrays["answer_std_error"]})
