"""A small residual CNN with batch norm on handwritten digits: the built-in workload ``resnet``.

Model, for 1-channel images (28x28 here; the global average pool takes any size):

- stem: conv ``width``@3x3 (padding 1) -> batch norm -> ReLU;
- stage 1: ``blocks`` basic residual blocks at ``width`` channels, full resolution;
- downsampling: conv ``2*width``@3x3, stride 2 -> batch norm -> ReLU (28x28 -> 14x14);
- stage 2: ``blocks`` basic residual blocks at ``2*width`` channels;
- global average pool -> linear to the classes.

A basic block is conv 3x3 -> BN -> ReLU -> conv 3x3 -> BN, plus the block's input
(an identity skip: every block keeps its channels and resolution), then ReLU (He et
al., 2016). Convolutions feeding a batch norm have no bias. ``blocks`` counts the
blocks of *each* stage, so the network holds ``2 * blocks`` residual blocks and
``4 * blocks + 2`` convolutions.

Params (``workload.params`` in a job file): the data params are ``lenet5``'s, and the
data is loaded by the same code (one per-process cache for both):

- ``dataset``: ``"digits"`` (default) is scikit-learn's bundled 8x8 digits (1,797
  images), upsampled to 24x24 and zero-padded to 28x28; ``"idx"`` reads MNIST or
  Fashion-MNIST IDX files from ``data_dir`` (the ``train-*`` pair, validating on the
  ``t10k-*`` pair when present, or a seeded split of whichever pair is there).
- ``data_dir``: folder of the IDX files (``dataset: idx`` only).
- ``train_samples`` / ``val_samples``: how many examples to use (default: all, with
  20% held out when one pool is split); chosen by a permutation seeded with
  ``data_seed`` (default 0).
- ``width``: channels of stage 1 (default 24; stage 2 has twice as many).
- ``blocks``: residual blocks per stage (default 2).

The defaults are sized for one CPU thread: an epoch over 3,000 MNIST images at batch
64 takes about 6 s of CPU on the 2-core AMD EPYC development VM (width 16 took 2.3 s,
below the 3-10 s wanted; ``benchmarks/compile_costs.py`` measures it). Evaluation
runs in batches of 128: on one thread that is 3x faster than batches of 1,024.

Hyperparameters: ``lr`` (SGD learning rate, default 0.05), ``momentum`` (0.9, in
[0, 1)), ``weight_decay`` (0, >= 0; applied to every parameter), ``batch_size`` (64).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from pipetune.errors import WorkloadParamError
from pipetune.workloads._classifier import ClassifierData, HParam
from pipetune.workloads.lenet import LeNet5Workload

#: Largest ``width`` and ``blocks`` accepted: far past what a CPU trains in minutes.
MAX_WIDTH = 512
MAX_BLOCKS = 16


class BasicBlock(nn.Module):
    """conv 3x3 -> BN -> ReLU -> conv 3x3 -> BN, plus the input, then ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


def _conv_bn_relu(c_in: int, c_out: int, stride: int) -> list[nn.Module]:
    return [
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    ]


def build_resnet(num_classes: int, width: int = 24, blocks: int = 2) -> nn.Sequential:
    """The residual CNN of the module doc, for 1-channel images."""
    wide = 2 * width
    return nn.Sequential(
        *_conv_bn_relu(1, width, 1),
        *(BasicBlock(width) for _ in range(blocks)),
        *_conv_bn_relu(width, wide, 2),
        *(BasicBlock(wide) for _ in range(blocks)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(wide, num_classes),
    )


class ResNetWorkload(LeNet5Workload):
    """A small residual CNN with batch norm on digits or MNIST-style IDX files; see the
    module doc. The data, its params and their checks are ``lenet5``'s (inherited).

    >>> w = ResNetWorkload(train_samples=200, val_samples=100, width=8, blocks=1)
    >>> w.setup({"lr": 0.05}, seed=0)
    >>> w.batch_size, w.hparams["weight_decay"]
    (64, 0.0)
    """

    name: ClassVar[str] = "resnet"
    metrics: ClassVar[tuple[str, ...]] = ("accuracy", "val_loss")
    #: Activations of 1,024 images at 28x28 and ``width`` channels miss the caches.
    eval_batch_size: ClassVar[int] = 128
    hparam_specs: ClassVar[dict[str, HParam]] = {
        "lr": HParam(0.05),
        "batch_size": HParam(64, int),
        "momentum": HParam(0.9, float, 0.0, low_open=False, high=1.0),
        "weight_decay": HParam(0.0, float, 0.0, low_open=False),
    }
    param_defaults: ClassVar[dict[str, Any]] = {
        **LeNet5Workload.param_defaults,
        "width": 24,
        "blocks": 2,
    }

    def _check_params(self) -> None:
        super()._check_params()
        for name, top in (("width", MAX_WIDTH), ("blocks", MAX_BLOCKS)):
            value = self.settings[name]
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise WorkloadParamError(name, f"must be an integer in [1, {top}], got {value!r}")

    def _build_model(self, data: ClassifierData, hparams: Mapping[str, Any]) -> nn.Module:
        return build_resnet(data.num_classes, self.settings["width"], self.settings["blocks"])

    def _build_optimizer(
        self, model: nn.Module, hparams: Mapping[str, Any]
    ) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            model.parameters(),
            lr=hparams["lr"],
            momentum=hparams["momentum"],
            weight_decay=hparams["weight_decay"],
        )
