"""The Prefect face of a study: the tasks its task runs belong to, and how the study
flow writes those runs (the engine itself never imports Prefect).

The names are loaded on first use: :mod:`tasks.recorded` and :mod:`tasks.task_runs`
load without Prefect (a study starts training before Prefect is loaded)."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "PrefectEpochBackend": "tasks.recorded",
    "evaluate_checkpoint": "tasks.epoch",
    "train_epoch": "tasks.epoch",
    "decide_system": "tasks.tuning",
    "lookup_groundtruth": "tasks.tuning",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'tasks' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
