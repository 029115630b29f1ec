"""Size checks for ``.npy`` / ``.npz`` files from elsewhere, made before numpy loads them.

``np.load`` allocates what a file's headers announce: an ``.npz`` member's ``.npy`` header
names its shape and dtype, and a deflated member of a few MiB can expand to gigabytes (a
2 MiB model file with a 2 GiB member made ``dpfed synth-sample`` take 2.2 GB). These checks
read only the zip directory and each member's ``.npy`` header, and refuse a file whose
members announce more than a limit, expand more than :data:`MAX_EXPANSION` times their
compressed size, or whose header claims more data than its member holds.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
from typing import IO

import numpy as np

from dpfed.common.errors import ValidationError

__all__ = ["MAX_EXPANSION", "check_npy_header", "check_npz"]

#: Largest ratio of a deflated member's size to its compressed size (dpfed writes its files
#: uncompressed; noisy arrays compress far less than this, zip bombs far more).
MAX_EXPANSION = 100
#: Members up to this size are exempt from the ratio (small constant arrays compress well).
_RATIO_SLACK = 1 << 20


def check_npy_header(fp: IO[bytes], where: str, max_bytes: int) -> int:
    """Read an ``.npy`` header from ``fp``; return the data size it announces, in bytes.

    Raises
    ------
    ValidationError
        Not an ``.npy`` header, an object dtype, or more than ``max_bytes`` of data.
    """
    try:
        version = np.lib.format.read_magic(fp)
        reader = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                  else np.lib.format.read_array_header_2_0)
        shape, _fortran, dtype = reader(fp)
    except (ValueError, OSError, EOFError) as exc:
        raise ValidationError(f"{where} is not a numpy array: {exc}") from None
    if dtype.hasobject:
        raise ValidationError(f"{where} holds Python objects; only numeric arrays are read")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > max_bytes:
        raise ValidationError(f"{where} announces {nbytes:,} bytes of data; at most "
                              f"{max_bytes:,} are read")
    return nbytes


def check_npz(source: bytes | str | os.PathLike[str], *, max_bytes: int,
              what: str = "the file") -> None:
    """Refuse an ``.npz`` whose members would expand past ``max_bytes`` in all.

    Checks, from the zip directory and the ``.npy`` headers only: the total declared size,
    each deflated member's expansion ratio, and that no header announces more data than its
    member holds.

    Raises
    ------
    ValidationError
        Naming the member and the limit it breaks (or that the file is not a zip at all).
    """
    raw: IO[bytes] | str | os.PathLike[str] = (io.BytesIO(source) if isinstance(source, bytes)
                                              else source)
    try:
        with zipfile.ZipFile(raw) as archive:
            infos = archive.infolist()
            for info in infos:
                if (info.compress_type != zipfile.ZIP_STORED
                        and info.file_size > _RATIO_SLACK
                        and info.file_size > MAX_EXPANSION * max(1, info.compress_size)):
                    raise ValidationError(
                        f"{what}: member {info.filename!r} expands from "
                        f"{info.compress_size:,} to {info.file_size:,} bytes (more than "
                        f"{MAX_EXPANSION} times); refused")
            total = sum(i.file_size for i in infos)
            if total > max_bytes:
                raise ValidationError(f"{what} expands to {total:,} bytes; at most "
                                      f"{max_bytes:,} are read")
            for info in infos:
                where = f"{what}: member {info.filename!r}"
                if info.filename.endswith(".npy"):
                    with archive.open(info) as member:
                        check_npy_header(member, where, info.file_size)
    except zipfile.BadZipFile as exc:
        raise ValidationError(f"{what} is not an .npz archive: {exc}") from None
    except OSError as exc:
        raise ValidationError(f"{what} cannot be read: {exc}") from None
