"""The ground truth's storage: one JSON file of records, shared by concurrent studies.

Storage is one JSON file. Writers take an exclusive ``fcntl.flock`` on a sibling
``.lock`` file, re-read the file, change it and ``os.replace`` a temporary copy over it
(keeping the file's permissions); readers take a shared lock. Concurrent studies neither
corrupt the file nor lose records. Every record is validated when written and when read,
by one rule: finite numbers, exactly the features of ``CLUSTER_FEATURES``, a known
objective, a valid config. A file that is not valid raises :class:`GroundTruthError`
naming it and ``pipetune groundtruth repair``; it is never wiped silently.
:meth:`JsonStore.audit` lists every problem; :meth:`JsonStore.repair` keeps the
valid records and drops the rest.

**Bounded growth**: records are grouped by (similar profile, bucket, objective), where
records share a similar profile when they are within ``min_bound`` of the same distinct
profile (the walk the clustering counts clusters with, in
:mod:`pipetune.groundtruth.model`). When a new record takes its group past
``max_records_per_group``, the group's oldest records are dropped until it fits, except
the last record of the group's best config (chosen as the model chooses it, the new
record included): the store follows what recent trials measured, and the config it
answers with never ages out. Other groups are trimmed when they next receive a record.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shlex
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipetune.errors import GroundTruthError, SystemConfigError
from pipetune.groundtruth.model import best_config, bucket, config_key, leaders
from pipetune.profiler.profile import CLUSTER_FEATURES
from pipetune.system.config import SystemConfig

FORMAT_VERSION = 1
OBJECTIVES: tuple[str, ...] = ("time", "energy")

Records = list[dict[str, Any]]


@dataclass(frozen=True)
class StoreReport:
    """What :meth:`GroundTruth.audit` found in a store: ``records`` in it, the ``bad``
    ones as ``(index, why)``, and ``unreadable``, why the file as a whole is not a
    ground truth (then ``records`` is 0). ``path`` is the JSON file, or a SQL store's
    location (password masked); ``unit`` names what an index counts: ``"record"`` (a
    position in the file) or ``"row"`` (a SQL row id)."""

    path: Path | str
    records: int
    bad: tuple[tuple[int, str], ...] = ()
    unreadable: str | None = None
    unit: str = "record"

    @property
    def ok(self) -> bool:
        return not self.bad and self.unreadable is None

    @property
    def problems(self) -> list[str]:
        """One line per problem."""
        if self.unreadable is not None:
            return [f"not a ground-truth file: {self.unreadable}"]
        return [f"{self.unit} {i}: {why}" for i, why in self.bad]


@dataclass(frozen=True)
class Repair:
    """What :meth:`GroundTruth.repair` did: what it ``found``, the ``kept`` record count,
    the ``backup`` of the file (or table) as it was and, for an unreadable file, where it
    was ``moved`` (both ``None`` when there was nothing to repair)."""

    found: StoreReport
    kept: int
    backup: Path | None = None
    moved: Path | None = None


class JsonStore:
    """The records of one ground-truth file at ``path``, read and changed under a lock.

    Holds nothing but the path, so it pickles as that.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def __repr__(self) -> str:
        return f"JsonStore({str(self.path)!r})"

    @property
    def location(self) -> str:
        """The file, as messages name it."""
        return str(self.path)

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    @property
    def backup_path(self) -> Path:
        return self.path.with_name(self.path.name + ".bak")

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    # -- reading -------------------------------------------------------------------
    def read(self) -> Records:
        """Every record, validated; raises :class:`GroundTruthError` for a bad file."""
        return self.parse(self.snapshot())

    def snapshot(self) -> bytes:
        """The file's bytes as they are now, read under a shared lock (``b""`` when
        there is no file)."""
        if not self.path.exists():
            return b""
        with self._locked(exclusive=False):
            return self._read_raw()

    def _read_raw(self) -> bytes:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return b""
        except OSError as err:
            raise GroundTruthError(f"{self.path}: cannot read the ground truth ({err})") from err

    def _scan(self, raw: bytes) -> tuple[list[Any], list[tuple[int, str]]]:
        """The file's records and the bad ones among them as ``(index, why)``. Raises
        ``ValueError`` when the file as a whole is not a ground truth, and
        :class:`GroundTruthError` for one written by a newer pipetune (not to be touched)."""
        if not raw.strip():
            return [], []
        data = json.loads(raw)
        if not isinstance(data, dict) or not isinstance(data.get("records"), list):
            raise ValueError("expected an object with a 'records' list")
        version = data.get("version", FORMAT_VERSION)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"unknown format version {version!r}")
        if version > FORMAT_VERSION:
            raise GroundTruthError(
                f"{self.path}: written by a newer pipetune (format {version}); use that version"
            )
        records = data["records"]
        bad = [(i, why) for i, rec in enumerate(records) if (why := record_problem(rec))]
        return records, bad

    def _report(self, raw: bytes) -> tuple[StoreReport, Records]:
        """What is wrong with ``raw``, and its valid records."""
        try:
            records, bad = self._scan(raw)
        except (ValueError, RecursionError) as err:  # RecursionError: absurdly nested JSON
            return StoreReport(self.path, 0, unreadable=str(err) or type(err).__name__), []
        dropped = {i for i, _ in bad}
        good = [rec for i, rec in enumerate(records) if i not in dropped]
        return StoreReport(self.path, len(records), tuple(bad)), good

    def parse(self, raw: bytes) -> Records:
        """The records of ``raw`` (a :meth:`snapshot`); raises :class:`GroundTruthError`
        naming the file and the repair command when any of it is not valid."""
        found, records = self._report(raw)
        if not found.ok:
            raise invalid_store(found, str(self.path), "ground-truth file", "file")
        return records

    def __len__(self) -> int:
        return len(self.read())

    def check(self) -> int:
        """Read and validate the whole store now; return its record count."""
        return len(self.read())

    def audit(self) -> StoreReport:
        """Read the whole store and list every problem in it, without raising for them."""
        return self._report(self.snapshot())[0]

    # -- writing -------------------------------------------------------------------
    def _write(self, records: Records, mode: int) -> None:
        write_json(self.path, records, mode)

    def mutate(self, change: Callable[[Records], Records]) -> None:
        """Replace the records with ``change(records)``, under the exclusive lock; a bad
        store raises :class:`GroundTruthError` and is left as it was."""
        with self._locked(exclusive=True):
            records = change(self.parse(self._read_raw()))
            self._write(records, _mode_for(self.path))  # a rewrite keeps who may read it

    def clear(self) -> int:
        """Remove every record; returns how many there were."""
        removed = 0

        def wipe(records: Records) -> Records:
            nonlocal removed
            removed = len(records)
            return []

        if self.path.exists():
            self.mutate(wipe)
        return removed

    def repair(self) -> Repair:
        """Keep the valid records, back the file up first; see :meth:`GroundTruth.repair`."""
        if not self.path.exists():
            return Repair(StoreReport(self.path, 0), kept=0)
        with self._locked(exclusive=True):
            raw = self._read_raw()
            found, records = self._report(raw)
            if found.ok:
                return Repair(found, kept=len(records))
            mode = _mode_for(self.path)
            _write_atomic(self.backup_path, raw, mode)
            moved = None
            if found.unreadable is not None:
                moved = self._aside_path()
                os.rename(self.path, moved)
            self._write(records, mode)
        return Repair(found, kept=len(records), backup=self.backup_path, moved=moved)

    def _aside_path(self) -> Path:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while aside.exists():
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        return aside


