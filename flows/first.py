"""Training first: ``pipetune tune`` sends a study's first epoch before Prefect is up.

The command checks the job, starts the cluster and opens the study through the
library; the study trains in the command's main thread at once. Beside it, the
Prefect server boots and the study flow's run is created (:func:`flows.beside.flow_beside`): the
flow run *witnesses* the study already running (:class:`StartedStudy`) instead of
opening one. Everything the study did before the flow run existed was kept, with
its own times, and reaches Prefect then: each epoch, lookup, decision and the best
checkpoint's evaluation as a task run of the flow run (a deferred
:class:`~tasks.task_runs.TaskRunWriter`), each decision as a line of the flow run's
log, the flow run's id on the study's MLflow runs and in its journal. The MLflow run
itself is opened beside the training too (:attr:`pipetune.session.StudyOptions.start_first`).

Nothing here imports Prefect; :mod:`flows.beside` runs the flow in its thread.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from pipetune.engine.events import Decided, LookedUp, Observer, StudyEvent
from tasks.recorded import PrefectEpochBackend
from tasks.task_runs import TaskRunWriter

#: The study a flow run called in this context witnesses (:func:`attached`).
_ATTACHED: contextvars.ContextVar[StartedStudy | None] = contextvars.ContextVar(
    "pipetune_attached_study", default=None)


def decisions_as_task_runs(task_runs: TaskRunWriter, say: Callable[[str], None]) -> Observer:
    """An engine observer: each profile lookup and tuning decision written as the task
    run it was (with its own times), and each decision said as one line (``say``: the
    flow run's log). (A job known at a trial's start shows in its first epoch's config,
    not as a lookup.)"""

    def observe(event: StudyEvent) -> None:
        if isinstance(event, LookedUp) and not event.known:
            trial = event.trial_id
            task_runs.ran("profile-lookup", f"trial-{trial}-profile-lookup", trial,
                          event.started, event.ended, event.error)
        elif isinstance(event, Decided):
            trial, epoch = event.trial_id, event.after_epoch
            task_runs.ran("tune-system", f"trial-{trial}-tune-after-epoch-{epoch}", trial,
                          event.started, event.ended, event.error)
            if event.decision is not None:
                say(f"trial {trial} after epoch {epoch}: {event.decision.phase.value} epoch "
                    f"under {event.decision.system.label()} ({event.decision.reason})")

    return observe


class StartedStudy:
    """A study opened and trained by the command (:meth:`run`, in its main thread),
    whose flow run is created beside it and only witnesses it."""

    def __init__(self, opened: Any, lines: queue.SimpleQueue | None = None):
        self.opened = opened
        self.task_runs = TaskRunWriter.deferred()
        self.backend = PrefectEpochBackend(opened.dask_backend(), self.task_runs)
        #: ``(level, line, notice)`` for the flow run's log (the study's lines, its
        #: decisions; a notice the command printed already),
        #: said by the flow run's thread (:class:`LinesForTheFlowRun` fills it).
        self.lines: queue.SimpleQueue[tuple[int, str, bool]] = lines or queue.SimpleQueue()
        self.done = threading.Event()
        self.summary: dict[str, Any] | None = None
        self.error: BaseException | None = None
        #: The flow run, once created.
        self.flow_run_id: str | None = None

    def run(self) -> dict[str, Any]:
        """Train the study to its end here (:meth:`pipetune.session.OpenedStudy.run`)."""
        try:
            self.summary = self.opened.run(self.backend, observers=[decisions_as_task_runs(
                self.task_runs, lambda line: self.lines.put((logging.INFO, line, False)))])
            return self.summary
        except BaseException as e:
            self.error = e
            raise
        finally:
            self.done.set()


class LinesForTheFlowRun(logging.Handler):
    """A log handler keeping each record's line for the flow run's log, until the flow
    run exists to say it (the study logs from its first step on)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: queue.SimpleQueue[tuple[int, str, bool]] = queue.SimpleQueue()

    def emit(self, record: logging.LogRecord) -> None:
        from pipetune.session import NOTICE_ATTR

        self.lines.put((record.levelno, record.getMessage(),
                        bool(getattr(record, NOTICE_ATTR, None))))


class attached:  # noqa: N801 - a context manager, used as ``with attached(started):``
    """Inside the block, a study flow called in this context witnesses ``started``."""

    def __init__(self, started: StartedStudy):
        self.started = started
        self._token: contextvars.Token | None = None

    def __enter__(self) -> StartedStudy:
        self._token = _ATTACHED.set(self.started)
        return self.started

    def __exit__(self, *exc: Any) -> None:
        assert self._token is not None
        _ATTACHED.reset(self._token)


def attached_study() -> StartedStudy | None:
    """The study the current flow run witnesses, if any."""
    return _ATTACHED.get()
