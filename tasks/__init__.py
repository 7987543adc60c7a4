"""The Prefect face of a study: the tasks its task runs belong to, and how the study
flow writes those runs (the engine itself never imports Prefect).

The names are loaded on first use: :mod:`tasks.recorded` and :mod:`tasks.task_runs`
load without Prefect (a study starts training before Prefect is loaded)."""

from __future__ import annotations

from pipetune.lazy import lazy_names

_WHERE = {
    "PrefectEpochBackend": "tasks.recorded",
    "evaluate_checkpoint": "tasks.epoch",
    "train_epoch": "tasks.epoch",
    "decide_system": "tasks.tuning",
    "lookup_groundtruth": "tasks.tuning",
}

__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
