"""Job kinds the coordinator can run (coordinator side of each plug-in)."""

from __future__ import annotations

from dpfed.aggregator.jobs.base import JobContext, JobOutput, JobType
from dpfed.aggregator.jobs.pca import PCAJob
from dpfed.aggregator.jobs.query import QueryJob
from dpfed.aggregator.jobs.svt import SVTJob
from dpfed.aggregator.jobs.synth import SynthJob

#: kind -> job type; adding a job kind means adding it here and a handler at the sites.
JOB_TYPES: dict[str, JobType] = {j.kind: j for j in (PCAJob(), SVTJob(), QueryJob(),
                                                      SynthJob())}

__all__ = ["JOB_TYPES", "JobContext", "JobOutput", "JobType"]
