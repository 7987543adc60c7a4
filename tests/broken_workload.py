"""Workloads with a user's ordinary bugs, for the broken-workload tests; imported by
path on Dask workers (``broken_workload:ShapeBug``).

They are the real synthetic workload with one model layer wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from pipetune.workloads.synthetic import SyntheticWorkload


class ShapeBug(SyntheticWorkload):
    """A first layer expecting 32 features where the data has 16: every trial raises
    in its first step, with a message that names its batch size."""

    def _build_model(self, data: Any, hparams: Mapping[str, Any]) -> nn.Module:
        return nn.Sequential(nn.Linear(32, hparams["hidden"]), nn.ReLU(),
                             nn.Linear(hparams["hidden"], data.num_classes))


class NarrowBug(SyntheticWorkload):
    """Only a trial with ``hidden`` 8 is broken (as a bad hyperparameter breaks some
    trials of a sound workload); the others train."""

    def _build_model(self, data: Any, hparams: Mapping[str, Any]) -> nn.Module:
        width = data.train_x.shape[1] * (2 if hparams["hidden"] == 8 else 1)
        return nn.Sequential(nn.Linear(width, hparams["hidden"]), nn.ReLU(),
                             nn.Linear(hparams["hidden"], data.num_classes))
