"""The study's epochs on its cluster, each written as the Prefect task run it was.

Nothing here imports Prefect: ``pipetune tune`` sends a study's first epoch before
Prefect is loaded (its server boots and its flow run is created beside the training;
:mod:`flows.first`), so the backend that records epochs as task runs must load
without it. The tasks the runs belong to are :mod:`tasks.epoch`'s.
"""

from __future__ import annotations

import time
from typing import Any

from pipetune.backends import EpochBackend, EpochOutcome
from pipetune.runner import EpochTask
from tasks.task_runs import TaskRunWriter


class PrefectEpochBackend(EpochBackend):
    """Epochs on ``cluster`` (a :class:`~pipetune.backends.DaskBackend`), each written
    as one ``train-epoch`` task run of the flow run by ``task_runs`` (a
    :class:`~tasks.task_runs.TaskRunWriter`): from the moment the epoch is sent, Running
    from its start on the worker, once the workload is built and its checkpoint loaded
    (the wait before, a worker starting, the workload's build, a free slot, in its final
    state's message), Completed or Failed when its Dask future is, Cancelled if the study
    stops first.

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
            result = outcome.result  # Running from the workload built, checkpoint loaded
            began = result.started + result.setup_s if result is not None else None
            self.task_runs.finished(run_id, error=outcome.error, began=began)
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
        """Re-evaluate on the cluster, written as one ``evaluate-best`` task run, as the
        epochs are (the study may run before its flow run exists: see
        :meth:`~tasks.task_runs.TaskRunWriter.deferred`)."""
        started, error = time.time(), None
        try:
            return self.cluster.evaluate(task, checkpoint)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.task_runs.ran("evaluate-best", evaluate_run_name(task), task.trial_id,
                               started, time.time(), error)


def evaluate_run_name(task: EpochTask) -> str:
    """The task run's name, as ``evaluate_checkpoint`` names it."""
    return f"evaluate-best-checkpoint-of-trial-{task.trial_id}"


def epoch_run_name(task: EpochTask) -> str:
    """The task run's name, as ``train_epoch`` names it."""
    return f"trial-{task.trial_id}-epoch-{task.epoch}-{task.phase.value}"
