"""What the system tuner reads and answers: one finished epoch of a trial as it sees it
(:class:`EpochObservation`), and what the next epoch runs under and why
(:class:`TuningDecision`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipetune.states import Phase
from pipetune.system.config import SystemConfig


@dataclass(frozen=True)
class EpochObservation:
    """One finished epoch of a trial, as the tuner sees it.

    ``cost`` is per sample under the system objective: seconds (``time``) or joules
    (``energy``). Lower is better; ``inf`` or NaN (an epoch that saw no samples) loses.
    ``steady`` is the same once warm, the epoch's one-time part left out (``None``:
    not measured, ``cost`` stands in); ``one_time`` is that part for the whole epoch
    (compiling, first steps, loader start), in the objective's units; ``samples`` the
    epoch's sample count (0: unknown).
    """

    epoch: int
    phase: Phase
    system: SystemConfig
    cost: float
    steady: float | None = None
    one_time: float = 0.0
    samples: int = 0
    #: Steady wall seconds per sample, whatever the objective (None: not measured).
    wall_steady: float | None = None

    @property
    def steady_cost(self) -> float:
        return finite_or_inf(self.cost if self.steady is None else float(self.steady))

    def __post_init__(self) -> None:
        if not isinstance(self.epoch, int) or isinstance(self.epoch, bool) or self.epoch < 1:
            raise ValueError(f"epoch must be an integer >= 1 (1-based), got {self.epoch!r}")
        object.__setattr__(self, "phase", Phase(self.phase))
        if not isinstance(self.system, SystemConfig):
            raise TypeError(f"system must be a SystemConfig, got {type(self.system).__name__}")
        object.__setattr__(self, "cost", float(self.cost))


@dataclass(frozen=True)
class TuningDecision:
    """What the next epoch runs under and why.

    ``remember`` is the config to remember for jobs like this one: it is set on the
    first decision after a run of probes (once per trial, unless a one-time knob is
    probed later, when the horizon allows it, and changes the choice). The caller stores
    ``remember`` with ``remember_cost`` (its steady cost per sample),
    ``remember_one_time`` and ``remember_speedup`` (against the default) as a record in
    the ground truth under the trial's epoch-1 profile. ``inputs`` are the figures the
    decision weighed (epochs it projects over, costs, one-time seconds), to show why.
    """

    system: SystemConfig
    phase: Phase
    remember: SystemConfig | None
    remember_cost: float | None
    reason: str
    inputs: Mapping[str, Any] = field(default_factory=dict)
    remember_one_time: float | None = None
    remember_speedup: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase(self.phase))
        if (self.remember is None) != (self.remember_cost is None):
            raise ValueError("remember and remember_cost are set together or not at all")


def finite_or_inf(cost: float) -> float:
    return cost if not math.isnan(cost) else math.inf


def checked_history(history: Sequence[EpochObservation]) -> list[EpochObservation]:
    out = list(history)
    for i, obs in enumerate(out, start=1):
        if not isinstance(obs, EpochObservation):
            raise TypeError(f"history[{i - 1}] is a {type(obs).__name__}, not an EpochObservation")
        if obs.epoch != i:
            raise ValueError(f"history must list epochs 1..n in order; item {i} is {obs.epoch}")
    return out
