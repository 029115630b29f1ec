"""A child process that charges a ledger, for the multi-process and kill -9 ledger tests.

Run as ``python tests/site_agent/ledger_worker.py MODE DB ...`` with the repository on PYTHONPATH.
Every line it prints is flushed at once, so a parent reading the pipe sees exactly what was
printed before the process died. Modes:

``same DB TASK_ID ATTEMPTS``
    Print ``READY``, wait for a line on stdin, then call ``charge_and_release`` ATTEMPTS
    times on one task id; print ``OUT <sha256 of result> <replayed 0|1>`` per call and
    finally ``RELEASES <how many times release() ran here>``.
``spend DB PREFIX N SEED``
    Print ``READY``, wait for a line on stdin, then charge N tasks ``PREFIX-i`` with random
    epsilon in [0.05, 0.25); print ``CHARGED <task> <epsilon>`` or ``REFUSED <task> <epsilon>``.
``loop DB PREFIX SEED [--retry TASK_ID]``
    Print ``STARTING``, open the ledger, print ``READY``; first retry TASK_ID if given, then
    charge ``PREFIX-0``, ``PREFIX-1``, ... forever. ``release()`` prints ``RELEASE <task>`` and
    then sleeps or computes for a random while before drawing its noise; ``ACK <task> <sha256
    of result> <replayed 0|1>`` is printed only after ``charge_and_release`` returned (i.e.
    after the commit). :func:`loop_child` runs the same loop in a process forked by
    multiprocessing, sending the lines over a pipe instead of stdout.

The payload digest of a task is the SHA-256 of its id, so a retry resends the same payload.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from dpfed.common.errors import BudgetExceededError
from dpfed.common.privacy.accounting import BudgetPolicy, PrivacyCost
from dpfed.common.privacy.rng import production_rng
from dpfed.site_agent.ledger import Ledger

WORKER = Path(__file__).resolve()
REPO = WORKER.parents[2]


def spawn(mode: str, db: str | Path, *args: str) -> subprocess.Popen[str]:
    """Start this script as a child process (used by the tests, in the parent)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, str(WORKER), mode, str(db), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def payload_digest(task_id: str) -> str:
    return hashlib.sha256(task_id.encode()).hexdigest()


def charge(ledger: Ledger, task_id: str, epsilon: float,
           release: Callable[[], bytes]) -> tuple[bytes, bool]:
    outcome = ledger.charge_and_release(
        task_id=task_id, job_id="job-" + task_id.split("-")[0], kind="test",
        payload_digest=payload_digest(task_id), cost=PrivacyCost.pure(epsilon),
        release=release)
    return outcome.result, outcome.replayed


def run_same(ledger: Ledger, task_id: str, attempts: int) -> None:
    releases = 0

    def release() -> bytes:
        nonlocal releases
        releases += 1
        time.sleep(0.005)  # widen the window in which other processes retry
        return production_rng().normal(size=8).tobytes()

    emit("READY")
    sys.stdin.readline()
    for _ in range(attempts):
        result, replayed = charge(ledger, task_id, 0.1, release)
        emit(f"OUT {hashlib.sha256(result).hexdigest()} {int(replayed)}")
    emit(f"RELEASES {releases}")


def run_spend(ledger: Ledger, prefix: str, n: int, seed: int) -> None:
    rnd = random.Random(seed)

    def release() -> bytes:
        time.sleep(0.001)
        return production_rng().normal(size=4).tobytes()

    emit("READY")
    sys.stdin.readline()
    for i in range(n):
        task_id = f"{prefix}-{i}"
        epsilon = rnd.uniform(0.05, 0.25)
        try:
            charge(ledger, task_id, epsilon, release)
        except BudgetExceededError:
            emit(f"REFUSED {task_id} {epsilon!r}")
        else:
            emit(f"CHARGED {task_id} {epsilon!r}")


LOOP_POLICY = BudgetPolicy(1e6, 1e-5)  # the kill tests never hit the cap
LOOP_COST = 0.01  # epsilon charged per task in loop mode


def run_loop(db: str, prefix: str, seed: int, retry: str | None,
             say: Callable[[str], None]) -> None:
    """Open the ledger and charge tasks forever, reporting progress through ``say``."""
    rnd = random.Random(seed)

    def make_release(task_id: str) -> Callable[[], bytes]:
        def release() -> bytes:
            say(f"RELEASE {task_id}")
            if rnd.random() < 0.5:
                time.sleep(rnd.uniform(0.0, 0.02))  # "waiting on I/O"
            else:
                production_rng().normal(size=rnd.randint(1_000, 200_000)).sum()  # "computing"
            return production_rng().normal(size=16).tobytes()  # the noise draw
        return release

    say("STARTING")  # imports done; the ledger is opened (maybe created, or recovered) next
    ledger = Ledger(db, LOOP_POLICY, busy_timeout_s=60.0)
    say("READY")
    tasks: list[str] = [retry] if retry else []
    i = 0
    while True:
        if not tasks:
            tasks.append(f"{prefix}-{i}")
            i += 1
        task_id = tasks.pop()
        result, replayed = charge(ledger, task_id, LOOP_COST, make_release(task_id))
        # Acknowledge only now: charge_and_release has returned, so the charge is committed.
        say(f"ACK {task_id} {hashlib.sha256(result).hexdigest()} {int(replayed)}")


def loop_child(db: str, prefix: str, seed: int, retry: str | None, out: Connection) -> None:
    """Entry point of a forked child (multiprocessing): ``loop`` mode, lines sent over a pipe.

    ``Connection.send_bytes`` writes each short line to the pipe in one ``write(2)`` before it
    returns, so, as with a flushed stdout, a line the parent can read was sent before the kill.
    """
    run_loop(db, prefix, seed, retry, lambda line: out.send_bytes(line.encode()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("same", "spend", "loop"))
    parser.add_argument("db")
    parser.add_argument("args", nargs="*")
    parser.add_argument("--epsilon", type=float, default=1e6)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--retry", default=None)
    ns = parser.parse_args()
    if ns.mode == "loop":
        run_loop(ns.db, ns.args[0], int(ns.args[1]), ns.retry, emit)
        return
    ledger = Ledger(ns.db, BudgetPolicy(ns.epsilon, ns.delta, accountant="basic"),
                    busy_timeout_s=60.0)
    if ns.mode == "same":
        run_same(ledger, ns.args[0], int(ns.args[1]))
    else:
        run_spend(ledger, ns.args[0], int(ns.args[1]), int(ns.args[2]))


if __name__ == "__main__":
    main()
