"""SVT sessions at a site: durable threshold noise and cut-off, replay, refusals, and the
empirical-epsilon audit on the real site path (handler + ledger + session store) with a
planted broken copy that loses the session on restart."""

from __future__ import annotations

import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from dpfed.common.data.encoding import EncodedTable, EncodingReport
from dpfed.common.jobs.contract import DataAccess, Release, Site
from dpfed.common.jobs.svt import BATCH
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.privacy.audit import audit, threshold_events
from dpfed.common.queries.svt_sessions import StoredSession, SVTSessionStore, sessions_path
from dpfed.common.queries.svt_stream import SessionState, SVTSessionParams, open_session
from dpfed.common.transport.protocol import Refusal, Task
from dpfed.common.transport.wire import result_from_bytes, result_to_bytes
from dpfed.site_agent.handlers import TaskHandler
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.runner import TaskRunner
from tests.support.schemas import AGE_WARD as SCHEMA
from tests.support.tables import FrameData


class SVTHandler(TaskHandler):
    """The svt round with a session store the test opens and re-opens (a site restart)."""

    def __init__(self, store: SVTSessionStore) -> None:
        self.store = store

    def prepare(self, task: Task, data: DataAccess) -> Release:
        return BATCH.prepare_with(task, Site(data), self.store)

class Table(FrameData):
    """A site's rows in memory (the DataAccess the rounds read), in one chunk."""

    def __init__(self, frame: pd.DataFrame) -> None:
        super().__init__(SCHEMA, frame, chunk_rows=None)
        self._encoded: list[tuple[EncodedTable, EncodingReport]] | None = None

    def iter_chunks(self) -> Iterator[tuple[EncodedTable, EncodingReport]]:
        # The rows never change: encode once (the audit runs thousands of tasks on them).
        if self._encoded is None:
            self._encoded = list(super().iter_chunks())
        return iter(self._encoded)


def table(n_icu: int, n: int = 10) -> Table:
    wards = ["icu"] * n_icu + ["general"] * (n - n_icu)
    return Table(pd.DataFrame({"age": np.linspace(10, 90, n), "ward": wards}))


def runner(path: Path, data: Table, handler: SVTHandler | None = None,
           budget: float = 1e6) -> TaskRunner:
    # basic composition: these tests are about sessions, and the audit's thousands of charges
    # need not recompose a privacy-loss distribution each time
    ledger = Ledger(path / "ledger.sqlite", BudgetPolicy(budget, 1e-3, accountant="basic"))
    handlers = {"svt": handler} if handler is not None else None
    return TaskRunner(data, ledger, ("svt",), handlers=handlers)


Q_ICU = [{"name": "icu", "where": {"column": "ward", "in_codes": [1]}}]
Q_MANY = [{"name": f"q{i}", "where": {"column": "age", "op": ">=", "value": float(v)}}
          for i, v in enumerate((0, 0, 0, 0))]


def open_task(job: str, queries: Any = Q_ICU, *, eps: float = 1.0, threshold: float = 5.0,
              cutoff: int = 1, eps3: float | None = None) -> Task:
    params: dict[str, Any] = {"session": job, "action": "open", "queries": queries,
                              "threshold": threshold, "cutoff": cutoff}
    if eps3 is not None:
        params["numeric_epsilon"] = eps3
    return Task(f"{job}/svt", job, "svt", eps, 0.0, params)


def batch_task(session: str, job: str, queries: Any = Q_ICU, eps: float = 1.0) -> Task:
    return Task(f"{job}/svt", job, "svt", eps, 0.0,
                {"session": session, "action": "batch", "queries": queries})


def stored_threshold(path: Path, session: str) -> float:
    conn = sqlite3.connect(sessions_path(path / "ledger.sqlite"))
    try:
        return float(conn.execute("SELECT noisy_threshold FROM svt_sessions WHERE "
                                  "session_id = ?", (session,)).fetchone()[0])
    finally:
        conn.close()


# --------------------------------------------------------------------------- durability


def test_open_charges_once_and_continuations_charge_nothing(tmp_path: Path) -> None:
    r = runner(tmp_path, table(3))
    out = r.run(open_task("j1", Q_MANY, eps=1e4, threshold=5, cutoff=3))
    assert isinstance(out, bytes)
    res = result_from_bytes(out)
    assert res.spend.epsilon == pytest.approx(1e4)
    # 10 rows all have age >= 0: every count is 10 >= 5; cut-off 3 stops after three.
    assert res.arrays["above"].tolist() == [1, 1, 1]
    assert res.metadata["halted"] is True
    assert len(r.ledger.events()) == 1
    nxt = result_from_bytes(r.run(batch_task("j1", "j2", Q_MANY)))  # type: ignore[arg-type]
    assert nxt.arrays["above"].size == 0 and nxt.spend.epsilon == 0.0
    assert len(r.ledger.events()) == 1


