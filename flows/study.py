"""The study flow: PipeTune's loop with epochs on Dask and the record in MLflow.

The flow only wires: the engine (:meth:`pipetune.study.Study.run`) decides what runs,
the cluster trains, the recorder process writes MLflow and the Prefect task runs.
Each epoch is a plain Dask future (it claims the cores its system config reserves,
and goes to the worker holding its model) recorded as one ``train-epoch`` task run;
the profile lookup and the tuning decision are recorded as task runs between a
trial's epochs, so every trial shows in the Prefect UI as a chain epoch -> lookup ->
tune -> epoch ... (:mod:`tasks.task_runs` says why they are written, not task-engine
runs: the engine cost the loop ~75 ms per epoch).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.exceptions import TerminationSignal
from prefect.runtime import deployment, flow_run

from flows.params import CoreBudget, JobArgument, TrialsOverride
from pipetune.backends import DaskBackend
from pipetune.checkpoints import CheckpointStore, default_checkpoint_root, resolve_checkpoint_root
from pipetune.confine import confine_parameters, confine_resumed, enforced
from pipetune.dask.address import check_scheduler_address, default_address
from pipetune.dask.cluster import (
    check_cluster_fits,
    client_for,
    cluster_core_budget,
    ensure_worker_groups,
    prepare_workload,
    process_knob_values,
)
from pipetune.errors import BrokenWorkload, PipetuneError
from pipetune.groundtruth import GroundTruth
from pipetune.journal import StudyJournal, find_study, studies_root
from pipetune.progress import notify
from pipetune.reports import orchestration_overhead, overhead_summary
from pipetune.spec import JobSpec, load_spec
from pipetune.states import TrialState
from pipetune.study import StepEvent, Study
from pipetune.tracking import StudyTracker, default_tracking_uri
from tasks import PrefectEpochBackend
from tasks.task_runs import TaskRunWriter, api_url


def resolve_job(
    job: JobSpec | dict[str, Any] | str, trials: int | None, pipetune: bool | None
) -> JobSpec:
    """The job as a checked spec; one the caller checked already is not checked again."""
    if isinstance(job, JobSpec):
        spec = job
    else:
        spec = load_spec(job) if isinstance(job, str) else JobSpec.from_dict(job)
    return spec.with_overrides(trials=trials, pipetune_enabled=pipetune)


@flow(name="pipetune-study", log_prints=False)
def study_flow(
    job: JobArgument,
    trials: TrialsOverride = None,
    pipetune: bool | None = None,
    tracking_uri: str | None = None,
    checkpoint_root: str | None = None,
    groundtruth_path: str | None = None,
    core_budget: CoreBudget = None,
    dask_address: str | None = None,
    resume: str | None = None,
    keep_checkpoints: Literal["best-and-last", "all"] = "best-and-last",
) -> dict[str, Any]:
    """Tune ``job`` (a job-spec dict, a path to a job YAML, or a checked
    :class:`~pipetune.spec.JobSpec` from a caller in this process) and record it in
    MLflow.

    ``resume``: a study id or the flow run id of a stopped or crashed study, or
    ``"latest"`` (the newest unfinished study of this job): that study goes on from
    its journal, with its own job, stores and MLflow runs; finished epochs are not
    run again.

    A run from a deployment is confined (:func:`confine_parameters`): the paths it
    names must lie under the worker's ``PIPETUNE_ALLOWED_ROOTS`` and an import-path
    workload's module in its ``PIPETUNE_ALLOWED_MODULES``; otherwise it fails with a
    :class:`~pipetune.errors.ConfinementError` naming the parameter, before anything
    is recorded.

    ``checkpoint_root``: a folder, an fsspec URL, an ``mlflow-artifacts:`` URI, or
    ``mlflow`` (the study run's own artifacts: through the tracking server's artifact
    proxy on a team stack, reachable by every host); default ``$PIPETUNE_CHECKPOINTS``,
    else the pipetune home. ``keep_checkpoints``: ``best-and-last`` deletes each ended
    trial's other checkpoints in the background; ``all`` keeps every one.

    Epochs run on the Dask cluster at ``dask_address``, else on this process's
    embedded ``LocalCluster`` (started once, reused by later studies). Returns a
    JSON-able summary: the MLflow parent run id, the study's numbers, the per-epoch
    timings and the trials table.
    """
    logger = get_run_logger()
    deployment_id = _deployment_id()
    from_deployment = bool(deployment_id)
    checked, policy = confine_parameters(
        {"job": job, "tracking_uri": tracking_uri, "checkpoint_root": checkpoint_root,
         "groundtruth_path": groundtruth_path},
        from_deployment=from_deployment,
        job_variables=flow_run.job_variables if from_deployment else None,
    )
    job, checkpoint_root, groundtruth_path = (
        checked["job"], checked["checkpoint_root"], checked["groundtruth_path"])
    resumed: dict[str, Any] = {}
    with enforced(policy):  # a job file's import-path workload is checked, then imported
        spec = resolve_job(job, trials, pipetune)
        if resume:
            journal = find_study(studies_root(), resume, spec.name)
            resumed = confine_resumed(journal.header(), policy)
            spec = JobSpec.from_dict(resumed["job"])  # the job as it started, seeds included
    if resume:
        study_id = journal.study_id
        tracking_uri = resumed["tracking_uri"]
        checkpoint_root = resumed["checkpoint_root"]
        groundtruth_path = resumed["groundtruth_path"]
    else:
        tracking_uri = tracking_uri or default_tracking_uri()
        study_id = f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        checkpoint_root = checkpoint_root or default_checkpoint_root()
    # The constructor takes the similarity section's fields by name: one rule, no copy.
    ground_truth = GroundTruth(groundtruth_path, **spec.pipetune.similarity.model_dump())
    # Refusals before anything is recorded: a corrupt ground truth, a system space
    # the cluster's workers cannot run.
    if spec.pipetune.enabled:
        ground_truth.check()
    dask_address = dask_address or default_address()  # a team stack's worker sets it
    if dask_address:
        check_scheduler_address(dask_address, field="dask_address")
    client = client_for(dask_address)
    # What one epoch can claim (the largest worker's cores): the tuner never picks more;
    # space values past it are left out, each knob's with one warning line.
    machine, spec, dropped = check_cluster_fits(client, spec, embedded=dask_address is None)
    for drop in dropped:  # pipetune's CLI shows it as its own `warning:` line
        logger.warning("%s", drop.line(), extra={"pipetune_notice": "warning"})
    space_dropped = {d.knob: d.to_dict() for d in dropped}
    prepare_workload(client, spec, dask_address)  # its own module, on every worker
    if not resume:
        journal = StudyJournal(studies_root(), study_id).create(
            job=spec.to_dict(), job_name=spec.name, tracking_uri=tracking_uri,
            checkpoint_root=checkpoint_root, groundtruth_path=groundtruth_path,
            space_dropped=space_dropped)
    elif space_dropped:
        journal.update(space_dropped={**journal.header().get("space_dropped", {}),
                                      **space_dropped})
    tags = {"prefect.flow_run_id": str(flow_run.id or ""), "pipetune.study_id": study_id}
    if space_dropped:
        tags["pipetune.space_dropped"] = json.dumps(space_dropped, sort_keys=True)
    if deployment_id:
        tags["prefect.deployment_id"] = deployment_id
        tags["prefect.deployment_name"] = str(deployment.name or "")
    tracker = StudyTracker(tracking_uri, spec, tags=tags,
                           resume_run_id=resumed.get("parent_run_id"))
    # ``mlflow``: checkpoints are artifacts of the study's run (through the tracking
    # server's artifact proxy on a team stack), so every host reaches them by URL.
    checkpoints = CheckpointStore(
        resolve_checkpoint_root(checkpoint_root, tracking_uri, lambda: tracker.artifact_uri),
        keep=keep_checkpoints)
    if dask_address is None:  # workers for OpenMP policies the job asks for, before the clock
        ensure_worker_groups(process_knob_values(spec))
    if core_budget is None and dask_address:
        core_budget = cluster_core_budget(dask_address)
    study = Study(
        spec, study_id=study_id, checkpoints=checkpoints,
        ground_truth=ground_truth if spec.pipetune.enabled else None,
        core_budget=core_budget, journal=journal, machine=machine,
    )
    if resume:
        study.replay(journal.events(), checkpoint_exists=CheckpointStore.exists)
        logger.info("study %s resumed: %d finished epochs taken over", study_id,
                    study.resumed_epochs)
    tracker.reopen_trials(
        [t.trial_id for t in study.trials.values() if t.state == TrialState.RUNNING])
    journal.update(status="running", reason=None, parent_run_id=tracker.parent_run_id,
                   flow_run_id=str(flow_run.id or ""))
    _name_flow_run(study_id)
    _link_mlflow_run(tracker, tracking_uri, study_id)
    logger.info("study %s: %s, %d trials (%d at a time), pipetune %s; MLflow parent run %s",
                study_id, spec.workload.name, spec.search.trials, spec.search.max_concurrent,
                "on" if spec.pipetune.enabled else "off", tracker.parent_run_id)

    task_runs = TaskRunWriter(str(flow_run.id or ""), api_url())
    backend = PrefectEpochBackend(DaskBackend(client), task_runs)
    if study.ground_truth is not None:  # fit its clusters while epoch 1 runs
        study.ground_truth.prepare_in_background()

    def on_step(event: StepEvent) -> None:
        if event.ended:
            if event.result is None:  # one line; the traceback is in the file and on MLflow
                where = (f" (traceback: {event.trial.traceback_file})"
                         if event.trial.traceback_file else "")
                logger.warning("trial %s failed: %s%s", event.trial.trial_id,
                               event.trial.error, where, extra={"pipetune_notice": "warning"})
            else:
                _log_trial_end(logger, event.trial, study.metric)
            tracker.end_trial(event.trial, metric=study.metric)
            checkpoints.prune_trial(event.trial.results, study.metric, study.mode)
        notify(study)

    started = time.time()
    try:
        notify(study)
        study.run(
            backend, on_step=on_step, on_result=tracker.log_epoch,
            lookup=lambda trial_id: _lookup(study, task_runs, trial_id),
            decide=lambda trial_id, epoch: _decide(study, task_runs, trial_id, epoch),
        )
        if study.broken is not None:  # trials kept failing the same way: the code is broken
            raise BrokenWorkload(f"{study.broken.line} (and traceback.txt on the MLflow run "
                                 f"of trial {study.broken.trial_id})")
        extra = _evaluate_best(study, backend)
        extra["checkpoints_pruned"] = float(checkpoints.wait_pruned())
        wall_s = time.time() - started
        timings = orchestration_overhead(study)
        extra.update(overhead_summary(timings))
        tracker.finish(study, wall_s=wall_s, extra_metrics=extra)
    except BaseException as stop:
        # Ctrl-C, pipetune's own SIGTERM/SIGHUP (Stopped), or Prefect's SIGTERM handler
        stopped = isinstance(stop, KeyboardInterrupt | TerminationSignal)
        reason = str(stop) if isinstance(stop, PipetuneError) else f"{type(stop).__name__}: {stop}"
        with contextlib.suppress(Exception):  # resumable with --resume either way
            journal.update(status="stopped" if stopped else "failed", reason=reason)
            journal.close()
        task_runs.cancel_open()
        tracker.fail(status="KILLED" if stopped else "FAILED", timeout=3 if stopped else 120,
                     reason=reason)
        with contextlib.suppress(Exception):
            task_runs.close(timeout=1 if stopped else 60)
        raise
    journal.update(status="finished")
    journal.close()
    try:  # the study is done and in MLflow; a lost Prefect task run is not worth failing it
        task_runs.close()
    except Exception as e:  # noqa: BLE001
        logger.warning("some Prefect task-run records were not written: %s", e)
    summary = study.summary()
    _log_summary(logger, study, summary, wall_s)
    return {
        "study_id": study_id,
        "flow_run_id": str(flow_run.id or ""),
        "parent_run_id": tracker.parent_run_id,
        "tracking_uri": tracking_uri,
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


def _deployment_id() -> str | None:
    """The deployment the flow run was created from, if any. Read off the run's
    context: ``prefect.runtime.deployment.id`` asks the API for the flow run again at
    every read when the run has no deployment (the common case: ``pipetune tune``)."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    run = getattr(context, "flow_run", None)
    if run is not None:
        return str(run.deployment_id) if run.deployment_id else None
    return deployment.id


