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

from pipetune.runner import EpochResult, EpochTask
from tasks.recorded import PrefectEpochBackend, epoch_run_name, evaluate_run_name


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


__all__ = ["PrefectEpochBackend", "epoch_run_name", "evaluate_checkpoint", "evaluate_run_name",
           "train_epoch"]
