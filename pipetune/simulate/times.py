"""Measured epochs, played back: what a simulated epoch costs and what it learns.

A journal (``$PIPETUNE_HOME/studies/<id>/events.jsonl``) holds every epoch a real study
ran: its trial's hyperparameters, its system config and phase, its measurement
(wall, energy, profile) and its metrics. :class:`EpochTimes` reads one or more of them,
and :meth:`EpochTimes.play` answers for an epoch task of any trial, the way a
tabulated benchmark is played back with a nearest-neighbour surrogate:

- **what it learns** (train loss, metrics): the recorded epoch of the same number
  whose trial's hyperparameters are nearest (the last one recorded when no trial got
  that far, as a curve that has flattened);
- **what it costs** (its wall from start to finish, its measurement): the recorded
  epoch under the same system config and the same kind of phase (profiled or not),
  nearest in hyperparameters (batch size and model width move an epoch's time), else
  under the same config in any phase, else under the nearest config (fewest knobs
  apart, then fewest cores apart).

A trial the real study ran, asked again with the same hyperparameters and config,
gets back exactly what it recorded. Distances: a choice counts 1 when it differs; a
range counts its difference over its span (log-spaced ones in logs).

``gap_s`` is the median time between one epoch's end and its trial's next epoch's
start in the journals: what the orchestration around an epoch costs on that stack.
An epoch is played without the workload's first build in its process (``build_s``, the
data and imports a worker process pays once); ``first_build_s``, the median of what the
journals' workers paid, is charged once per slot of the simulated cluster.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetune.errors import PipetuneError
from pipetune.spec import SYSTEM_HPARAM_PREFIX as SYSTEM_PREFIX
from pipetune.states import Phase

if TYPE_CHECKING:
    import numpy as np

    from pipetune.runner import EpochResult, EpochTask
    from pipetune.space import Distribution
    from pipetune.system.config import SystemConfig


class TimesError(PipetuneError):
    """A ``--times`` file that cannot be read or holds no epoch to play."""


@dataclass(frozen=True)
class Recorded:
    """One epoch a real study ran: its trial's hyperparameters and its result."""

    hparams: dict[str, Any]
    result: EpochResult

    @property
    def wall_s(self) -> float:
        """Its wall, without the workload's first build in its process (``build_s``):
        a process pays that once, which the simulated cluster charges per slot."""
        return max(self.result.finished - self.result.started - self.result.build_s, 0.0)


def read_journal(path: str | Path) -> tuple[list[Recorded], list[float]]:
    """The epochs of one study's journal (``events.jsonl`` or its study folder) and the
    gaps between each trial's consecutive epochs."""
    from pipetune.engine.journal import JournalError, StudyJournal

    path = Path(path).expanduser()
    folder = path if path.is_dir() else path.parent
    if not (folder / "events.jsonl").is_file():
        raise TimesError(f"--times {path}: no study journal there (a study's folder under "
                         f"$PIPETUNE_HOME/studies, or its events.jsonl)")
    try:
        events = StudyJournal(folder.parent, folder.name).events()
    except JournalError as e:
        raise TimesError(f"--times {path}: {e}") from None
    params: dict[int, dict[str, Any]] = {}
    records: list[Recorded] = []
    for event in events:
        if event.kind == "start":
            params[event.trial] = {k: v for k, v in event.data.items()
                                   if not k.startswith(SYSTEM_PREFIX)}
        elif event.kind == "result" and event.trial in params:
            records.append(Recorded(params[event.trial], event.data))
    by_trial: dict[int, list[EpochResult]] = defaultdict(list)
    for r in records:
        by_trial[r.result.trial_id].append(r.result)
    gaps = []
    for results in by_trial.values():
        ordered = sorted(results, key=lambda x: x.epoch)
        gaps += [max(b.started - a.finished, 0.0) for a, b in itertools.pairwise(ordered)
                 if b.epoch == a.epoch + 1]
    return records, gaps


