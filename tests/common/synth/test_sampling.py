"""The sampling path: exact decoding of float32 latents, parallel chunks, same distribution.

Layers: the decoders against the previous (float64, per-row argmax/searchsorted)
implementations, exactly, on random and on adversarial boundary values -- with a naive float32
threshold rounding that the boundary test must catch; the ordered thread map; chunk streams that
do not depend on the number of threads; and the distribution of the rows against the previous
sampler (one generator stream, float64 decoding) on a fixed model, with a deliberately broken
decoder that the same comparison must reject.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from scipy import special

from dpfed.common.data.encoding import EncodedTable
from dpfed.common.data.schema import ContinuousColumn, NominalColumn, OrdinalColumn, Schema
from dpfed.common.errors import ValidationError
from dpfed.common.privacy.rng import derived_rng
from dpfed.common.synth.generative import FactorModel, in_order, iter_samples
from dpfed.common.synth.links import (
    ContinuousLink,
    LatentLinks,
    NominalLink,
    OrdinalLink,
    ceil_float32,
)
from dpfed.common.synth.quantile_link import _DECODE_STEP as _GRID_STEP
from dpfed.common.synth.quantile_link import _GRID_LO, QuantileLink

LEVELS = tuple(f"l{i}" for i in range(20))  # 19 thresholds: the binary-search path
SCHEMA = Schema((
    ContinuousColumn("skewed", 0.0, 60.0), ContinuousColumn("plain", -5.0, 5.0),
    ContinuousColumn("ident", 10.0, 20.0), OrdinalColumn("grade", ("1", "2", "3", "4")),
    OrdinalColumn("many", LEVELS), NominalColumn("ward", ("a", "b", "c", "d", "e")),
    NominalColumn("sex", ("f", "m")),
))


def make_links() -> LatentLinks:
    rng = np.random.default_rng(11)
    links = (
        QuantileLink(SCHEMA.columns[0], proportions=rng.dirichlet(np.full(24, 0.5))),
        QuantileLink(SCHEMA.columns[1], proportions=rng.dirichlet(np.ones(16))),
        ContinuousLink(SCHEMA.columns[2], 0.1, 0.4, True),
        OrdinalLink(SCHEMA.columns[3], np.array([0.5, 0.3, 0.15, 0.05])),  # type: ignore[arg-type]
        OrdinalLink(SCHEMA.columns[4], rng.dirichlet(np.ones(20))),  # type: ignore[arg-type]
        NominalLink(SCHEMA.columns[5], np.array([0.1, 0.4, 0.2, 0.2, 0.1])),  # type: ignore[arg-type]
        NominalLink(SCHEMA.columns[6], np.array([0.45, 0.55])),  # type: ignore[arg-type]
    )
    return LatentLinks(SCHEMA, links)


def make_model(links: LatentLinks) -> FactorModel:
    p = links.dim
    rng = np.random.default_rng(12)
    q, _ = np.linalg.qr(rng.standard_normal((p, 3)))
    return FactorModel(q, np.array([0.5, 0.3, 0.1]), 0.02, np.full(p, 2.0))


# --------------------------------------------------------------------------- the previous decoders


def old_quantile(link: QuantileLink, latent: np.ndarray) -> np.ndarray:
    """Exact decoding through the cells: ``u = Phi(z)``, its cell, its position (reference)."""
    cells = link.layout
    u = special.ndtr(np.clip(latent[:, 0], _GRID_LO, -_GRID_LO))
    leaf = np.clip(np.searchsorted(link.cdf, u, side="right") - 1, 0, link.n_bins - 1)
    return cells.values(leaf, (u - link.cdf[leaf]) / link.proportions[leaf])


def old_identity(link: ContinuousLink, latent: np.ndarray) -> np.ndarray:
    col = link.column
    y = latent[:, 0] * (col.half_range * link.sd) + (col.center + col.half_range * link.mean)
    return np.asarray(np.clip(y, col.min, col.max))


def old_ordinal(link: OrdinalLink, latent: np.ndarray) -> np.ndarray:
    return np.searchsorted(link.thresholds, latent[:, 0], side="right").astype(np.int32)


def old_nominal(link: NominalLink, latent: np.ndarray) -> np.ndarray:
    u = latent + link.locations[None, :]
    best = np.argmax(u, axis=1)
    top = np.take_along_axis(u, best[:, None], axis=1)[:, 0]
    return np.asarray(np.where(top > 0.0, best + 1, 0).astype(np.int32))


def old_from_latent(links: LatentLinks, latent: np.ndarray) -> dict[str, np.ndarray]:
    x = np.asarray(latent, dtype=np.float64)
    out = {}
    for link, a, b in zip(links.links, links.offsets[:-1], links.offsets[1:], strict=True):
        block = x[:, a:b]
        if isinstance(link, QuantileLink):
            out[link.column.name] = old_quantile(link, block)
        elif isinstance(link, ContinuousLink):
            out[link.column.name] = old_identity(link, block)
        elif isinstance(link, OrdinalLink):
            out[link.column.name] = old_ordinal(link, block)
        else:
            out[link.column.name] = old_nominal(link, block)
    return out


def boundary_latent(links: LatentLinks, n_random: int, dtype: type) -> np.ndarray:
    """Random rows plus rows sitting on every decision boundary (and one float32 step off)."""
    rng = np.random.default_rng(13)
    x = (rng.standard_normal((n_random, links.dim)) * 2.0).astype(dtype)
    extra = []
    for link, a, b in zip(links.links, links.offsets[:-1], links.offsets[1:], strict=True):
        if isinstance(link, OrdinalLink):
            t32 = link.thresholds.astype(np.float32)
            for v in np.concatenate([t32, np.nextafter(t32, np.float32(np.inf)),
                                     np.nextafter(t32, np.float32(-np.inf))]):
                row = np.zeros(links.dim, dtype=dtype)
                row[a] = v
                extra.append(row)
        elif isinstance(link, NominalLink):
            m = link.locations.astype(dtype)
            for k in range(b - a):
                row = np.zeros(links.dim, dtype=dtype)
                row[a:b] = -m  # every u_k = 0: the "all <= 0" boundary, and ties
                extra.append(row.copy())
                row[a + k] = np.nextafter(row[a + k], dtype(np.inf))
                extra.append(row.copy())
                row[a:b] = 1.0 - m  # ties at a positive maximum: the first coordinate wins
                extra.append(row.copy())
        elif isinstance(link, QuantileLink):
            for v in (_GRID_LO, _GRID_LO + _GRID_STEP, 0.0, 8.5, -40.0, 40.0):
                row = np.zeros(links.dim, dtype=dtype)
                row[a] = v
                extra.append(row)
    return np.asfortranarray(np.vstack([x, np.array(extra, dtype=dtype)]))


# --------------------------------------------------------------------------- exact decoding


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decoding_equals_the_exact_decode(dtype: type) -> None:
    links = make_links()
    x = boundary_latent(links, 20_000, dtype)
    new = links.from_latent(x)
    old = old_from_latent(links, x)
    for link in links.links:
        col = link.column
        got = new.columns[col.name]
        assert got.dtype == (np.float64 if isinstance(col, ContinuousColumn) else np.int32)
        if isinstance(link, QuantileLink):
            # One table lookup and a linear interpolation in z: within a hair of the exact
            # decode (the grid's step is far below any cell's probability).
            np.testing.assert_allclose(got, old[col.name], rtol=0.0,
                                       atol=1e-6 * (col.max - col.min), err_msg=col.name)
        else:
            np.testing.assert_array_equal(got, old[col.name], err_msg=col.name)


def test_float32_thresholds_decide_like_float64_and_naive_rounding_does_not() -> None:
    links = make_links()
    x = boundary_latent(links, 0, np.float32)
    for link, a in zip(links.links, links.offsets, strict=False):
        if not isinstance(link, OrdinalLink):
            continue
        block = x[:, a:a + 1]
        exact = old_ordinal(link, block.astype(np.float64))
        np.testing.assert_array_equal(link.inverse(block), exact)
        # The broken copy: thresholds rounded to the nearest float32 decide some boundary
        # rows differently, and the boundary rows above are there to catch exactly that.
        naive = np.searchsorted(link.thresholds.astype(np.float32), block[:, 0],
                                side="right").astype(np.int32)
        assert np.any(naive != exact), link.column.name


def test_ceil_float32_is_the_smallest_float32_not_below() -> None:
    v = np.random.default_rng(14).standard_normal(10_000) * 3.0
    c = ceil_float32(v)
    assert c.dtype == np.float32
    assert np.all(c.astype(np.float64) >= v)
    assert np.all(np.nextafter(c, np.float32(-np.inf)).astype(np.float64) < v)


def test_from_latent_still_rejects_bad_latents() -> None:
    links = make_links()
    with pytest.raises(ValidationError, match="shape"):
        links.from_latent(np.zeros((3, links.dim + 1), dtype=np.float32))
    bad = np.zeros((4, links.dim), dtype=np.float32)
    bad[2, 3] = np.inf
    with pytest.raises(ValidationError, match="finite"):
        links.from_latent(bad)


# --------------------------------------------------------------------------- threads


def test_in_order_keeps_order_bounds_look_ahead_and_raises() -> None:
    started: list[int] = []
    lock = threading.Lock()

    def slow(i: int) -> int:
        with lock:
            started.append(i)
        time.sleep(0.002 * (i % 3))
        return i * i

    out = []
    for r in in_order(slow, range(40), workers=3):
        with lock:
            assert len(started) <= len(out) + 1 + 3 + 1  # yielded + this one + look-ahead
        out.append(r)
    assert out == [i * i for i in range(40)]
    assert list(in_order(slow, range(5), workers=0)) == [0, 1, 4, 9, 16]
    assert list(in_order(slow, range(5), workers=1)) == [0, 1, 4, 9, 16]

    def boom(i: int) -> int:
        if i == 7:
            raise ValueError("chunk 7")
        return i

    with pytest.raises(ValueError, match="chunk 7"):
        list(in_order(boom, range(20), workers=2))
    consumed = in_order(slow, iter(range(10**9)), workers=2)  # closing it stops the work
    assert [next(consumed) for _ in range(3)] == [0, 1, 4]
    consumed.close()


def test_rows_do_not_depend_on_the_number_of_threads() -> None:
    links = make_links()
    fm = make_model(links)

    def draw(workers: int, seed: int) -> EncodedTable:
        return EncodedTable.concatenate(list(iter_samples(
            fm, links, 10_001, np.random.default_rng(seed), 1000, workers=workers)))

    one, three = draw(0, 5), draw(3, 5)
    other = draw(3, 6)
    for col in SCHEMA.names:
        np.testing.assert_array_equal(one.columns[col], three.columns[col])
    assert not np.array_equal(one.columns["skewed"], other.columns["skewed"])
    # Every chunk has its own stream: no two chunks repeat each other.
    chunks = one.columns["skewed"][:10_000].reshape(10, 1000)
    assert len({c.tobytes() for c in chunks}) == 10
    with pytest.raises(ValidationError, match="workers"):
        next(iter_samples(fm, links, 10, np.random.default_rng(0), workers=-1))


def test_derived_generators_are_deterministic_and_distinct() -> None:
    a, b = np.random.default_rng(1), np.random.default_rng(1)
    x = [derived_rng(a).random(4) for _ in range(3)]
    y = [derived_rng(b).random(4) for _ in range(3)]
    np.testing.assert_array_equal(x, y)
    assert len({v.tobytes() for v in x}) == 3
    with pytest.raises(ValidationError):
        derived_rng("seed")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- same distribution


def previous_sampler(fm: FactorModel, links: LatentLinks, n: int,
                     rng: np.random.Generator, chunk: int) -> dict[str, np.ndarray]:
    """The sampler before this change: one generator stream, float64 decoding per chunk."""
    parts = [old_from_latent(links, fm.latent(min(chunk, n - s), rng))
             for s in range(0, n, chunk)]
    return {c: np.concatenate([p[c] for p in parts]) for c in SCHEMA.names}


def _codes(columns: dict[str, np.ndarray] | EncodedTable) -> np.ndarray:
    """Columns as small integer codes: continuous ones on 10 equal-width bins."""
    cols = columns.columns if isinstance(columns, EncodedTable) else columns
    out = []
    for col in SCHEMA.columns:
        v = cols[col.name]
        if isinstance(col, ContinuousColumn):
            v = np.clip(((v - col.min) / (col.max - col.min) * 10).astype(int), 0, 9)
        out.append(np.asarray(v, dtype=np.int64))
    return np.column_stack(out)


def distribution_gap(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(largest 1-way TVD over the columns, largest |difference| of the code correlations)."""
    tvd = 0.0
    for j in range(a.shape[1]):
        size = int(max(a[:, j].max(), b[:, j].max())) + 1
        pa = np.bincount(a[:, j], minlength=size) / a.shape[0]
        pb = np.bincount(b[:, j], minlength=size) / b.shape[0]
        tvd = max(tvd, 0.5 * float(np.abs(pa - pb).sum()))
    corr = float(np.abs(np.corrcoef(a.T) - np.corrcoef(b.T)).max())
    return tvd, corr


def test_rows_have_the_distribution_of_the_previous_sampler() -> None:
    links = make_links()
    fm = make_model(links)
    n = 200_000
    before = _codes(previous_sampler(fm, links, n, np.random.default_rng(21), 65536))
    after = _codes(EncodedTable.concatenate(list(iter_samples(
        fm, links, n, np.random.default_rng(22), 65536, workers=2))))
    tvd, corr = distribution_gap(before, after)
    # Sampling error at n = 200 000: TVD ~ 0.003, correlations ~ 0.005.
    assert tvd < 0.012 and corr < 0.02, (tvd, corr)
    # A broken decoder (the nominal locations shifted by 0.2) must fail the same check.
    ward = links.links[5]
    assert isinstance(ward, NominalLink)
    broken = LatentLinks(SCHEMA, links.links[:5] + (NominalLink(
        ward.column, np.array([0.16, 0.37, 0.19, 0.18, 0.10])),) + links.links[6:])
    wrong = _codes(EncodedTable.concatenate(list(iter_samples(
        fm, broken, n, np.random.default_rng(23), 65536, workers=2))))
    tvd_b, _ = distribution_gap(before, wrong)
    assert tvd_b > 0.03, tvd_b