def _lookup(study: Study, task_runs: TaskRunWriter, trial_id: int):
    with task_runs.span("profile-lookup", f"trial-{trial_id}-profile-lookup", trial_id):
        return study.lookup(trial_id)


def _decide(study: Study, task_runs: TaskRunWriter, trial_id: int, epoch: int):
    with task_runs.span("tune-system", f"trial-{trial_id}-tune-after-epoch-{epoch}", trial_id):
        decision = study.decide(trial_id)
    get_run_logger().info("trial %d after epoch %d: %s epoch under %s (%s)", trial_id, epoch,
                          decision.phase.value, decision.system.label(), decision.reason)
    return decision


def _log_trial_end(logger: Any, trial: Any, metric: str) -> None:
    value = trial.last_value(metric)
    logger.info("trial %d %s after %d epoch(s): %s %s under %s", trial.trial_id, trial.state,
                trial.epochs_run, metric, "-" if value is None else f"{value:.4g}",
                trial.final_system.label() if trial.final_system else "-")


def _log_summary(logger: Any, study: Study, summary: Any, wall_s: float) -> None:
    best = (f"best {study.metric} {summary.best_value:.4g} (trial {summary.best_trial}) "
            f"params {summary.best_params} under {summary.best_system.label()}"
            if summary.best_value is not None and summary.best_system else "no trial finished")
    logger.info("study %s done in %.1f s: %s; %d trials (%d completed, %d stopped, %d failed), "
                "%d epochs, %d probe epochs, ground-truth hits %d/%d", study.study_id, wall_s,
                best, summary.trials, summary.completed, summary.stopped, summary.failed,
                summary.epochs_run, summary.probe_epochs, summary.groundtruth_hits,
                summary.groundtruth_lookups)


