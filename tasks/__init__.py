"""The Prefect face of a study: the tasks its task runs belong to, and how the study
flow writes those runs (the engine itself never imports Prefect)."""

from tasks.epoch import PrefectEpochBackend, evaluate_checkpoint, train_epoch
from tasks.tuning import decide_system, lookup_groundtruth

__all__ = [
    "PrefectEpochBackend",
    "decide_system",
    "evaluate_checkpoint",
    "lookup_groundtruth",
    "train_epoch",
]
