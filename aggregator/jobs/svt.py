"""Coordinator side of the ``svt`` job: one batch of a session at every site, combined.

Per query: how many sites answered "above" and which, and with eps_3 the sum of the released
values with its standard error -- post-processing only.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from dpfed import __version__
from dpfed.aggregator.jobs.job import Job, JobOutput
from dpfed.common.job_params import SVTParams
from dpfed.common.jobs.svt import BATCH, batch_of


async def run(job: Job[SVTParams]) -> JobOutput:
    """Send the batch, combine the transcripts per query."""
    params = job.params
    # Up to 50,000 predicate nodes to compile: off the event loop.
    batch = await asyncio.to_thread(batch_of, params, job.job_id, job.federation.schema)
    t = (await job.release(BATCH, batch)).value
    k = len(batch.names)
    n_above = (t.above == 1).sum(axis=0)
    n_examined = (t.above >= 0).sum(axis=0)
    released = ~np.isnan(t.values)
    n_valued = released.sum(axis=0)
    value_sum = np.where(n_valued > 0, np.nansum(t.values, axis=0), 0.0)
    value_se = np.where(n_valued > 0, np.sqrt(n_valued * 2.0) * t.numeric_scale, 0.0)
    metadata: dict[str, Any] = {
        "job_id": job.job_id, "kind": "svt", "action": params.action,
        "session": batch.session, "epsilon": job.spec.epsilon, "queries": batch.names,
        "site_ids": t.site_ids, "sites": t.sites,
        "numeric_scale": t.numeric_scale if bool(released.any()) else None,
        "params": {k2: v for k2, v in params.to_mapping().items() if k2 != "queries"},
        "charged_now": params.action == "open", "software_version": __version__}
    summary = {"session": batch.session, "action": params.action, "queries": k,
               "sites": len(t.site_ids), "queries_above_somewhere": int((n_above > 0).sum()),
               "halted_sites": sum(1 for m in t.sites if m["halted"])}
    # Result files hold finite numbers only (the coordinator refuses to store NaN): "no value"
    # travels as 0 with a mask (``value_released``, ``n_valued``); SVTJobResult restores NaN.
    arrays = {"above": t.above, "values": np.where(released, t.values, 0.0),
              "value_released": released, "n_above": n_above.astype(np.int64),
              "n_examined": n_examined.astype(np.int64), "n_valued": n_valued.astype(np.int64),
              "value_sum": value_sum, "value_std_error": value_se}
    return JobOutput(arrays, metadata, summary)