def test_restart_keeps_threshold_noise_and_cutoff(tmp_path: Path) -> None:
    data = table(3)
    r = runner(tmp_path, data)
    # Count 10 against T = 5 at huge epsilon: "above". c = 2: one positive left after batch 1.
    first = result_from_bytes(r.run(open_task("s", Q_MANY[:1], eps=1e4,  # type: ignore[arg-type]
                                              threshold=5, cutoff=2)))
    assert first.arrays["above"].tolist() == [1]
    noisy = stored_threshold(tmp_path, "s")
    r.ledger.close()
    r2 = runner(tmp_path, data)  # a restarted site: new objects on the same files
    second = result_from_bytes(r2.run(batch_task("s", "b2", Q_MANY)))  # type: ignore[arg-type]
    assert second.arrays["above"].tolist() == [1]  # the cut-off carried over: one more only
    assert second.metadata["n_positives_total"] == 2 and second.metadata["halted"] is True
    assert stored_threshold(tmp_path, "s") == noisy
    # A retried batch replays the same transcript (same bytes), also after a restart.
    r2.ledger.close()
    r3 = runner(tmp_path, data)
    again = r3.run(batch_task("s", "b2", Q_MANY))
    assert isinstance(again, bytes)
    assert again == result_to_bytes(second)


def test_retried_batch_returns_identical_bytes(tmp_path: Path) -> None:
    r = runner(tmp_path, table(5))
    r.run(open_task("s", eps=0.5))
    a = r.run(batch_task("s", "b", Q_ICU))
    b = r.run(batch_task("s", "b", Q_ICU))
    assert isinstance(a, bytes) and a == b
    other = r.run(batch_task("s", "b", Q_MANY))  # same task id, other payload
    assert isinstance(other, Refusal) and other.code == "conflict"


def test_open_retry_after_crash_reuses_the_session(tmp_path: Path) -> None:
    # The session row committed but the ledger charge did not (a crash in between): the
    # retried opening task must reuse the threshold noise, not redraw it.
    store = SVTSessionStore(sessions_path(tmp_path / "ledger.sqlite"))
    sp = SVTSessionParams(5.0, 1, 1.0)
    store.open_session("s", "s/svt", {**sp.to_mapping(), "epsilon": 1.0},
                       lambda: SessionState(123.0))
    r = runner(tmp_path, table(5))
    out = r.run(open_task("s", eps=1.0, threshold=5.0))
    assert isinstance(out, bytes)
    assert stored_threshold(tmp_path, "s") == 123.0
    assert len(r.ledger.events()) == 1


def test_refusals(tmp_path: Path) -> None:
    r = runner(tmp_path, table(5), budget=1.0)
    unknown = r.run(batch_task("nope", "b"))
    assert isinstance(unknown, Refusal) and "no SVT session" in unknown.reason
    over = r.run(open_task("big", eps=2.0))
    assert isinstance(over, Refusal) and over.code == "budget_exceeded"
    assert not sessions_path(tmp_path / "ledger.sqlite").exists() or (
        SVTSessionStore(sessions_path(tmp_path / "ledger.sqlite")).get("big") is None)
    bad = r.run(open_task("c0", cutoff=0))
    assert isinstance(bad, Refusal) and "cutoff" in bad.reason
    # A session row without the ledger's opening charge is never continued.
    store = SVTSessionStore(sessions_path(tmp_path / "ledger.sqlite"))
    store.open_session("ghost", "ghost/svt", {"threshold": 1.0, "cutoff": 1, "monotonic": False,
                                              "epsilon": 1.0}, lambda: SessionState(1.0))
    ghost = r.run(batch_task("ghost", "g2"))
    assert isinstance(ghost, Refusal) and "never charged" in ghost.reason
    # Closing: later batches are refused.
    r2 = r
    assert isinstance(r2.run(open_task("ok", eps=0.5)), bytes)
    close = Task("cl/svt", "cl", "svt", 0.5, 0.0, {"session": "ok", "action": "close"})
    assert isinstance(r2.run(close), bytes)
    after = r2.run(batch_task("ok", "late"))
    assert isinstance(after, Refusal) and "closed" in after.reason
    mono = r2.run(Task("m/svt", "m", "svt", 0.1, 0.0, {
        "session": "m", "action": "open", "threshold": 1, "cutoff": 1, "monotonic": True,
        "queries": [{"name": "a", "where": {"column": "ward", "in_codes": [0]}},
                    {"name": "b", "where": {"column": "ward", "in_codes": [1]}}]}))
    assert isinstance(mono, Refusal) and "one" in mono.reason and "direction" in mono.reason


