"""The ``synth`` job's secure rounds, in-process with the real code (shared by the benches).

:func:`fit_secure` runs ``dpfed synth --aggregation secure`` without the network: the job's
own run (:func:`dpfed.aggregator.jobs.synth.run`) with a dispatcher whose every release is an
in-process secure sum -- each site's contribution from the round's own code (the same exact
statistic the site agent computes), its Skellam share and pairwise masks (real X25519 keys
signed with certificates from dpfed's CA, :func:`federation`), decoded and checked as the
coordinator does -- so the post-processing (links, factor model, pair tables) is the job's.

Used by ``bench/synth_secure.py`` and ``bench/synth_quality.py`` (methods ``fed-secure-*``).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from secure_aggregation import masked_shares  # noqa: E402

from dpfed.aggregator.federation import Federation  # noqa: E402
from dpfed.aggregator.jobs import synth as synth_job  # noqa: E402
from dpfed.aggregator.jobs.job import Job  # noqa: E402
from dpfed.aggregator.jobs.secure_rounds import _decoded, _plan  # noqa: E402
from dpfed.aggregator.synth_model import SynthModel  # noqa: E402
from dpfed.common.data.encoding import EncodedTable, EncodingReport  # noqa: E402
from dpfed.common.data.schema import Schema  # noqa: E402
from dpfed.common.job_params import SynthParams  # noqa: E402
from dpfed.common.jobs.contract import Ask, Budget, Pooled, Round, Site, SumRound  # noqa: E402
from dpfed.common.jobs.registry import SECURE_TASK_KIND, job_kind  # noqa: E402
from dpfed.common.secagg.masking import MaskContext  # noqa: E402
from dpfed.common.secagg.messages import plan_params  # noqa: E402
from dpfed.common.synth.pair_marginals import DEFAULT_GROUPS  # noqa: E402
from dpfed.common.transport.certs import init_federation  # noqa: E402
from dpfed.common.transport.protocol import JobSpec, Task, TaskResult  # noqa: E402


class SiteRows:
    """One site's encoded rows as the site reads them (schema + chunked pass)."""

    def __init__(self, schema: Schema, table: EncodedTable) -> None:
        self._schema, self.table = schema, table

    @property
    def schema(self) -> Schema:
        return self._schema

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        yield self.table, EncodingReport()


def federation(directory: Path, ids: list[str]) -> Path:
    """Create a federation (CA, site certificates) for ``ids`` under ``directory``."""
    fed = directory / "fed"
    init_federation(fed, coordinator_hosts=["localhost"], sites=ids, analysts=[])
    return fed


class _EverySiteContributed:
    """The recovery of a sum every participant contributed to: no mask is left to remove.

    ``order`` are the participants, masked on the complete graph (``graph`` None).
    """

    graph = None

    def __init__(self, order: list[str]) -> None:
        self.order = order

    @staticmethod
    def correction(survivors: list[str], n_values: int) -> np.ndarray:
        return np.zeros(n_values, dtype=np.uint64)


