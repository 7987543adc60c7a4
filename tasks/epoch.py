"""Epoch tasks: one Prefect task run per epoch, the epoch a plain Dask future.

A Prefect task run executed *on* a Dask worker cost 0.24-0.31 s (the flow-run context
serialised into every submit, settings, clients and the engine rebuilt on the
worker); one run by the task engine in the flow process's thread pool, mirroring the
epoch's future, still cost the loop ~50 ms of GIL per epoch. Here the epoch is a plain
function on the cluster (:class:`pipetune.backends.DaskBackend`) and its task run is
written by the recorder process (:mod:`tasks.task_runs`): the Prefect UI shows one
``train-epoch`` task run per epoch, lasting as long as the epoch.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from pipetune.backends import EpochBackend, EpochOutcome
from pipetune.runner import EpochResult, EpochTask
from tasks.task_runs import TaskRunWriter


@task(
    name="train-epoch",
    task_run_name="trial-{epoch_task.trial_id}-epoch-{epoch_task.epoch}-{epoch_task.phase.value}",
    cache_policy=NO_CACHE,
    persist_result=False,
)
def train_epoch(epoch_task: EpochTask) -> EpochResult:
    """Train, profile, evaluate and checkpoint one epoch under its system config, here.

    A study runs its epochs on Dask and writes each as a run of this task
    (:class:`PrefectEpochBackend`); called as a task, it runs the epoch in place."""
    from pipetune.runner import run_epoch

    return run_epoch(epoch_task)


@task(
    name="evaluate-best",
    task_run_name="evaluate-best-checkpoint-of-trial-{epoch_task.trial_id}",
    cache_policy=NO_CACHE,
    persist_result=False,
)
def evaluate_checkpoint(epoch_task: EpochTask, checkpoint: str, backend: Any) -> dict[str, Any]:
    """Re-evaluate a trial's final checkpoint on the held-out split."""
    return backend.evaluate(epoch_task, checkpoint)


class PrefectEpochBackend(EpochBackend):
    """Epochs on ``cluster`` (a :class:`~pipetune.backends.DaskBackend`), each written
    as one ``train-epoch`` task run of the flow run by ``task_runs`` (a
    :class:`~tasks.task_runs.TaskRunWriter`): Running from the moment the epoch is sent,
    Completed or Failed when its Dask future is, Cancelled if the study stops first.

    The engine hears of a finished epoch from the Dask future itself; the task run is
    written by the recorder process, so Prefect costs the study loop nothing but a
    message per state."""

    def __init__(self, cluster: Any, task_runs: TaskRunWriter):
        self.cluster = cluster
        self.task_runs = task_runs
        self._runs: dict[tuple[int, int], str] = {}

    def submit(self, task: EpochTask) -> None:
        self.cluster.submit(task)
        self._runs[(task.trial_id, task.epoch)] = self.task_runs.started(
            "train-epoch", epoch_run_name(task), task.trial_id)

    def wait(self) -> EpochOutcome:
        outcome = self.cluster.wait()
        run_id = self._runs.pop((outcome.task.trial_id, outcome.task.epoch), None)
        if run_id is not None:
            self.task_runs.finished(run_id, error=outcome.error)
        return outcome

    def release(self, study_id: str, trial_id: int | None = None) -> None:
        self.cluster.release(study_id, trial_id)

    def close(self, timeout: float | None = 60.0) -> None:
        """The task-run records still on their way are written (at most ``timeout`` s)."""
        self.task_runs.close(timeout=timeout)

    def cancel(self) -> None:
        try:
            self.cluster.cancel()  # may raise when the scheduler is gone ...
        finally:  # ... the task runs still end Cancelled
            self._runs.clear()
            self.task_runs.cancel_open()

    def evaluate(self, task: EpochTask, checkpoint: str) -> dict[str, float]:
        return evaluate_checkpoint(task, checkpoint, self.cluster)


def epoch_run_name(task: EpochTask) -> str:
    """The task run's name, as ``train_epoch`` names it."""
    return f"trial-{task.trial_id}-epoch-{task.epoch}-{task.phase.value}"
