"""How secure-round data travels in generic task parameters and named arrays.

Both sides use these helpers: the coordinator to relay signed keys and the public plan, the
site to read them back. Byte strings travel as uint8 arrays named ``<field>/<site id>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.secagg.keys import SignedKey
from dpfed.common.secagg.secure_sum import SecureSumPlan

__all__ = ["MAX_PARTICIPANTS", "as_array", "as_bytes", "plan_params", "signed_key_arrays",
           "signed_key_from_arrays"]

_FIELDS = ("public_key", "signature", "certificate")
#: Most participants of one secure sum (bounds every list a secure task carries).
MAX_PARTICIPANTS = 1000


def as_array(raw: bytes) -> np.ndarray:
    """Return bytes as a uint8 array (how byte strings travel)."""
    return np.frombuffer(raw, dtype=np.uint8).copy()


def as_bytes(arrays: Mapping[str, np.ndarray], name: str) -> bytes:
    """Return the bytes of the uint8 array ``name`` (at most 16 KiB).

    Raises
    ------
    ValidationError
        The array is missing, not uint8 and 1-D, or too large.
    """
    arr = arrays.get(name)
    if arr is None or arr.dtype != np.uint8 or arr.ndim != 1 or arr.size > 16384:
        raise ValidationError(f"the secure round lacks a valid uint8 array {name!r}")
    return arr.tobytes()


def signed_key_arrays(signed: SignedKey) -> dict[str, np.ndarray]:
    """Return a signed key as named byte arrays."""
    return {f"public_key/{signed.site_id}": as_array(signed.public_key),
            f"signature/{signed.site_id}": as_array(signed.signature),
            f"certificate/{signed.site_id}": as_array(signed.certificate_pem)}


def signed_key_from_arrays(arrays: Mapping[str, np.ndarray], site_id: str) -> SignedKey:
    """Read one site's signed key back from named arrays."""
    pub, sig, cert = (as_bytes(arrays, f"{f}/{site_id}") for f in _FIELDS)
    return SignedKey(site_id, pub, sig, cert)


def plan_params(plan: SecureSumPlan, *, row_norm: float) -> dict[str, Any]:
    """Return the public part of a plan a task carries (each site recomputes the rest)."""
    return {"statistic": plan.statistic, "scale": plan.scale, "row_norm": row_norm,
            "participants": list(plan.participants), "tolerated": plan.tolerated,
            "dropouts": plan.dropouts}
