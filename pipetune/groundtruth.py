"""The ground truth: the best system config known for each kind of job, shared by studies.

Every trial that probed leaves one record: its epoch-1 profile, batch size, system
objective, the config it kept and that config's cost per sample. A later trial's
profile is compared with the records; if it is similar to a cluster of past profiles
and that cluster knows a config for the trial's batch-size bucket and objective, the
trial uses it and skips probing.

How similarity is decided (lazily, at lookup; refitted only when the file's content
changed, so lookups on an unchanged store reuse one fit):

- **Features**: ``Profile.vector(CLUSTER_FEATURES)``.
- **Noise units**: each feature has a floor in :data:`SCALE_FLOORS`, the size of a
  difference that does not tell jobs apart (run-to-run jitter): 5 points of operator
  mix, a tenth of a core of CPU use, ~28% of speed, work or memory (0.25 in log units),
  half of a per-step count (relative to the larger of the two values compared, at least
  1: context switches and page faults per step are dominated by process warm-up and
  differ several-fold within one job, so each can add at most 2 units). A **distance**
  is the root-mean-square over features of the difference divided by the floor, so 1
  means "one floor per feature on average", whatever the number of features.
- **Clusters**: scikit-learn ``KMeans`` (``n_init=10``, ``random_state=0``) on the
  standardised features (``StandardScaler``: mean and population standard deviation over
  the records), each feature's scale floored at its noise floor so a feature that barely
  varies across a handful of records (or not at all) does not blow distances up. The
  number of clusters is the number of *distinct* profiles, capped at ``max_clusters``:
  walking the records in the order they were stored, a record is distinct when it is
  farther than ``min_bound`` from every distinct record before it, the distance under
  which a lookup calls a profile similar to a one-record cluster; so two records that
  would not be called similar to each other do not share a cluster (until the cap).
  Cluster ids are ordered by each cluster's oldest record, so they stay put as records
  are added.
- **Bound**: a profile is similar to its nearest cluster when its distance to the
  centroid is at most ``max(min_bound, bound_factor * radius)``, where ``radius`` is the
  RMS distance of the cluster's members to its centroid (the square root of the
  cluster's inertia per member: the paper derived its "new job" bound from the k-means
  inertia the same way). ``min_bound`` gives a one-record cluster, whose radius is 0, a
  non-zero reach. Similarity is measured in noise units rather than in standard
  deviations on purpose: the standard deviation over the store grows with every
  different job recorded, and a bound in those units would let a job halfway between
  two known ones count as similar to both.
- **Best config** for (cluster, bucket, objective): the records of that cluster with
  that batch-size bucket and objective, grouped by config; the config with the lowest
  median cost wins (ties: more records, then the older). ``support`` is the number of
  records (trials) that chose that config; ``cost`` its median.

**Bounded growth**: records are grouped by (similar profile, bucket, objective), where
records share a similar profile when they are within ``min_bound`` of the same distinct
profile (the walk the clustering counts clusters with). When a new record takes its group
past ``max_records_per_group``, the group's oldest records are dropped until it fits,
except the last record of the group's best config (chosen as above, the new record
included): the store follows what recent trials measured, and the config it answers
with never ages out. Other groups are trimmed when they next receive a record.

Storage is one JSON file. Writers take an exclusive ``fcntl.flock`` on a sibling
``.lock`` file, re-read the file, change it and ``os.replace`` a temporary copy over it
(keeping the file's permissions); readers take a shared lock. Concurrent studies neither
corrupt the file nor lose records. Every record is validated when written and when read,
by one rule: finite numbers, exactly the features of ``CLUSTER_FEATURES``, a known
objective, a valid config. A file that is not valid raises :class:`GroundTruthError`
naming it and ``pipetune groundtruth repair``; it is never wiped silently.
:meth:`GroundTruth.audit` lists every problem; :meth:`GroundTruth.repair` keeps the
valid records and drops the rest.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shlex
import stat
import statistics
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipetune.errors import GroundTruthError, SpecError, SystemConfigError
from pipetune.home import pipetune_home
from pipetune.profiler.profile import CLUSTER_FEATURES, Profile
from pipetune.system.config import SystemConfig
from pipetune.tuner import GroundTruthMatch

FORMAT_VERSION = 1
OBJECTIVES: tuple[str, ...] = ("time", "energy")

_SHARE = (0.1, 0.0)
_LOG = (0.25, 0.0)
_COUNT = (1.0, 0.5)
#: Per feature, ``(absolute, relative)``: its noise floor at value ``v`` is
#: ``max(absolute, relative * |v|)``. See the module docstring for why.
SCALE_FLOORS: dict[str, tuple[float, float]] = {
    "op_conv_share": _SHARE,
    "op_matmul_share": _SHARE,
    "op_elementwise_share": _SHARE,
    "op_data_share": _SHARE,
    "op_other_share": _SHARE,
    "cpu_util": (0.1, 0.0),
    "log_samples_per_s": _LOG,
    "log_flops_proxy": _LOG,
    "ctx_switches_per_step": _COUNT,
    "page_faults_per_step": _COUNT,
    "log_peak_rss_mb": _LOG,
}
#: Floor for a feature missing from :data:`SCALE_FLOORS`.
DEFAULT_SCALE_FLOOR: tuple[float, float] = (0.1, 0.1)

_KMEANS_N_INIT = 10
_KMEANS_SEED = 0


@dataclass(frozen=True)
class GroundTruthEntry:
    """The best known config of one (cluster, batch-size bucket, objective)."""

    cluster: int
    bucket: int
    objective: str
    config: SystemConfig
    cost: float
    support: int


@dataclass(frozen=True)
class StoreReport:
    """What :meth:`GroundTruth.audit` found in a store file: ``records`` in it, the
    ``bad`` ones as ``(index, why)``, and ``unreadable``, why the file as a whole is not
    a ground truth (then ``records`` is 0)."""

    path: Path
    records: int
    bad: tuple[tuple[int, str], ...] = ()
    unreadable: str | None = None

    @property
    def ok(self) -> bool:
        return not self.bad and self.unreadable is None

    @property
    def problems(self) -> list[str]:
        """One line per problem."""
        if self.unreadable is not None:
            return [f"not a ground-truth file: {self.unreadable}"]
        return [f"record {i}: {why}" for i, why in self.bad]


@dataclass(frozen=True)
class Repair:
    """What :meth:`GroundTruth.repair` did: what it ``found``, the ``kept`` record count,
    the ``backup`` of the file as it was and, for an unreadable file, where it was
    ``moved`` (both ``None`` when there was nothing to repair)."""

    found: StoreReport
    kept: int
    backup: Path | None = None
    moved: Path | None = None


@dataclass
class _Fit:
    """Clusters fitted on one version of the records."""

    key: str
    names: tuple[str, ...]
    centroids: Any  # np.ndarray (k, d), feature units
    sizes: list[int]
    radius: list[float]
    bounds: list[float]
    entries: dict[tuple[int, int, str], GroundTruthEntry]


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


class GroundTruth:
    """The shared store of best system configs, keyed by job profile and batch size.

    ``path`` defaults to ``pipetune_home() / "groundtruth.json"``. See the module
    docstring for how ``max_clusters``, ``bound_factor``, ``min_bound`` and
    ``max_records_per_group`` are used.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        max_clusters: int = 8,
        bound_factor: float = 2.0,
        min_bound: float = 2.0,
        max_records_per_group: int = 200,
    ) -> None:
        if not isinstance(max_clusters, int) or isinstance(max_clusters, bool) or max_clusters < 1:
            raise SpecError(
                "pipetune.similarity.max_clusters", f"must be an integer >= 1, got {max_clusters!r}"
            )
        if not bound_factor >= 0:
            raise SpecError(
                "pipetune.similarity.bound_factor", f"must be >= 0, got {bound_factor!r}"
            )
        if not min_bound > 0:
            raise SpecError("pipetune.similarity.min_bound", f"must be > 0, got {min_bound!r}")
        if (not isinstance(max_records_per_group, int) or isinstance(max_records_per_group, bool)
                or max_records_per_group < 1):
            raise SpecError(
                "max_records_per_group",
                f"must be an integer >= 1, got {max_records_per_group!r}",
            )
        self.path = (
            Path(path).expanduser() if path is not None else (pipetune_home() / "groundtruth.json")
        )
        self.max_clusters = max_clusters
        self.bound_factor = float(bound_factor)
        self.min_bound = float(min_bound)
        self.max_records_per_group = max_records_per_group
        self._fit: _Fit | None = None
        self._fit_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"GroundTruth({str(self.path)!r})"

    # -- public API ----------------------------------------------------------------
    @staticmethod
    def bucket(batch_size: int) -> int:
        """The power-of-two bucket of a batch size: the largest power of two <= it.

        >>> [GroundTruth.bucket(b) for b in (1, 32, 48, 63, 64, 100)]
        [1, 32, 32, 32, 64, 64]
        """
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise GroundTruthError(f"batch size must be an integer >= 1, got {batch_size!r}")
        return 1 << (batch_size.bit_length() - 1)

    def lookup(self, profile: Profile, batch_size: int, objective: str) -> GroundTruthMatch:
        """The best known config for a job with this epoch-1 profile, or why there is none.

        A profile with a non-finite feature cannot be compared and is answered with a
        miss; a profile that lacks a feature raises :class:`GroundTruthError`.
        """
        objective = _check_objective(objective)
        bucket = self.bucket(batch_size)
        features = _profile_features(profile)
        bad = [n for n, v in features.items() if not math.isfinite(v)]
        if bad:
            return GroundTruthMatch.miss(f"profile feature {bad[0]} is not finite", bucket=bucket)
        fit = self._fitted()
        if fit is None:
            return GroundTruthMatch.miss("the ground truth has no records yet", bucket=bucket)
        import numpy as np

        x = np.array([features[n] for n in fit.names])
        dists = _noise_distance(fit.names, fit.centroids, x)
        cluster = int(np.argmin(dists))
        distance = float(dists[cluster])
        bound = fit.bounds[cluster]
        where = f"cluster {cluster} at distance {distance:.3g}"
        near = dict(cluster=cluster, bucket=bucket, distance=distance, bound=bound)
        if distance > bound:
            return GroundTruthMatch(
                hit=False,
                config=None,
                cost=None,
                support=0,
                **near,
                reason=f"new job: nearest is {where} > bound {bound:.3g}",
            )
        entry = fit.entries.get((cluster, bucket, objective))
        if entry is None:
            return GroundTruthMatch(
                hit=False,
                config=None,
                cost=None,
                support=0,
                **near,
                reason=f"similar to {where} <= bound {bound:.3g}, but no config is known "
                f"there for batch bucket {bucket} and objective {objective}",
            )
        return GroundTruthMatch(
            hit=True,
            config=entry.config,
            cost=entry.cost,
            support=entry.support,
            **near,
            reason=f"similar to {where} <= bound {bound:.3g}; bucket {bucket}, {objective}: "
            f"{entry.config.label()} chosen by {entry.support} trial(s)",
        )

    def record(
        self,
        profile: Profile,
        batch_size: int,
        objective: str,
        config: SystemConfig,
        cost: float,
        *,
        job: str = "",
        trial: str = "",
    ) -> None:
        """Store the config a trial kept, under its epoch-1 profile. Safe across processes.

        The record is checked by the rule records are read with (finite features and
        cost, ...); one that would not read back raises :class:`GroundTruthError` and
        nothing is written. So does a store that is not valid. The record's group is
        then cut to ``max_records_per_group`` (see the module docstring).
        """
        objective = _check_objective(objective)
        self.bucket(batch_size)
        if not isinstance(config, SystemConfig):
            raise GroundTruthError(f"config must be a SystemConfig, got {type(config).__name__}")
        rec = {
            "features": _profile_features(profile),
            "batch_size": batch_size,
            "objective": objective,
            "config": config.to_dict(),
            "cost": float(cost),
            "job": str(job),
            "trial": str(trial),
            "time": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        why = _record_problem(rec)
        if why is not None:
            raise GroundTruthError(f"{why}; not recorded")
        self._mutate(lambda records: self._capped([*records, rec]))
        # Refit now, in the background, so the next lookup does not pay for it on the
        # study's critical path (a k-means fit took ~1 s here); a lookup that comes
        # first waits for this fit rather than doing its own.
        self.prepare_in_background()

    def __getstate__(self) -> dict[str, Any]:  # crosses processes without its fit or lock
        state = dict(self.__dict__)
        state["_fit"] = None
        del state["_fit_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fit_lock = threading.Lock()

    def prepare_in_background(self) -> None:
        """Fit the clusters in a background thread; the next lookup waits for that fit
        instead of doing its own, and reports a broken store itself."""
        def fit_quietly() -> None:
            with contextlib.suppress(Exception):
                self._fitted()

        threading.Thread(target=fit_quietly, daemon=True, name="pipetune-groundtruth-fit").start()

    def entries(self) -> list[GroundTruthEntry]:
        """Every (cluster, bucket, objective) with its best config, sorted by those keys."""
        fit = self._fitted()
        if fit is None:
            return []
        return [fit.entries[k] for k in sorted(fit.entries)]

    def clusters(self) -> list[dict[str, Any]]:
        """The clusters, for display: ``id``, ``size``, ``radius``, ``bound``, ``centroid``
        (feature -> value in the profile's own units) and ``entries`` (bucket, objective,
        config, cost, support)."""
        fit = self._fitted()
        if fit is None:
            return []
        out: list[dict[str, Any]] = []
        for cid in range(len(fit.sizes)):
            centroid = fit.centroids[cid]
            out.append(
                {
                    "id": cid,
                    "size": fit.sizes[cid],
                    "radius": fit.radius[cid],
                    "bound": fit.bounds[cid],
                    "centroid": {n: float(v) for n, v in zip(fit.names, centroid, strict=True)},
                    "entries": [
                        {
                            "bucket": e.bucket,
                            "objective": e.objective,
                            "config": e.config.to_dict(),
                            "cost": e.cost,
                            "support": e.support,
                        }
                        for k, e in sorted(fit.entries.items())
                        if k[0] == cid
                    ],
                }
            )
        return out

    def clear(self) -> int:
        """Remove every record; returns how many there were."""
        removed = 0

        def wipe(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
            nonlocal removed
            removed = len(records)
            return []

        if self.path.exists():
            self._mutate(wipe)
        self._fit = None
        return removed

    def __len__(self) -> int:
        return len(self._read())

    # -- storage -------------------------------------------------------------------
    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    @property
    def backup_path(self) -> Path:
        return self.path.with_name(self.path.name + ".bak")

    def _read(self) -> list[dict[str, Any]]:
        return self._parse(self._snapshot())

    def _snapshot(self) -> bytes:
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
        bad = [(i, why) for i, rec in enumerate(records) if (why := _record_problem(rec))]
        return records, bad

    def _report(self, raw: bytes) -> tuple[StoreReport, list[dict[str, Any]]]:
        """What is wrong with ``raw``, and its valid records."""
        try:
            records, bad = self._scan(raw)
        except (ValueError, RecursionError) as err:  # RecursionError: absurdly nested JSON
            return StoreReport(self.path, 0, unreadable=str(err) or type(err).__name__), []
        dropped = {i for i, _ in bad}
        good = [rec for i, rec in enumerate(records) if i not in dropped]
        return StoreReport(self.path, len(records), tuple(bad)), good

    def _parse(self, raw: bytes) -> list[dict[str, Any]]:
        found, records = self._report(raw)
        if not found.ok:
            first, *more = found.problems
            also = f"; and {len(more)} more bad record(s)" if more else ""
            raise GroundTruthError(
                f"{self.path}: not a valid ground-truth file ({first}{also}); run "
                f"`pipetune groundtruth repair --path {shlex.quote(str(self.path))}` to keep "
                "its valid records and drop the rest (the file was left untouched)"
            )
        return records

    def _write(self, records: list[dict[str, Any]], mode: int) -> None:
        payload = json.dumps({"version": FORMAT_VERSION, "records": records}, indent=1,
                             allow_nan=False)
        _write_atomic(self.path, payload.encode(), mode)

    def _mutate(self, change: Any) -> None:
        with self._locked(exclusive=True):
            records = change(self._parse(self._read_raw()))
            self._write(records, _mode_for(self.path))  # a rewrite keeps who may read it

    def check(self) -> int:
        """Read and validate the whole store now; return its record count. A study calls
        this before it records anything, so a corrupt store stops it at once with
        :class:`GroundTruthError` instead of at its first lookup."""
        return len(self._read())

    def audit(self) -> StoreReport:
        """Read the whole store and list every problem in it, without raising for them
        (:meth:`check` raises at the first)."""
        return self._report(self._snapshot())[0]

    def repair(self) -> Repair:
        """Keep every valid record and drop the bad ones; a file that cannot be read as a
        ground truth at all is moved aside to ``<file>.corrupt-<UTC time>`` and an empty
        store started. Before changing anything the file as it was is copied to
        ``<file>.bak``; both keep the file's permissions. A valid store is left as it
        was. Safe across processes."""
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

    def _capped(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``records`` with the group of the last one cut to ``max_records_per_group``:
        its oldest records dropped, except the last record of its best config."""
        if len(records) <= self.max_records_per_group:
            return records
        import numpy as np

        names = CLUSTER_FEATURES
        leaders = self._leaders(np.array([[r["features"][n] for n in names] for r in records]))
        keys = [(lead, self.bucket(r["batch_size"]), r["objective"])
                for lead, r in zip(leaders, records, strict=True)]
        group = [i for i, key in enumerate(keys) if key == keys[-1]]
        excess = len(group) - self.max_records_per_group
        if excess <= 0:
            return records
        best, _ = _best_config([records[i] for i in group])
        best_left = sum(1 for i in group if _config_key(records[i]) == best)
        drop: set[int] = set()
        for i in group:  # oldest first
            if len(drop) == excess:
                break
            if _config_key(records[i]) == best:
                if best_left == 1:
                    continue
                best_left -= 1
            drop.add(i)
        return [rec for i, rec in enumerate(records) if i not in drop]

    # -- clustering ----------------------------------------------------------------
    def prepare(self) -> None:
        """Read the store and fit its clusters now (scikit-learn's import included), so
        a study's first lookup does not pay for it; the fit is reused until the store
        changes. Safe to call from a background thread."""
        self._fitted()

    def _fitted(self) -> _Fit | None:
        with self._fit_lock:
            raw = self._snapshot()
            key = hashlib.sha1(raw).hexdigest()
            if self._fit is not None and self._fit.key == key:
                return self._fit  # unchanged content: neither re-parsed nor refitted
            records = self._parse(raw)
            self._fit = self._fit_records(records, key) if records else None
            return self._fit

    def _fit_records(self, records: list[dict[str, Any]], key: str) -> _Fit:
        import numpy as np

        names = CLUSTER_FEATURES
        x = np.array([[float(r["features"][n]) for n in names] for r in records])

        k = min(self.max_clusters, len(set(self._leaders(x))))
        if k == 1:
            labels = np.zeros(len(x), dtype=int)
        else:
            from sklearn.cluster import KMeans

            mean = x.mean(axis=0)
            scale = np.maximum(x.std(axis=0), _floors(names, mean))
            km = KMeans(n_clusters=k, n_init=_KMEANS_N_INIT, random_state=_KMEANS_SEED)
            labels = km.fit((x - mean) / scale).labels_
        # Renumber clusters by their oldest record so ids survive a refit.
        order = list(dict.fromkeys(int(label) for label in labels))
        labels = np.array([order.index(int(label)) for label in labels])

        centroids, sizes, radius, bounds = [], [], [], []
        for cid in range(len(order)):
            members = x[labels == cid]
            centroid = members.mean(axis=0)
            r = float(np.sqrt(np.mean(_noise_distance(names, members, centroid) ** 2)))
            centroids.append(centroid)
            sizes.append(len(members))
            radius.append(r)
            bounds.append(max(self.min_bound, self.bound_factor * r))

        groups: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
        for rec, cid in zip(records, labels, strict=True):
            gkey = (int(cid), self.bucket(rec["batch_size"]), rec["objective"])
            groups.setdefault(gkey, []).append(rec)
        entries = {gkey: _best_entry(gkey, recs) for gkey, recs in groups.items()}
        return _Fit(key, names, np.array(centroids), sizes, radius, bounds, entries)

    def _leaders(self, x: Any) -> list[int]:
        """Each row's distinct profile, as a row index: walking the rows in order, a row
        farther than ``min_bound`` from every distinct row before it is distinct (its
        own leader); any other row belongs to the nearest of those."""
        import numpy as np

        leaders: list[int] = []
        out: list[int] = []
        for i, row in enumerate(x):
            if leaders:
                dists = _noise_distance(CLUSTER_FEATURES, x[leaders], row)
                nearest = int(np.argmin(dists))
                if dists[nearest] <= self.min_bound:
                    out.append(leaders[nearest])
                    continue
            leaders.append(i)
            out.append(i)
        return out


def _config_key(rec: dict[str, Any]) -> str:
    return json.dumps(rec["config"], sort_keys=True)


def _best_config(recs: list[dict[str, Any]]) -> tuple[str, list[float]]:
    """The config (as :func:`_config_key`) with the lowest median cost among ``recs``,
    ties to more records, then the older; and its costs."""
    by_config: dict[str, list[float]] = {}
    for rec in recs:
        by_config.setdefault(_config_key(rec), []).append(float(rec["cost"]))
    # Insertion order is record order; min() keeps the first of equals: older wins ties.
    best = min(by_config, key=lambda c: (statistics.median(by_config[c]), -len(by_config[c])))
    return best, by_config[best]


def _best_entry(gkey: tuple[int, int, str], recs: list[dict[str, Any]]) -> GroundTruthEntry:
    best, costs = _best_config(recs)
    cluster, bucket, objective = gkey
    return GroundTruthEntry(
        cluster=cluster,
        bucket=bucket,
        objective=objective,
        config=SystemConfig.from_dict(json.loads(best)),
        cost=float(statistics.median(costs)),
        support=len(costs),
    )


def _floors(names: tuple[str, ...], at: Any) -> Any:
    """Each feature's noise floor at the values ``at``."""
    import numpy as np

    pairs = [SCALE_FLOORS.get(n, DEFAULT_SCALE_FLOOR) for n in names]
    absolute = np.array([a for a, _ in pairs])
    relative = np.array([r for _, r in pairs])
    return np.maximum(absolute, relative * np.abs(at))


def _noise_distance(names: tuple[str, ...], points: Any, other: Any) -> Any:
    """Root-mean-square over features of the difference in noise units, one per row.

    A relative floor is taken at the larger magnitude of the two values, so the distance
    is symmetric and one count feature adds at most ``1 / relative`` units however far
    apart its values are (a cold process's first epoch faults in pages a warm one does
    not, so such counts differ by orders of magnitude within one job).
    """
    import numpy as np

    points = np.atleast_2d(points)
    floors = _floors(names, np.maximum(np.abs(points), np.abs(other)))
    return np.sqrt(np.mean(((points - other) / floors) ** 2, axis=1))


def _profile_features(profile: Profile) -> dict[str, float]:
    try:
        vector = profile.vector(CLUSTER_FEATURES)
    except KeyError as err:
        raise GroundTruthError(f"cannot use this profile: {err.args[0]}") from None
    return dict(zip(CLUSTER_FEATURES, vector, strict=True))


def _check_objective(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise GroundTruthError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    return objective


_REQUIRED = ("batch_size", "objective", "config", "cost")


def _finite(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _record_problem(rec: Any) -> str | None:
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
    if not isinstance(rec["config"], dict):
        return "config is not an object"
    try:
        SystemConfig.from_dict(rec["config"])
    except (ValueError, TypeError, KeyError, SystemConfigError) as err:
        return f"config: {err}"
    return None
