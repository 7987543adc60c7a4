"""What observers may read of a running study: :class:`StudyView`, read-only.

The engine hands its observers (:mod:`pipetune.engine.events`) a view, never itself: a
display or a tracker reads the study's trials, counts and best trial through it, and
nothing it can reach starts, stops or changes anything. Reading is done when asked
(:meth:`StudyView.trials`, :meth:`StudyView.best` walk the trials then), so handing a
view out costs nothing per step, at any number of trials; what a read returns is a
snapshot (:class:`TrialRow`), which does not change afterwards.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipetune.engine.study import Study
    from pipetune.engine.trial import Trial


@dataclass(frozen=True)
class TrialRow:
    """One trial as it was when read: its id, state, epochs run, the phase and system
    config of its last epoch, and its value of the study's metric (None: none yet)."""

    trial_id: int
    state: str
    epochs_run: int
    last_phase: str | None
    last_system: str | None
    value: float | None


class StudyView:
    """A read-only view of a study, for its observers."""

    __slots__ = ("_study",)

    def __init__(self, study: Study):
        self._study = study

    @property
    def study_id(self) -> str:
        return self._study.study_id

    @property
    def name(self) -> str:
        """The job's name."""
        return self._study.spec.name

    @property
    def metric(self) -> str:
        return self._study.metric

    @property
    def trials_planned(self) -> int:
        """Trials the study is to run (``search.trials``)."""
        return self._study.spec.search.trials

    @property
    def trials_started(self) -> int:
        return len(self._study.trials)

    @property
    def in_flight(self) -> int:
        """Epochs running now."""
        return self._study.in_flight

    @property
    def max_epochs(self) -> int:
        return self._study.max_epochs

    def trials(self, last: int | None = None) -> list[TrialRow]:
        """The trials started so far, oldest first; with ``last``, only the newest
        ``last`` of them (read without walking the others)."""
        trials = self._study.trials
        if last is None:
            chosen = list(trials.values())
        else:  # trials are added as they start: the newest are the dict's last
            chosen = list(itertools.islice(reversed(trials.values()), last))
        return [self._row(t) for t in sorted(chosen, key=lambda t: t.trial_id)]

    def best(self) -> TrialRow | None:
        """The best trial so far by the study's metric (None: none scored yet)."""
        trial = self._study.best_trial()
        return None if trial is None else self._row(trial)

    def _row(self, trial: Trial) -> TrialRow:
        last = trial.results[-1] if trial.results else None
        return TrialRow(trial_id=trial.trial_id, state=str(trial.state),
                        epochs_run=trial.epochs_run,
                        last_phase=last.phase.value if last else None,
                        last_system=last.system.label() if last else None,
                        value=trial.last_value(self._study.metric))
