"""Opening a study: the one way in, for every caller.

:func:`open_study` takes a checked job and the options a caller was given and does
everything before the first epoch, refusing what cannot run before anything is
recorded: the resume (the journal's job, stores and MLflow runs), the ground truth's
check, the cluster's fit (space values no worker can run dropped, with a warning
each), the workload made loadable on the workers, the journal, the MLflow record, the
checkpoint store, the engine (replayed on a resume). It returns an
:class:`OpenedStudy`, whose :meth:`~OpenedStudy.run` drives the engine to the end over
a backend and returns the summary (the trials table included), recording a failure or a
stop on the way out.

The Prefect flow (:mod:`flows.study`) is wiring around it: it confines a deployment's
parameters, names its flow run, links the MLflow run and records the engine's epochs
and decisions as task runs. Nothing here imports Prefect.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetune.errors import BrokenWorkload, CheckpointWriteError, PipetuneError, SpecError
from pipetune.states import TrialState
from pipetune.watching import (  # NOTICE ... observing: re-exported (__all__)
    _OBSERVING,
    _OPENED,
    NOTICE,
    NOTICE_ATTR,
    SAID,
    SAID_ATTR,
    collecting_opened,
    observing,
)

if TYPE_CHECKING:
    from pipetune.backends import EpochBackend
    from pipetune.checkpoints import CheckpointStore
    from pipetune.engine.events import Observer, StudyEvent
    from pipetune.engine.journal import StudyJournal
    from pipetune.engine.study import Study
    from pipetune.engine.trial import Trial
    from pipetune.spec import JobSpec, SpaceDrop
    from pipetune.tracking import StudyTracker
    from pipetune.tracking.api import Tracker

@dataclass(frozen=True)
class StudyOptions:
    """Where a study runs and is recorded; each ``None`` takes its default."""

    #: MLflow store (default: ``$MLFLOW_TRACKING_URI``, else ``./mlflow.db``).
    tracking_uri: str | None = None
    #: Checkpoint folder, fsspec URL, ``mlflow-artifacts:`` URI, or ``mlflow`` (the study
    #: run's own artifacts: through the tracking server's artifact proxy on a team stack,
    #: reachable by every host); default ``$PIPETUNE_CHECKPOINTS``, else the home's.
    checkpoint_root: str | None = None
    groundtruth_path: str | None = None
    #: Cores the engine may hand out at once (default: the cluster's).
    core_budget: int | None = None
    #: A Dask scheduler (default: ``$PIPETUNE_DASK_ADDRESS``, else this process's
    #: embedded cluster).
    dask_address: str | None = None
    #: A study id, the flow run id of a stopped or crashed study, or ``latest`` (the
    #: newest unfinished study of this job): it goes on from its journal, with its own
    #: job, stores and MLflow runs; finished epochs are not run again.
    resume: str | None = None
    #: ``best-and-last`` deletes each ended trial's other checkpoints in the background;
    #: ``all`` keeps every one.
    keep_checkpoints: str = "best-and-last"
    #: Tags every MLflow run of the study carries (who ran it: a flow run, a deployment).
    tags: Mapping[str, str] = field(default_factory=dict)
    #: The journal's id of the process that runs it (a Prefect flow run id), if any.
    runner_id: str = ""
    #: Training first: the study's MLflow run is opened beside its first epochs (its
    #: writes wait in the sink, and in the spool, until the store answers), and the
    #: journal learns its run id when the study ends or a caller asks
    #: (:meth:`OpenedStudy.runs_known`).
    start_first: bool = False


def check_study(spec: JobSpec, options: StudyOptions) -> None:
    """The refusals that need no cluster, no server and no record, in one place: a study
    to resume must exist (its journal in the current format), a ground truth must read,
    a scheduler address must be one pipetune connects to. :func:`open_study` makes them
    first; a caller with servers to start (``pipetune tune``) makes them before it
    starts any, so a refusal costs nothing (exit 2, nothing recorded). (``tune`` checks
    its ``--dask-address`` itself, with ``--allow-insecure-dask``.)"""
    from pipetune.dask.address import check_scheduler_address
    from pipetune.engine.journal import find_study, studies_root
    from pipetune.groundtruth import GroundTruth
    from pipetune.policies import factory

    # A searcher or scheduler of the user's own (an import path) must import.
    for name, value, kind in (("search.algorithm", spec.search.algorithm, "searcher"),
                              ("early_stopping.policy", spec.early_stopping.policy,
                               "scheduler"),
                              *((f"tracking.trackers[{i}]", path, "tracker")
                                for i, path in enumerate(spec.tracking.trackers))):
        if ":" in value:
            factory(name, value, kind=kind)
    if options.resume:
        find_study(studies_root(), options.resume, spec.name).check_format()
    elif spec.pipetune.enabled:
        GroundTruth(options.groundtruth_path,
                    **spec.pipetune.similarity.model_dump()).check()
    if options.dask_address:
        check_scheduler_address(options.dask_address, field="dask_address")


def open_study(spec: JobSpec, options: StudyOptions, *, policy: Any = None,
               log: logging.Logger | logging.LoggerAdapter | None = None) -> OpenedStudy:
    """Everything before a study's first epoch (the module docstring lists it).

    ``policy``: the confinement of a deployment's run (:mod:`pipetune.confine`): a
    resumed study's stores and workload are checked against it too. ``log`` gets the
    study's lines (a dropped space value, a resume, the start)."""
    from pipetune.checkpoints import (
        CheckpointStore,
    )
    from pipetune.dask.address import check_scheduler_address, default_address
    from pipetune.dask.cluster import (
        check_cluster_fits,
        client_for,
        cluster_core_budget,
        ensure_worker_groups,
        prepare_workload,
        process_knob_values,
    )
    from pipetune.engine.journal import StudyJournal, studies_root
    from pipetune.engine.study import Study
    from pipetune.groundtruth import GroundTruth

    log = log or logging.getLogger("pipetune.study")
    check_study(spec, options)
    spec, study_id, journal, resumed = _new_or_resumed(spec, options, policy)
    tracking_uri = resumed["tracking_uri"]
    checkpoint_root = resumed["checkpoint_root"]
    groundtruth_path = resumed["groundtruth_path"]
    # The constructor takes the similarity section's fields by name: one rule, no copy.
    ground_truth = GroundTruth(groundtruth_path, **spec.pipetune.similarity.model_dump())
    # Refusals before anything is recorded: a resumed study's corrupt ground truth (a
    # new study's was checked above), a system space the cluster's workers cannot run.
    if spec.pipetune.enabled and options.resume:
        ground_truth.check()
    dask_address = options.dask_address or default_address()  # a team stack's worker sets it
    if dask_address and not options.dask_address:
        check_scheduler_address(dask_address, field="dask_address")
    client = client_for(dask_address)
    # What one epoch can claim (the largest worker's cores): the tuner never picks more;
    # space values past it are left out, each knob's with one warning line.
    machine, spec, dropped = check_cluster_fits(client, spec, embedded=dask_address is None)
    for drop in dropped:
        log.warning("%s", drop.line(), extra=NOTICE)
    space_dropped = {d.knob: d.to_dict() for d in dropped}
    prepare_workload(client, spec, dask_address)  # its own module, on every worker
    if journal is None:
        journal = StudyJournal(studies_root(), study_id).create(
            job=spec.to_dict(), job_name=spec.name, tracking_uri=tracking_uri,
            checkpoint_root=checkpoint_root, groundtruth_path=groundtruth_path,
            space_dropped=space_dropped)
    elif space_dropped:
        journal.update(space_dropped={**journal.header().get("space_dropped", {}),
                                      **space_dropped})
    tracker, checkpoints = _open_records(spec, options, study_id, resumed, space_dropped)
    if dask_address is None:  # workers for OpenMP policies the job asks for, before the clock
        ensure_worker_groups(process_knob_values(spec))
    core_budget = options.core_budget
    if core_budget is None and dask_address:
        core_budget = cluster_core_budget(dask_address)
    study = Study(
        spec, study_id=study_id, checkpoints=checkpoints,
        ground_truth=ground_truth if spec.pipetune.enabled else None,
        core_budget=core_budget, journal=journal, machine=machine,
    )
    if options.resume:
        study.replay(journal.events(), checkpoint_exists=CheckpointStore.exists)
        log.info("study %s resumed: %d finished epochs taken over", study_id,
                 study.resumed_epochs)
    tracker.reopen_trials(
        [t.trial_id for t in study.trials.values() if t.state == TrialState.RUNNING])
    # Trackers of the job's own (tracking.trackers) hear the events from here on.
    trackers = [_own_tracker(i, path, spec, study_id, journal.folder)
                for i, path in enumerate(spec.tracking.trackers)]
    refused = _mark_running(spec, options, journal, tracker, log)
    if _OPENED.get() is not None:  # a caller collecting the studies opened (the bench)
        _OPENED.get().append(study)
    return OpenedStudy(study=study, journal=journal, tracker=tracker, checkpoints=checkpoints,
                       client=client, tracking_uri=tracking_uri, dropped=tuple(dropped),
                       log=log, refused=refused, trackers=trackers)


