"""The synth job's pair rounds against a hostile site (real coordinator, real honest agents).

A hand-written site (genuine certificate, genuine wire messages) answers ``links`` and
``pca`` with well-formed releases, then poisons ``pair_scores`` or ``pairs`` (NaN, 1e308, a
wrong shape, float32, a missing array, a bad row count). The coordinator must record an
error outcome for it, keep it out of the later rounds, and build the model from the honest
sites only.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpfed.aggregator.synth_model import SynthModel
from dpfed.common.data.schema import Schema
from dpfed.common.pb.v1 import analyst_pb2, analyst_pb2_grpc, site_link_pb2
from dpfed.common.synth.link_release import histogram_sizes
from dpfed.common.synth.links import latent_dim
from dpfed.common.transport.protocol import PROTOCOL_VERSION, JobSpec, SiteHello, Task
from dpfed.common.transport.wire import Reassembler, hello_to_proto
from tests.aggregator.hardening_harness import HandSite, harness

pytestmark = pytest.mark.timeout(180)

N_BINS = 8
SPEC = JobSpec("synth", 8.0, 1e-5, {"n_bins": N_BINS}, min_sites=2, deadline_seconds=20.0)


class SynthHandSite(HandSite):
    """A hand site that advertises the synth kind."""

    def hello(self) -> site_link_pb2.SiteMessage:
        from dpfed import __version__

        return site_link_pb2.SiteMessage(hello=hello_to_proto(SiteHello(
            __version__, PROTOCOL_VERSION, self.h.schema_digest, self.rows, ("synth",), None,
            None)))


def poison(kind: str, size: int) -> tuple[np.ndarray | None, dict[str, Any] | None]:
    """The array (None: left out) and metadata of a hostile answer with ``size`` entries."""
    if kind == "nan":
        bad = np.zeros(size)
        bad[0] = np.nan
        return bad, None
    if kind == "huge":
        return np.full(size, 1e308), None
    if kind == "shape":
        return np.zeros(size + 1), None
    if kind == "float32":
        return np.zeros(size, dtype=np.float32), None
    if kind == "missing":
        return None, None
    assert kind == "rows"
    return np.zeros(size), {"n_rows": -3}


@pytest.mark.parametrize("target, kind", [
    ("pair_scores", "nan"), ("pair_scores", "huge"), ("pair_scores", "shape"),
    ("pairs", "float32"), ("pairs", "missing"), ("pairs", "rows"),
])
async def test_a_poisoned_pair_release_is_an_error_outcome_and_the_model_uses_honest_sites(
        tmp_path: Path, target: str, kind: str) -> None:
    async with harness(tmp_path, extra_kinds=("synth",)) as h:
        schema = Schema.load(h.fed.schema_path)
        dim = latent_dim(schema)
        size = sum(histogram_sizes(schema, N_BINS, "fine"))  # a new job's cells
        site = SynthHandSite(h)
        await site.connect()
        await h.wait_connected("hospital-3")
        seen: list[str] = []

        async def play() -> None:
            while True:
                task: Task = await site.next_task()
                rnd = str(task.params["round"])
                seen.append(rnd)
                if rnd == "links":
                    await site.send_result(task, {"histograms": np.full(size, 300.0 / size)})
                elif rnd == "pca":
                    await site.send_result(task, {"factor": 0.3 * np.eye(dim)})
                elif rnd == "pair_scores" and target != "pair_scores":
                    n = len(schema.columns) * (len(schema.columns) - 1) // 2
                    await site.send_result(task, {"pair_scores": np.zeros(n)})
                else:
                    n_cells = (len(schema.columns) * (len(schema.columns) - 1) // 2
                               if rnd == "pair_scores" else
                               sum(np.prod(c) for c in _cells(task, h)))
                    value, meta = poison(kind, int(n_cells))
                    name = "pair_scores" if rnd == "pair_scores" else "pair_tables"
                    await site.send_result(task, {} if value is None else {name: value}, meta)
                    return

        player = asyncio.create_task(play())
        job = await h.submit(SPEC)
        await asyncio.wait_for(player, 10)
        data = None
        reassembler = Reassembler(1 << 30)
        async with h.analyst_channel() as ch:
            async for chunk in analyst_pb2_grpc.AnalystStub(ch).FetchResult(
                    analyst_pb2.FetchResultRequest(job_id=job.job_id), timeout=30):
                data = reassembler.add(chunk) or data
        await site.close()
        assert data is not None
    assert job.state == "succeeded", job.error
    outcomes = {s.site_id: (s.status, s.reason) for s in job.sites}
    assert outcomes["hospital-3"][0] == "error" and "invalid result" in outcomes["hospital-3"][1]
    assert seen == ["links", "pca", "pair_scores", "pairs"][:seen.index(target) + 1]
    model = SynthModel.from_bytes(data)
    honest = ["hospital-1", "hospital-2"]
    assert model.metadata["rounds"]["pairs"] == honest
    assert model.metadata["rounds"]["pca"] == [*honest, "hospital-3"]
    assert model.pair_correction is not None and job.summary["sites"] == 2
    assert model.metadata["n_rows_total"] == 600


def _cells(task: Task, h: Any) -> list[tuple[int, int]]:
    """Cells of each edge the task carries (the grid of the links it carries)."""
    from dpfed.common.synth.pair_marginals import PairGrid

    schema = Schema.load(h.fed.schema_path)
    grid = PairGrid.from_proportions(schema, task.arrays["link_proportions"], N_BINS,
                                     int(task.params["pair_groups"]),
                                     str(task.params.get("resolution", "bins")))
    return [(grid.sizes[a], grid.sizes[b]) for a, b in task.params["pair_edges"]]
