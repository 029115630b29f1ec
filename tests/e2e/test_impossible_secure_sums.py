"""A site that corrupts its secure contributions cannot publish an impossible result.

Real processes over mTLS: a coordinator and three sites, one of them the hostile build of
``tests/support/shifting_site.py`` -- the real agent, adding 2^50 to the first entry of every
exact integer statistic it contributes to a secure sum (the masks hide that from everyone).
Every decoded secure sum is checked against what the public row counts and the statistic
allow: the job fails with the named reason ``impossible_secure_sum`` and nothing is published.
Without the hostile site the same federation runs the same jobs, so the check passes honest
sums.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.common.errors import ImpossibleSumError, NotFoundError
from dpfed.common.transport.protocol import JobSpec
from tests.e2e.federations import charged_events, roomy_settings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

HOSTILE = "hospital-3"


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=1500, features=6, seed=5, min_sites=2,
        task_deadline_s=60, resume_wait_s=10, mixed=True,
        settings=roomy_settings(allowed_jobs=("pca", "query")))
    federation.start_coordinator()
    try:
        for site_id in federation.site_ids:
            if site_id != HOSTILE:
                federation.start_site(site_id)
        federation._spawn(HOSTILE, ["-m", "tests.support.shifting_site", "--config",
                                    str(federation.site_config(HOSTILE)), "--coordinator",
                                    federation.address])
        federation.wait_for_sites()
        yield federation
    finally:
        federation.stop_all()


def _refused_unpublished(fed: LocalFederation, spec: JobSpec) -> None:
    with fed.analyst() as coord:
        job = coord.submit(spec)
        assert job.state == "failed"
        assert job.error.startswith(ImpossibleSumError.REASON + ": "), job.error
        assert "nothing was published" in job.error
        assert job.result_size == 0
        with pytest.raises(NotFoundError):
            coord.fetch_result(job.job_id)


def test_shifted_secure_sums_fail_the_job_with_a_named_reason(fed: LocalFederation) -> None:
    # a Gram sum (the eigenvalue 36,562 where unit-ball rows allow 1)
    _refused_unpublished(fed, JobSpec("pca", 50.0, 1e-5, {
        "n_components": 2, "aggregation": "secure", "centering": "none",
        "clip_norm": "schema"}))
    # a row sum (the first sum of a centred job with the schema's bound)
    _refused_unpublished(fed, JobSpec("pca", 50.0, 1e-5, {
        "n_components": 2, "aggregation": "secure", "clip_norm": "schema"}))
    # the matrix mechanism's answers (the count of 1.7e10 from 6,000 rows)
    _refused_unpublished(fed, JobSpec("query", 5.0, 1e-5, {
        "domain": {"columns": ["ward"]}, "aggregation": "secure"}))
    # every site paid for the sums it took part in; nothing came back to anyone
    for site_id in fed.site_ids:
        assert len(charged_events(fed, site_id)) == 3
    # without the hostile site the same jobs run: honest sums pass the check
    fed.stop(HOSTILE)
    with fed.analyst() as coord:
        for spec in (JobSpec("pca", 50.0, 1e-5, {"n_components": 2, "aggregation": "secure"}),
                     JobSpec("query", 5.0, 1e-5, {"domain": {"columns": ["ward"]},
                                                  "aggregation": "secure"})):
            job = coord.submit(spec)
            assert job.state == "succeeded", job.error
