"""The evaluation holdout of a synthesis job: which row positions a site keeps out of training.

When a ``synth`` job asks for a site-local evaluation, every site reserves a holdout of its
rows *before the first round*: those rows take part in no release of that job and serve only
as the "unseen" reference of the site's evaluation (distance to closest record, DP summary).

* **Size** -- :func:`holdout_size` is a public function of the site's public row count
  ``N_s`` (a fifth, at most :data:`MAX_HOLDOUT_ROWS`), so the training count
  ``N_s - holdout_size(N_s)`` is public too; it is what the site reports and what the
  coordinator uses for normalisation and size weighting.
* **Which rows** -- :func:`holdout_positions` draws a uniform subset of that size of the row
  *positions* ``0..N_s-1`` (the order in which the site's source yields its valid rows) with
  Floyd's algorithm, every random choice a keyed hash (BLAKE2b) of the loop index under a
  per-job key derived from a secret only the site holds. The choice depends on the key, the
  job id and ``N_s`` -- never on a value in the table.

Privacy
-------
Relation: replace-one at the site. For any fixed set of held-out positions, a neighbouring
table (one row replaced) either changes a held-out row -- then no training statistic moves --
or one training row, so every training round keeps the sensitivity it states for one replaced
row among ``N_s - holdout_size(N_s)`` public rows. The subset is drawn independently of the
data, so the guarantee holds for each draw and therefore for the mixture. Because the
positions are uniform and secret, which *records* are held out does not depend on their
values even when the source's order does (e.g. a query sorted by a column).
"""

from __future__ import annotations

import hashlib
import hmac

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.validation import check_int

#: Share of a site's rows held out for evaluation (before the cap).
HOLDOUT_FRACTION_DENOMINATOR = 5
#: Most rows a site holds out (the evaluation compares at most this many rows).
MAX_HOLDOUT_ROWS = 20_000
#: Length of the site's holdout secret in bytes.
KEY_BYTES = 32


def holdout_size(n_rows: int) -> int:
    """Return how many of ``n_rows`` rows a site holds out: ``min(n_rows // 5, 20 000)``.

    A public function of the public row count (so the training count is public).
    """
    n = check_int(n_rows, "n_rows", minimum=0)
    return min(n // HOLDOUT_FRACTION_DENOMINATOR, MAX_HOLDOUT_ROWS)


def training_count(n_rows: int) -> int:
    """Return the public number of training rows, ``n_rows - holdout_size(n_rows)``."""
    return int(n_rows) - holdout_size(n_rows)


def job_key(site_secret: bytes, job_id: str) -> bytes:
    """Return the per-job key ``HMAC-SHA256(site_secret, job_id)``."""
    if len(site_secret) != KEY_BYTES:
        raise ValidationError(f"the holdout secret must be {KEY_BYTES} bytes")
    return hmac.new(site_secret, job_id.encode("utf-8"), hashlib.sha256).digest()


def _keyed_below(key: bytes, index: int, bound: int) -> int:
    """Return a keyed pseudo-random integer in ``[0, bound)`` (64-bit hash, negligible bias)."""
    h = hashlib.blake2b(index.to_bytes(8, "little"), key=key, digest_size=8).digest()
    return int.from_bytes(h, "little") % bound


def holdout_positions(key: bytes, n_rows: int, size: int | None = None) -> np.ndarray:
    """Return the sorted held-out row positions (``holdout_size(n_rows)`` of ``0..n_rows-1``).

    Floyd's algorithm: a uniformly random subset of ``size`` positions, each step's random
    integer a keyed hash of the step under ``key`` (see :func:`job_key`). Deterministic for
    a (key, n_rows) pair, so every round of a job -- and a replayed or resumed one -- holds
    out the same rows; O(size) time and memory, whatever ``n_rows``.
    """
    n = check_int(n_rows, "n_rows", minimum=0)
    k = holdout_size(n) if size is None else check_int(size, "size", minimum=0, maximum=n)
    chosen: set[int] = set()
    for j in range(n - k, n):
        t = _keyed_below(key, j, j + 1)
        chosen.add(j if t in chosen else t)
    return np.array(sorted(chosen), dtype=np.int64)


def position_mask(positions: np.ndarray, start: int, length: int) -> np.ndarray:
    """Return a boolean mask of rows ``start..start+length-1`` that are in ``positions``."""
    lo, hi = np.searchsorted(positions, [start, start + length])
    mask = np.zeros(length, dtype=bool)
    mask[positions[lo:hi] - start] = True
    return mask
