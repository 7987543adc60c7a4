"""No early stopping: every trial runs ``max_epochs`` epochs."""

from __future__ import annotations

from pipetune.schedulers._base import Decision, Scheduler


class NoopScheduler(Scheduler):
    """Continues every trial until ``max_epochs``."""

    def _decide(self, trial_id: int, epoch: int, value: float) -> Decision:
        return Decision.CONTINUE