def _open_records(spec: JobSpec, options: StudyOptions, study_id: str,
                  where: dict[str, Any], space_dropped: dict[str, Any],
                  ) -> tuple[StudyTracker, CheckpointStore]:
    """The study's MLflow record (a resumed study's own run) and its checkpoint store."""
    from pipetune.checkpoints import CheckpointStore, resolve_checkpoint_root
    from pipetune.tracking import StudyTracker
    from pipetune.tracking.tracker import FIND_STUDY_RUN

    tags = {**options.tags, "pipetune.study_id": study_id}
    if space_dropped:
        tags["pipetune.space_dropped"] = json.dumps(space_dropped, sort_keys=True)
    tracker = StudyTracker(where["tracking_uri"], spec, tags=tags,
                           resume_run_id=where.get("parent_run_id")
                           or (FIND_STUDY_RUN if options.resume else None),
                           defer_open=options.start_first)
    # ``mlflow``: checkpoints are artifacts of the study's run (through the tracking
    # server's artifact proxy on a team stack), so every host reaches them by URL.
    checkpoints = CheckpointStore(
        resolve_checkpoint_root(where["checkpoint_root"], where["tracking_uri"],
                                lambda: tracker.artifact_uri),
        keep=options.keep_checkpoints)
    return tracker, checkpoints


