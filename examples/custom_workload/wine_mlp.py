"""A workload written with pipetune's function API: an MLP on scikit-learn's bundled
wine data (178 wines, 13 measurements, 3 cultivars; nothing is downloaded).

You write what is yours (the data, the model, the optimiser); pipetune owns the
training loop, the data loaders, the system knobs, checkpoints and profiling. The
job file beside this module names it ``wine_mlp:workload``.

Every function is module-level: pipetune rebuilds the workload on each Dask worker
by importing this module and calling ``workload(**params)``.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pipetune.errors import WorkloadParamError
from pipetune.workloads import HParam, TorchWorkload, torch_workload

FEATURES, CLASSES = 13, 3


@functools.lru_cache(maxsize=4)
def _splits(val_fraction: float, data_seed: int):
    from sklearn.datasets import load_wine

    x, y = load_wine(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(data_seed))
    x = torch.as_tensor(x, dtype=torch.float32)[order]
    y = torch.as_tensor(y, dtype=torch.int64)[order]
    n_val = round(len(y) * val_fraction)
    train_x, val_x = x[n_val:], x[:n_val]
    mean, std = train_x.mean(dim=0), train_x.std(dim=0)  # standardise on the train split
    return ((train_x - mean) / std, y[n_val:]), ((val_x - mean) / std, y[:n_val])


def wine_splits(params: dict) -> tuple:
    """(train, val) as (inputs, targets) tensor pairs; ``params`` is workload.params."""
    return _splits(params["val_fraction"], params["data_seed"])


def check_params(params: dict) -> None:
    """Runs when the workload is built, so `pipetune validate` reports a bad value."""
    fraction, seed = params["val_fraction"], params["data_seed"]
    if not isinstance(fraction, float) or not 0.05 <= fraction <= 0.5:
        raise WorkloadParamError("val_fraction", f"must be in [0.05, 0.5], got {fraction!r}")
    if not isinstance(seed, int) or seed < 0:
        raise WorkloadParamError("data_seed", f"must be an integer >= 0, got {seed!r}")


def build_model(hparams: dict) -> nn.Module:
    """The trial's hyperparameters arrive as a dict, every declared one present."""
    return nn.Sequential(
        nn.Linear(FEATURES, hparams["hidden"]),
        nn.ReLU(),
        nn.Dropout(hparams["dropout"]),
        nn.Linear(hparams["hidden"], CLASSES),
    )


def build_optimizer(parameters: list, hparams: dict) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=hparams["lr"], weight_decay=hparams["weight_decay"])


workload = torch_workload(TorchWorkload(
    model=build_model,
    data=wine_splits,
    optimizer=build_optimizer,
    # The default loss is cross-entropy and the metrics accuracy and val_loss.
    hparams={
        "lr": HParam(0.01),                                   # > 0
        "batch_size": 16,
        "hidden": HParam(32, int),                            # an int > 0
        "dropout": HParam(0.1, low=0.0, low_open=False, high=1.0),
        "weight_decay": 0.0,
    },
    params={"val_fraction": 0.25, "data_seed": 0},
    check_params=check_params,
    name="wine-mlp",
))
