"""Thin Prefect task wrappers over pipetune library calls."""

from tasks.epoch import evaluate_checkpoint, train_epoch
from tasks.tuning import decide_system, lookup_groundtruth

__all__ = ["decide_system", "evaluate_checkpoint", "lookup_groundtruth", "train_epoch"]