def _new_or_resumed(spec: JobSpec, options: StudyOptions, policy: Any,
                    ) -> tuple[JobSpec, str, StudyJournal | None, dict[str, Any]]:
    """``(spec, study_id, journal, where)``: a resumed study's job (as it started, seeds
    included), id, journal and journal header; or a new study's id, no journal yet, and
    its stores. ``where`` holds ``tracking_uri``, ``checkpoint_root`` and
    ``groundtruth_path`` either way (and ``parent_run_id`` of a resumed study)."""
    from pipetune.checkpoints import default_checkpoint_root
    from pipetune.confine import confine_resumed, enforced
    from pipetune.engine.journal import find_study, studies_root
    from pipetune.spec import JobSpec
    from pipetune.tracking import default_tracking_uri

    if options.resume:
        with enforced(policy):  # the journal's import-path workload is checked, then imported
            journal = find_study(studies_root(), options.resume, spec.name)
            resumed = confine_resumed(journal.header(), policy)
            spec = JobSpec.from_dict(resumed["job"])  # the job as it started, seeds included
        return spec, journal.study_id, journal, resumed
    study_id = f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    return spec, study_id, None, {
        "tracking_uri": options.tracking_uri or default_tracking_uri(),
        "checkpoint_root": options.checkpoint_root or default_checkpoint_root(),
        "groundtruth_path": options.groundtruth_path}


def _mark_running(spec: JobSpec, options: StudyOptions, journal: StudyJournal,
                  tracker: StudyTracker, log: Any) -> list[BaseException]:
    """The journal says the study runs (with its MLflow run, or once MLflow opened it,
    for a study started first); its start line. What refused the MLflow run, if any,
    lands in the list returned."""
    ids = {} if options.start_first else {"parent_run_id": tracker.parent_run_id}
    journal.update(status="running", reason=None, flow_run_id=options.runner_id, **ids)
    refused: list[BaseException] = []
    if options.start_first:  # the run's id in the journal once MLflow has opened it
        _note_run_id_when_open(journal, tracker, refused)
    log.info("study %s: %s, %d trials (%d at a time), pipetune %s; MLflow parent run %s",
             journal.study_id, spec.workload.name, spec.search.trials,
             spec.search.max_concurrent, "on" if spec.pipetune.enabled else "off",
             ids.get("parent_run_id", "opened beside it"))
    return refused


