"""The epochs a study has handed out and not heard back from, with running counts.

Thousands of epochs may be in flight at once (a 100-node cluster); the engine asks
about them on every step (the cores they hold; whether another trial is probing a
one-time knob). :class:`InFlight` keeps those answers as counts updated when an epoch
leaves or returns, so each question costs the same at 3 or 3,000 epochs in flight.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pipetune.states import Phase

if TYPE_CHECKING:
    from pipetune.runner import EpochTask


class InFlight:
    """Epoch tasks by (trial, epoch), and the counts the engine asks about."""

    def __init__(self) -> None:
        self._tasks: dict[tuple[int, int], EpochTask] = {}
        #: Cores the epochs in flight hold together.
        self.cores = 0
        #: Probes of a one-time knob (a compile) in flight, by trial.
        self._one_time_probes: Counter[int] = Counter()
        self._one_time_total = 0

    @staticmethod
    def _one_time_probe(task: EpochTask) -> bool:
        return task.phase is Phase.PROBE and bool(task.system.one_time_knobs())

    def add(self, task: EpochTask) -> None:
        key = (task.trial_id, task.epoch)
        if key in self._tasks:
            self.pop(*key)
        self._tasks[key] = task
        self.cores += task.system.cores
        if self._one_time_probe(task):
            self._one_time_probes[task.trial_id] += 1
            self._one_time_total += 1

    def pop(self, trial_id: int, epoch: int) -> EpochTask | None:
        task = self._tasks.pop((trial_id, epoch), None)
        if task is not None:
            self.cores -= task.system.cores
            if self._one_time_probe(task):
                self._one_time_probes[trial_id] -= 1
                self._one_time_total -= 1
                if not self._one_time_probes[trial_id]:
                    del self._one_time_probes[trial_id]
        return task

    def one_time_probe_elsewhere(self, trial_id: int) -> bool:
        """Whether a trial other than ``trial_id`` is probing a one-time knob now."""
        return self._one_time_total > self._one_time_probes.get(trial_id, 0)

    def values(self) -> Iterator[EpochTask]:
        return iter(self._tasks.values())

    def __len__(self) -> int:
        return len(self._tasks)

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def __contains__(self, key: object) -> bool:
        return key in self._tasks