def _name_flow_run(study_id: str) -> None:
    """Name the flow run after its study (the study id: job name, start time, a suffix),
    unless its caller named it (``study_flow.with_options(flow_run_name=...)``)."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None or context.flow.flow_run_name:
        return
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(context.flow_run.id, name=study_id)
    except Exception as e:  # noqa: BLE001 - a name is not worth failing the study
        get_run_logger().warning("could not name the flow run %s: %s", study_id, e)


def _evaluate_best(study: Study, backend: PrefectEpochBackend) -> dict[str, float]:
    """Re-evaluate the best trial from its last checkpoint, proving the checkpoint."""
    best = study.best_trial()
    if best is None or best.checkpoint is None:
        return {}
    metrics = backend.evaluate(study.final_task(best), best.checkpoint)
    return {f"best_checkpoint_{k}": v for k, v in metrics.items()}


def _link_mlflow_run(tracker: StudyTracker, tracking_uri: str, study_id: str) -> None:
    """A markdown artifact on the flow run: a table with the study's MLflow run, its
    trials' runs and the store, each a link into the MLflow UI's Model-training view."""
    from prefect.artifacts import create_markdown_artifact

    from pipetune.tracking.links import run_url, study_runs_url, ui_base_url

    base = ui_base_url(tracking_uri)
    experiment = tracker.experiment_id
    local = not tracking_uri.startswith(("http://", "https://"))
    opened = (f"`pipetune ui --tracking-uri {tracking_uri}` serves them at {base}" if local
              else "the tracking server's own UI")
    rows = [
        ("study run", f"[{tracker.parent_run_id}]"
                      f"({run_url(base, tracker.parent_run_id, experiment)})"),
        ("the study and its trials", f"[runs table]({study_runs_url(base, experiment, study_id)})"),
        ("study id", f"`{study_id}`"),
        ("experiment", f"`pipetune` (id `{experiment}`)"),
        ("tracking URI", f"`{tracking_uri}`"),
        ("opened with", opened),
    ]
    create_markdown_artifact(
        key="mlflow-run",
        markdown="## MLflow\n\n| | |\n|---|---|\n" + "".join(
            f"| {name} | {value} |\n" for name, value in rows),
        description="Where this study is recorded in MLflow",
    )


def flow_settings(*, own_server: bool) -> contextlib.AbstractContextManager:
    """Prefect settings for a study's flow run called in this process. On a server
    started for this one run (``own_server``), no flow-run heartbeats: they let a
    server tell a crashed flow run, and this server goes when the run goes; and the
    engine joins its heartbeat thread at the end of the run, which sleeps in 1 s steps
    (up to 1 s added to every run)."""
    if not own_server:
        return contextlib.nullcontext()
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def drain_prefect(timeout: float = 5.0) -> None:
    """Send the logs and events Prefect still holds in this process, while its API is
    up: a server stopped first would leave them retrying at exit for a minute."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout)