def _own_tracker(i: int, path: str, spec: JobSpec, study_id: str, folder: Path) -> Tracker:
    """The job's tracker ``tracking.trackers[i]`` (an import path), built for this study."""
    from pipetune.policies import factory
    from pipetune.tracking.api import Tracker

    field_name = f"tracking.trackers[{i}]"
    made = factory(field_name, path, kind="tracker")(spec=spec, study_id=study_id,
                                                      folder=folder)
    if not isinstance(made, Tracker):
        raise SpecError(field_name, f"{path!r} made a {type(made).__name__}, not a "
                                    "pipetune.tracking.Tracker")
    return made


def _note_run_id_when_open(journal: StudyJournal, tracker: StudyTracker,
                           refused: list[BaseException]) -> None:
    """In a daemon thread: wait for the study's MLflow run (opened beside the training)
    and write its id in the journal, so a study killed mid-way resumes in that run. A
    store that never answered it (:class:`~pipetune.tracking.TrackingUnreachable`) is
    put in ``refused``: the study stops at its next step, with that error."""
    import threading

    from pipetune.sidecar import SidecarError

    def note() -> None:
        try:
            parent_run_id = tracker.parent_run_id
        except SidecarError:  # the study ended first and closed its sink: nothing to say
            return
        except Exception as e:  # noqa: BLE001 - raised in the study's loop
            refused.append(e)
            return
        with contextlib.suppress(Exception):  # the end writes it too, where it can
            journal.update(parent_run_id=parent_run_id)

    threading.Thread(target=note, name="pipetune-note-run-id", daemon=True).start()


