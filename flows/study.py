"""The study flow: PipeTune's loop with epochs on Dask and the record in MLflow.

The flow only wires. The study is opened, run and closed by the library
(:func:`pipetune.session.open_study`); here a deployment's parameters are confined, the
flow run is named after its study and linked to its MLflow run, and the engine's epochs,
profile lookups and tuning decisions (its events, :mod:`pipetune.engine.events`) are recorded
as task runs, so every trial shows in
the Prefect UI as a chain epoch -> lookup -> tune -> epoch ... Each epoch is a plain Dask
future recorded as one ``train-epoch`` task run (:mod:`tasks.task_runs` says why they are
records, not task-engine runs: the engine cost the loop ~75 ms per epoch).
"""

from __future__ import annotations

import contextlib
import queue
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.runtime import deployment, flow_run

from flows.first import StartedStudy, attached_study, decisions_as_task_runs
from flows.params import CoreBudget, JobArgument, TrialsOverride
from pipetune.confine import confine_parameters, enforced
from pipetune.session import SAID, StudyOptions, open_study
from pipetune.spec import JobSpec, load_spec
from pipetune.tracking import StudyTracker
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
    """Tune ``job`` (a job-spec dict, a job YAML path, or a checked
    :class:`~pipetune.spec.JobSpec` from a caller in this process) and record it in
    MLflow; the study is opened and run by :func:`pipetune.session.open_study`, which
    says what each option means (``resume``: a study id, a flow run id or ``latest``).
    A run from a deployment is confined first (:func:`confine_parameters`): the paths it
    names must lie under the worker's ``PIPETUNE_ALLOWED_ROOTS`` and an import-path
    workload's module in its ``PIPETUNE_ALLOWED_MODULES``, or it fails naming the
    parameter before anything is recorded. Returns the study's JSON-able summary.
    """
    logger = get_run_logger()
    started = attached_study()
    if started is not None:  # pipetune tune: the study trains already, beside this run
        return _witness(started, logger)
    deployment_id = _deployment_id()
    checked, policy = confine_parameters(
        {"job": job, "tracking_uri": tracking_uri, "checkpoint_root": checkpoint_root,
         "groundtruth_path": groundtruth_path},
        from_deployment=bool(deployment_id),
        job_variables=flow_run.job_variables if deployment_id else None,
    )
    with enforced(policy):  # a job file's import-path workload is checked, then imported
        spec = resolve_job(checked["job"], trials, pipetune)
    run_id = str(flow_run.id or "")
    tags = {"prefect.flow_run_id": run_id}
    if deployment_id:
        tags.update({"prefect.deployment_id": deployment_id,
                     "prefect.deployment_name": str(deployment.name or "")})
    opened = open_study(spec, StudyOptions(
        tracking_uri=tracking_uri, checkpoint_root=checked["checkpoint_root"],
        groundtruth_path=checked["groundtruth_path"], core_budget=core_budget,
        dask_address=dask_address, resume=resume, keep_checkpoints=keep_checkpoints,
        tags=tags, runner_id=run_id), policy=policy, log=logger)
    _name_flow_run(opened.study_id)
    _link_mlflow_run(opened.tracker, opened.tracking_uri, opened.study_id)
    task_runs = TaskRunWriter(run_id, api_url())
    summary = opened.run(PrefectEpochBackend(opened.dask_backend(), task_runs),
                         observers=[decisions_as_task_runs(task_runs, logger.info)])
    return {**summary, "flow_run_id": run_id}


def _witness(started: StartedStudy, logger: Any) -> dict[str, Any]:
    """The flow run of a study that started training before it existed
    (:mod:`flows.first`): its task runs so far are sent under this run, its MLflow runs
    and journal learn this run's id, its decisions go to this run's log as they come,
    and the run ends with the study (Failed with the study's error)."""
    run_id = str(flow_run.id or "")
    started.flow_run_id = run_id
    started.task_runs.bind(run_id, api_url())
    opened = started.opened
    _name_flow_run(opened.study_id)

    def say_lines() -> None:
        while True:
            try:
                level, line, notice = started.lines.get_nowait()
            except queue.Empty:
                return
            logger.log(level, "%s", line, extra=SAID if notice else None)

    try:  # waits for the MLflow run, opened beside the study
        opened.runs_known(run_id)
        _link_mlflow_run(opened.tracker, opened.tracking_uri, opened.study_id)
    except Exception as e:  # noqa: BLE001 - the study says it (it stops on a refused run)
        logger.info("no link to the MLflow run: %s", e)
    while not started.done.wait(0.25):
        say_lines()
    say_lines()
    try:  # what the study's end could not close (it ended before this run existed)
        started.task_runs.close()
    except Exception as e:  # noqa: BLE001 - the study finished; MLflow has all of it
        logger.warning("the task-run record is incomplete: %s", e)
    if started.error is not None:  # the command says it; the run ends Failed, quietly
        from prefect.states import Failed

        return Failed(message=f"the study ended with {type(started.error).__name__}: "
                              f"{started.error}")
    assert started.summary is not None
    return {**started.summary, "flow_run_id": run_id}


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


def current_flow_run_id() -> str | None:
    """The id of the flow run this code runs in (an engine observer does), if any."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    run = getattr(context, "flow_run", None)
    return str(run.id) if run is not None else None


def settle_flow_run(flow_run_id: str, message: str) -> None:
    """Record flow run ``flow_run_id`` Completed now: its study finished while the
    Prefect server was being started again, so the engine's own end never reached it."""
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.states import Completed

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(uuid.UUID(flow_run_id), Completed(message=message),
                                  force=True)


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
    up: a server stopped first would leave them retrying at exit for a minute. In a
    thread that runs an event loop (a notebook's kernel), Prefect's sync calls hand back
    coroutines: the drain runs in a thread of its own there."""
    import asyncio
    import threading

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        _drain(timeout)
        return
    drainer = threading.Thread(target=_drain, args=(timeout,), name="pipetune-drain-prefect",
                               daemon=True)
    drainer.start()
    drainer.join(2 * timeout + 1)


def _drain(timeout: float) -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout)
