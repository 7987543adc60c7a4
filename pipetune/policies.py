"""The names a job file may give its searcher and its early-stopping scheduler.

A job file names its policies by string (``search.algorithm: tpe``,
``early_stopping.policy: asha``). Each string resolves through a registry here: the
built-in names, names a program registered (:func:`register_searcher`,
:func:`register_scheduler`), or an import path ``package.module:Factory`` to a class or
function of your own, imported when the study starts. A program can also hand a study
the objects themselves (``Study(spec, searcher=..., scheduler=...)``); then the job
file's name is only what the record shows.

A searcher factory is called as ``factory(space, mode=..., seed=..., **options)``
(``space``: parameter name -> :class:`~pipetune.space.Distribution`) and returns a
:class:`~pipetune.searchers.Searcher`; a scheduler factory as ``factory(early_stopping,
mode)`` (the job's ``early_stopping`` section) and returns a
:class:`~pipetune.schedulers.Scheduler`.

This module sits low (the job spec checks names against it) and imports no policy: the
built-ins are import paths too, resolved on first use.

>>> searcher_names()
('grid', 'random', 'tpe')
>>> check_name("search.algorithm", "mypkg.search:Bandit", kind="searcher")
'mypkg.search:Bandit'
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable
from typing import Any

from pipetune.errors import SpecError

_lock = threading.Lock()
_SEARCHERS: dict[str, str | Callable[..., Any]] = {
    "random": "pipetune.searchers._random:RandomSearcher",
    "grid": "pipetune.searchers._grid:GridSearcher",
    "tpe": "pipetune.searchers._tpe:TPESearcher",
}
_SCHEDULERS: dict[str, str | Callable[..., Any]] = {
    "asha": "pipetune.schedulers:asha_from_spec",
    "none": "pipetune.schedulers:none_from_spec",
}
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_NAME = re.compile(r"^[A-Za-z_][\w-]*$")


def _register(table: dict, name: str, factory: Callable[..., Any], kind: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"a {kind} name is a word (letters, digits, _ and -), got {name!r}")
    if not callable(factory):
        raise TypeError(f"a {kind} factory must be callable, got {factory!r}")
    with _lock:
        table[name] = factory


def register_searcher(name: str, factory: Callable[..., Any]) -> None:
    """Let job files name ``factory`` as ``search.algorithm: NAME`` (in this process;
    register before the job file is read). A built-in name is replaced."""
    _register(_SEARCHERS, name, factory, "searcher")


def register_scheduler(name: str, factory: Callable[..., Any]) -> None:
    """Let job files name ``factory`` as ``early_stopping.policy: NAME``."""
    _register(_SCHEDULERS, name, factory, "scheduler")


def searcher_names() -> tuple[str, ...]:
    with _lock:
        return tuple(sorted(_SEARCHERS))


def scheduler_names() -> tuple[str, ...]:
    with _lock:
        return tuple(sorted(_SCHEDULERS))


def check_name(field: str, value: Any, *, kind: str) -> str:
    """``value`` if it is a registered ``kind`` name (``searcher``/``scheduler``; any
    other kind, e.g. ``tracker``, has no names) or an import path; else
    :class:`SpecError` for ``field`` saying what is allowed."""
    names = {"searcher": searcher_names, "scheduler": scheduler_names}.get(kind, tuple)()
    if isinstance(value, str) and (value in names or _IMPORT_PATH.match(value)):
        return value
    known = f"one of {', '.join(names)} or " if names else ""
    raise SpecError(field, f"must be {known}an import path package.module:Factory to a "
                           f"{kind} of your own, got {value!r}")


def factory(field: str, value: str, *, kind: str) -> Callable[..., Any]:
    """What ``value`` names (see :func:`check_name`), imported now."""
    check_name(field, value, kind=kind)
    with _lock:
        found = {"searcher": _SEARCHERS, "scheduler": _SCHEDULERS}.get(kind, {}).get(value, value)
    if callable(found):
        return found
    module, _, attr = found.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as e:  # noqa: BLE001 - any failure of the user's import, as one line
        raise SpecError(field, f"cannot import {found!r}: {type(e).__name__}: {e}") from None
    if not callable(obj):
        raise SpecError(field, f"{found!r} is not a class or function, got {obj!r}")
    return obj
