"""A trial as the engine keeps it (params, seed, state, everything observed), and
what one engine step did to a trial.

The engine (:class:`pipetune.engine.study.Study`) writes them; the executors' callbacks,
tracking, reports and the benchmark read them.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipetune.profiler.profile import Profile
from pipetune.states import Phase, TrialState

if TYPE_CHECKING:
    from pipetune.runner import EpochFailure, EpochResult
    from pipetune.states import GroundTruthMatch
    from pipetune.system.config import SystemConfig
    from pipetune.tuner import EpochObservation, TuningDecision


#: The profile an ended trial's epochs keep (see :meth:`Trial.compact`).
_NO_PROFILE = Profile(features={}, sources={})


@dataclass
class Trial:
    """A hyperparameter trial and everything observed of it so far."""

    trial_id: int
    params: dict[str, Any]
    seed: int
    state: TrialState = TrialState.RUNNING
    results: list[EpochResult] = field(default_factory=list)
    history: list[EpochObservation] = field(default_factory=list)
    match: GroundTruthMatch | None = None
    decisions: list[TuningDecision] = field(default_factory=list)
    remembered: SystemConfig | None = None
    #: Why the trial failed, in one line.
    error: str | None = None
    #: The exception a failed epoch raised (its whole traceback), and the file in the
    #: study's folder that keeps it.
    failure: EpochFailure | None = None
    traceback_file: str | None = None
    #: Set when the search space holds system knobs (joint tuning): every epoch runs
    #: under it and the system tuner is not consulted.
    fixed_system: SystemConfig | None = None
    #: Index of the epoch the system tuner's view starts at: 0, or 1 after a first
    #: epoch run under a known job's config did not confirm it (the tuner then starts
    #: over from a default epoch).
    baseline: int = 0
    #: Wall-clock time (``time.time()``) the engine started the trial (asked the
    #: searcher for it), or None when not known; its MLflow run starts then.
    started: float | None = None
    #: Wall-clock time the trial ended (finished, stopped or failed); None while it runs.
    ended: float | None = None

    def tuner_history(self) -> list[EpochObservation]:
        """The observations the system tuner sees, numbered from its baseline."""
        return [dataclasses.replace(o, epoch=o.epoch - self.baseline)
                for o in self.history[self.baseline:]]

    def compact(self, systems: dict[SystemConfig, SystemConfig]) -> None:
        """Once the trial ended and its observers recorded it: keep of each epoch what the
        study's reports and its result read at the end (times, metrics, config, phase,
        checkpoint), not the profile, counters and operator mix its record already holds
        (about 7 KB an epoch as unpickled from a worker, 2 KB after). ``systems`` maps a
        config to the one instance the study keeps of it."""
        self.results = [compact_result(r, systems) for r in self.results]

    @property
    def epochs_run(self) -> int:
        return len(self.results)

    @property
    def probe_epochs(self) -> int:
        return sum(1 for r in self.results if r.phase is Phase.PROBE)

    @property
    def checkpoint(self) -> str | None:
        return self.results[-1].checkpoint if self.results else None

    def last_value(self, metric: str) -> float | None:
        return self.results[-1].metrics.get(metric) if self.results else None

    @property
    def final_system(self) -> SystemConfig | None:
        """The config the trial settled on: the one its probes chose (and remembered), even
        when the trial ended right after probing; else its last epoch's."""
        if self.remembered is not None:
            return self.remembered
        return self.results[-1].system if self.results else None


def compact_result(result: EpochResult, systems: dict[SystemConfig, SystemConfig]
                   ) -> EpochResult:
    """``result`` without what only the trial's own record and decisions read (its
    profile vector, counters, operator mix, the config as the worker applied it); the
    strings it repeats from every other epoch shared (see :meth:`Trial.compact`)."""
    m = result.measurement
    measurement = dataclasses.replace(
        m, op_mix={}, counters={}, profile=_NO_PROFILE,
        energy_source=sys.intern(m.energy_source),
        counters_source=sys.intern(m.counters_source))
    return dataclasses.replace(
        result, measurement=measurement, actual={},
        system=systems.setdefault(result.system, result.system),
        metrics={sys.intern(k): v for k, v in result.metrics.items()},
        worker=sys.intern(result.worker), address=sys.intern(result.address),
        torch_version=sys.intern(result.torch_version), graph=sys.intern(result.graph))


@dataclass(frozen=True)
class StepEvent:
    """What one :meth:`pipetune.engine.study.Study.step` did: the trial whose epoch finished,
    that epoch's result (None when it failed), and whether the trial has now ended."""

    trial: Trial
    result: EpochResult | None
    ended: bool
