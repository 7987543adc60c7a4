"""The SQL store's rows as this process last read or wrote them.

A study of thousands of trials writes the ground truth once per trial it remembers,
and every write reads the whole table first (the cap on a group's records needs it).
:class:`RowCache` keeps the rows, decoded and checked, with the state they were read
or written at: the store's generation (every write through any store bumps it) and the
table's row count and highest id (so a row added behind the store's back is seen too).
When the state is the same, the table is not read again.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from pipetune.groundtruth.sqlschema import records_table, state_table
from pipetune.groundtruth.store import record_problem


@dataclass(frozen=True)
class Row:
    id: int
    text: str
    record: Any  # the decoded JSON (None when it is not JSON)
    why: str | None  # what is wrong with it, or None


def table_state(conn: Connection) -> tuple[Any, ...]:
    """The store's id and generation, and the table's row count and highest id."""
    rc = records_table.c
    store = conn.execute(sa.select(state_table.c.store_id, state_table.c.generation)).one()
    table = conn.execute(sa.select(sa.func.count(), sa.func.max(rc.id))).one()
    return (*store, *table)


class RowCache:
    """Rows by the state they were read or written at (module doc); threads share it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: tuple[Any, ...] | None = None
        self._rows: list[Row] = []
        self._checked: dict[int, tuple[str, str | None]] = {}  # id -> (text, problem)

    def __reduce__(self) -> tuple[Any, ...]:  # a store crosses processes empty-handed
        return RowCache, ()

    def read(self, conn: Connection, *, fresh: bool = False) -> list[Row]:
        """Every row, decoded and checked; from memory when the table is as it was
        (``fresh``: read it anyway, as an audit does)."""
        state = table_state(conn)
        with self._lock:
            if fresh or state != self._state:
                self._rows, self._state = self._decoded(conn), state
            return self._rows

    def _decoded(self, conn: Connection, after: int | None = None) -> list[Row]:
        """The rows (with ``after``: those with a higher id), each checked unless it was
        checked before with the same text (the check depends on the text alone)."""
        rc, rows = records_table.c, []
        query = sa.select(rc.id, rc.record).order_by(rc.id)
        for rid, text in conn.execute(query if after is None else query.where(rc.id > after)):
            try:
                rec = json.loads(text)
            except (ValueError, TypeError, RecursionError) as err:
                rows.append(Row(rid, text, None, f"is not valid JSON ({err})"))
                continue
            seen = self._checked.get(rid)
            why = seen[1] if seen and seen[0] == text else record_problem(rec)
            self._checked[rid] = (text, why)
            rows.append(Row(rid, text, rec, why))
        return rows

    def written(self, conn: Connection, kept: list[Row]) -> tuple[tuple[Any, ...], list[Row]]:
        """After a write that kept ``kept`` (in order) and appended the rest: the state
        and rows to remember once it commits (:meth:`committed`)."""
        with self._lock:
            new = self._decoded(conn, kept[-1].id if kept else -1)
        return table_state(conn), [*kept, *new]

    def committed(self, state: tuple[Any, ...], rows: list[Row]) -> None:
        live = {r.id for r in rows}
        with self._lock:
            self._state, self._rows = state, rows
            self._checked = {k: v for k, v in self._checked.items() if k in live}
