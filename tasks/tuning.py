"""Profile lookup and system-tuning tasks: run in the flow process, between epochs."""

from __future__ import annotations

from collections.abc import Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from pipetune.groundtruth import GroundTruth
from pipetune.profiler.profile import Profile
from pipetune.tuner import EpochObservation, GroundTruthMatch, SystemTuner, TuningDecision


@task(
    name="profile-lookup",
    task_run_name="trial-{trial_id}-profile-lookup",
    cache_policy=NO_CACHE,
    persist_result=False,
)
def lookup_groundtruth(
    ground_truth: GroundTruth, profile: Profile, batch_size: int, objective: str, trial_id: int
) -> GroundTruthMatch:
    """Match the epoch-1 profile against the ground truth's clusters."""
    return ground_truth.lookup(profile, batch_size, objective)


@task(
    name="tune-system",
    task_run_name="trial-{trial_id}-tune-after-epoch-{epoch}",
    cache_policy=NO_CACHE,
    persist_result=False,
)
def decide_system(
    tuner: SystemTuner,
    history: Sequence[EpochObservation],
    epochs_left: int,
    match: GroundTruthMatch | None,
    trial_id: int,
    epoch: int,
) -> TuningDecision:
    """The system tuner's choice of config (and phase) for the trial's next epoch."""
    return tuner.next_epoch(history, epochs_left=epochs_left, match=match)
