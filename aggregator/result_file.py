"""The result file format: an ``.npz`` with named arrays plus a JSON ``metadata`` entry.

Readable with plain numpy, no pickle: ``np.load(path, allow_pickle=False)``; the metadata is
``json.loads(str(f["metadata"]))``.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from dpfed.common.errors import ValidationError


def encode_result(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> bytes:
    """Serialize arrays and JSON metadata to ``.npz`` bytes."""
    if "metadata" in arrays:
        raise ValidationError("'metadata' is reserved in result files")
    buf = io.BytesIO()
    payload: dict[str, Any] = {k: np.asarray(v) for k, v in arrays.items()}
    payload["metadata"] = np.array(json.dumps(dict(metadata), sort_keys=True))
    np.savez(buf, **payload)
    return buf.getvalue()


def decode_result(data: bytes | str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read ``.npz`` bytes (or a path) into (arrays, metadata)."""
    source: Any = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        with np.load(source, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files if k != "metadata"}
            meta = json.loads(str(f["metadata"])) if "metadata" in f.files else {}
    except (OSError, ValueError, KeyError) as exc:
        raise ValidationError(f"not a dpfed result file: {exc}") from None
    return arrays, meta
