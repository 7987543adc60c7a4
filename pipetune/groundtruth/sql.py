"""The ground truth in a SQL database (SQLAlchemy 2): a SQLite file or a PostgreSQL server.

Two tables, created on first use: ``pipetune_groundtruth_records`` (``id``,
``created_at``, ``record``: one record as JSON text, in insertion order) and
``pipetune_groundtruth_state``, one row whose ``generation`` every write bumps, so
:meth:`SqlStore.snapshot` is one small query and the facade refits only when it moves.

Writers are serialised: :meth:`SqlStore.mutate` is one transaction that starts with
``LOCK TABLE ... IN SHARE ROW EXCLUSIVE MODE`` on PostgreSQL (readers are never
blocked) and ``BEGIN IMMEDIATE`` on SQLite (SQLAlchemy's pysqlite transaction recipe,
a busy timeout, WAL journal so readers are not blocked either). Records are validated
with :func:`~pipetune.groundtruth.store.record_problem` on write and on read (a row's
text once per process); a bad row is reported by its row id and :meth:`SqlStore.repair`
deletes the bad rows after exporting the whole table to a JSON backup file.

Tables and engines: :mod:`~pipetune.groundtruth.sqlschema` (the store pickles without
its engine); URLs, masked passwords, the wait for a server: ``sql_connect``. Each read
and write is one transaction, run again whole while a server does not answer; a write
whose COMMIT got no answer is found by its token, not written twice (SQLite: no retry).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import URL, Connection, Engine

from pipetune.errors import GroundTruthError
from pipetune.groundtruth.sql_connect import _Waiting, mask, retry_budget, sql_url
from pipetune.groundtruth.sql_rows import Row as _Row
from pipetune.groundtruth.sql_rows import RowCache
from pipetune.groundtruth.sqlschema import (
    ENGINES,
    ENGINES_LOCK,
    READY,
    SQLITE_TABLES,
    TOKEN_KEEP,
    WRITE,
    already_exists,
    metadata,
    new_engine,
    records_table,
    state_table,
    transient,
    writes_table,
)
from pipetune.groundtruth.store import (
    FORMAT_VERSION,
    JsonStore,
    Records,
    Repair,
    StoreReport,
    _mode_for,
    _write_atomic,
    invalid_store,
    record_problem,
)
from pipetune.home import pipetune_home

log = logging.getLogger(__name__)
T = TypeVar("T")

_SCHEMA_LOCK = 0x70697065  # PostgreSQL advisory lock key for creating the schema ("pipe")


class SqlStore:
    """The records of one ground truth in the database at ``url``.

    ``legacy``: a JSON ground-truth file imported once, the first time the store is
    found empty (the default store's predecessor). ``retry_s``: how long a store on a
    database server waits for the server to answer again (default ``RETRY_S``, or
    ``$PIPETUNE_GROUNDTRUTH_RETRY_S``; 0 for a SQLite file). Pickles without its engine.
    """

    lock_path = None  # no lock file: the database serialises writers
    backup_path = None  # each repair writes its own timestamped backup (Repair.backup)

    def __init__(self, url: str | URL, *, legacy: Path | None = None,
                 retry_s: float | None = None) -> None:
        self.url = sql_url(url)
        self.legacy = legacy
        if self.is_sqlite:  # a local file: nothing to wait for
            self.retry_s = 0.0
        else:
            self.retry_s = retry_budget() if retry_s is None else float(retry_s)
        self._legacy_checked = legacy is None
        self._engine_obj: Engine | None = None
        self._engine_key: tuple[int, str] | None = None
        self._cache = RowCache()  # the rows as last read or written

    def __repr__(self) -> str:
        return f"SqlStore({self.location!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_engine_obj=None, _engine_key=None)
        return state

    @property
    def location(self) -> str:
        """The URL, its password (if any) as ``***``: what messages print."""
        return self.url.render_as_string(hide_password=True)

    @property
    def path(self) -> Path | None:
        """The SQLite file, or ``None`` for a database server."""
        return Path(self.url.database).expanduser() if self.is_sqlite else None

    @property
    def is_sqlite(self) -> bool:
        return self.url.drivername == "sqlite"

    # -- connections ----------------------------------------------------------------
    def _failure(self, err: exc.SQLAlchemyError) -> GroundTruthError:
        """A database error as one :class:`GroundTruthError` naming the store (masked)."""
        return GroundTruthError(f"{self.location}: database error: {self._first_line(err)}")

    def _first_line(self, err: exc.SQLAlchemyError) -> str:
        if isinstance(err, exc.DBAPIError):
            text = str(err.orig).strip()
            return self._hide(text.splitlines()[0] if text else type(err.orig).__name__)
        return self._hide(str(err))

    def _hide(self, text: str) -> str:
        """``text`` with the password, wherever it appears, as ``***``."""
        text = mask(re.sub(r"(password\s*=\s*)\S+", r"\1***", text))
        return text.replace(self.url.password, "***") if self.url.password else text

    def _engine(self) -> Engine:
        key = (os.getpid(), self.url.render_as_string(hide_password=False))
        if self._engine_obj is None or self._engine_key != key:  # new, or a forked child
            with ENGINES_LOCK:
                engine = ENGINES.get(key)
                if engine is None:
                    engine = ENGINES[key] = new_engine(self.url)
                if key not in READY:
                    self._create_schema(engine)
                    READY.add(key)
            self._engine_obj, self._engine_key = engine, key
        if not self._legacy_checked:
            self._legacy_checked = True
            try:
                self._import_legacy()
            except BaseException:
                self._legacy_checked = False
                raise
        return self._engine_obj

    @contextlib.contextmanager
    def _connection(self, engine: Engine, *, write: bool,
                    lock: bool = True) -> Iterator[Connection]:
        """One transaction. A write is the only one at a time on this store when ``lock``;
        a read on a server sees one snapshot for all its statements."""
        with engine.connect() as conn:
            if write:
                conn.execution_options(**{WRITE: True})
            elif not self.is_sqlite:
                conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                if write and lock and not self.is_sqlite:  # SQLite: BEGIN IMMEDIATE did it
                    conn.execute(sa.text(
                        f"LOCK TABLE {records_table.name} IN SHARE ROW EXCLUSIVE MODE"))
                yield conn

    def _transaction(self, work: Callable[[Connection], T], *, write: bool) -> T:
        """``work(conn)`` in one transaction; its result.

        On a database server, a transaction the server broke off (it restarted, the
        connection dropped) is run again, whole, until it commits or :attr:`retry_s`
        seconds have passed since the first failure. A write whose COMMIT got no answer
        may have landed: its token (:data:`writes_table`) says so, and then it is not
        written again (the result is the one that attempt computed)."""
        token = str(uuid.uuid4()) if write and not self.is_sqlite else None
        waiting = _Waiting(self)
        sent: list[T] = []  # the result of an attempt whose COMMIT was sent
        while True:
            try:
                with self._connection(self._engine(), write=write) as conn:
                    if sent and self._landed(conn, token):
                        result = sent[0]
                    else:
                        result = work(conn)
                        if token is not None:
                            self._leave_token(conn, token)
                        sent[:] = [result]
                waiting.done()
                return result
            except exc.DBAPIError as err:
                if self.is_sqlite or not transient(err):
                    raise self._failure(err) from None
                waiting.wait(err)
            except exc.SQLAlchemyError as err:
                raise self._failure(err) from None

    @staticmethod
    def _landed(conn: Connection, token: str | None) -> bool:
        """Whether the write with ``token`` committed (called under the table lock, so an
        unfinished transaction that holds it ends first)."""
        return conn.execute(sa.select(writes_table.c.token)
                            .where(writes_table.c.token == token)).first() is not None

    @staticmethod
    def _leave_token(conn: Connection, token: str) -> None:
        conn.execute(writes_table.delete().where(
            writes_table.c.at < sa.literal_column(f"now() - interval '{TOKEN_KEEP}'")))
        conn.execute(writes_table.insert().values(token=token, at=sa.func.now()))

    def _create_schema(self, engine: Engine) -> None:
        """The tables and the state row, if missing. Several processes may start at once:
        SQLite serialises them (BEGIN IMMEDIATE), PostgreSQL with an advisory lock, and a
        process that still loses the race ("already exists") checks again and goes on.
        Other database errors are raised as they are (:meth:`_transaction` sorts them)."""
        tables = list(SQLITE_TABLES) if self.is_sqlite else None
        for attempt in range(5):
            try:
                with self._connection(engine, write=True, lock=False) as conn:
                    if not self.is_sqlite:
                        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"),
                                     {"k": _SCHEMA_LOCK})
                    metadata.create_all(conn, tables=tables, checkfirst=True)
                    if conn.execute(sa.select(state_table.c.id)).first() is None:
                        conn.execute(state_table.insert().values(
                            id=1, generation=0, store_id=str(uuid.uuid4())))
                return
            except exc.DBAPIError as err:
                if not already_exists(err) or attempt == 4:
                    raise
                log.debug("ground-truth schema created by another process: %s", err.orig)

    # -- reading --------------------------------------------------------------------
    def _rows(self, conn: Connection) -> list[_Row]:
        return self._cache.read(conn)

    def _fresh_rows(self, conn: Connection) -> list[_Row]:
        return self._cache.read(conn, fresh=True)

    def _report(self, rows: list[_Row]) -> StoreReport:
        bad = tuple((r.id, r.why) for r in rows if r.why is not None)
        return StoreReport(self.location, len(rows), bad, unit="row")

    def _valid(self, rows: list[_Row]) -> Records:
        found = self._report(rows)
        if not found.ok:
            raise invalid_store(found, self.location, "ground truth", "table")
        return [r.record for r in rows]

    def read(self) -> Records:
        """Every record, in the order written, validated; raises :class:`GroundTruthError`
        naming the first bad row and the repair command."""
        return self._valid(self._transaction(self._rows, write=False))

    def snapshot(self) -> bytes:
        """The store's identity and generation: changes with every write, not on reads."""
        store_id, generation = self._transaction(lambda conn: conn.execute(
            sa.select(state_table.c.store_id, state_table.c.generation)).one(), write=False)
        return f"{store_id}:{generation}".encode()

    def parse(self, raw: bytes) -> Records:
        """The records now (``raw``, a :meth:`snapshot`, only keys the caller's cache: a
        write between the two makes the next snapshot differ, so the cache refreshes)."""
        return self.read()

    def check(self) -> int:
        """Read and validate the whole store now; return its record count."""
        return len(self.read())

    __len__ = check

    def audit(self) -> StoreReport:
        """Every problem in the store, by row id, without raising for them."""
        return self._report(self._transaction(self._fresh_rows, write=False))

    # -- writing --------------------------------------------------------------------
    @staticmethod
    def _encode(rec: Any) -> str:
        why = record_problem(rec)
        if why is not None:
            raise GroundTruthError(f"{why}; not recorded")
        return json.dumps(rec, allow_nan=False)

    @staticmethod
    def _bump(conn: Connection) -> None:
        conn.execute(state_table.update().where(state_table.c.id == 1)
                     .values(generation=state_table.c.generation + 1))

    def mutate(self, change: Callable[[Records], Records]) -> None:
        """Replace the records with ``change(records)`` in one transaction that holds off
        every other writer: rows ``change`` kept (the same objects, in order) stay, the
        others are deleted, new records are appended. A bad store or a bad new record
        raises :class:`GroundTruthError` and nothing is written.

        On a database server that restarts meanwhile, ``change`` may be called again on
        the records as they are then (so it must not count on being called once); the
        change lands once (see :meth:`_transaction`). ``change`` must not alter a record
        in place (the records are this process's copy of the table): it returns a new
        object for a changed record."""

        def write(conn: Connection) -> Any:
            rows = self._rows(conn)
            kept = self._apply(conn, rows, change(list(self._valid(rows))))
            if kept is None:
                return None
            self._bump(conn)
            return self._cache.written(conn, kept)

        done = self._transaction(write, write=True)
        if done is not None:
            self._cache.committed(*done)

    def _apply(self, conn: Connection, rows: list[_Row], after: Records) -> list[_Row] | None:
        """Make the table hold ``after``; the rows kept as they were (the rest of
        ``after`` was appended after them), or None when nothing changed."""
        if len(after) >= len(rows) and all(  # the common case: records appended
                a is r.record for a, r in zip(after, rows, strict=False)):
            added = after[len(rows):]
            return rows if self._write_rows(conn, [], [self._encode(r) for r in added]) else None
        row_of = {id(r.record): r for r in rows}
        kept: list[_Row] = []
        added = []
        for rec in after:
            row = row_of.pop(id(rec), None)
            if row is not None and (added or (kept and row.id < kept[-1].id)):
                kept, added = [], list(after)  # reordered: write them all again, in order
                row_of = {r.id: r for r in rows}
                break
            if row is None:
                added.append(rec)
            else:
                kept.append(row)
        gone = [r.id for r in row_of.values()]
        return kept if self._write_rows(conn, gone, [self._encode(r) for r in added]) else None

    @staticmethod
    def _write_rows(conn: Connection, gone: list[int], new: list[str]) -> bool:
        """Delete rows ``gone``, append ``new``; whether anything changed."""
        for start in range(0, len(gone), 500):
            conn.execute(records_table.delete().where(
                records_table.c.id.in_(gone[start:start + 500])))
        if new:
            now = datetime.now(UTC)
            conn.execute(records_table.insert(),
                         [{"created_at": now, "record": text} for text in new])
        return bool(gone or new)

    def clear(self) -> int:
        """Delete every row, valid or not; returns how many there were."""

        def write(conn: Connection) -> int:
            removed = conn.execute(sa.select(sa.func.count()).select_from(records_table)).scalar()
            if removed:
                conn.execute(records_table.delete())
                self._bump(conn)
            return int(removed or 0)

        return self._transaction(write, write=True)

    def repair(self) -> Repair:
        """Keep the valid rows and delete the bad ones, after exporting the whole table
        to a JSON backup (beside a SQLite file; in the pipetune home for a server)."""

        def write(conn: Connection) -> Repair:
            rows = self._fresh_rows(conn)
            found = self._report(rows)
            kept = len(rows) - len(found.bad)
            if found.ok:
                return Repair(found, kept=kept)
            backup = self._backup(rows)
            bad = [rid for rid, _ in found.bad]
            for start in range(0, len(bad), 500):
                conn.execute(records_table.delete().where(
                    records_table.c.id.in_(bad[start:start + 500])))
            self._bump(conn)
            return Repair(found, kept=kept, backup=backup)

        return self._transaction(write, write=True)

    def _backup(self, rows: list[_Row]) -> Path:
        """Every row as it is, in the ground-truth file format (a row that is not JSON as
        its text), with ``row_ids`` beside ``records``; returns the new file."""
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        if self.is_sqlite:
            db = self.path
            base, mode = db.with_name(f"{db.name}.bak-{stamp}"), _mode_for(db)
        else:
            name = re.sub(r"[^A-Za-z0-9._-]+", "_",
                          f"groundtruth-{self.url.host or 'local'}-{self.url.database or ''}")
            base, mode = pipetune_home() / f"{name}.bak-{stamp}", 0o600
        path, n = base.with_name(base.name + ".json"), 1
        while path.exists():
            path, n = base.with_name(f"{base.name}-{n}.json"), n + 1
        payload = {"version": FORMAT_VERSION, "source": self.location,
                   "row_ids": [r.id for r in rows],
                   "records": [r.text if r.record is None else r.record for r in rows]}
        _write_atomic(path, json.dumps(payload, indent=1).encode(), mode)
        return path

    # -- the old JSON store ---------------------------------------------------------
    def _import_legacy(self) -> None:
        """Import ``legacy`` once, when this store is empty and has never imported it."""
        legacy = self.legacy
        if legacy is None or not legacy.is_file():
            return
        if self._transaction(self._legacy_done, write=False):
            return
        try:
            records = JsonStore(legacy).read()
        except GroundTruthError as err:
            raise GroundTruthError(
                f"{err}; it is imported into {self.location} once it is valid") from None

        def write(conn: Connection) -> bool:
            if self._legacy_done(conn):
                return False
            self._apply(conn, [], records)
            conn.execute(state_table.update().where(state_table.c.id == 1).values(
                legacy_import=f"{len(records)} records from {legacy} at "
                              f"{datetime.now(UTC).isoformat(timespec='seconds')}"))
            self._bump(conn)
            return True

        if self._transaction(write, write=True):
            log.info("imported %d ground-truth records from %s into %s (the JSON file is "
                     "no longer read)", len(records), legacy, self.location)

    @staticmethod
    def _legacy_done(conn: Connection) -> bool:
        """Whether the legacy file was imported, or the store is in use without it."""
        return conn.execute(sa.select(state_table.c.legacy_import)).scalar() is not None \
            or conn.execute(sa.select(records_table.c.id).limit(1)).first() is not None
