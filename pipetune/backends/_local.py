"""The reference backend: epochs run one at a time in this process."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from pipetune.backends.base import EpochBackend, EpochOutcome

if TYPE_CHECKING:
    from pipetune.runner import EpochResult, EpochTask


class LocalBackend(EpochBackend):
    """Runs each submitted epoch when :meth:`wait` is called, in submission order.

    ``run`` defaults to :func:`pipetune.runner.run_epoch` with models kept in memory
    between a trial's epochs; pass another callable to run epochs differently.
    """

    def __init__(self, run: Callable[[EpochTask], EpochResult] | None = None):
        from pipetune.runner import LiveTrials, run_epoch

        self._live = LiveTrials()
        self._run = run or (lambda task: run_epoch(task, live=self._live, address="local"))
        self._queue: deque[EpochTask] = deque()

    def submit(self, task: EpochTask) -> None:
        self._queue.append(task)

    def wait(self) -> EpochOutcome:
        from pipetune.runner import EpochFailure, failing_safely

        task = self._queue.popleft()
        answer = failing_safely(self._run, task)  # a failing trial must not end the study
        if isinstance(answer, EpochFailure):
            return EpochOutcome.failed(task, answer)
        return EpochOutcome(task, result=answer)

    def release(self, study_id: str, trial_id: int | None = None) -> None:
        from pipetune.checkpoints import flush_checkpoints

        self._live.drop(study_id, trial_id)
        if trial_id is None:
            flush_checkpoints()

    def cancel(self) -> None:
        self._queue.clear()
