"""Progress of a running study, pushed to whoever listens (the CLI's live display).

The study loop calls :func:`notify` after every change; listeners get the engine and
must only read it. With no listener this costs one empty loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipetune.study import Study

Listener = Callable[["Study"], None]
_listeners: list[Listener] = []


def add_listener(listener: Listener) -> None:
    _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def notify(study: Study) -> None:
    for listener in list(_listeners):
        listener(study)
