"""Opening a study: :func:`open_study` does everything before its first epoch, and
:func:`check_study` the refusals that need no cluster, server or record."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetune.errors import SpecError
from pipetune.session.opened import OpenedStudy
from pipetune.states import TrialState
from pipetune.watching import _OPENED, NOTICE

if TYPE_CHECKING:
    from pipetune.checkpoints import CheckpointStore
    from pipetune.engine.journal import StudyJournal
    from pipetune.spec import JobSpec
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
