"""The result file format: an ``.npz`` with named arrays plus a JSON ``metadata`` entry.

Readable with plain numpy, no pickle: ``np.load(path, allow_pickle=False)``; the metadata is
``json.loads(str(f["metadata"]))``. Reading checks the members' sizes first (a result file may
come from anywhere: ``dpfed synth-sample MODEL``, ``dpfed report FILE``).
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from dpfed.common.array_files import check_npz
from dpfed.common.errors import ValidationError
from dpfed.common.transport.grpc_options import MAX_TRANSFER_BYTES


def encode_result(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> bytes:
    """Serialize arrays and JSON metadata to ``.npz`` bytes."""
    if "metadata" in arrays:
        raise ValidationError("'metadata' is reserved in result files")
    buf = io.BytesIO()
    payload: dict[str, Any] = {k: np.asarray(v) for k, v in arrays.items()}
    payload["metadata"] = np.array(json.dumps(dict(metadata), sort_keys=True))
    np.savez(buf, **payload)
    return buf.getvalue()


#: Largest result file read (its members' total size): the most the coordinator sends.
MAX_RESULT_BYTES = MAX_TRANSFER_BYTES


def decode_result(data: bytes | str, *,
                  max_bytes: int = MAX_RESULT_BYTES) -> tuple[dict[str, np.ndarray],
                                                               dict[str, Any]]:
    """Read ``.npz`` bytes (or a path) into (arrays, metadata).

    The members' sizes are checked from the zip directory and their ``.npy`` headers before
    anything is loaded (:func:`dpfed.common.array_files.check_npz`): a file from elsewhere
    cannot make this allocate more than ``max_bytes``.
    """
    source: Any = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        is_zip = zipfile.is_zipfile(source)
        if isinstance(source, io.BytesIO):
            source.seek(0)
    except OSError as exc:
        raise ValidationError(f"not a dpfed result file: {exc}") from None
    if not is_zip:
        raise ValidationError("not a dpfed result file: not an .npz (zip) archive")
    check_npz(data, max_bytes=max_bytes, what=f"result file {data!r}" if isinstance(data, str)
              else "the result file")
    try:
        with np.load(source, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files if k != "metadata"}
            meta = json.loads(str(f["metadata"])) if "metadata" in f.files else {}
    except (OSError, ValueError, KeyError) as exc:
        raise ValidationError(f"not a dpfed result file: {exc}") from None
    return arrays, meta
