"""The study flow: PipeTune's loop with epochs on Dask and the record in MLflow.

The flow only wires: the engine (:class:`pipetune.study.Study`) decides what runs,
tasks do the work, the tracker writes MLflow. Epoch tasks go to the Dask task runner,
each claiming the cores its system config reserves; the profile lookup and the
tuning decision are tasks called in the flow process between a trial's epochs, so
every trial shows in the Prefect UI as a chain epoch -> lookup -> tune -> epoch ...
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import dask
from prefect import flow, get_run_logger
from prefect.futures import as_completed
from prefect.runtime import deployment, flow_run

from flows.cluster import task_runner
from flows.params import CoreBudget, JobArgument, TrialsOverride
from pipetune.checkpoints import CheckpointStore
from pipetune.groundtruth import GroundTruth
from pipetune.home import pipetune_home
from pipetune.progress import notify
from pipetune.schedulers import Decision
from pipetune.spec import JobSpec, load_spec
from pipetune.study import Study, orchestration_overhead, overhead_summary
from pipetune.tracking import StudyTracker, default_tracking_uri
from tasks import decide_system, evaluate_checkpoint, lookup_groundtruth, train_epoch


def resolve_job(job: dict[str, Any] | str, trials: int | None, pipetune: bool | None) -> JobSpec:
    spec = load_spec(job) if isinstance(job, str) else JobSpec.from_dict(job)
    return spec.with_overrides(trials=trials, pipetune_enabled=pipetune)


@flow(name="pipetune-study", task_runner=task_runner(), log_prints=False)
def study_flow(
    job: JobArgument,
    trials: TrialsOverride = None,
    pipetune: bool | None = None,
    tracking_uri: str | None = None,
    checkpoint_root: str | None = None,
    groundtruth_path: str | None = None,
    core_budget: CoreBudget = None,
) -> dict[str, Any]:
    """Tune ``job`` (a job-spec dict or a path to a job YAML) and record it in MLflow.

    Returns a JSON-able summary including the MLflow parent run id.
    """
    logger = get_run_logger()
    spec = resolve_job(job, trials, pipetune)
    tracking_uri = tracking_uri or default_tracking_uri()
    study_id = f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    checkpoints = CheckpointStore(checkpoint_root or str(pipetune_home() / "checkpoints"))
    ground_truth = GroundTruth(
        groundtruth_path,
        max_clusters=spec.pipetune.similarity.max_clusters,
        bound_factor=spec.pipetune.similarity.bound_factor,
        min_bound=spec.pipetune.similarity.min_bound,
    )
    study = Study(
        spec, study_id=study_id, checkpoints=checkpoints,
        ground_truth=ground_truth if spec.pipetune.enabled else None,
        core_budget=core_budget,
    )
    tags = {"prefect.flow_run_id": str(flow_run.id or ""), "pipetune.study_id": study_id}
    if deployment.id:
        tags["prefect.deployment_id"] = str(deployment.id)
        tags["prefect.deployment_name"] = str(deployment.name or "")
    tracker = StudyTracker(tracking_uri, spec, tags=tags)
    _link_mlflow_run(tracker, tracking_uri)
    logger.info("study %s: MLflow parent run %s", study_id, tracker.parent_run_id)

    started = time.time()
    running: dict[Any, Any] = {}
    finished: dict[str, Any] = {}  # checkpoint ref -> the epoch future that wrote it
    try:
        while not study.done:
            for task in study.launchable():
                upstream = [finished[task.checkpoint_in]] if task.checkpoint_in in finished else []
                with dask.annotate(resources={"cores": task.system.cores}):
                    future = train_epoch.submit(task, wait_for=upstream)
                running[future] = task
            notify(study)
            if not running:
                raise RuntimeError("study is stuck: nothing launchable and nothing in flight")
            future = next(as_completed(list(running)))
            task = running.pop(future)
            finished[task.checkpoint_out] = future
            future.wait()  # settles the future's final state from Dask, not the API
            state = future.state
            trial = study.trials[task.trial_id]
            if not state.is_completed():
                error = _describe_failure(state)
                study.on_epoch_failed(task.trial_id, task.epoch, error)
                logger.warning("trial %s failed in epoch %s: %s", task.trial_id, task.epoch, error)
                tracker.end_trial(trial, metric=study.metric, objective=study.objective)
                continue
            result = future.result()
            decision = study.on_epoch_done(result)
            tracker.log_epoch(trial, result)
            if decision is Decision.CONTINUE:
                if study.needs_lookup(task.trial_id):
                    match = lookup_groundtruth(study, task.trial_id, wait_for=[future])
                    study.set_match(task.trial_id, match)
                choice = decide_system(study, task.trial_id, task.epoch, wait_for=[future])
                study.apply_decision(task.trial_id, choice)
            else:
                tracker.end_trial(trial, metric=study.metric, objective=study.objective)
        notify(study)
        extra = _evaluate_best(study)
        wall_s = time.time() - started
        timings = orchestration_overhead(study)
        extra.update(overhead_summary(timings))
        tracker.finish(study, wall_s=wall_s, extra_metrics=extra)
    except BaseException:
        tracker.fail()
        raise
    summary = study.summary()
    return {
        "study_id": study_id,
        "flow_run_id": str(flow_run.id or ""),
        "parent_run_id": tracker.parent_run_id,
        "tracking_uri": tracking_uri,
        "experiment_id": tracker.experiment_id,
        "tuning_wall_s": wall_s,
        **summary.to_metrics(),
        "best_params": summary.best_params,
        "best_system": summary.best_system.label() if summary.best_system else None,
        "energy_source": summary.energy_source,
        **{k: v for k, v in extra.items() if k.startswith("orchestration_")},
        "epoch_timings": timings,
        "trials_table": [
            {"trial": t.trial_id, "outcome": t.state, "epochs": t.epochs_run,
             "probe_epochs": t.probe_epochs, study.metric: t.last_value(study.metric),
             "system": t.final_system.label() if t.final_system else "",
             "error": t.error or ""}
            for t in sorted(study.trials.values(), key=lambda t: t.trial_id)
        ],
    }


def _describe_failure(state: Any) -> str:
    outcome = state.result(raise_on_failure=False)
    if isinstance(outcome, BaseException):
        return f"{type(outcome).__name__}: {outcome}"
    return state.message or state.name


def _evaluate_best(study: Study) -> dict[str, float]:
    """Re-evaluate the best trial from its last checkpoint, proving the checkpoint."""
    best = study.best_trial()
    if best is None or best.checkpoint is None:
        return {}
    metrics = evaluate_checkpoint(study.final_task(best), best.checkpoint)
    return {f"best_checkpoint_{k}": v for k, v in metrics.items()}


def _link_mlflow_run(tracker: StudyTracker, tracking_uri: str) -> None:
    """A markdown artifact on the flow run pointing at its MLflow parent run."""
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(
        key="mlflow-run",
        markdown=(
            f"## MLflow\n\n- tracking URI: `{tracking_uri}`\n"
            f"- experiment id: `{tracker.experiment_id}`\n"
            f"- parent run id: `{tracker.parent_run_id}`\n\n"
            f"Open with `pipetune ui` (or `mlflow ui --backend-store-uri {tracking_uri}`), "
            f"then experiment `pipetune` -> run `{tracker.parent_run_id}`."
        ),
        description="Where this study is recorded in MLflow",
    )
