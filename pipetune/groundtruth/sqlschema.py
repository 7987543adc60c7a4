"""The SQL side of the ground truth: its two tables, and one engine per URL per process.

SQLite engines follow SQLAlchemy's pysqlite transaction recipe: pysqlite's own BEGIN
is turned off on "connect" and the "begin" event emits ``BEGIN IMMEDIATE`` for a write
transaction (the execution option :data:`WRITE`) and a deferred ``BEGIN`` for a read;
every connection waits up to :data:`BUSY_TIMEOUT_S` for a lock and the file is in WAL
mode, so readers never wait for a writer.

On a database server, every write also leaves its token (a UUID) in
``pipetune_groundtruth_writes``, in the same transaction: a writer whose COMMIT got no
answer (the server restarted, the connection broke) looks for its token before it
writes again, so a retried write lands exactly once (:mod:`pipetune.groundtruth.sql`).
Tokens older than :data:`TOKEN_KEEP` are deleted by later writes.
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
#: Seconds a ground truth on a database server keeps trying while the server does not
#: answer (restarting, or the connection broke), from the first failure, before it
#: raises; ``$PIPETUNE_GROUNDTRUTH_RETRY_S`` overrides it (0: no retries).
RETRY_S = 60.0
RETRY_ENV = "PIPETUNE_GROUNDTRUTH_RETRY_S"
#: How long a write's token is kept (far longer than :data:`RETRY_S`).
TOKEN_KEEP = "1 day"

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
writes_table = sa.Table(  # database servers only (see the module's docstring)
    "pipetune_groundtruth_writes", metadata,
    sa.Column("token", sa.String(36), primary_key=True),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False, index=True),
)
#: The tables of a SQLite ground truth (a local file: a COMMIT's answer is never lost).
SQLITE_TABLES = (records_table, state_table)

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


#: SQLSTATE classes and codes of a server that will answer again: connection exceptions,
#: shutting down / starting up / in recovery, a transaction rolled back (serialization,
#: deadlock), too many connections.
_TRANSIENT_STATES = ("08", "57P", "40", "53")
#: Words of a connection error that waiting will not mend.
_PERMANENT_WORDS = ("authentication", "password", "pg_hba.conf", "does not exist",
                    "permission denied", "invalid dsn", "no such host", "could not translate")


def transient(err: exc.DBAPIError) -> bool:
    """Whether ``err`` (from a database server) is the server being away for a while
    (restarting, the connection broken) rather than a mistake that waiting won't mend
    (no such database, a wrong password, bad SQL)."""
    if err.connection_invalidated:
        return True
    if not isinstance(err, (exc.OperationalError, exc.InterfaceError)):
        return False
    state = getattr(err.orig, "sqlstate", None)
    if state:
        return state.startswith(_TRANSIENT_STATES)
    text = str(err.orig).lower()
    return not any(word in text for word in _PERMANENT_WORDS)


def already_exists(err: exc.DBAPIError) -> bool:
    """Whether ``err`` is another process having created the schema first."""
    text = str(err.orig).lower()
    return any(s in text for s in ("already exists", "duplicate key", "unique constraint"))
