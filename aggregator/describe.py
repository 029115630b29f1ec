"""Human-readable descriptions of jobs, shared by the ``dpfed`` commands and ``dpfed simulate``."""

from __future__ import annotations

from dpfed.common.transport.protocol import JobInfo


def describe_job(job: JobInfo) -> str:
    """Describe a job in a few readable lines."""
    lines = [f"job {job.job_id}: {job.spec.kind} {job.state}",
             f"  submitted by {job.submitted_by or '?'} at {job.created}, updated {job.updated}",
             f"  epsilon={job.spec.epsilon:g} delta={job.spec.delta:g} "
             f"params={dict(job.spec.params)}"
             + (f" study={job.spec.study}" if job.spec.study else "")]
    if job.error:
        lines.append(f"  error: {job.error}")
    for s in job.sites:
        spent = "" if s.spend is None else f" spent eps={s.spend.epsilon:g} delta={s.spend.delta:g}"
        reason = f" ({s.reason})" if s.reason else ""
        lines.append(f"  site {s.site_id}: {s.status}{reason} rows={s.row_count}{spent}")
    if job.summary:
        lines.append(f"  summary: {dict(job.summary)}")
    if job.result_size:
        lines.append(f"  result: {job.result_size} bytes (dpfed fetch {job.job_id} --out FILE.npz)")
    return "\n".join(lines)