@dataclass
class OpenedStudy:
    """A study ready for its first epoch (what :func:`open_study` returns)."""

    study: Study
    journal: StudyJournal
    tracker: StudyTracker
    checkpoints: CheckpointStore
    #: The Dask client of the cluster its epochs run on.
    client: Any
    tracking_uri: str
    dropped: tuple[SpaceDrop, ...]
    log: logging.Logger | logging.LoggerAdapter
    #: What refused the study's MLflow run when it was opened beside the training
    #: (:attr:`StudyOptions.start_first`): the study stops with it.
    refused: list[BaseException] = field(default_factory=list)
    #: The job's own trackers (``tracking.trackers``), beside MLflow's :attr:`tracker`.
    trackers: list[Tracker] = field(default_factory=list)

    @property
    def study_id(self) -> str:
        return self.study.study_id

    def _run_ids_known(self) -> dict[str, str]:
        """The study's MLflow run id for its journal, where known by now (not waited for)."""
        ids = self.tracker._ids  # noqa: SLF001 - read only
        return {"parent_run_id": ids[1]} if ids and ids[1] else {}

    def runs_known(self, flow_run_id: str | None = None) -> None:
        """What a study started first learns once its records answer: its MLflow run
        (waited for here) in the journal, and the Prefect flow run it belongs to on its
        MLflow runs and in the journal (``--resume`` finds it by that id)."""
        changes: dict[str, Any] = {"parent_run_id": self.tracker.parent_run_id}
        if flow_run_id:
            self.tracker.add_tags({"prefect.flow_run_id": flow_run_id})
            changes["flow_run_id"] = flow_run_id
        self.journal.update(**changes)

    def dask_backend(self) -> EpochBackend:
        """The backend that runs this study's epochs on its cluster."""
        from pipetune.dask.backend import DaskBackend

        return DaskBackend(self.client)

    def run(self, backend: EpochBackend, *,
            observers: Sequence[Observer] = ()) -> dict[str, Any]:
        """Drive the study to its end over ``backend`` and return its summary.

        Every finished epoch and ended trial is recorded as it happens (MLflow, the
        pruned checkpoints, one line per failed trial); the end re-evaluates the best
        trial from its checkpoint (proving it) and writes the summary. A failure or a
        stop (Ctrl-C, a SIGTERM or SIGHUP: :func:`_is_stop`) ends the
        MLflow record ``FAILED`` or ``KILLED`` with its reason and leaves the journal
        resumable; it is raised again (a :class:`PipetuneError` carrying the study's id
        as ``study_id``). ``backend.close`` is called either way. ``observers`` (and
        those of an enclosing :func:`observing`) hear the engine's events
        (:mod:`pipetune.engine.events`) after the study's own records have, and, last, a
        :class:`~pipetune.engine.events.StudyFinished` with the summary returned here."""
        from pipetune.engine.events import StudyFinished
        from pipetune.reports import load_in_background, orchestration_overhead, overhead_summary

        study, tracker, log = self.study, self.tracker, self.log
        attached = [study.observe(self._observe), *map(study.observe, self.trackers),
                    *map(study.observe, observers), *map(study.observe, _OBSERVING.get())]
        if study.ground_truth is not None:  # fit its clusters while epoch 1 runs
            study.ground_truth.prepare_in_background()
        load_in_background()  # what the end draws with, loaded while it trains
        started = time.time()
        try:
            study.run(backend)
            if study.broken is not None and study.broken.store:  # a full store
                raise CheckpointWriteError(study.broken.line)
            if study.broken is not None:  # trials kept failing the same way: broken code
                raise BrokenWorkload(f"{study.broken.line} (and traceback.txt on the MLflow "
                                     f"run of trial {study.broken.trial_id})")
            extra = evaluate_best(study, backend)
            for trial in study.trials.values():  # a woken worker's late write, again
                self.checkpoints.prune_superseded(trial.results)
            extra["checkpoints_pruned"] = float(self.checkpoints.wait_pruned())
            wall_s = time.time() - started
            timings = orchestration_overhead(study)
            extra.update(overhead_summary(timings))
            tracker.finish(study, wall_s=wall_s, extra_metrics=extra)
            if tracker.waiting is not None:  # MLflow did not answer: its writes wait
                log.warning("%s", tracker.waiting.line(), extra=NOTICE)
        except BaseException as stop:
            self._ended_badly(stop, backend)
            raise
        finally:
            for observer in attached:
                study.unobserve(observer)
        self.journal.update(status="finished", **self._run_ids_known())
        self.journal.close()
        try:  # the study is done and in MLflow; a lost side record is not worth failing it
            backend.close()
        except Exception as e:  # noqa: BLE001
            log.warning("the task-run record is incomplete: %s (the study finished; MLflow "
                        "has all of it)", e, extra=NOTICE)
        summary = study.summary()
        self._say_summary(summary, wall_s)
        result = self._summary_dict(summary, started, wall_s, extra, timings)
        self._end_trackers(lambda t: t.finished(result))
        finished = StudyFinished(summary=result)
        for observer in (*observers, *_OBSERVING.get()):
            observer(finished)
        return result

    def _ended_badly(self, stop: BaseException, backend: EpochBackend) -> None:
        """A study that failed or was stopped (:func:`_is_stop`): its journal says so
        (resumable with ``--resume`` either way), its epochs are cancelled, its records
        end ``FAILED`` or ``KILLED`` with the reason, the backend closes. ``stop`` learns
        the study's id (a :class:`PipetuneError`), for the caller to say where it is."""
        study, tracker, log = self.study, self.tracker, self.log
        if isinstance(stop, PipetuneError) and getattr(stop, "study_id", None) is None:
            stop.study_id = study.study_id  # which study a caller finds it in
        stopped = _is_stop(stop)
        reason = str(stop) if isinstance(stop, PipetuneError) else \
            f"{type(stop).__name__}: {stop}"
        with contextlib.suppress(Exception):  # resumable with --resume either way
            self.journal.update(status="stopped" if stopped else "failed", reason=reason,
                                **self._run_ids_known())
            self.journal.close()
        with contextlib.suppress(Exception):
            backend.cancel()
        tracker.fail(status="KILLED" if stopped else "FAILED",
                     timeout=3 if stopped else 120, reason=reason)
        self._end_trackers(lambda t: t.failed("KILLED" if stopped else "FAILED", reason))
        with contextlib.suppress(Exception):  # a run opened beside the study: its id
            if self._run_ids_known():
                self.journal.update(**self._run_ids_known())
        if tracker.waiting is not None:
            log.warning("%s", tracker.waiting.line(), extra=NOTICE)
        with contextlib.suppress(Exception):
            backend.close(timeout=1 if stopped else 60)

    def _end_trackers(self, end: Callable[[Tracker], None]) -> None:
        """``end(tracker)`` then ``close()`` for each of the job's own trackers; one that
        raises is one line, and the others still end (the study is over either way)."""
        for tracker in self.trackers:
            for step in (end, type(tracker).close):
                try:
                    step(tracker)
                except Exception as e:  # noqa: BLE001 - a tracker of the user's own
                    self.log.warning("tracker %s: %s: %s", type(tracker).__name__,
                                     type(e).__name__, e, extra=NOTICE)
                    break

    # -- what it records, says and returns -------------------------------------------------
    def _observe(self, event: StudyEvent) -> None:
        """The study's own observer: each finished epoch and ended trial into MLflow, an
        ended trial's other checkpoints pruned, one line per ended trial."""
        from pipetune.engine.events import TrialEnded

        study = self.study
        if self.refused:  # the tracking store never opened the study's run
            raise self.refused[0]
        self.tracker(event)  # MLflow's record: the epoch's metrics, the trial's outcome
        if isinstance(event, TrialEnded):
            self._say_ended(event.trial)
            self.checkpoints.prune_trial(event.trial.results, study.metric, study.mode)

    def _say_ended(self, trial: Trial) -> None:
        if trial.state == TrialState.FAILED:  # one line; the traceback is in the file and on MLflow
            where = f" (traceback: {trial.traceback_file})" if trial.traceback_file else ""
            self.log.warning("trial %s failed: %s%s", trial.trial_id, trial.error, where,
                             extra=NOTICE)
            return
        value = trial.last_value(self.study.metric)
        self.log.info("trial %d %s after %d epoch(s): %s %s under %s", trial.trial_id,
                      trial.state, trial.epochs_run, self.study.metric,
                      "-" if value is None else f"{value:.4g}",
                      trial.final_system.label() if trial.final_system else "-")

    def _say_summary(self, summary: Any, wall_s: float) -> None:
        study = self.study
        best = (f"best {study.metric} {summary.best_value:.4g} (trial {summary.best_trial}) "
                f"params {summary.best_params} under {summary.best_system.label()}"
                if summary.best_value is not None and summary.best_system
                else "no trial finished")
        self.log.info(
            "study %s done in %.1f s: %s; %d trials (%d completed, %d stopped, %d failed), "
            "%d epochs, %d probe epochs, ground-truth hits %d/%d", study.study_id, wall_s,
            best, summary.trials, summary.completed, summary.stopped, summary.failed,
            summary.epochs_run, summary.probe_epochs, summary.groundtruth_hits,
            summary.groundtruth_lookups)

    def _summary_dict(self, summary: Any, started: float, wall_s: float,
                      extra: dict[str, float], timings: Any) -> dict[str, Any]:
        """The JSON-able summary: ids, the study's numbers, timings, the trials table."""
        study, tracker = self.study, self.tracker
        return {
            "study_id": study.study_id,
            "parent_run_id": tracker.parent_run_id,
            "tracking_uri": self.tracking_uri,
            "experiment_id": tracker.experiment_id,
            "tuning_wall_s": wall_s,
            "resumed_epochs": study.resumed_epochs,
            "started_at": started,
            "first_epoch_at": min((t[1] for t in study.epoch_times.values()), default=started),
            **summary.to_metrics(),
            "best_params": summary.best_params,
            "best_system": summary.best_system.label() if summary.best_system else None,
            "energy_source": summary.energy_source,
            **{k: v for k, v in extra.items() if k.startswith("orchestration_")},
            "checkpoints_pruned": int(extra.get("checkpoints_pruned", 0)),
            "epoch_timings": timings,
            "trials_table": [
                {"trial": t.trial_id, "outcome": t.state, "epochs": t.epochs_run,
                 "probe_epochs": t.probe_epochs, study.metric: t.last_value(study.metric),
                 "system": t.final_system.label() if t.final_system else "",
                 "error": t.error or "", "traceback": t.traceback_file or ""}
                for t in sorted(study.trials.values(), key=lambda t: t.trial_id)
            ],
        }


def _is_stop(error: BaseException) -> bool:
    """Whether ``error`` stopped the study (Ctrl-C, pipetune's SIGTERM/SIGHUP, or the
    flow engine's own SIGTERM handler, found by name: the library never imports Prefect)
    rather than failed it (a cancelled Dask future is a failure)."""
    return isinstance(error, KeyboardInterrupt) or any(
        cls.__name__ == "TerminationSignal" for cls in type(error).__mro__)


def evaluate_best(study: Study, backend: EpochBackend) -> dict[str, float]:
    """Re-evaluate the best trial from its last checkpoint, proving the checkpoint."""
    best = study.best_trial()
    if best is None or best.checkpoint is None:
        return {}
    metrics = backend.evaluate(study.final_task(best), best.checkpoint)
    return {f"best_checkpoint_{k}": v for k, v in metrics.items()}


__all__ = ["NOTICE", "NOTICE_ATTR", "SAID", "SAID_ATTR", "OpenedStudy", "StudyOptions",
           "check_study", "collecting_opened", "evaluate_best", "observing", "open_study"]
