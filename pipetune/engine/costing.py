"""What a finished epoch cost, as the system tuner compares configs: the study's
objective per sample, scaled to what the epoch kept from the trials beside it.

>>> Costing("time", max_concurrent=1).unit
'seconds'
>>> Costing("time", max_concurrent=4).unit
'core_seconds'
>>> Costing("energy", max_concurrent=4).unit
'joules'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipetune.tuner import EpochObservation

if TYPE_CHECKING:
    from pipetune.runner import EpochResult


class Costing:
    """The cost rule of one study: its ``objective`` (``time`` or ``energy``) and how
    many trials run side by side (``max_concurrent``)."""

    def __init__(self, objective: str, max_concurrent: int):
        self.objective = objective
        self.side_by_side = max_concurrent > 1

    @property
    def unit(self) -> str:
        """What the costs count: ``core_seconds`` (time, trials side by side),
        ``seconds`` or ``joules``, per sample."""
        if self.objective == "energy":
            return "joules"
        return "core_seconds" if self.side_by_side else "seconds"

    def scale(self, result: EpochResult) -> float:
        """The factor on the epoch's own cost: the cores it reserved, or the CPU it kept
        busy where that was more (DataLoader workers run beside the cores a trial
        reserves), when trials share the machine and the objective is time; else 1."""
        if self.objective == "time" and self.side_by_side:
            return max(float(result.system.cores), result.measurement.cores_busy)
        return 1.0

    def cost(self, result: EpochResult) -> float:
        """The objective per sample, and for ``time`` in a study that runs trials side
        by side, *core*-seconds per sample. Cores one trial holds are cores the next
        trial waits for, so a config reserving two cores only pays when it is more than
        twice as fast; and a probe that reserves every core runs alone, while the
        default epoch it is compared with shared the machine, so plain seconds would
        favour it for the wrong reason (measured: cores=2 probes won on LeNet-5 although
        cores=1 was faster alone). A config keeping more CPU busy than it reserved
        (DataLoader workers) pays for that CPU instead: it is taken from the trials
        beside it (measured: LeNet-5 kept ``dataloader_workers=1``, 0.6 CPU-s an epoch
        against 0.4). The seconds are the epoch's own, without the time it waited for a
        CPU (:attr:`~pipetune.profiler.EpochMeasurement.own_wall_s`): an epoch 1 slowed
        by the study's start-up beside it made every probe look better than the
        default."""
        return result.cost(self.objective) * self.scale(result)

    def observation(self, result: EpochResult) -> EpochObservation:
        """What the system tuner sees of a finished epoch: its cost, steady cost and
        one-time part, each scaled as :meth:`cost` scales."""
        scale = self.scale(result)
        m = result.measurement
        return EpochObservation(
            epoch=result.epoch,
            phase=result.phase,
            system=result.system,
            cost=self.cost(result),
            steady=m.steady_cost(self.objective) * scale,
            one_time=m.one_time_cost(self.objective) * scale,
            samples=m.samples,
            wall_steady=m.steady_cost("time"),
        )
