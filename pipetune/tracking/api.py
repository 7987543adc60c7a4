"""The interface a study's record implements: :class:`Tracker`.

A tracker is an observer of the engine (:mod:`pipetune.engine.events`): it hears every
event of a study as it happens, in the driver's study loop (so it must be quick; hand
slow writes to a thread or a process of your own), then how the study ended. MLflow's
record (:class:`~pipetune.tracking.StudyTracker`) is one; a job file adds its own with
``tracking: {trackers: [package.module:Factory]}``, each built when the study opens as
``Factory(spec=JobSpec, study_id=str, folder=Path)`` (``folder``: the study's own folder,
beside its journal). A tracker that raises stops the study, like the MLflow record.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipetune.engine.events import StudyEvent


class Tracker(ABC):
    """Records a study: every engine event (:meth:`__call__`), then its end
    (:meth:`finished` with the summary ``pipetune tune`` prints and a flow run returns,
    or :meth:`failed`)."""

    @abstractmethod
    def __call__(self, event: StudyEvent) -> None:
        """One event of the study (an epoch finished, a trial ended, a decision...)."""

    def finished(self, summary: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """The study ended; ``summary`` is JSON-able (its id, best trial, tables)."""

    def failed(self, status: str, reason: str) -> None:  # noqa: B027 - optional hook
        """The study stopped (``status`` ``KILLED``) or failed (``FAILED``): ``reason``."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Nothing more will come; called once, after :meth:`finished` or :meth:`failed`."""
