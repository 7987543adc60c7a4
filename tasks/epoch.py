"""Epoch tasks: Prefect task runs in the flow process, each driving one Dask future.

A Prefect task run executed *on* a Dask worker costs 0.24-0.31 s (the flow-run
context serialised into every submit, settings, clients and the engine rebuilt on the
worker). Here the epoch is a plain function on the cluster
(:class:`pipetune.backends.DaskBackend`) and its task run lives in the flow process's
thread pool, mirroring the epoch's Dask future: the Prefect UI still shows one task
run per epoch, lasting as long as the epoch, and Prefect costs the study nothing on
its critical path but the thread's CPU.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture

from pipetune.backends import EpochBackend, EpochOutcome
from pipetune.runner import EpochResult, EpochTask


@task(
    name="train-epoch",
    task_run_name="trial-{epoch_task.trial_id}-epoch-{epoch_task.epoch}-{epoch_task.phase.value}",
    cache_policy=NO_CACHE,
    persist_result=False,
)
def train_epoch(epoch_task: EpochTask, running: Any) -> EpochResult:
    """Train, profile, evaluate and checkpoint one epoch under its system config.

    The epoch is already running on the cluster as the Dask future ``running`` (sent
    before this task run started, so Prefect's own start-up overlaps the epoch); the
    task run lasts until it is done and fails if it fails."""
    return running.result()


@task(name="evaluate-best", cache_policy=NO_CACHE, persist_result=False)
def evaluate_checkpoint(epoch_task: EpochTask, checkpoint: str, backend: Any) -> dict[str, Any]:
    """Re-evaluate a trial's final checkpoint on the held-out split."""
    return backend.evaluate(epoch_task, checkpoint)


class PrefectEpochBackend(EpochBackend):
    """One ``train-epoch`` task run per epoch, in the flow's thread pool, mirroring the
    epoch's Dask future on ``cluster`` (a :class:`~pipetune.backends.DaskBackend`).

    The engine hears of a finished epoch from the Dask future itself, so neither the
    task run's start nor its completion is on the study's critical path; every task
    run is settled before the study ends (:meth:`release` of the whole study).
    """

    def __init__(self, cluster: Any):
        self.cluster = cluster
        self._task_runs: list[PrefectFuture] = []

    def submit(self, task: EpochTask) -> None:
        running = self.cluster.submit(task)
        self._task_runs.append(train_epoch.submit(task, running))

    def wait(self) -> EpochOutcome:
        return self.cluster.wait()

    def _settle_task_runs(self, timeout: float | None = None) -> None:
        runs, self._task_runs = self._task_runs, []
        for future in runs:
            future.wait(timeout=timeout)

    def release(self, study_id: str, trial_id: int | None = None) -> None:
        self.cluster.release(study_id, trial_id)
        if trial_id is None:
            self._settle_task_runs()

    def cancel(self) -> None:
        self.cluster.cancel()
        self._settle_task_runs(timeout=10)

    def evaluate(self, task: EpochTask, checkpoint: str) -> dict[str, float]:
        return evaluate_checkpoint(task, checkpoint, self.cluster)