# --------------------------------------------------------------------------- audit

B = 12          # batches per session, the site restarted before each continuation
EPS = 1.0       # the session's claimed epsilon (transcript + values)
EPS3 = 0.9      # of which the values of positive answers
N_AUDIT = 250   # sessions per neighbour


class ForgetfulStore(SVTSessionStore):
    """Planted bug: session state kept in memory only; a restarted site that meets a session
    it no longer knows re-creates it (threshold noise redrawn, positives reset to 0)."""

    def __init__(self, path: Path, memory: dict[str, StoredSession]) -> None:
        super().__init__(path)
        self.memory = memory

    def get(self, session_id: str) -> StoredSession | None:
        found = super().get(session_id)
        if found is not None and session_id not in self.memory:
            sp = SVTSessionParams(**found.params)
            state = open_session(sp, np.random.default_rng())
            with self._connection() as conn:
                conn.execute("UPDATE svt_sessions SET noisy_threshold = ?, n_positives = 0 "
                             "WHERE session_id = ?", (state.noisy_threshold, session_id))
            found = super().get(session_id)
        if found is not None:
            self.memory[session_id] = found
        return found


def site_sampler(root: Path, broken: bool) -> Any:
    """n sessions through the real site path (runner, ledger, SVT handler, session store),
    the session store re-opened from disk before every continuation (a restart).

    Each session opens with one count at T far below it ("above" bar ~e^-30; c = 1)
    and pays eps3 for its value; the analyst then sends the same query B - 1 more times.
    Output: the mean of the released values (one value for a correct site, which has
    halted; up to B for a site that forgot its cut-off -- an averaging attack).
    """
    datasets = {0: table(5), 1: table(6)}  # replace-one: one general row becomes icu
    counter = [0]

    def sample(x: Any, n: int, rng: np.random.Generator) -> np.ndarray:
        del rng  # the site draws its own production noise, as in deployment
        out = np.zeros(n)
        data = datasets[int(x)]
        path = root / f"d{int(x)}"
        path.mkdir(parents=True, exist_ok=True)
        memory: dict[str, StoredSession] = {}
        store_path = sessions_path(path / "ledger.sqlite")
        stores: list[SVTSessionStore] = []

        def restarted() -> SVTHandler:
            for st in stores:
                st.close()
            stores.clear()
            memory.clear()  # a restart loses whatever was only in memory
            stores.append(ForgetfulStore(store_path, memory) if broken else
                          SVTSessionStore(store_path))
            return SVTHandler(stores[0])

        r = runner(path, data, restarted())
        for i in range(n):
            counter[0] += 1
            sid = f"x{counter[0]}"
            first = r.run(open_task(sid, eps=EPS, threshold=-1000.0, cutoff=1, eps3=EPS3))
            assert isinstance(first, bytes)
            values = list(result_from_bytes(first).arrays["values"])
            for b in range(1, B):
                r.handlers["svt"] = restarted()
                res = r.run(batch_task(sid, f"{sid}-{b}"))
                assert isinstance(res, bytes), res
                values += list(result_from_bytes(res).arrays.get("values", np.zeros(0)))
            out[i] = float(np.mean(values)) if values else np.nan  # no positive at all
        r.ledger.close()
        return out

    return sample


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_federated_svt_audit_passes_and_flags_a_session_lost_on_restart(tmp_path: Path) -> None:
    # ~12000 durable SQLite commits: on a RAM disk when there is one (fsync is the cost).
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else tmp_path) as tmp:
        root = Path(tmp)
        events = threshold_events(np.linspace(2.0, 9.0, 29))  # around the counts 5 and 6
        good = audit(site_sampler(root / "good", broken=False), (0, 1), events,
                     n_samples=N_AUDIT, rng=np.random.default_rng(0))
        bad = audit(site_sampler(root / "bad", broken=True), (0, 1), events,
                    n_samples=N_AUDIT, rng=np.random.default_rng(0))
    print(f"\nSVT restart audit: epsilon lower bound {good.epsilon_lcb:.3f} (correct site), "
          f"{bad.epsilon_lcb:.3f} (forgetful store); claimed {EPS}")
    assert good.epsilon_lcb <= EPS * 1.05, good.epsilon_lcb
    assert bad.epsilon_lcb >= 1.3 * EPS, bad.epsilon_lcb
