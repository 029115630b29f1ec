"""The site connects before counting its rows and tells the coordinator the count after."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from dpfed import __version__
from dpfed.aggregator.config import AggregatorConfig
from dpfed.aggregator.server import start_coordinator
from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.demo_data import write_demo
from dpfed.common.data.encoding import RowPolicy
from dpfed.common.data.schema import Schema
from dpfed.common.errors import DataError
from dpfed.common.privacy.accounting import BudgetPolicy
from dpfed.common.transport.protocol import PROTOCOL_VERSION, SiteHello
from dpfed.site_agent.agent import SiteAgent
from dpfed.site_agent.ledger import Ledger
from dpfed.site_agent.row_count import CountedData
from dpfed.site_agent.runner import TaskRunner


def _demo(tmp_path: Path, rows: int) -> tuple[Path, Path]:
    schema_path, paths = write_demo(tmp_path / "demo", 1, rows, 6, seed=3)
    return schema_path, paths[0]


def test_counted_data_records_the_count_of_any_full_pass(tmp_path: Path) -> None:
    schema_path, data = _demo(tmp_path, 700)
    source = open_data_source(spec_from_path(data, chunk_rows=100), Schema.load(schema_path))
    counted = CountedData(source)
    assert counted.row_count is None
    chunks = counted.iter_chunks()
    next(chunks)  # an abandoned pass records nothing
    chunks.close()
    assert counted.row_count is None
    assert sum(t.n_rows for t, _ in counted.iter_chunks()) == 700
    assert counted.row_count == 700
    assert counted.ensure_counted() is False  # already known: no second pass


def test_check_sample_reads_only_the_first_rows(tmp_path: Path) -> None:
    schema_path, data = _demo(tmp_path, 5000)
    schema = Schema.load(schema_path)
    # At most `rows` rows of the first chunk: never more than one chunk.
    report = open_data_source(spec_from_path(data, chunk_rows=64), schema).check_sample(200)
    assert report.rows_read == 64
    report = open_data_source(spec_from_path(data), schema).check_sample(200)
    assert report.rows_read == 200
    # A bad value in the first rows stops the site at start-up under on_invalid = "error".
    lines = data.read_text().splitlines()
    first = lines[1].split(",")
    first[0] = "oops"
    lines[1] = ",".join(first)
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(lines) + "\n")
    strict = spec_from_path(bad, policy=RowPolicy(invalid="error"))
    with pytest.raises(DataError, match="data row 1 has invalid values"):
        open_data_source(strict, schema).check_sample()


async def test_hello_goes_out_before_the_count_and_is_updated_after(tmp_path: Path) -> None:
    schema_path, data = _demo(tmp_path, 900)
    schema = Schema.load(schema_path)
    config = AggregatorConfig(source="test", listen="127.0.0.1:0", tls=None,
                              schema_path=schema_path, allowed_sites=("hospital-a",), min_sites=1,
                              task_deadline_s=30.0, resume_wait_s=0.0,
                              store_path=tmp_path / "store")
    coordinator = await start_coordinator(config)
    counted = CountedData(open_data_source(spec_from_path(data), schema))
    ledger = Ledger(tmp_path / "ledger.sqlite", BudgetPolicy(10.0, 1e-4))
    release_count = threading.Event()

    def count_after_release() -> bool:
        assert release_count.wait(30)
        return counted.ensure_counted()

    def hello() -> SiteHello:
        return SiteHello(__version__, PROTOCOL_VERSION, schema.digest(),
                         counted.row_count or 0, ("pca",), None, ledger.status())

    agent = SiteAgent(address=f"127.0.0.1:{coordinator.port}", credentials=None,
                      runner=TaskRunner(counted, ledger, ("pca",)), hello=hello,
                      connect_timeout_s=20.0, insecure_principal="site/hospital-a",
                      after_connect=count_after_release)
    running = asyncio.ensure_future(agent.run())
    try:
        async def rows_seen() -> int | None:
            for _ in range(200):
                session = coordinator.registry.get("hospital-a")
                if session is not None:
                    return session.hello.row_count
                await asyncio.sleep(0.05)
            return None

        # Connected while the count has not even started: "not counted yet".
        assert await rows_seen() == 0
        release_count.set()
        for _ in range(200):
            if (await rows_seen()) == 900:
                break
            await asyncio.sleep(0.05)
        assert await rows_seen() == 900
        assert counted.row_count == 900
    finally:
        release_count.set()
        agent.stop()
        await asyncio.wait_for(running, 20)
        await coordinator.stop(0.5)
        ledger.close()


def test_site_start_up_reads_a_sample_not_the_table(tmp_path: Path) -> None:
    from dpfed.site_agent.cli import _prepare
    from dpfed.site_agent.config import load_site_config

    schema_path, data = _demo(tmp_path, 5000)
    lines = data.read_text().splitlines()
    last = lines[-1].split(",")
    last[0] = "not-a-number"  # a bad value in the last row
    lines[-1] = ",".join(last)
    data.write_text("\n".join(lines) + "\n")
    site_toml = tmp_path / "site.toml"
    site_toml.write_text(f"""
[coordinator]
address = "127.0.0.1:1"
[tls]
insecure = true
[data]
path = "{data}"
schema = "{schema_path}"
on_invalid = "error"
[budget]
epsilon = 1.0
delta = 1e-5
""")
    prepared = _prepare(load_site_config(site_toml))  # the first rows are fine: no error
    assert prepared.data.row_count is None
    with pytest.raises(DataError, match="data row 5000 has invalid values"):
        prepared.data.ensure_counted()  # the full pass (after connecting) finds it
