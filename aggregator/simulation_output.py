"""The output directory of ``dpfed simulate`` (every job kind) and its progress lines."""

from __future__ import annotations

import shutil
from pathlib import Path

from dpfed.common.errors import ConfigError


def say(step: str, text: str) -> None:
    """Print one progress line of a simulation."""
    print(f"[simulate] {step:<12} {text}", flush=True)


MARKER = ".dpfed-simulation"


def prepare_output(out: Path) -> None:
    """Create ``out``, or empty it if it holds an earlier simulation (never anything else).

    A fresh directory each run keeps a demo from inheriting the previous run's spent budget.
    """
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise ConfigError(f"--out {out} exists and is not an earlier dpfed simulation; "
                              "choose an empty or new directory")
        say("output", f"replacing the earlier simulation in {out}")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by dpfed simulate; the directory is replaced on re-run\n")
