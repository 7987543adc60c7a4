"""LeNet-5 on handwritten digits: the built-in workload ``lenet5``.

Model: conv 6@5x5 (padding 2, so a 28x28 input keeps its size) -> ReLU -> 2x2
max-pool -> conv 16@5x5 -> ReLU -> 2x2 max-pool -> fc 120 -> fc 84 -> fc classes.
ReLU and max-pooling replace the original's tanh and subsampling layers; the
shape of the network is LeCun et al.'s (1998).

Params (``workload.params`` in a job file):

- ``dataset``: ``"digits"`` (default) is scikit-learn's bundled 8x8 digits (1,797
  images), each upsampled by nearest neighbour to 24x24 and zero-padded to 28x28
  (see :mod:`pipetune.workloads.datasets.digits`); ``"idx"`` reads MNIST or
  Fashion-MNIST IDX files from ``data_dir``: the ``train-*`` pair (validating on the
  ``t10k-*`` pair when present) or, if only the ``t10k-*`` pair is there, a seeded
  train/val split of it.
- ``data_dir``: folder of the IDX files (``dataset: idx`` only).
- ``train_samples`` / ``val_samples``: how many examples to use (default: all, with
  20% held out when one pool is split); chosen by a permutation seeded with
  ``data_seed`` (default 0).

Pixels are scaled to [0, 1], then standardised with the training split's mean and
standard deviation.

Hyperparameters: ``lr`` (SGD learning rate, default 0.05), ``batch_size`` (64),
``momentum`` (0.9).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pipetune.errors import WorkloadParamError
from pipetune.workloads._classifier import ClassifierData, HParam, TorchClassifierWorkload

if TYPE_CHECKING:
    import torch
    from torch import nn

DATASETS: tuple[str, ...] = ("digits", "idx")


def _lenet5(num_classes: int) -> nn.Module:
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 6, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, kernel_size=5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, num_classes),
    )


@functools.lru_cache(maxsize=4)
def load_lenet_data(
    dataset: str,
    data_dir: str | None,
    train_samples: int | None,
    val_samples: int | None,
    data_seed: int,
) -> ClassifierData:
    """The LeNet-5 dataset as (N, 1, 28, 28) float32 tensors; cached per process."""
    import numpy as np
    import torch

    from pipetune.workloads.datasets import DatasetError, load_digits_28, load_idx_dataset
    from pipetune.workloads.datasets.common import head, pool_split

    sizes_field = "workload.params.train_samples"
    if dataset == "digits":
        images, labels = load_digits_28()
        tr, va = pool_split(len(images), train_samples, val_samples, data_seed, sizes_field)
        train_x, train_y, val_x, val_y = images[tr], labels[tr], images[va], labels[va]
    else:
        assert data_dir is not None
        idx = load_idx_dataset(data_dir)
        if idx.train_images is not None and idx.test_images is not None:
            tr = head(len(idx.train_images), train_samples, data_seed, sizes_field)
            va = head(len(idx.test_images), val_samples, data_seed, "workload.params.val_samples")
            train_x, train_y = idx.train_images[tr], idx.train_labels[tr]
            val_x, val_y = idx.test_images[va], idx.test_labels[va]
        else:
            pool_x = idx.train_images if idx.train_images is not None else idx.test_images
            pool_y = idx.train_labels if idx.train_labels is not None else idx.test_labels
            assert pool_x is not None and pool_y is not None
            tr, va = pool_split(len(pool_x), train_samples, val_samples, data_seed, sizes_field)
            train_x, train_y, val_x, val_y = pool_x[tr], pool_y[tr], pool_x[va], pool_y[va]
        if train_x.ndim != 3 or train_x.shape[1:] != (28, 28):
            raise DatasetError(
                f"LeNet-5 needs 28x28 images; the IDX images in {data_dir} are "
                f"{'x'.join(map(str, train_x.shape[1:]))}"
            )
        scale = 255.0 if train_x.dtype == np.uint8 else 1.0
        train_x = train_x.astype(np.float32) / scale
        val_x = val_x.astype(np.float32) / scale
    train_y = train_y.astype(np.int64)
    val_y = val_y.astype(np.int64)
    if min(train_y.min(), val_y.min()) < 0:
        raise DatasetError("labels must be non-negative class indices")
    mean, std = float(train_x.mean()), float(train_x.std()) or 1.0
    return ClassifierData(
        train_x=torch.from_numpy((train_x - mean) / std).unsqueeze(1),
        train_y=torch.from_numpy(train_y),
        val_x=torch.from_numpy((val_x - mean) / std).unsqueeze(1),
        val_y=torch.from_numpy(val_y),
        num_classes=max(10, int(max(train_y.max(), val_y.max())) + 1),
    )


class LeNet5Workload(TorchClassifierWorkload):
    """LeNet-5 on digits (sklearn, bundled) or MNIST-style IDX files; see the module doc.

    >>> w = LeNet5Workload(train_samples=200, val_samples=100)
    >>> w.setup({"lr": 0.05, "batch_size": 32}, seed=0)
    >>> w.batch_size
    32
    """

    name: ClassVar[str] = "lenet5"
    metrics: ClassVar[tuple[str, ...]] = ("accuracy", "val_loss")
    hparam_specs: ClassVar[dict[str, HParam]] = {
        "lr": HParam(0.05),
        "batch_size": HParam(64, int),
        "momentum": HParam(0.9, float, 0.0, low_open=False, high=1.0),
    }
    param_defaults: ClassVar[dict[str, Any]] = {
        "dataset": "digits",
        "data_dir": None,
        "train_samples": None,
        "val_samples": None,
        "data_seed": 0,
    }

    def _check_params(self) -> None:
        self._choice_param("dataset", DATASETS)
        for name in ("train_samples", "val_samples"):
            self._int_param(name)
        self._int_param("data_seed", minimum=0, optional=False)
        data_dir = self.settings["data_dir"]
        if self.settings["dataset"] == "idx":
            if not data_dir:
                raise WorkloadParamError("data_dir", "is required when dataset is idx")
            self.settings["data_dir"] = str(Path(data_dir).expanduser())
        elif data_dir is not None:
            raise WorkloadParamError("data_dir", "is used only with dataset: idx")

    def _load_data(self) -> ClassifierData:
        s = self.settings
        return load_lenet_data(
            s["dataset"], s["data_dir"], s["train_samples"], s["val_samples"], s["data_seed"]
        )

    def _build_model(self, data: ClassifierData, hparams: Mapping[str, Any]) -> nn.Module:
        return _lenet5(data.num_classes)

    def _build_optimizer(
        self, model: nn.Module, hparams: Mapping[str, Any]
    ) -> torch.optim.Optimizer:
        import torch

        return torch.optim.SGD(model.parameters(), lr=hparams["lr"], momentum=hparams["momentum"])
