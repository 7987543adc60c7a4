"""What a study's engine emits: one event per thing that happened, to its observers.

The engine (:class:`pipetune.engine.study.Study`) decides and keeps state; it does not
record, display or write task runs. It tells its observers (``study.observe(fn)``)
what happened, in order, synchronously: each observer has seen an event before the
engine acts on the next thing. The journal (:meth:`pipetune.engine.journal.StudyJournal.observe`),
the MLflow record, the command line's live table, the Prefect flow's task runs and the
bench are observers.

Events that change the engine's state carry a ``journal_kind``: the journal appends
them, and a resumed study replays them (:meth:`pipetune.engine.study.Study.replay`). The
others (an epoch sent, a trial ended, a step done) are derived and not journaled.

A lookup and a decision carry when they started and ended (``time.time()``), so an
observer can record them as spans after the fact (the Prefect flow's task runs).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from pipetune.engine.trial import Trial
    from pipetune.engine.view import StudyView
    from pipetune.runner import EpochResult, EpochTask
    from pipetune.tuner import GroundTruthMatch, TuningDecision


@dataclass(frozen=True)
class StudyEvent:
    """Base of every event: the trial it is about (``-1`` for the study)."""

    #: The journal's kind for this event, or None when it is not journaled.
    journal_kind: ClassVar[str | None] = None
    #: The event's class as a name (``epoch_finished``, ``trial_ended``...), for
    #: observers below the engine that tell events apart without importing it (the
    #: trackers, :class:`pipetune.tracking.Tracker`).
    name: ClassVar[str] = "study_event"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__.lstrip("_")).lower()

    @property
    def trial_id(self) -> int:
        return -1

    @property
    def journaled(self) -> bool:
        """Whether the journal keeps this event (replay needs it)."""
        return self.journal_kind is not None

    def journal_data(self) -> Any:
        """The payload the journal keeps (what replay needs)."""
        raise NotImplementedError


Observer = Callable[[StudyEvent], None]


@dataclass(frozen=True)
class _OfTrial(StudyEvent):
    trial: Trial

    @property
    def trial_id(self) -> int:
        return self.trial.trial_id


@dataclass(frozen=True)
class TrialStarted(_OfTrial):
    """The searcher proposed a trial; the engine started it with these params."""

    journal_kind: ClassVar[str | None] = "start"

    def journal_data(self) -> Any:
        return self.trial.params


@dataclass(frozen=True)
class EpochSent(StudyEvent):
    """An epoch was handed to the backend (it runs from now)."""

    task: EpochTask

    @property
    def trial_id(self) -> int:
        return self.task.trial_id


@dataclass(frozen=True)
class EpochFinished(_OfTrial):
    """An epoch came back with its result (recorded before any policy looks at it)."""

    result: EpochResult
    journal_kind: ClassVar[str | None] = "result"

    def journal_data(self) -> Any:
        return self.result


@dataclass(frozen=True)
class EpochFailed(_OfTrial):
    """An epoch raised, timed out or lost its worker: its trial fails.
    ``traceback_file``: where the study's folder keeps the whole traceback."""

    epoch: int
    error: str
    traceback_file: str | None = None
    journal_kind: ClassVar[str | None] = "failed"

    def journal_data(self) -> Any:
        return (self.epoch, self.error, self.traceback_file)


@dataclass(frozen=True)
class LookedUp(_OfTrial):
    """The trial's profile was looked up in the ground truth after its first epoch, or
    (``known``) its job was recognised at its start by the job's key: ``match`` is the
    answer, or ``error`` why the lookup raised."""

    match: GroundTruthMatch | None
    started: float
    ended: float
    error: str | None = None
    known: bool = False
    journal_kind: ClassVar[str | None] = "match"

    @property
    def journaled(self) -> bool:
        return self.error is None

    def journal_data(self) -> Any:
        return self.match


@dataclass(frozen=True)
class Decided(_OfTrial):
    """The system tuner chose the config (and phase) of the trial's next epoch, after
    its epoch ``after_epoch``; ``error`` when the tuner raised. (A trial's first
    decision is part of its start: replay makes it again.)"""

    after_epoch: int
    decision: TuningDecision | None
    started: float
    ended: float
    error: str | None = None
    journal_kind: ClassVar[str | None] = "decision"

    @property
    def journaled(self) -> bool:
        return self.error is None

    def journal_data(self) -> Any:
        return self.decision


@dataclass(frozen=True)
class Unconfirmed(_OfTrial):
    """A known job's config was not confirmed by the trial's first epoch (``why``): the
    trial starts over from a default, profiled epoch."""

    why: str
    journal_kind: ClassVar[str | None] = "unconfirmed"

    def journal_data(self) -> Any:
        return self.why


@dataclass(frozen=True)
class Broke(_OfTrial):
    """Trials kept failing the same way before any epoch finished, or the checkpoint
    store refused trials in a row: the study stops starting trials (``line`` says why,
    in one line). Journaled, not replayed."""

    line: str
    journal_kind: ClassVar[str | None] = "broken"

    def journal_data(self) -> Any:
        return self.line


@dataclass(frozen=True)
class TrialEnded(_OfTrial):
    """The trial ended (completed, stopped early or failed): its state says which."""


@dataclass(frozen=True)
class Stepped(StudyEvent):
    """The engine finished a step (or is about to run its first): a display redraws.
    ``view`` is what it may read of the study (:class:`~pipetune.engine.view.StudyView`,
    read-only), never the engine itself."""

    view: StudyView


@dataclass(frozen=True)
class StudyFinished(StudyEvent):
    """The study finished (its journal says so); ``summary`` is what
    :meth:`pipetune.session.OpenedStudy.run` returns. Told before the run returns, so a
    caller whose orchestrator fails after the study (its API gone) still has it."""

    summary: dict[str, Any]


__all__ = [
    "Broke",
    "Decided",
    "EpochFailed",
    "EpochFinished",
    "EpochSent",
    "LookedUp",
    "Observer",
    "Stepped",
    "StudyEvent",
    "StudyFinished",
    "TrialEnded",
    "TrialStarted",
    "Unconfirmed",
]
