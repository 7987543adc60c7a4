"""Profile lookup and system-tuning tasks: run in the flow process, between epochs.

They take the study engine and a trial id, and call the engine's policy methods, so
the Prefect UI shows each decision as a task run between a trial's epochs.
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
