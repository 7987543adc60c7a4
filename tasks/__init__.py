"""Thin Prefect task wrappers over library calls."""

from tasks.epoch import PrefectEpochBackend, evaluate_checkpoint, train_epoch
from tasks.tuning import decide_system, lookup_groundtruth

__all__ = [
    "PrefectEpochBackend",
    "decide_system",
    "evaluate_checkpoint",
    "lookup_groundtruth",
    "train_epoch",
]
