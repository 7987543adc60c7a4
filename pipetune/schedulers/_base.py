"""The scheduler interface: after each epoch, does this trial go on?"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import StrEnum


class Decision(StrEnum):
    """A scheduler's answer after an epoch."""

    CONTINUE = "continue"
    STOP = "stop"


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class Scheduler(ABC):
    """Decides, after each epoch of a trial, whether the trial continues.

    The caller reports every epoch of every trial with :meth:`on_epoch_result`
    (``epoch`` counts from 1) and follows the answer. Every scheduler answers
    ``STOP`` once ``epoch >= max_epochs``, so a trial never runs past the budget.
    """

    def __init__(self, max_epochs: int) -> None:
        self.max_epochs = _check_int("max_epochs", max_epochs, 1)

    def on_epoch_result(self, trial_id: int, epoch: int, value: float) -> Decision:
        """Whether trial ``trial_id`` goes on after ``epoch`` scored ``value``."""
        _check_int("epoch", epoch, 1)
        decision = self._decide(trial_id, epoch, float(value))
        return Decision.STOP if epoch >= self.max_epochs else decision

    def sure_epochs(self, epochs_run: int) -> int:
        """Epochs a trial that has run ``epochs_run`` will run for certain from now on
        (the next epoch included): up to the next point where this scheduler may stop
        it, or ``max_epochs``. What a one-time cost (a compile) must be earned back
        within; a trial that goes on past that point is asked again then."""
        return max(self.max_epochs - epochs_run, 0)

    def expected_epochs(self, epochs_run: int) -> float:
        """Epochs a trial that has run ``epochs_run`` is *expected* to run from now on
        (the next epoch included): each later epoch weighted by the chance that the
        trial gets there. What a one-time cost (a compile) is weighed against; a
        scheduler that never stops a trial early expects every epoch up to
        ``max_epochs``."""
        return float(self.sure_epochs(epochs_run))

    def on_trial_remove(self, trial_id: int) -> None:  # noqa: B027 - optional hook
        """Trial ``trial_id`` ended (finished, stopped or failed); nothing more comes from it.

        What it already reported stays part of the history later trials are compared
        against.
        """

    @abstractmethod
    def _decide(self, trial_id: int, epoch: int, value: float) -> Decision:
        """The policy's answer for an epoch; ``max_epochs`` is enforced by the caller."""
