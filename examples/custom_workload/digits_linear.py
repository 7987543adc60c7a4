"""A workload written with pipetune's class API: softmax regression (one linear layer)
on scikit-learn's bundled 8x8 digits (1,797 images; nothing is downloaded).

:class:`~pipetune.workloads.TorchClassifierWorkload` owns the loop, evaluation
(accuracy, val_loss) and checkpoints; a subclass declares its hyperparameters and
params and supplies the data, the model and the optimiser. For full control (your own
loop, another framework) subclass :class:`~pipetune.workloads.Workload` instead.
The job file ``digits_job.yaml`` names it ``digits_linear:DigitsLinear``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pipetune.errors import WorkloadParamError
from pipetune.workloads import ClassifierData, HParam, TorchClassifierWorkload


@functools.lru_cache(maxsize=4)
def load_digits_data(val_samples: int, data_seed: int) -> ClassifierData:
    """Pixels scaled to [0, 1], a seeded split; cached per process."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(data_seed))
    x = torch.as_tensor(x, dtype=torch.float32)[order] / 16.0
    y = torch.as_tensor(y, dtype=torch.int64)[order]
    return ClassifierData(train_x=x[val_samples:], train_y=y[val_samples:],
                          val_x=x[:val_samples], val_y=y[:val_samples], num_classes=10)


class DigitsLinear(TorchClassifierWorkload):
    name = "digits-linear"
    hparam_specs = {
        "lr": HParam(0.1),
        "batch_size": HParam(64, int),
        "weight_decay": HParam(0.0, low=0.0, low_open=False),
    }
    param_defaults = {"val_samples": 400, "data_seed": 0}

    def _check_params(self) -> None:
        val = self.settings["val_samples"]
        if not isinstance(val, int) or not 1 <= val <= 1000:
            raise WorkloadParamError("val_samples", f"must be an integer in [1, 1000], got {val!r}")

    def _load_data(self) -> ClassifierData:
        return load_digits_data(self.settings["val_samples"], self.settings["data_seed"])

    def _build_model(self, data: ClassifierData, hparams: Mapping[str, Any]) -> nn.Module:
        return nn.Linear(data.train_x.shape[1], data.num_classes)

    def _build_optimizer(self, model: nn.Module, hparams: Mapping[str, Any]) -> Any:
        return torch.optim.SGD(model.parameters(), lr=hparams["lr"], momentum=0.9,
                               weight_decay=hparams["weight_decay"])
