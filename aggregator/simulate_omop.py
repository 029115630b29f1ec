"""``dpfed simulate --omop``: the federation over three generated OMOP CDM warehouses.

Each hospital gets its own synthetic CDM (:mod:`dpfed.common.data.omop_synthetic`, a
different case mix per site): the first in a throw-away PostgreSQL server started for the
run (when the machine has PostgreSQL's ``initdb``/``pg_ctl``; otherwise in DuckDB too, as the
output says), the others in DuckDB files. Every site reads its warehouse through a
``<site>.omop.toml`` and the federation schema's ``[omop]`` extraction, read-only and
streamed, and the chosen job (``--job pca`` or ``--job synth``) runs as in ``--data`` mode.

``--out`` then holds ``warehouses/`` (the DuckDB files, the ``.omop.toml`` files and the
schema) and ``run/`` (the simulation itself: report, result, logs, ledgers).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from dpfed.aggregator.local_postgres import PostgresServer, start
from dpfed.aggregator.simulation_output import prepare_output, say
from dpfed.common.data.omop_synthetic import (
    DEMO_SCHEMA,
    generate_cdm,
    write_duckdb,
    write_postgres,
)
from dpfed.common.errors import ConfigError

if TYPE_CHECKING:
    from dpfed.aggregator.simulate import SimulationOptions

#: The PostgreSQL role the site reads as (SELECT on the CDM tables only).
READER = "dpfed_reader"
#: Persons per warehouse: ``--rows``, at most this many ("a few thousand").
MAX_PERSONS = 5000
OMOP_JOBS = ("pca", "synth")


def check_omop_options(opts: SimulationOptions) -> None:
    """Refuse what --omop cannot combine with, before anything is made."""
    if opts.data or opts.schema is not None:
        raise ConfigError("--omop generates the sites' warehouses and the schema; drop --data "
                          "and --schema")
    if opts.job not in OMOP_JOBS:
        raise ConfigError(f"--omop runs --job {' or '.join(OMOP_JOBS)}, not --job {opts.job}")


def _postgres_site(server: PostgresServer, folder: Path, name: str, persons: int,
                   seed: int, site: int) -> Path:
    import psycopg

    password = secrets.token_urlsafe(18)
    with psycopg.connect(server.admin_conninfo(), autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {READER} LOGIN PASSWORD '{password}'")
    write_postgres(generate_cdm(persons, seed=seed, site=site), server.admin_conninfo(),
                   reader=READER)
    secret = folder / f"{name}.pgpass"
    secret.write_text(password + "\n")
    os.chmod(secret, 0o600)
    descriptor = folder / f"{name}.omop.toml"
    descriptor.write_text(f'engine = "postgres"\nconninfo = "{server.tcp_conninfo(READER)}"\n'
                          f'password_file = "{secret.name}"\ncdm_schema = "cdm"\n')
    return descriptor


def _duckdb_site(folder: Path, name: str, persons: int, seed: int, site: int) -> Path:
    db = write_duckdb(generate_cdm(persons, seed=seed, site=site), folder / f"{name}.duckdb")
    descriptor = folder / f"{name}.omop.toml"
    descriptor.write_text(f'engine = "duckdb"\npath = "{db.name}"\ncdm_schema = "cdm"\n')
    return descriptor


def run_omop_simulation(opts: SimulationOptions,
                        run_simulation: Callable[[SimulationOptions], int]) -> int:
    """Generate the warehouses, run ``opts.job`` on them, stop the server; return an exit code.

    ``run_simulation`` runs the job on the generated ``--data``/``--schema`` (the simulation's
    own entry point, passed in: this module is imported by it).
    """
    check_omop_options(opts)
    out = opts.out.resolve()
    prepare_output(out)
    folder = out / "warehouses"
    folder.mkdir()
    seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(4), "little")
    persons = min(opts.rows, MAX_PERSONS)
    schema = folder / "schema.toml"
    schema.write_text(DEMO_SCHEMA)
    server, why = start()
    if server is None:
        say("omop", f"no PostgreSQL server could start ({why}); every warehouse is DuckDB")
    descriptors: list[Path] = []
    try:
        for site in range(opts.sites):
            name = f"hospital-{site + 1}"
            if site == 0 and server is not None:
                descriptors.append(_postgres_site(server, folder, name, persons, seed, site))
                kind = f"PostgreSQL on 127.0.0.1:{server.port} (throw-away server)"
            else:
                descriptors.append(_duckdb_site(folder, name, persons, seed, site))
                kind = f"DuckDB {folder / (name + '.duckdb')}"
            say("omop", f"{name}: synthetic CDM of {persons} persons in {kind}")
        return run_simulation(replace(opts, omop=False, out=out / "run", data=descriptors,
                                      schema=schema))
    finally:
        if server is not None:
            server.stop()
