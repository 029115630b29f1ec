"""Secure aggregation end to end with real processes over mTLS: the secure PCA matches the pooled
data, every message the coordinator received (read back from the sites' ledgers, which store
exactly the released bytes) looks uniform on its own while their sum decodes correctly, and a
site that fails between the key exchange and its contribution leads to a clean retry."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpfed.aggregator.local_federation import LocalFederation
from dpfed.aggregator.simulate import pooled_reference
from dpfed.common.data.schema import Schema
from dpfed.common.pca.dppca import captured_energy, top_components
from dpfed.common.pca.features import max_feature_norm
from dpfed.common.secagg.masking import sum_masked
from tests.e2e.federations import released_results, ring_uniformity_p, roomy_settings, running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation.create(
        tmp_path / "fed", n_sites=3, rows=1500, features=6, seed=5, min_sites=2,
        task_deadline_s=30, resume_wait_s=10,
        settings=roomy_settings())
    yield from running(federation)


def test_secure_pca_matches_the_pooled_data_and_the_coordinator_sees_only_noise(
        fed: LocalFederation) -> None:
    schema = Schema.load(fed.schema_path)
    paths = list(fed.data_paths.values())
    with fed.analyst() as coord:
        # every site advertises its policy (dpfed sites shows it)
        assert {s.secure_policy for s in coord.sites()} == {"allowed, min 2 sites, t=1"}
        centred = coord.pca(3, epsilon=1000.0, delta=1e-5, aggregation="secure",
                            clip_norm="schema")
        uncentred = coord.pca(3, epsilon=1000.0, delta=1e-5, aggregation="secure",
                              centering="none", clip_norm="schema")
        auto = coord.pca(3, epsilon=1000.0, delta=1e-5, aggregation="secure")  # the default
    assert [r["round"] for r in auto.metadata["rounds"]] == ["norms", "mean", "pca"]
    assert auto.metadata["clip_norm"] < max_feature_norm(schema)  # a radius the rows have
    for result, is_centred in ((centred, True), (uncentred, False), (auto, True)):
        reference = pooled_reference(schema, paths, centred=is_centred).matrix
        exact = top_components(reference, 3)
        assert captured_energy(result.components_, reference) / captured_energy(
            exact, reference) > 0.999
    spread = np.array([c.half_range for c in schema.columns])
    np.testing.assert_allclose(centred.mean_, pooled_mean(schema, paths), atol=0.01 * spread.max())
    secure = uncentred.metadata["secure"]
    assert secure["participants"] == fed.site_ids and secure["tolerated_colluders"] == 1
    masked = {}
    for site in fed.site_ids:
        released = released_results(fed, site)
        # one charge per secure sum: the centred job's mean and Gram, the uncentred Gram,
        # the auto job's norm histogram, mean and Gram
        assert [r.spend.mechanism for r in released] == ["secure-skellam[n=3,t=1]"] * 6
        masked[site] = released[2].arrays["masked"]
        # What the coordinator received from this site, alone, is uniform in the ring.
        p_value = ring_uniformity_p(masked[site])
        assert p_value > 1e-4, (site, p_value)
    # ...and even their sum is uniform: each carries its site's self-mask, which the
    # coordinator only rebuilds from the survivors' revealed shares (the result above shows
    # it did); the messages alone give nothing.
    summed = sum_masked(list(masked.values()))
    assert np.max(np.abs(summed.view(np.int64).astype(np.float64))) > 2.0 ** 40


def pooled_mean(schema: Schema, paths: list[Path]) -> np.ndarray:
    """The raw pooled mean of the demo data's (continuous) columns."""
    frame = pd.concat([pd.read_csv(p) for p in paths])
    return frame[list(schema.names)].to_numpy(dtype=np.float64).mean(axis=0)


def test_a_site_failing_after_the_key_exchange_leads_to_a_clean_retry(
        fed: LocalFederation) -> None:
    # hospital-3 answers the key exchange (no data read) but can no longer read its table when
    # the contribution is due: its masks cannot cancel, so the attempt is dropped.
    fed.data_paths["hospital-3"].write_text("not,the,schema\n1,2,3\n")
    with fed.analyst() as coord:
        events: list[str] = []
        # one secure round (no auto clip radius first): its attempts are the job's
        result = coord.pca(2, epsilon=1000.0, delta=1e-5, aggregation="secure", min_sites=2,
                           centering="none", clip_norm="schema",
                           on_event=lambda e: events.append(e.message))
    secure = result.metadata["secure"]
    assert secure["attempts"] == 2
    assert secure["participants"] == ["hospital-1", "hospital-2"]
    assert any("hospital-3 did not contribute; retrying" in m for m in events)
    # The surviving sites were charged for both attempts (conservatively); nothing was unmasked.
    assert [len(released_results(fed, s)) for s in ("hospital-1", "hospital-2")] == [2, 2]
    assert released_results(fed, "hospital-3") == []
