"""The decisions between a trial's epochs, as the Prefect tasks their runs belong to.

The engine makes the profile lookup and the tuning decision itself and emits each
with its times (:class:`pipetune.engine.events.LookedUp`, :class:`pipetune.engine.events.Decided`);
the study flow writes each as a run of one of these tasks
(:meth:`tasks.task_runs.TaskRunWriter.ran`), so the Prefect UI shows every decision
between a trial's epochs. A task run must belong to a task (its name, key and tags);
these are those tasks. They are records only: calling one raises.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

_RECORD_ONLY = ("a record of what the study engine did (pipetune.engine.events); the engine "
                "makes this decision itself")


@task(
    name="profile-lookup",
    task_run_name="trial-{trial_id}-profile-lookup",
    cache_policy=NO_CACHE,
    persist_result=False,
)
def lookup_groundtruth(trial_id: int) -> None:
    """The trial's epoch-1 profile matched against the ground truth's clusters."""
    raise RuntimeError(_RECORD_ONLY)


@task(
    name="tune-system",
    task_run_name="trial-{trial_id}-tune-after-epoch-{epoch}",
    cache_policy=NO_CACHE,
    persist_result=False,
)
def decide_system(trial_id: int, epoch: int) -> None:
    """The system tuner's choice of config (and phase) for the trial's next epoch."""
    raise RuntimeError(_RECORD_ONLY)
