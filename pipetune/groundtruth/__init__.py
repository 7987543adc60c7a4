"""The ground truth: the best system config known for each kind of job, shared by studies.

Every trial that probed leaves one record: its epoch-1 profile, batch size, system
objective, the config it kept and that config's cost per sample. A later trial's
profile is compared with the records; if it is similar to a cluster of past profiles
and that cluster knows a config for the trial's batch-size bucket and objective, the
trial uses it and skips probing.

:class:`GroundTruth` is the one object callers use; it combines two parts that change
for different reasons:

- :mod:`pipetune.groundtruth.model`: how similarity is decided (features, noise floors,
  distances, the k-means clusters and their bounds) and which config is best;
- the store: :mod:`pipetune.groundtruth.sql` (a SQLite file or a PostgreSQL database,
  the default) or :mod:`pipetune.groundtruth.store` (one JSON file, also the
  import/export format, which holds the one validation rule for records, audit and
  repair, and the cap on each group's records); :mod:`pipetune.groundtruth.location`
  picks one from a path or URL.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipetune.errors import GroundTruthError, SpecError
from pipetune.groundtruth.location import GROUNDTRUTH_ENV, open_store
from pipetune.groundtruth.model import (
    DEFAULT_SCALE_FLOOR,
    SCALE_FLOORS,
    Fit,
    GroundTruthEntry,
    Similarity,
    bucket,
    profile_features,
)
from pipetune.groundtruth.store import (
    FORMAT_VERSION,
    OBJECTIVES,
    JsonStore,
    Records,
    Repair,
    StoreReport,
    capped,
    check_objective,
    record_problem,
    write_json,
)
from pipetune.profiler.profile import Profile
from pipetune.states import GroundTruthMatch
from pipetune.system.config import SystemConfig

__all__ = [
    "DEFAULT_SCALE_FLOOR",
    "FORMAT_VERSION",
    "GROUNDTRUTH_ENV",
    "OBJECTIVES",
    "SCALE_FLOORS",
    "GroundTruth",
    "GroundTruthEntry",
    "JsonStore",
    "Repair",
    "Similarity",
    "StoreReport",
]


def _forward(holder: str, name: str, doc: str) -> property:
    """A read-only property giving ``self.<holder>.<name>``."""
    return property(lambda self: getattr(getattr(self, holder), name), doc=doc)


class GroundTruth:
    """The shared store of best system configs, keyed by job profile and batch size.

    ``location`` is a path or URL (see :mod:`pipetune.groundtruth.location`): by default
    ``$PIPETUNE_GROUNDTRUTH``, else ``sqlite:///<pipetune_home()>/groundtruth.db``
    (which imports an old ``groundtruth.json`` beside it once). ``max_clusters``,
    ``bound_factor`` and ``min_bound`` set the similarity rule (see
    :mod:`pipetune.groundtruth.model`), ``max_records_per_group`` the bounded growth
    (see :mod:`pipetune.groundtruth.store`).
    """

    def __init__(
        self,
        location: str | Path | None = None,
        *,
        max_clusters: int = 8,
        bound_factor: float = 2.0,
        min_bound: float = 2.0,
        max_records_per_group: int = 200,
    ) -> None:
        self._similarity = Similarity(max_clusters, bound_factor, min_bound)
        if (not isinstance(max_records_per_group, int) or isinstance(max_records_per_group, bool)
                or max_records_per_group < 1):
            raise SpecError(
                "max_records_per_group",
                f"must be an integer >= 1, got {max_records_per_group!r}",
            )
        self._store = open_store(location)
        self.max_records_per_group = max_records_per_group
        self._fit: Fit | None = None
        self._fit_lock = threading.Lock()
        #: The records as last read, keyed by the store's snapshot (:meth:`_records`).
        self._read: tuple[bytes, Records] | None = None
        self._read_lock = threading.Lock()
        #: known()'s answers for the records last read (a GroundTruthMatch is frozen).
        self._known: tuple[Records | None, dict[tuple[str, str], Any]] = (None, {})
        self._refit = [False, False]  # a background fit asked for, a thread fitting

    def __repr__(self) -> str:
        return f"GroundTruth({self.location!r})"

    def __getstate__(self) -> dict[str, Any]:  # crosses processes without its fit or lock
        state = dict(self.__dict__)
        state["_fit"] = state["_read"] = None
        state["_known"], state["_refit"] = (None, {}), [False, False]
        del state["_fit_lock"], state["_read_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fit_lock, self._read_lock = threading.Lock(), threading.Lock()

    # -- settings: read from the store and the similarity section ----------------------
    location = _forward("_store", "location", "Where it is, for messages: the JSON file, or "
                        "the database URL with any password as ``***``.")
    path = _forward("_store", "path", "The JSON or SQLite file; ``None`` for a server.")
    lock_path = _forward("_store", "lock_path", "A JSON file's lock file (else ``None``).")
    backup_path = _forward("_store", "backup_path", "Where ``repair`` keeps a JSON file as "
                           "it was (a SQL store's repair names its backup: ``Repair.backup``).")
    max_clusters = _forward("_similarity", "max_clusters", "At most this many clusters.")
    bound_factor = _forward("_similarity", "bound_factor", "Bound = factor x spread.")
    min_bound = _forward("_similarity", "min_bound", "The smallest bound of a cluster.")

    # -- public API ----------------------------------------------------------------
    @staticmethod
    def bucket(batch_size: int) -> int:
        """The power-of-two bucket of a batch size: the largest power of two <= it.

        >>> [GroundTruth.bucket(b) for b in (1, 32, 48, 63, 64, 100)]
        [1, 32, 32, 32, 64, 64]
        """
        return bucket(batch_size)

    def lookup(self, profile: Profile, batch_size: int, objective: str) -> GroundTruthMatch:
        """The best known config for a job with this epoch-1 profile, or why there is none.

        A profile with a non-finite feature cannot be compared and is answered with a
        miss; a profile that lacks a feature raises :class:`GroundTruthError`.
        """
        objective = check_objective(objective)
        bucket_ = bucket(batch_size)
        features = profile_features(profile)
        bad = [n for n, v in features.items() if not math.isfinite(v)]
        if bad:
            return GroundTruthMatch.miss(f"profile feature {bad[0]} is not finite", bucket=bucket_)
        fit = self._fitted()
        if fit is None:
            return GroundTruthMatch.miss("the ground truth has no records yet", bucket=bucket_)
        return fit.match(features, bucket_, objective)

    def remember(
        self,
        profile: Profile,
        batch_size: int,
        objective: str,
        config: SystemConfig,
        cost: float,
        *,
        job: str = "",
        trial: str = "",
        one_time: float | None = None,
        speedup: float | None = None,
        job_key: str = "",
        graph: str = "",
        cost_unit: str = "",
    ) -> None:
        """Store the config a trial kept, under its epoch-1 profile. Safe across processes.

        ``one_time`` (what the config cost once, e.g. compiling) and ``speedup`` (its
        steady rate against the same config without its one-time knobs; for a config
        without any, against the trial's default) let a later trial weigh a one-time
        knob against the epochs it has left without probing it. ``job_key``, ``graph``
        and ``cost_unit`` let :meth:`known` answer for this very job.

        The record is checked by the rule records are read with (finite features and
        cost, ...); one that would not read back raises :class:`GroundTruthError` and
        nothing is written. So does a store that is not valid. The record's group is
        then cut to ``max_records_per_group`` (see :mod:`pipetune.groundtruth.store`).
        """
        objective = check_objective(objective)
        bucket(batch_size)
        if not isinstance(config, SystemConfig):
            raise GroundTruthError(f"config must be a SystemConfig, got {type(config).__name__}")
        rec = {
            "features": profile_features(profile),
            "batch_size": batch_size,
            "objective": objective,
            "config": config.to_dict(),
            "cost": float(cost),
            "job": str(job),
            "trial": str(trial),
            "time": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        if one_time is not None:
            rec["one_time"] = float(one_time)
        if speedup is not None:
            rec["speedup"] = float(speedup)
        if job_key:
            rec["job_key"] = str(job_key)
        if graph:
            rec["graph"] = str(graph)
        if cost_unit:
            rec["cost_unit"] = str(cost_unit)
        why = record_problem(rec)
        if why is not None:
            raise GroundTruthError(f"{why}; not recorded")
        self._store.mutate(
            lambda records: capped([*records, rec], self.max_records_per_group, self.min_bound)
        )
        # Refit now, in the background, so the next lookup does not pay for it on the
        # study's critical path (a k-means fit took ~1 s here); a lookup that comes
        # first waits for this fit rather than doing its own.
        self.prepare_in_background()

    def record(self, *args: Any, **kwargs: Any) -> None:
        """Deprecated name of :meth:`remember` (one meaning per word: "record" is the
        MLflow record); it goes in the next release."""
        warnings.warn("GroundTruth.record is now GroundTruth.remember; the old name goes "
                      "in the next release", DeprecationWarning, stacklevel=2)
        self.remember(*args, **kwargs)

    def known(self, job_key: str, objective: str) -> GroundTruthMatch | None:
        """The best config recorded for this very job (``job_key``: the same workload,
        params and model-shaping hyperparameters, see
        :meth:`pipetune.engine.study.Study.job_key`), or ``None`` when none is recorded. The
        answer names the model graph signature behind it (``known_graph``), which the
        trial's first epoch confirms, and the config's one-time cost and speed-up."""
        objective = check_objective(objective)
        if not job_key:
            return None
        records = self._records()
        with self._read_lock:  # the answer, per content read: thousands of trials ask
            if self._known[0] is not records:
                self._known = (records, {})
            answers = self._known[1]
        if (job_key, objective) not in answers:
            answers[(job_key, objective)] = self._known_in(records, job_key, objective)
        return answers[(job_key, objective)]

    @staticmethod
    def _known_in(records: Records, job_key: str, objective: str) -> GroundTruthMatch | None:
        import collections
        import json
        import statistics

        from pipetune.groundtruth.model import best_config, config_key, median_field

        recs = [r for r in records
                if r.get("job_key") == job_key and r.get("objective") == objective]
        if not recs:
            return None
        units = collections.Counter(r.get("cost_unit") for r in recs)
        best, costs = best_config(recs)
        behind = [r for r in recs if config_key(r) == best]
        graphs = collections.Counter(r.get("graph", "") for r in behind)
        config = SystemConfig.from_dict(json.loads(best))
        return GroundTruthMatch(
            hit=True, config=config, cost=float(statistics.median(costs)), cluster=None,
            bucket=None, distance=0.0, bound=0.0, support=len(costs),
            reason=f"known job {job_key[:12]}: {config.label()} chosen by {len(costs)} "
                   "trial(s)",
            one_time=median_field(behind, "one_time"), speedup=median_field(behind, "speedup"),
            known_graph=graphs.most_common(1)[0][0],
            cost_unit=units.most_common(1)[0][0] if len(units) == 1 else None)

    def one_time_figures(self, objective: str) -> tuple[float | None, float, int] | None:
        """What one-time knobs (a compile) cost once and saved for every job the store
        holds, whatever the job: ``(price, saving, jobs)``. ``price`` is the median over
        jobs of the most a job paid once (its first compile: later trials of a job reuse
        a warm cache), in wall seconds (``None`` where only joules were recorded);
        ``saving`` the median over jobs of the share of an epoch they saved
        (``1 - 1/speedup``, 0 where it slowed the epoch); ``jobs`` how many jobs that
        is. Only records of ``objective`` count; None where no record has both figures.

        Only configs a trial kept are recorded, so a compile that lost is not here: the
        figures lean towards compiles that paid.

        A job nothing is known of weighs an untried compile with these before it pays
        one (see :class:`pipetune.tuner.OneTimePrice`)."""
        import statistics

        objective = check_objective(objective)
        walls: dict[str, float] = {}
        savings: dict[str, list[float]] = {}
        for rec in self._records():
            if (rec.get("objective") != objective or rec.get("one_time") is None
                    or rec.get("speedup") is None):
                continue
            config = SystemConfig.from_dict(rec["config"])
            if not config.one_time_knobs():
                continue
            job = str(rec.get("job_key") or rec.get("job") or "")
            speedup = float(rec["speedup"])
            savings.setdefault(job, []).append(max(0.0, 1.0 - 1.0 / speedup)
                                               if speedup > 0 else 0.0)
            # Core-seconds are wall seconds x the cores the config reserved.
            per_wall = {"seconds": 1.0, "core_seconds": float(max(1, config.cores))}.get(
                rec.get("cost_unit", ""))
            if per_wall is not None:
                walls[job] = max(walls.get(job, 0.0), float(rec["one_time"]) / per_wall)
        if not savings:
            return None
        price = float(statistics.median(walls.values())) if walls else None
        saving = float(statistics.median(statistics.median(v) for v in savings.values()))
        return price, saving, len(savings)

    def entries(self) -> list[GroundTruthEntry]:
        """Every (cluster, bucket, objective) with its best config, sorted by those keys."""
        fit = self._fitted()
        return [] if fit is None else fit.sorted_entries()

    def clusters(self) -> list[dict[str, Any]]:
        """The clusters, for display: ``id``, ``size``, ``radius``, ``bound``, ``centroid``
        (feature -> value in the profile's own units) and ``entries`` (bucket, objective,
        config, cost, support)."""
        fit = self._fitted()
        return [] if fit is None else fit.clusters()

    def clear(self) -> int:
        """Remove every record; returns how many there were."""
        removed = self._store.clear()
        self._fit = None
        return removed

    def __len__(self) -> int:
        return len(self._store)

    # -- the store as a whole ------------------------------------------------------
    def check(self) -> int:
        """Read and validate the whole store now; return its record count. A study calls
        this before it records anything, so a corrupt store stops it at once with
        :class:`GroundTruthError` instead of at its first lookup."""
        return self._store.check()

    def audit(self) -> StoreReport:
        """Read the whole store and list every problem in it, without raising for them
        (:meth:`check` raises at the first)."""
        return self._store.audit()

    def repair(self) -> Repair:
        """Keep every valid record and drop the bad ones; a file that cannot be read as a
        ground truth at all is moved aside to ``<file>.corrupt-<UTC time>`` and an empty
        store started. Before changing anything the file as it was is copied to
        ``<file>.bak``; both keep the file's permissions. A SQL store deletes its bad rows
        after exporting the whole table to a new JSON file (``Repair.backup``: beside a
        SQLite file, in the pipetune home for a server). A valid store is left as it
        was. Safe across processes."""
        return self._store.repair()

    # -- import and export: the JSON file format -----------------------------------
    def export_json(self, path: str | Path) -> int:
        """Write every record to ``path`` in the JSON file format (``FORMAT_VERSION``),
        readable back by :meth:`import_json` or as a store; returns how many. A store
        that is not valid raises :class:`GroundTruthError` and nothing is written."""
        records = self._store.read()
        write_json(Path(path).expanduser(), records)
        return len(records)

    def import_json(self, path: str | Path) -> int:
        """Append every record of the JSON file at ``path``, in one transaction; returns
        how many. Each is checked first: a file with any bad record (see
        :meth:`JsonStore.audit`) raises :class:`GroundTruthError` and nothing is written."""
        source = JsonStore(Path(path).expanduser())
        if not source.path.is_file():
            raise GroundTruthError(f"{source.path}: no such file")
        records: Records = source.read()
        self._store.mutate(lambda current: [*current, *records])
        return len(records)

    def _records(self) -> Records:
        """Every record, read again only when the store changed since the last read (its
        snapshot: one small query): a study asks for each trial it starts, and a store
        of many studies' records is long."""
        with self._read_lock:  # not the fit's: a refit runs for a second beside the study
            raw = self._store.snapshot()
            if self._read is None or self._read[0] != raw:
                self._read = (raw, self._store.parse(raw))
            return self._read[1]

    # -- clustering ----------------------------------------------------------------
    def prepare(self) -> None:
        """Read the store and fit its clusters now (scikit-learn's import included), so
        a study's first lookup does not pay for it; the fit is reused until the store
        changes. Safe to call from a background thread."""
        self._fitted()

    def prepare_in_background(self) -> None:
        """Fit the clusters in a background thread; the next lookup waits for that fit
        instead of doing its own, and reports a broken store itself. While one fits,
        asking again fits once more when it is done (not once per ask: a study of
        thousands of trials remembers many a second)."""
        def fit_while_asked() -> None:
            while True:
                with self._read_lock:
                    if not self._refit[0]:
                        self._refit[1] = False  # no thread fits now
                        return
                    self._refit[0] = False
                with contextlib.suppress(Exception):
                    self._fitted()

        with self._read_lock:
            self._refit[0] = True  # asked
            if self._refit[1]:  # a thread fits, and will again
                return
            self._refit[1] = True
        threading.Thread(target=fit_while_asked, daemon=True,
                         name="pipetune-groundtruth-fit").start()

    def _fitted(self) -> Fit | None:
        with self._fit_lock:
            raw = self._store.snapshot()
            key = hashlib.sha1(raw).hexdigest()
            if self._fit is not None and self._fit.key == key:
                return self._fit  # unchanged content: neither re-parsed nor refitted
            records = self._store.parse(raw)
            self._fit = self._fit_records(records, key) if records else None
            return self._fit

    def _fit_records(self, records: list[dict[str, Any]], key: str) -> Fit:
        return self._similarity.fit(records, key)