class EpochTimes:
    """The recorded epochs of one or more journals, ready to play (module doc)."""

    def __init__(self, records: Sequence[Recorded], gap_s: float = 0.0,
                 sources: Sequence[str] = ()):
        if not records:
            raise TimesError("--times: the journals hold no finished epoch to play back")
        self.records = list(records)
        self.gap_s = gap_s
        #: What a worker process paid once to build the workload (its data, imports):
        #: the median over the journals' workers of their first epoch's ``build_s``.
        self.first_build_s = _first_build_s(self.records)
        self.sources = tuple(sources)
        self._space: Mapping[str, Distribution] | None = None
        self._by_epoch: dict[int, list[int]] = defaultdict(list)
        self._by_config: dict[tuple[SystemConfig, bool], list[int]] = defaultdict(list)
        self._any_phase: dict[SystemConfig, list[int]] = defaultdict(list)
        for i, r in enumerate(self.records):
            self._by_epoch[r.result.epoch].append(i)
            self._by_config[(r.result.system, _profiled(r.result.phase))].append(i)
            self._any_phase[r.result.system].append(i)
        self._encoded: np.ndarray | None = None
        self._nearest_config: dict[SystemConfig, SystemConfig] = {}
        #: Configs no journal measured, each played as the nearest measured one, with
        #: how many epochs were (what a reader of the simulation must know).
        self.stand_ins: dict[tuple[SystemConfig, SystemConfig], int] = defaultdict(int)

    @classmethod
    def from_journals(cls, paths: Iterable[str | Path]) -> EpochTimes:
        records: list[Recorded] = []
        gaps: list[float] = []
        sources = []
        for path in paths:
            more, more_gaps = read_journal(path)
            records += more
            gaps += more_gaps
            sources.append(str(path))
        return cls(records, statistics.median(gaps) if gaps else 0.0, sources)

    # -- nearest hyperparameters --------------------------------------------------------
    def bind(self, space: Mapping[str, Distribution]) -> EpochTimes:
        """Measure hyperparameter distances over ``space`` (a job's, ``system.*`` left
        out); refuse journals that share none of its hyperparameters."""
        import numpy as np

        names = [n for n in space if not n.startswith(SYSTEM_PREFIX)]
        if names and not any(n in r.hparams for r in self.records for n in names):
            raise TimesError(f"--times: the journals' trials have none of this job's "
                             f"hyperparameters ({', '.join(names)})")
        self._space = {n: space[n] for n in names}
        self._encoded = np.array([self._encode(r.hparams) for r in self.records],
                                 dtype=float).reshape(len(self.records), len(names))
        return self

    def _encode(self, hparams: Mapping[str, Any]) -> list[float]:
        """Each hyperparameter as a number whose differences are the distances (a choice:
        its index, compared for equality; a missing one: NaN, which counts 1)."""
        from pipetune.space import Choice

        out = []
        for name, dist in (self._space or {}).items():
            value = hparams.get(name)
            if value is None:
                out.append(math.nan)
            elif isinstance(dist, Choice):
                out.append(float(next((i for i, v in enumerate(dist.values) if v == value),
                                      -1)))
            else:
                out.append(_scaled(dist, value))
        return out

    def _nearest(self, among: list[int], hparams: Mapping[str, Any]) -> int:
        import numpy as np

        from pipetune.space import Choice

        if self._encoded is None or len(among) == 1 or not self._space:
            return among[0]
        query = np.array(self._encode(hparams), dtype=float)
        rows = self._encoded[among]
        choice = np.array([isinstance(d, Choice) for d in self._space.values()])
        diff = np.abs(rows - query)
        diff[:, choice] = (diff[:, choice] != 0).astype(float)
        diff[np.isnan(diff)] = 1.0
        return among[int(np.argmin((diff ** 2).sum(axis=1)))]

    # -- playing an epoch ---------------------------------------------------------------
    def learned(self, task: EpochTask) -> Recorded:
        """The recorded epoch whose train loss and metrics the task gets."""
        among = self._by_epoch.get(task.epoch)
        if not among:  # past the deepest recorded epoch: its curve has flattened
            reached = [e for e in self._by_epoch if e <= task.epoch]
            among = self._by_epoch[max(reached) if reached else min(self._by_epoch)]
        return self.records[self._nearest(among, task.hparams)]

    def costed(self, task: EpochTask) -> Recorded:
        """The recorded epoch whose wall and measurement the task gets."""
        among = (self._by_config.get((task.system, _profiled(task.phase)))
                 or self._any_phase.get(task.system))
        if not among:
            closest = self._closest_config(task.system)
            self.stand_ins[(task.system, closest)] += 1
            among = self._any_phase[closest]
        return self.records[self._nearest(among, task.hparams)]

    def _closest_config(self, system: SystemConfig) -> SystemConfig:
        if system not in self._nearest_config:
            mine = system.to_dict()

            def apart(other: SystemConfig) -> tuple[int, int]:
                theirs = other.to_dict()
                return (sum(mine[k] != theirs[k] for k in mine),
                        abs(mine["cores"] - theirs["cores"]))

            self._nearest_config[system] = min(self._any_phase, key=apart)
        return self._nearest_config[system]

    def play(self, task: EpochTask, start: float, worker: str) -> EpochResult:
        """The task's result had it started at ``start`` (seconds on the simulated
        clock) on ``worker``."""
        learned, cost = self.learned(task), self.costed(task)
        src = cost.result
        return dataclasses.replace(
            src, trial_id=task.trial_id, epoch=task.epoch, phase=task.phase,
            system=task.system, train_loss=learned.result.train_loss,
            metrics=dict(learned.result.metrics), checkpoint=task.checkpoint_out,
            started=start, finished=start + cost.wall_s, worker=worker, address=worker,
            notes=[], reused_model=task.epoch > 1, build_s=0.0,
            setup_s=max(src.setup_s - src.build_s, 0.0))

    def configs(self) -> list[SystemConfig]:
        return list(self._any_phase)


def _first_build_s(records: Sequence[Recorded]) -> float:
    first: dict[str, EpochResult] = {}
    for r in records:
        seen = first.get(r.result.worker)
        if seen is None or r.result.started < seen.started:
            first[r.result.worker] = r.result
    return statistics.median(r.build_s for r in first.values()) if first else 0.0


def _profiled(phase: Phase | str) -> bool:
    return Phase(phase) is Phase.PROFILE


def _scaled(dist: Distribution, value: Any) -> float:
    """``value`` over the range's span, in logs where the range is log-spaced."""
    from pipetune.space import IntUniform, LogUniform

    low, high = float(dist.low), float(dist.high)  # type: ignore[attr-defined]
    log = isinstance(dist, LogUniform) or (isinstance(dist, IntUniform) and dist.log)
    try:
        v = float(value)
    except (TypeError, ValueError):
        return math.nan
    if log and v > 0 and low > 0:
        return (math.log(v) - math.log(low)) / max(math.log(high) - math.log(low), 1e-12)
    return (v - low) / max(high - low, 1e-12)
