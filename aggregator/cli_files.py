"""Files the ``dpfed`` commands read and write: checked before anything runs.

An input file (a result, a model, a query set, a workload) that is missing is a data error
(exit 4) at once, before any connection, whatever the command (:func:`check_input_file`).
A job spends privacy budget at every site before its result comes back, so a ``--out`` that
cannot be written must be refused before the job is submitted (:func:`check_output_file`,
:func:`check_output_dir`), naming the flag. The checks make nothing: they find the nearest
folder that exists and ask whether it can take the file. If writing still fails after the
job finished (a full disk), :func:`write_result` says how to get the result again at no
privacy cost: the coordinator keeps it, and ``dpfed fetch JOB --out FILE.npz`` downloads it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from dpfed.common.errors import ConfigError, DataError

T = TypeVar("T")


def check_input_file(path: str | os.PathLike[str], flag: str, what: str) -> Path:
    """Return ``path`` if it is a readable file; raise DataError naming ``flag`` and ``what``."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{flag} {p}: no such {what} file" if not p.exists() else
                        f"{flag} {p} is not a file (expected a {what} file)")
    if not os.access(p, os.R_OK):
        raise DataError(f"{flag} {p}: this user cannot read the {what} file")
    return p


def _writable_folder(folder: Path, flag: str, path: Path) -> None:
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: this user cannot write in {existing}")


def check_output_file(path: str | os.PathLike[str], flag: str) -> Path:
    """Return ``path`` if a file can be written there; raise ConfigError naming ``flag``.

    Refused: an existing folder, a path through a file (``results.txt/pca.npz``), a folder
    this user cannot write in, an existing file this user cannot write. Missing parent
    folders are fine (the write creates them).
    """
    p = Path(path)
    if str(path) == "":
        raise ConfigError(f"{flag} is empty: give a file name")
    if p.is_dir():
        raise ConfigError(f"{flag} {p} is a folder: give a file name in it, e.g. "
                          f"{p / 'result.npz'}")
    _writable_folder(p.parent, flag, p)
    if p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(f"{flag} {p} exists and this user cannot overwrite it")
    return p


def check_output_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """Return ``path`` if it is, or can become, a folder this user writes in."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {p} is a file: give a folder")
    _writable_folder(p, flag, p)
    return p


def write_result(write: Callable[[], T], out: str | os.PathLike[str],
                 metadata: Mapping[str, Any], then: str = "") -> T:
    """Run ``write()`` (saving a finished job's result); on failure say how to recover it.

    Parameters
    ----------
    write : callable
        Writes the file at ``out``.
    out : path
        The file, for the message.
    metadata : mapping
        The result's metadata (its ``job_id``).
    then : str
        What to do with the fetched file, if it is not the output itself (synthesis: the
        model, from which ``dpfed synth-sample`` writes the table).
    """
    try:
        return write()
    except OSError as exc:
        job = metadata.get("job_id", "JOB_ID")
        raise ConfigError(
            f"job {job} finished, but {out} could not be written ({exc.strerror or exc}); "
            f"its result is kept at the coordinator and costs no budget to get again: "
            f"dpfed fetch {job} --out FILE.npz{then}") from None
