"""A study's journal: every engine event, appended as it happens, so a study resumes.

The engine (:class:`pipetune.engine.study.Study`) is deterministic given its spec, its seeds
and the order of what it was told: which trial the searcher proposed, each finished
or failed epoch, each ground-truth match and tuning decision. The journal appends
those events, one line each, flushed before the engine acts on the next one; a
resumed study replays them into a fresh engine (:meth:`Study.replay`) and goes on
from there. Nothing is re-run that finished, and the searcher, the scheduler's rungs
and each trial's phases come back exactly as they were.

Layout, under ``$PIPETUNE_HOME/studies/<study_id>/``:

- ``study.json``: the header: job (as a dict), status (``running``, ``finished``,
  ``failed``, ``stopped``), MLflow parent run id, Prefect flow run id, stores used;
- ``events.jsonl``: one JSON object per line, ``{"seq", "kind", "trial", "data"}``,
  ``data`` the event's payload as plain JSON (:mod:`pipetune.jsondata`): a trial's
  params, an epoch's result, a ground-truth match, a tuning decision. Read back, each
  payload is checked against its type, field by field; nothing is unpickled (a journal
  of the old format, base64 pickles, is refused: ``journal_format`` in the header
  says which). A line cut short by a crash is the last one and is ignored. ``broken``
  (the study stopped on a broken workload) is not replayed: a resumed study goes on;
- ``failures/trial-T-epoch-E.txt``: the whole traceback of each epoch that raised.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetune.errors import PipetuneError
from pipetune.jsondata import DataError, from_data, to_data
from pipetune.runner import EpochResult
from pipetune.states import GroundTruthMatch
from pipetune.tuner import TuningDecision

if TYPE_CHECKING:
    from pipetune.engine.events import StudyEvent

#: Header states ``--resume`` without a study id picks from (``finished`` is the other).
UNFINISHED = ("running", "stopped", "failed")
#: Each event kind and the type its payload is read back as.
PAYLOADS: dict[str, Any] = {
    "start": dict[str, Any],
    "result": EpochResult,
    "failed": tuple[int, str, str | None],
    "match": GroundTruthMatch,
    "decision": TuningDecision,
    "unconfirmed": str,
    "broken": str,
}
KINDS = tuple(PAYLOADS)
#: The header's ``journal_format`` of a journal of JSON payloads (a header without it
#: belongs to a journal of pickled payloads, which is never read).
JOURNAL_FORMAT = 2


@dataclass(frozen=True)
class Event:
    seq: int
    kind: str
    trial: int
    data: Any


class JournalError(PipetuneError):
    """A journal that cannot be read or does not replay."""


def studies_root(home: Path | None = None) -> Path:
    from pipetune.home import pipetune_home

    return (home or pipetune_home()) / "studies"


class StudyJournal:
    """The journal of study ``study_id`` under ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path, study_id: str):
        self.root = Path(root)
        self.study_id = study_id
        self.folder = self.root / study_id
        self._lock = threading.Lock()
        self._seq = 0
        self._fh = None

    # -- header ---------------------------------------------------------------------
    @property
    def header_path(self) -> Path:
        return self.folder / "study.json"

    @property
    def events_path(self) -> Path:
        return self.folder / "events.jsonl"

    def create(self, **header: Any) -> StudyJournal:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write_header({"study_id": self.study_id, "status": "running",
                            "created": time.time(), "journal_format": JOURNAL_FORMAT,
                            **header})
        return self

    def header(self) -> dict[str, Any]:
        try:
            return json.loads(self.header_path.read_text())
        except (OSError, ValueError) as exc:
            raise JournalError(f"study {self.study_id}: cannot read {self.header_path}: {exc}") \
                from None

    def update(self, **changes: Any) -> None:
        with self._lock:
            self._write_header({**self.header(), **changes, "updated": time.time()})

    def _write_header(self, header: dict[str, Any]) -> None:
        tmp = self.header_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(header, indent=2, sort_keys=True, default=str))
        os.replace(tmp, self.header_path)

    # -- events ---------------------------------------------------------------------
    def append(self, kind: str, trial: int, data: Any) -> None:
        """Append one event; it is on disk (in the OS's hands) when this returns."""
        if kind not in KINDS:
            raise ValueError(f"unknown journal event {kind!r}")
        payload = to_data(data)
        with self._lock:
            if self._fh is None:
                self._open_for_append()
            self._seq += 1
            line = json.dumps({"seq": self._seq, "kind": kind, "trial": trial,
                               "data": payload}, ensure_ascii=False)
            self._fh.write(line.encode("utf-8") + b"\n")
            self._fh.flush()

    def observe(self, event: StudyEvent) -> None:
        """An engine observer (:mod:`pipetune.engine.events`): append the events a resumed
        study replays."""
        if event.journaled:
            self.append(event.journal_kind, event.trial_id, event.journal_data())

    def write_traceback(self, trial: int, epoch: int, text: str) -> Path:
        """Keep a failed epoch's whole traceback as ``failures/trial-T-epoch-E.txt`` in
        the study's folder; return its path."""
        folder = self.folder / "failures"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"trial-{trial}-epoch-{epoch}.txt"
        path.write_text(text, encoding="utf-8")
        return path

    def _open_for_append(self) -> None:
        """Cut a line a crash left torn (so the next event starts a line of its own),
        then number on from the last complete event."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.events_path, "ab+")  # noqa: SIM115
        self._fh.seek(0)
        text = self._fh.read()
        complete = text[: text.rfind(b"\n") + 1]
        if len(complete) < len(text):
            self._fh.truncate(len(complete))
        self._seq = complete.count(b"\n")
        if not self._seq and self.header_path.exists():
            # Its first event: a study an earlier pipetune created but that stopped
            # before any event is a journal of this format from now on.
            header = self.header()
            if header.get("journal_format") != JOURNAL_FORMAT:
                self._write_header({**header, "journal_format": JOURNAL_FORMAT})

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def _lines(self) -> Iterator[str]:
        if not self.events_path.exists():
            return
        with open(self.events_path, encoding="utf-8") as fh:
            yield from fh

    def events(self) -> list[Event]:
        """Every complete event, in order, each payload checked against its kind's type
        (a torn last line, from a crash, is dropped). A journal of the old format
        (pickled payloads) is refused, never unpickled."""
        lines = list(self._lines())
        if lines:
            self.check_format()
        out: list[Event] = []
        for i, line in enumerate(lines):
            try:
                out.append(self._event(line))
            except (ValueError, KeyError, TypeError) as exc:
                if i == len(lines) - 1 and not line.endswith("\n"):  # torn by a crash
                    break
                why = str(exc) if isinstance(exc, DataError) else type(exc).__name__
                raise JournalError(
                    f"study {self.study_id}: {self.events_path} line {i + 1} is corrupt "
                    f"({why}); the study cannot be resumed") from None
        return out

    def check_format(self) -> None:
        """Refuse a journal of the old format (pickled events: a file that could run
        code when read), which pipetune no longer reads."""
        if self.header().get("journal_format") != JOURNAL_FORMAT and self.events_path.exists():
            raise JournalError(
                f"study {self.study_id}: its journal {self.events_path} is in the old "
                "format (pickled events, which pipetune no longer reads: a file that could "
                "run code when read); it cannot be resumed: start the study again")

    @staticmethod
    def _event(line: str) -> Event:
        raw = json.loads(line)
        if not isinstance(raw, dict):
            raise DataError("an event is a JSON object")
        kind = from_data(str, raw.get("kind"), "kind")
        if kind not in PAYLOADS:
            raise DataError(f"kind: {kind!r} is not one of {', '.join(KINDS)}")
        return Event(from_data(int, raw.get("seq"), "seq"), kind,
                     from_data(int, raw.get("trial"), "trial"),
                     from_data(PAYLOADS[kind], raw.get("data"), kind))


def find_study(root: str | Path, wanted: str | None, job_name: str | None = None) -> StudyJournal:
    """The journal to resume: study id or Prefect flow run id ``wanted``; with ``None``
    or ``"latest"`` the newest unfinished study of job ``job_name``."""
    root = Path(root)
    wanted = None if wanted == "latest" else wanted
    headers: list[dict[str, Any]] = []
    for path in sorted(root.glob("*/study.json")) if root.exists() else []:
        try:
            headers.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if wanted:
        for h in headers:
            if wanted in (h.get("study_id"), h.get("flow_run_id")):
                return StudyJournal(root, h["study_id"])
        raise JournalError(f"--resume: no study or flow run {wanted!r} under {root}")
    candidates = [h for h in headers if h.get("status") in UNFINISHED
                  and (job_name is None or h.get("job_name") == job_name)]
    if not candidates:
        raise JournalError(f"--resume: no unfinished study of job {job_name!r} under {root}")
    newest = max(candidates, key=lambda h: h.get("created", 0))
    return StudyJournal(root, newest["study_id"])
