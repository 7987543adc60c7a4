"""Epoch tasks: run on Dask workers, return results; they never log to MLflow."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from pipetune.runner import EpochResult, EpochTask, run_epoch


@task(
    name="train-epoch",
    task_run_name="trial-{epoch_task.trial_id}-epoch-{epoch_task.epoch}-{epoch_task.phase.value}",
    cache_policy=NO_CACHE,
    persist_result=False,
)
def train_epoch(epoch_task: EpochTask) -> EpochResult:
    """Train, profile, evaluate and checkpoint one epoch under its system config."""
    return run_epoch(epoch_task)


@task(name="evaluate-best", cache_policy=NO_CACHE, persist_result=False)
def evaluate_checkpoint(epoch_task: EpochTask, checkpoint: str) -> dict[str, Any]:
    """Re-evaluate a trial's final checkpoint on the held-out split."""
    from pipetune.runner import evaluate_checkpoint as evaluate

    return evaluate(epoch_task, checkpoint)
