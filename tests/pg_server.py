"""A real PostgreSQL server for tests: the team stack's own :class:`Postgres`.

Reuse it from a test module with::

    from pg_server import postgres_server  # noqa: F401  (a session-scoped fixture)

    def test_something(postgres_server):
        url = postgres_server.create_database()  # a fresh, empty database

It listens on 127.0.0.1 only, on a free port, and trusts loopback connections; as root
its commands run as the ``postgres`` user (initdb refuses root). Tests that use it are
skipped, with the reason, only when the machine has no PostgreSQL binaries.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from team import skip_without_postgres


class PostgresServer:
    """One throwaway server: :meth:`create_database` gives each test its own database."""

    def __init__(self) -> None:
        from pipetune.stack.postgres import Postgres

        self.root = Path(tempfile.mkdtemp(prefix="pipetune-pg-"))
        self.server = Postgres(self.root / "pg")
        self._names = itertools.count()

    def start(self) -> PostgresServer:
        self.server.start()
        return self

    def url(self, database: str = "postgres") -> str:
        return self.server.url(database)

    def create_database(self, name: str | None = None) -> str:
        """A new empty database; returns its ``postgresql://`` URL."""
        name = name or f"test_{os.getpid()}_{next(self._names)}"
        self.server.create_database(name)
        return self.server.url(name)

    def stop(self) -> None:
        try:
            self.server.stop()
        finally:
            self.server.remove()
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL server for the whole session (skipped where there is none)."""
    skip_without_postgres()
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()