def invalid_store(found: StoreReport, location: str, what: str, kind: str) -> GroundTruthError:
    """The error for a store whose audit ``found`` problems: the first, how many more,
    and the repair command. ``what`` the store is (``ground-truth file``), ``kind``
    what was left untouched (``file``, ``rows``)."""
    first, *more = found.problems
    also = f"; and {len(more)} more bad {found.unit}(s)" if more else ""
    return GroundTruthError(
        f"{location}: not a valid {what} ({first}{also}); run "
        f"`pipetune groundtruth repair --path {shlex.quote(location)}` to keep its valid "
        f"records and drop the rest (the {kind} was left untouched)"
    )


def capped(records: Records, max_records_per_group: int, min_bound: float) -> Records:
    """``records`` with the group of the last one cut to ``max_records_per_group``:
    its oldest records dropped, except the last record of its best config."""
    if len(records) <= max_records_per_group:
        return records
    import numpy as np

    names = CLUSTER_FEATURES
    x = np.array([[r["features"][n] for n in names] for r in records])
    keys = [(lead, bucket(r["batch_size"]), r["objective"])
            for lead, r in zip(leaders(x, min_bound), records, strict=True)]
    group = [i for i, key in enumerate(keys) if key == keys[-1]]
    excess = len(group) - max_records_per_group
    if excess <= 0:
        return records
    best, _ = best_config([records[i] for i in group])
    best_left = sum(1 for i in group if config_key(records[i]) == best)
    drop: set[int] = set()
    for i in group:  # oldest first
        if len(drop) == excess:
            break
        if config_key(records[i]) == best:
            if best_left == 1:
                continue
            best_left -= 1
        drop.add(i)
    return [rec for i, rec in enumerate(records) if i not in drop]


