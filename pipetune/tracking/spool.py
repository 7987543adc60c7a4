"""Writes that wait for the MLflow store: a study's spool, JSON lines in its folder.

An MLflow tracking server can be unreachable for minutes (a deploy, a restart), and a
SQLite store can stay locked past :data:`~pipetune.tracking.store.LOCKED_BACKOFF_S`. A
:class:`~pipetune.tracking.sink.MlflowSink` given a spool then appends each write it
cannot make, and every write after it, to ``$PIPETUNE_HOME/studies/<study_id>/``
:data:`SPOOL_FILE`, and sends them in order once the store answers. A study that ends
while the store is down says so and how to send the spool later
(:data:`FLUSH_COMMAND`, :func:`~pipetune.tracking.flush.send_spool`).

The file, one JSON object a line (data read back as data, never code):

- ``{"header": {...}}`` first: the store, experiment, parent run and tags to send to;
- ``{"seq": n, "op": name, "args": [...]}``: one write, ``n`` counting from 0;
- ``{"sent": n}``: write ``n`` returned OK (appended only after it did).

A write is acknowledged only once its call returned. A write whose call failed may
still have reached the store (a connection that broke after the request went out), so
the first write of each attempt to send is checked against the store before it is sent
again: its metrics already in the history (same key, step, timestamp and value) are
left out, a trial run that exists is not created again; params, tags, run ends and
artifacts are the same when written twice. No metric is written twice (MLflow's SQL
stores also keep one row for a metric sent twice with the same key, step, timestamp
and value; the check holds for any store). The file is removed once every write in it
is sent.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetune.errors import PipetuneError

logger = logging.getLogger(__name__)

#: The spool's file name in a study's folder.
SPOOL_FILE = "mlflow-spool.jsonl"
#: The command that sends a study's spool (``{study_id}`` filled in).
FLUSH_COMMAND = "pipetune tracking flush {study_id}"


class StoreUnavailable(PipetuneError):
    """The MLflow store did not answer: what was spooled still waits."""


class TrackingUnreachable(PipetuneError):
    """The MLflow store did not answer when a study came to open its run."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self):
        return (type(self), (str(self), self.exit_code))


#: Seconds a study waits, at its start, for a tracking store that does not answer.
START_WAIT_ENV = "PIPETUNE_MLFLOW_START_WAIT_S"


def spool_path(study_id: str, home: Path | None = None) -> Path:
    """Where study ``study_id``'s spool lives (the study's folder beside its journal)."""
    from pipetune.home import pipetune_home

    return (home or pipetune_home()) / "studies" / study_id / SPOOL_FILE


def store_unavailable(error: BaseException) -> bool:
    """Whether ``error`` says the store did not answer (down, unreachable, restarting,
    locked past the back-off) rather than refused the write: the write may be
    spooled and sent later. A refusal (a bad value, a missing run) is not."""
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    text = str(error)
    if "database is locked" in text:
        return True
    if "API request to" in text and ("failed with exception" in text
                                     or "failed with timeout exception" in text):
        return True
    return any(f"failed with error code {code}" in text for code in (502, 503, 504))


def to_json(value: Any) -> Any:
    """``value`` (tuples, bytes, dicts of them) as JSON data; :func:`from_json` reverses
    it but for tuples, which come back as lists."""
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    return value


