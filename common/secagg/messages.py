"""How secure-round data travels in generic task parameters and named arrays.

Both sides use these helpers: the coordinator to relay signed keys and the public plan, the
site to read them back. Byte strings travel as uint8 arrays named ``<field>/<site id>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dpfed.common.errors import ValidationError
from dpfed.common.privacy.polya import DLaplaceCalibration, polya_shape
from dpfed.common.secagg.keys import SignedKey
from dpfed.common.secagg.secure_sum import SecureSumPlan

__all__ = ["MAX_PARTICIPANTS", "as_array", "as_bytes", "check_plan_noise", "plan_params",
           "signed_key_arrays", "signed_key_from_arrays"]

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
    """Return the public part of a plan a task carries (each site recomputes the rest).

    A discrete Laplace plan also states its noise: ``alpha`` and each share's Pólya shape
    ``r = 1/(n - t - d)``, which every site recomputes and compares
    (:func:`check_plan_noise`); a Skellam plan's task is unchanged.
    """
    out = {"statistic": plan.statistic, "scale": plan.scale, "row_norm": row_norm,
           "participants": list(plan.participants), "tolerated": plan.tolerated,
           "dropouts": plan.dropouts}
    return {**out, **_noise_params(plan)}


def _noise_params(plan: SecureSumPlan) -> dict[str, Any]:
    cal = plan.calibration
    if not isinstance(cal, DLaplaceCalibration):
        return {}
    return {"noise": plan.noise, "alpha": cal.alpha,
            "polya_shape": polya_shape(len(plan.participants), plan.tolerated, plan.dropouts)}


def check_plan_noise(plan: SecureSumPlan, params: Mapping[str, Any]) -> None:
    """Refuse a task whose stated noise is not the one this site computed for its plan.

    The site's ``plan`` comes from public inputs only (its own calibration); the task must
    state exactly its noise, ``alpha`` and Pólya shape (or nothing of them, for Skellam).

    Raises
    ------
    ValidationError
        Naming the field that differs.
    """
    stated = {k: params[k] for k in ("noise", "alpha", "polya_shape") if k in params}
    own = _noise_params(plan)
    for key in sorted(set(stated) | set(own)):
        if stated.get(key) != own.get(key):
            raise ValidationError(f"secure round refused: the task states {key} = "
                                  f"{stated.get(key)!r}, this site computes {own.get(key)!r} "
                                  "from the public plan")