# -- the one rule for a record -----------------------------------------------------------

_REQUIRED = ("batch_size", "objective", "config", "cost")


def check_objective(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise GroundTruthError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    return objective


def _finite(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def record_problem(rec: Any) -> str | None:
    """Why a record is not valid, or ``None``: the one rule for writing and reading."""
    if not isinstance(rec, dict):
        return "is not an object"
    features = rec.get("features")
    if not isinstance(features, dict):
        return "features is missing or not an object"
    for name, value in features.items():
        if not _finite(value):
            return f"feature {name} is not a finite number ({value!r})"
    missing = [k for k in _REQUIRED if k not in rec]
    if missing:
        return f"lacks {', '.join(missing)}"
    bs = rec["batch_size"]
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
        return f"batch_size must be an integer >= 1, got {bs!r}"
    if rec["objective"] not in OBJECTIVES:
        return f"objective must be one of {OBJECTIVES}, got {rec['objective']!r}"
    cost = rec["cost"]
    if not _finite(cost) or cost < 0:
        return f"cost must be a finite number >= 0, got {cost!r}"
    if set(features) != set(CLUSTER_FEATURES):
        lacks = [n for n in CLUSTER_FEATURES if n not in features]
        extra = sorted(set(features) - set(CLUSTER_FEATURES))
        return (f"features differ from the {len(CLUSTER_FEATURES)} the ground truth "
                f"clusters on (missing {lacks}, extra {extra})")
    for name in ("job_key", "graph", "cost_unit"):  # optional strings
        if name in rec and not isinstance(rec[name], str):
            return f"{name} must be a string, got {rec[name]!r}"
    for name in ("one_time", "speedup"):  # optional; absent in records before them
        value = rec.get(name)
        if value is not None and (not _finite(value) or value < 0):
            return f"{name} must be a finite number >= 0, got {value!r}"
    if not isinstance(rec["config"], dict):
        return "config is not an object"
    try:
        SystemConfig.from_dict(rec["config"])
    except (ValueError, TypeError, KeyError, SystemConfigError) as err:
        return f"config: {err}"
    return None


# -- files -------------------------------------------------------------------------------


def write_json(path: Path, records: Records, mode: int | None = None) -> None:
    """Write ``records`` to ``path`` in the ground-truth file format (``FORMAT_VERSION``),
    in one step; ``mode`` defaults to the file's own permissions (see :func:`_mode_for`)."""
    payload = json.dumps({"version": FORMAT_VERSION, "records": records}, indent=1,
                         allow_nan=False)
    _write_atomic(path, payload.encode(), _mode_for(path) if mode is None else mode)


def _mode_for(path: Path) -> int:
    """The permission bits a rewrite of ``path`` keeps: the file's own, or for a new
    file what the umask allows of 0o666 (as ``open`` would have made it)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` with ``data`` in one step (a temporary copy, fsynced, renamed over
    it), with permission bits ``mode``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` would, for an
    instant, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