def from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"$bytes"}:
            return base64.b64decode(value["$bytes"])
        return {k: from_json(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class SpoolNote:
    """What a study left waiting: ``count`` writes in ``path`` for ``tracking_uri``."""

    path: str
    count: int
    tracking_uri: str
    study_id: str | None

    def line(self) -> str:
        """The one line a study ending with writes waiting says."""
        send = (f"send them once it answers: {FLUSH_COMMAND.format(study_id=self.study_id)}"
                if self.study_id else "send them once it answers")
        return (f"MLflow at {self.tracking_uri} did not answer: {self.count} write(s) wait "
                f"in {self.path}; {send}")


class Spool:
    """One study's spool file (see the module docstring). Every read or change holds
    an exclusive lock on ``<file>.lock``: the recorder and ``pipetune tracking flush``
    never send the same write twice."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self._next_seq: int | None = None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _lines(self) -> list[dict[str, Any]]:
        try:
            raw = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for i, line in enumerate(raw):
            try:
                entry = json.loads(line)
            except ValueError:
                if i == len(raw) - 1:  # torn by a crash mid-write: never acknowledged
                    continue
                raise StoreUnavailable(f"{self.path}: line {i + 1} is not JSON") from None
            if isinstance(entry, dict):
                out.append(entry)
        return out

    def read(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """``(header, writes not yet sent, in order)``; call it holding :meth:`locked`."""
        header: dict[str, Any] = {}
        writes: dict[int, dict[str, Any]] = {}
        sent: set[int] = set()
        for entry in self._lines():
            if "header" in entry:
                header = entry["header"]
            elif "sent" in entry:
                sent.add(int(entry["sent"]))
            elif "seq" in entry and "op" in entry:
                writes[int(entry["seq"])] = entry
        self._next_seq = max(writes, default=-1) + 1
        return header, [writes[n] for n in sorted(writes) if n not in sent]

    def waiting(self) -> int:
        """How many writes wait to be sent."""
        if not self.path.exists():  # the common case: no lock file made for nothing
            return 0
        with self.locked():
            return len(self.read()[1])

    def _append(self, entry: dict[str, Any]) -> None:
        with open(self.path, "ab+") as f:
            # A line a crash left torn (no newline) is cut first: the next entry must
            # start a line of its own, or it would be lost inside the torn one.
            end = f.seek(0, 2)
            if end:
                f.seek(end - 1)
                if f.read(1) != b"\n":  # rare: only then is the whole file read
                    f.seek(0)
                    f.truncate(f.read().rfind(b"\n") + 1)
            f.seek(0, 2)
            f.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")

    def append(self, op: str, args: tuple[Any, ...], header: dict[str, Any]) -> None:
        """Write ``op(*args)`` after those waiting (the header first, in a new file)."""
        with self.locked():
            if self._next_seq is None or not self.path.exists():
                self.read()
            if not self.path.exists():
                self._append({"header": header})
            self._append({"seq": self._next_seq, "op": op, "args": to_json(args)})
            self._next_seq = (self._next_seq or 0) + 1

    def acknowledge(self, seq: int) -> None:
        """Write ``seq`` is in the store; call it holding :meth:`locked`."""
        self._append({"sent": seq})

    def remove(self) -> None:
        """Every write sent: the file goes; call it holding :meth:`locked`."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._next_seq = 0


#: MLflow's REST settings while a sink with a spool writes: a store that does not answer
#: costs a few seconds before the write waits in the spool (not MLflow's 7 retries of
#: 120 s each); the environment's own values win.
QUICK_REQUESTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
#: The timeout (s) of the study's summary write instead: it uploads the best model,
#: whose answer a server may take longer to give.
SUMMARY_TIMEOUT_S = 30


@contextlib.contextmanager
def quick_requests(timeout_s: int | None = None) -> Iterator[None]:
    """MLflow's REST calls fail fast while a sink with a spool writes (it spools and
    tries again), unless the environment sets their timeout and retries itself."""
    quick = dict(QUICK_REQUESTS)
    if timeout_s is not None:
        quick["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(timeout_s)
    added = [k for k in quick if k not in os.environ]
    for k in added:
        os.environ[k] = quick[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def timed_out(error: BaseException | None) -> bool:
    """Whether ``error`` is a call that timed out: its request may have reached a server
    that was stopped, and may still land once it runs again."""
    text = str(error or "").lower()
    return "timeout" in text or "timed out" in text


def short_error(error: BaseException) -> str:
    """``error`` in a few words: its innermost reason (urllib3 nests three deep)."""
    text = str(error)
    for marker in ("Caused by ", "failed with exception "):
        if marker in text:
            text = text.rsplit(marker, 1)[1]
    return f"{type(error).__name__}: {text.strip('()')[:200]}"
