"""The SQL side of the ground truth: its two tables, and one engine per URL per process.

SQLite engines follow SQLAlchemy's pysqlite transaction recipe: pysqlite's own BEGIN
is turned off on "connect" and the "begin" event emits ``BEGIN IMMEDIATE`` for a write
transaction (the execution option :data:`WRITE`) and a deferred ``BEGIN`` for a read;
every connection waits up to :data:`BUSY_TIMEOUT_S` for a lock and the file is in WAL
mode, so readers never wait for a writer.
"""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import URL, Connection, Engine

#: Seconds a SQLite writer waits for another writer's transaction to end.
BUSY_TIMEOUT_S = 60.0
#: Seconds to wait for a database server to answer a new connection (unless the URL's
#: ``connect_timeout`` says otherwise).
CONNECT_TIMEOUT_S = 15
WRITE = "pipetune_write"  # execution option: this transaction writes (BEGIN IMMEDIATE)

metadata = sa.MetaData()
records_table = sa.Table(
    "pipetune_groundtruth_records", metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
              autoincrement=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("record", sa.Text(), nullable=False),
    sqlite_autoincrement=True,  # a deleted row's id is never given to another
)
state_table = sa.Table(
    "pipetune_groundtruth_state", metadata,
    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("generation", sa.BigInteger(), nullable=False),
    sa.Column("store_id", sa.String(36), nullable=False),
    sa.Column("legacy_import", sa.Text(), nullable=True),
)

# -- engines: one per URL per process (the key: pid and URL); READY: schema checked ------

ENGINES: dict[tuple[int, str], Engine] = {}
READY: set[tuple[int, str]] = set()
ENGINES_LOCK = threading.Lock()


def new_engine(url: URL) -> Engine:
    if url.drivername != "sqlite":  # a server that does not answer: an error, not a hang
        timeout = {} if "connect_timeout" in url.query else {"connect_timeout": CONNECT_TIMEOUT_S}
        return sa.create_engine(url, pool_pre_ping=True, connect_args=timeout)
    Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url, pool_pre_ping=True,
                              connect_args={"timeout": BUSY_TIMEOUT_S})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        # pysqlite's own BEGIN handling is off; "begin" below emits ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        _use_wal(cursor)
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        write = conn.get_execution_options().get(WRITE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _use_wal(cursor: Any) -> None:
    """Put the SQLite file in WAL mode (once per file; readers then never wait for a
    writer). Switching does not wait for the busy timeout when another process holds
    the file (measured: "database is locked" at once), so it is retried until then."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(random.uniform(0.005, 0.05))


def already_exists(err: exc.DBAPIError) -> bool:
    """Whether ``err`` is another process having created the schema first."""
    text = str(err.orig).lower()
    return any(s in text for s in ("already exists", "duplicate key", "unique constraint"))
