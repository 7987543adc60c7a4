"""Reaching a ground truth's database: its URL (:func:`sql_url`, PostgreSQL through
psycopg 3, or a SQLite file), a password kept out of messages (:func:`mask`), and how
long a transaction waits for a server that does not answer (:func:`retry_budget`,
``_Waiting``). Used by :class:`~pipetune.groundtruth.sql.SqlStore`.

A database server may restart (or a connection break) under a running study: a
transaction is run again while the server does not answer, for up to
:data:`~pipetune.groundtruth.sqlschema.RETRY_S` seconds from the first failure, then a
one-line :class:`GroundTruthError`. Passwords never appear in a store's location, its
``repr`` or an error message. SQLite files are not retried: a local file has no server
to wait for.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from typing import TYPE_CHECKING

from sqlalchemy import exc
from sqlalchemy.engine import URL, make_url

from pipetune.errors import GroundTruthError
from pipetune.groundtruth.sqlschema import RETRY_ENV, RETRY_S

if TYPE_CHECKING:
    from pipetune.groundtruth.sql import SqlStore

log = logging.getLogger("pipetune.groundtruth.sql")


#: URL schemes a ground truth accepts -> the SQLAlchemy driver that serves each.
_SCHEMES = {"postgresql": "postgresql+psycopg", "postgres": "postgresql+psycopg",
            "postgresql+psycopg": "postgresql+psycopg", "sqlite": "sqlite",
            "sqlite+pysqlite": "sqlite"}


def mask(text: str) -> str:
    """``text`` with the password of any ``scheme://user:password@`` in it as ``***``."""
    return re.sub(r"(://[^:/@\s]*):[^@\s]*@", r"\1:***@", text)


def sql_url(location: str | URL) -> URL:
    """The SQLAlchemy URL of a ground-truth location: ``postgresql://`` and
    ``postgresql+psycopg://`` (both driven by psycopg 3) or ``sqlite:///FILE``."""
    try:
        url = location if isinstance(location, URL) else make_url(location)
    except (exc.ArgumentError, ValueError):
        raise GroundTruthError(f"not a database URL: {mask(str(location))!r}") from None
    driver = _SCHEMES.get(url.drivername)
    if driver is None:
        raise GroundTruthError(
            f"{url.render_as_string(hide_password=True)}: a ground-truth URL starts with "
            "postgresql://, postgresql+psycopg:// or sqlite:///")
    if driver == "sqlite" and url.database in (None, "", ":memory:"):
        raise GroundTruthError("a SQLite ground truth needs a file: sqlite:///PATH")
    return url.set(drivername=driver)


def retry_budget() -> float:
    """Seconds to wait for a database server that does not answer: ``RETRY_S``, or
    ``$PIPETUNE_GROUNDTRUTH_RETRY_S``."""
    raw = os.environ.get(RETRY_ENV, "").strip()
    if not raw:
        return RETRY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise GroundTruthError(f"{RETRY_ENV}={raw!r}: give a number of seconds, 0 or more")
    return value


class _Waiting:
    """The waits of one transaction for its database server: backoff from 0.1 s to 2 s
    (jittered, so many workers do not knock at once), for ``store.retry_s`` seconds
    from the first failure; then a :class:`GroundTruthError` naming the store."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self.since: float | None = None
        self.tries = 0
        self.delay = 0.1

    def wait(self, err: exc.DBAPIError) -> None:
        now = time.monotonic()
        self.tries += 1
        store = self.store
        if self.since is None:
            self.since = now
            if store.retry_s > 0:
                log.warning("ground truth %s: the database did not answer (%s); trying again "
                            "for up to %.0f s", store.location, store._first_line(err),
                            store.retry_s)
        left = self.since + store.retry_s - now
        if left <= 0:
            if store.retry_s <= 0:
                raise store._failure(err) from None
            raise GroundTruthError(
                f"{store.location}: the database did not answer for {store.retry_s:g} s "
                f"({self.tries} tries; {RETRY_ENV} sets how long): "
                f"{store._first_line(err)}") from None
        time.sleep(min(left, self.delay * random.uniform(0.5, 1.0)))
        self.delay = min(self.delay * 2, 2.0)

    def done(self) -> None:
        if self.since is not None:
            log.warning("ground truth %s: the database answered again after %.1f s",
                        self.store.location, time.monotonic() - self.since)
