"""The tests' throw-away PostgreSQL server: :mod:`dpfed.aggregator.local_postgres`."""

from dpfed.aggregator.local_postgres import ADMIN as ADMIN
from dpfed.aggregator.local_postgres import PostgresServer as PostgresServer
from dpfed.aggregator.local_postgres import start as start
