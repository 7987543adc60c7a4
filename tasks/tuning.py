"""Profile lookup and system-tuning tasks: the decisions between a trial's epochs.

They take the study engine and a trial id and call its policy methods. The study flow
makes those calls itself and writes each as a run of these tasks
(:class:`tasks.task_runs.TaskRunWriter`), so the Prefect UI shows every decision as a
task run between a trial's epochs without the task engine on the loop's path.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from pipetune.study import Study
from pipetune.tuner import GroundTruthMatch, TuningDecision


@task(
    name="profile-lookup",
    task_run_name="trial-{trial_id}-profile-lookup",
    cache_policy=NO_CACHE,
    persist_result=False,
)
def lookup_groundtruth(study: Study, trial_id: int) -> GroundTruthMatch:
    """Match the trial's epoch-1 profile against the ground truth's clusters."""
    return study.lookup(trial_id)


@task(
    name="tune-system",
    task_run_name="trial-{trial_id}-tune-after-epoch-{epoch}",
    cache_policy=NO_CACHE,
    persist_result=False,
)
def decide_system(study: Study, trial_id: int, epoch: int) -> TuningDecision:
    """The system tuner's choice of config (and phase) for the trial's next epoch."""
    return study.decide(trial_id)
