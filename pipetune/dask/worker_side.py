"""What runs on the Dask workers: an epoch (its model kept in the worker process for
the trial's next epoch), the best model's evaluation, a refusal, a release."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distributed import get_worker

if TYPE_CHECKING:
    from pipetune.runner import EpochFailure, EpochResult, EpochTask


def remote_epoch(task: EpochTask) -> EpochResult | EpochFailure:
    """Run ``task`` in this worker process, keeping the model for the trial's next epoch.
    An exception the epoch raises comes back as an :class:`EpochFailure` (its whole
    traceback kept): raised, Dask would log it as a failed computation, traceback and
    all, on the terminal of every study it belongs to."""
    from pipetune.runner import LIVE_TRIALS, failing_safely, run_epoch

    for trial_id in task.release:
        LIVE_TRIALS.drop(task.study_id, trial_id)
    return failing_safely(run_epoch, task, live=LIVE_TRIALS, address=get_worker().address)


def remote_refuse(message_field: str, message: str) -> None:
    """Run in place of an epoch no worker of the cluster can run as asked."""
    from pipetune.errors import SystemConfigError

    raise SystemConfigError(message_field, message)


def remote_evaluate(task: EpochTask, checkpoint: str) -> dict[str, float]:
    from pipetune.runner import evaluate_checkpoint

    return evaluate_checkpoint(task, checkpoint)


def remote_release(study_id: str, trial_id: int | None) -> int:
    """Drop live workloads; for a whole study also wait for its checkpoint writes."""
    from pipetune.checkpoints import flush_checkpoints
    from pipetune.runner import LIVE_TRIALS

    dropped = LIVE_TRIALS.drop(study_id, trial_id)
    if trial_id is None:
        flush_checkpoints()
    return dropped
