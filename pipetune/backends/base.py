"""The backend interface: submit an epoch, wait for the next finished one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipetune.runner import EpochFailure, EpochResult, EpochTask


@dataclass(frozen=True)
class EpochOutcome:
    """One finished epoch task: its result, or why it failed (exactly one is set).

    ``error`` is one line; ``failure`` the workload's exception with its whole
    traceback, when the epoch raised (not when its worker died or it timed out)."""

    task: EpochTask
    result: EpochResult | None = None
    error: str | None = None
    failure: EpochFailure | None = None

    @classmethod
    def failed(cls, task: EpochTask, failure: EpochFailure) -> EpochOutcome:
        return cls(task, error=failure.line(), failure=failure)

    def __post_init__(self) -> None:
        if (self.result is None) == (self.error is None):
            raise ValueError("EpochOutcome needs exactly one of result and error")


class EpochBackend(ABC):
    """Runs epoch tasks for one study.

    ``submit`` must return at once; ``wait`` blocks until one submitted epoch has
    finished (in any order) and returns it. A backend never decides what runs next.
    """

    @abstractmethod
    def submit(self, task: EpochTask) -> None: ...

    @abstractmethod
    def wait(self) -> EpochOutcome: ...

    def release(self, study_id: str, trial_id: int | None = None) -> None:  # noqa: B027
        """The trial (with ``None``: every trial of the study) has ended: its model need
        not be kept, and its checkpoints must be on storage when this returns."""

    def cancel(self) -> None:  # noqa: B027 - optional hook
        """Stop every epoch still running (the study is being abandoned)."""

    def close(self, timeout: float | None = 60.0) -> None:  # noqa: B027 - optional hook
        """The study has ended (or failed): write what the backend still holds (a record
        of its epochs kept elsewhere), waiting at most ``timeout`` seconds; raise what
        could not be written."""

    def evaluate(self, task: EpochTask, checkpoint: str) -> dict[str, float]:
        """Rebuild a trial from ``checkpoint`` and evaluate it (proves the checkpoint)."""
        from pipetune.runner import evaluate_checkpoint

        return evaluate_checkpoint(task, checkpoint)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
