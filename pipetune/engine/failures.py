"""When failing trials stop a study: the same failure, trial after trial, before any
epoch finished (a broken workload), or a checkpoint store refusing every checkpoint.
The study asks :meth:`FailureCount.count` after each failed trial; a :class:`Broken` back
means nothing more starts."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pipetune.errors import refused_by_store

if TYPE_CHECKING:
    from pipetune.engine.trial import Trial
    from pipetune.runner import EpochFailure


class Broken:
    """Why a study stopped on a broken workload: ``line`` says it in one line (the
    workload, the exception and its message, where the whole traceback is). ``store``:
    it stopped because the checkpoint store refused every trial's checkpoint (full,
    read-only): not the workload's fault, and resumable once the store has room."""

    def __init__(self, line: str, trial_id: int, traceback_file: str | None,
                 store: bool = False):
        self.line = line
        self.trial_id = trial_id
        self.traceback_file = traceback_file
        self.store = store

    def __repr__(self) -> str:
        return f"Broken({self.line!r})"


def _trials(n: int) -> str:
    return f"{n} {'trial' if n == 1 else 'trials'}"


class FailureCount:
    """The failures of one run of a study, against ``limit``
    (``search.stop_after_failures``; 0: never stop), for ``workload`` and ``study_id``
    (named in the line that says why it stopped)."""

    def __init__(self, limit: int, workload: str, study_id: str):
        self.limit, self.workload, self.study_id = limit, workload, study_id
        #: Failures by kind (:attr:`EpochFailure.kind`), counted until an epoch finishes.
        self.same: Counter[tuple[str, str]] = Counter()
        #: Trials failed in a row because the checkpoint store refused their checkpoint
        #: (:class:`~pipetune.errors.CheckpointWriteError`), since the last epoch that
        #: finished (whose checkpoint the store took).
        self.store_refusals = 0
        #: Epochs finished in this run of the study (replayed ones included).
        self.epochs_finished = 0

    def epoch_finished(self) -> None:
        """An epoch finished, and the store took its checkpoint."""
        self.store_refusals = 0
        self.epochs_finished += 1

    def count(self, trial: Trial, failure: EpochFailure, *,
              any_epoch_finished: bool) -> Broken | None:
        """Count ``trial``'s failure; why the study must stop now, or None."""
        if refused_by_store(failure.line()):
            return self._store_refused(trial, failure)
        if not self.limit or any_epoch_finished:
            return None
        self.same[failure.kind] += 1
        same = self.same[failure.kind]
        if same < self.limit:
            return None
        where = f"; whole traceback: {trial.traceback_file}" if trial.traceback_file else ""
        return Broken(
            f"workload {self.workload} is broken: {_trials(same)} failed with "
            f"{failure.line()} before any epoch finished (search.stop_after_failures: "
            f"{self.limit}){where}",
            trial.trial_id, trial.traceback_file)

    def _store_refused(self, trial: Trial, failure: EpochFailure) -> Broken | None:
        """A full or refusing checkpoint store fails every trial alike, however many
        epochs finished before it filled up: once ``limit`` trials in a row failed on
        it, the study stops, resumable when the store has room."""
        self.store_refusals += 1
        if not self.limit or self.store_refusals < self.limit:
            return None
        return Broken(
            f"the checkpoint store refuses checkpoints: {_trials(self.store_refusals)}"
            f" in a row failed with {failure.line()} (search.stop_after_failures: "
            f"{self.limit}); give the store room, then resume the study with --resume "
            f"{self.study_id}",
            trial.trial_id, trial.traceback_file, store=True)


def traceback_text(study_id: str, workload: str, trial: Trial, epoch: int,
                   failure: EpochFailure) -> str:
    """The traceback file's text: which study, workload, trial, epoch and params."""
    return (f"study {study_id}, workload {workload}, trial {trial.trial_id} epoch {epoch}"
            f"\nparams {trial.params}\nraised at {failure.where}\n\n{failure.traceback}")
