"""What a block of code watches of the studies run inside it, and how a study's lines
are marked for the terminal: :func:`observing` (every study run in the block tells an
observer its events), :func:`collecting_opened` (every study opened in the block is
handed over, for the bench), ``NOTICE`` and ``SAID`` (log-record markers). Scoped to
the block and its context (a Prefect flow called in it included), never global.
Re-exported by :mod:`pipetune.session`."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipetune.engine.events import Observer

#: The attribute a log record carries (through ``extra``) for a line meant for a person
#: at the terminal: the command line prints it as its own ``warning:`` line.
NOTICE_ATTR = "pipetune_notice"
NOTICE = {NOTICE_ATTR: "warning"}
#: The attribute of a log record repeating a line the terminal has shown already (the
#: study's notice, said again in its flow run's log): kept off the terminal.
SAID_ATTR = "pipetune_said"
SAID = {SAID_ATTR: True}

#: Observers that every study run in this context hears (:func:`observing`).
_OBSERVING: contextvars.ContextVar[tuple[Observer, ...]] = contextvars.ContextVar(
    "pipetune_observing", default=())


@contextlib.contextmanager
def observing(observer: Observer) -> Iterator[Observer]:
    """Every study run inside the block (in this thread or a task it starts, e.g. a
    Prefect flow called here) also tells ``observer`` its events
    (:mod:`pipetune.engine.events`): how the command line's live table watches a study it
    starts through the flow. Scoped to the block and the context, not a global."""
    token = _OBSERVING.set((*_OBSERVING.get(), observer))
    try:
        yield observer
    finally:
        _OBSERVING.reset(token)


_OPENED: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "pipetune_opened", default=None)


@contextlib.contextmanager
def collecting_opened(studies: list[Any]) -> Iterator[list[Any]]:
    """Every study opened inside the block (in this thread or a task it starts, e.g. a
    Prefect flow called here) has its engine appended to ``studies``: for a caller that
    reads a study's trials after the flow (the bench), where observers only ever get a
    read-only view (:class:`~pipetune.engine.view.StudyView`)."""
    token = _OPENED.set(studies)
    try:
        yield studies
    finally:
        _OPENED.reset(token)