class InProcessJob(Job[SynthParams]):
    """The job's dispatcher with every release an in-process secure sum over ``sites``."""

    def __init__(self, schema: Schema, sites: dict[str, SiteRows], fed: Path,
                 spec: JobSpec, params: SynthParams, rng: np.random.Generator) -> None:
        connected = [SimpleNamespace(site_id=s, hello=SimpleNamespace(
            row_count=rows.table.n_rows, allowed_kinds=("synth", SECURE_TASK_KIND)))
            for s, rows in sites.items()]
        super().__init__(job_id="bench", spec=spec, kind=job_kind("synth"), params=params,
                         federation=Federation(schema, min_sites=2),
                         registry=SimpleNamespace(connected=lambda: connected),  # type: ignore[arg-type]
                         emit=lambda *_: None)
        self.sites, self.fed, self.rng = sites, fed, rng

    async def release(self, rnd: Round[SynthParams, Any, Any], inputs: Any, *,
                      among: Collection[str] | None = None) -> Pooled[Any]:
        """One secure sum through the sites' real round code; decoded and checked."""
        assert isinstance(rnd, SumRound), rnd.name
        budget = rnd.task_budget(self.budget(rnd.name), inputs)
        ask = Ask(self.params, self.federation.schema, inputs, budget)
        enc = rnd.encoding(ask)
        ids = list(self.sites)
        total = sum(s.table.n_rows for s in self.sites.values())
        planned = await _plan(rnd, enc, budget, ids, 0, total)
        plan = planned.plan
        charged = Budget(plan.calibration.epsilon if budget.rho is not None
                         else budget.epsilon, budget.delta, budget.rho)
        task = Task(f"bench/{rnd.name}-sum-1", "bench", SECURE_TASK_KIND, charged.epsilon,
                    charged.delta, {"stage": "contribute", "sum_round": f"{rnd.name}-sum-1",
                                    **dict(enc.params),
                                    **plan_params(plan, row_norm=enc.row_norm)},
                    dict(enc.arrays))
        given = {s: rnd.contribution(task, Site(rows), ids, 0)  # type: ignore[arg-type]
                 for s, rows in self.sites.items()}
        assert all(g.plan == plan for g in given.values())  # each site recomputed the plan
        computed = {s: g.compute(self.rng) for s, g in given.items()}
        ctx = MaskContext("bench", plan.statistic,
                          f"bench/{rnd.name}/{self.rng.integers(1 << 30)}")
        masked = masked_shares({s: c[0] for s, c in computed.items()}, plan, self.fed, ctx,
                               self.rng)
        results = {s: TaskResult(task.task_id, plan.cost(), {"masked": masked[s]},
                                 {"n_rows": int(computed[s][1])}) for s in ids}
        recovery: Any = _EverySiteContributed(ids)
        return await _decoded(rnd, ask, enc, planned, charged, results, 1, recovery)


def fit_secure(schema: Schema, tables: list[EncodedTable], ids: list[str], fed: Path,
               eps: float, delta: float, rng: np.random.Generator, *, n_bins: int,
               split: Mapping[str, tuple[float, float]] | tuple[float, float] | None = None,
               pairs: int | None = None, pair_groups: int = DEFAULT_GROUPS,
               composition: str = "basic", resolution: str = "fine",
               pair_gate: bool = True, heaps: bool = True) -> SynthModel:
    """The job's run with its secure rounds in-process; return the model it publishes.

    ``split`` maps round names to (epsilon share, delta share) as the job's ``split``
    parameter (None: the job's default for ``pairs``); a bare (epsilon, delta) pair is the
    links round's share with the rest to the pca round (no pair rounds). ``pairs`` (None: the
    job's default, columns - 1; 0: no pair rounds) and ``pair_groups`` are the job's.
    ``composition`` is the job's (``zcdp``: every round its share of rho), and so are
    ``resolution`` (the continuous columns' cells), ``pair_gate`` and ``heaps``. ``rng``
    draws the noise and the post-processing's randomness; the job's budget check (which refuses
    budgets whose histograms are mostly noise) is skipped, so every budget is measured.
    """
    raw: dict[str, object] = {"n_bins": n_bins, "aggregation": "secure",
                              "pair_groups": pair_groups, "composition": composition,
                              "resolution": resolution, "pair_gate": pair_gate,
                              "heaps": heaps}
    if isinstance(split, Mapping):
        raw["split"] = {k: [float(v[0]), float(v[1])] for k, v in split.items()}
    elif split is not None:
        raw["split"] = {"links": [split[0], split[1]], "pca": [1.0 - split[0], 1.0 - split[1]]}
        pairs = 0
    if pairs is not None:
        raw["pairs"] = pairs
    params = SynthParams.parse(raw, schema)
    job = InProcessJob(schema, {s: SiteRows(schema, t) for s, t in zip(ids, tables, strict=True)},
                       fed, JobSpec("synth", eps, delta, params.to_mapping()), params, rng)
    with mock.patch.object(synth_job, "production_rng", lambda: rng), \
            mock.patch.object(synth_job, "_check_budget", lambda _job: None):
        out = asyncio.run(synth_job.run(job))
    return SynthModel.from_result(out.arrays, out.metadata)
