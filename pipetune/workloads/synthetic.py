"""A workload whose epoch time depends on the system config in a known way: ``synthetic``.

For orchestration tests and benchmarks. It really trains a one-hidden-layer MLP on
a seeded Gaussian-blob classification set (loss falls, accuracy rises), and on top
of the real work it sleeps, per epoch::

    sleep = base_seconds + sum(cost_by_knob[knob].get(str(value), 0) for each knob)

where ``value`` is the epoch's :class:`SystemConfig` value of that knob (booleans
are looked up as ``"true"``/``"false"``; keys given as numbers or booleans in a job
file are normalised the same way). The sleep is spread evenly over the epoch's
optimiser steps, before each ``on_step`` call, so a step-sampling profiler sees it.
:meth:`SyntheticWorkload.sleep_seconds` returns the amount for a config, so a test
knows which config is cheapest before any tuning runs.

Params: ``base_seconds`` (0.0), ``cost_by_knob`` (``{}``), e.g.
``{"cores": {"1": 0.3, "2": 0.1}, "dataloader_workers": {"1": 0.05}}``;
``one_time_by_knob`` (``{}``), the same shape: seconds slept once, in the first
step, the first time a trial's workload (in one process) trains under that value,
e.g. ``{"compile": {"true": 2.0}}``: a compile with a known price. The ``compile``
knob itself is only simulated here (the model is never really compiled), so a test
knows exactly what it costs; ``one_time_scope`` (``"trial"``): ``"process"`` pays a
one-time cost once per worker process instead, as a compile that dynamo reuses for
the next trial's model of the same graph on that worker;
``fail_at_epoch`` (None): ``train_epoch`` raises :class:`RuntimeError` when asked
to train that epoch (1-based; the epoch counter is part of the checkpoint, so
this works across processes); ``train_samples`` (512), ``val_samples`` (256),
``features`` (16), ``classes`` (4), ``data_seed`` (0).

Hyperparameters: ``lr`` (SGD with momentum 0.9, default 0.05), ``batch_size``
(32), ``hidden`` (32).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from pipetune.errors import SpecError
from pipetune.system.config import KNOBS, SystemConfig
from pipetune.workloads._classifier import ClassifierData, HParam, TorchClassifierWorkload

if TYPE_CHECKING:
    import torch
    from torch import nn


#: Where a one-time cost is paid once: per trial's workload, or per worker process.
ONE_TIME_SCOPES: tuple[str, ...] = ("trial", "process")
#: What this process paid once (``one_time_scope: process``): (knob, value).
_PROCESS_PAID: set[tuple[str, str]] = set()


def _key(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@functools.lru_cache(maxsize=8)
def load_blobs(
    train_samples: int, val_samples: int, features: int, classes: int, data_seed: int
) -> ClassifierData:
    """Gaussian blobs: class centres ~ N(0, 1.5^2) per feature, points ~ N(centre, 1)."""
    import torch

    g = torch.Generator().manual_seed(data_seed)
    centres = torch.randn(classes, features, generator=g) * 1.5

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.arange(n) % classes
        y = y[torch.randperm(n, generator=g)]
        x = centres[y] + torch.randn(n, features, generator=g)
        return x, y

    train_x, train_y = draw(train_samples)
    val_x, val_y = draw(val_samples)
    return ClassifierData(train_x, train_y, val_x, val_y, num_classes=classes)


class SyntheticWorkload(TorchClassifierWorkload):
    """Tiny MLP plus a known, config-dependent sleep; see the module doc.

    >>> w = SyntheticWorkload(base_seconds=0.1, cost_by_knob={"cores": {1: 0.3}})
    >>> w.sleep_seconds(SystemConfig(cores=1)), w.sleep_seconds(SystemConfig(cores=2))
    (0.4, 0.1)
    """

    name: ClassVar[str] = "synthetic"
    metrics: ClassVar[tuple[str, ...]] = ("accuracy", "val_loss")
    hparam_specs: ClassVar[dict[str, HParam]] = {
        "lr": HParam(0.05),
        "batch_size": HParam(32, int),
        "hidden": HParam(32, int),
    }
    param_defaults: ClassVar[dict[str, Any]] = {
        "base_seconds": 0.0,
        "cost_by_knob": {},
        "one_time_by_knob": {},
        "one_time_scope": "trial",
        "fail_at_epoch": None,
        "train_samples": 512,
        "val_samples": 256,
        "features": 16,
        "classes": 4,
        "data_seed": 0,
    }

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._sleep_per_step = 0.0
        self._first_step_sleep = 0.0
        self._paid: set[tuple[str, str]] = (
            _PROCESS_PAID if self.settings["one_time_scope"] == "process" else set())

    def _check_params(self) -> None:
        s = self.settings
        base = s["base_seconds"]
        if not _non_negative(base):
            raise SpecError("workload.params.base_seconds", f"must be a number >= 0, got {base!r}")
        s["base_seconds"] = float(base)
        for param in ("cost_by_knob", "one_time_by_knob"):
            s[param] = _knob_table(s[param], param)
        if s["one_time_scope"] not in ONE_TIME_SCOPES:
            raise SpecError("workload.params.one_time_scope",
                            f"must be one of {', '.join(ONE_TIME_SCOPES)}, "
                            f"got {s['one_time_scope']!r}")
        self._int_param("fail_at_epoch")
        for name in ("train_samples", "val_samples", "features"):
            self._int_param(name, optional=False)
        self._int_param("classes", minimum=2, optional=False)
        self._int_param("data_seed", minimum=0, optional=False)

    def one_time_seconds(self, system: SystemConfig) -> float:
        """Seconds ``system`` costs once per trial workload (``one_time_by_knob``)."""
        return sum(table.get(_key(getattr(system, knob)), 0.0)
                   for knob, table in self.settings["one_time_by_knob"].items())

    def _step_model(self, model: Any, ctx: Any) -> Any:
        return model  # compile is simulated by one_time_by_knob and cost_by_knob

    def sleep_seconds(self, system: SystemConfig) -> float:
        """Seconds slept per epoch under ``system`` (the formula in the module doc)."""
        s = self.settings
        total = s["base_seconds"]
        for knob, table in s["cost_by_knob"].items():
            total += table.get(_key(getattr(system, knob)), 0.0)
        return total

    def _load_data(self) -> ClassifierData:
        s = self.settings
        return load_blobs(
            s["train_samples"], s["val_samples"], s["features"], s["classes"], s["data_seed"]
        )

    def _build_model(self, data: ClassifierData, hparams: Mapping[str, Any]) -> nn.Module:
        from torch import nn

        return nn.Sequential(
            nn.Linear(data.train_x.shape[1], hparams["hidden"]),
            nn.ReLU(),
            nn.Linear(hparams["hidden"], data.num_classes),
        )

    def _build_optimizer(
        self, model: nn.Module, hparams: Mapping[str, Any]
    ) -> torch.optim.Optimizer:
        import torch

        return torch.optim.SGD(model.parameters(), lr=hparams["lr"], momentum=0.9)

    def _before_epoch(self, system: SystemConfig, steps: int) -> None:
        upcoming = self._epoch + 1
        if self.settings["fail_at_epoch"] == upcoming:
            raise RuntimeError(f"synthetic workload: planned failure at epoch {upcoming}")
        self._sleep_per_step = self.sleep_seconds(system) / max(steps, 1)
        self._first_step_sleep = 0.0
        for knob, table in self.settings["one_time_by_knob"].items():
            key = (knob, _key(getattr(system, knob)))
            if key not in self._paid:
                self._paid.add(key)
                self._first_step_sleep += table.get(key[1], 0.0)

    def _after_step(self) -> None:
        extra, self._first_step_sleep = self._first_step_sleep, 0.0
        if self._sleep_per_step + extra > 0:
            time.sleep(self._sleep_per_step + extra)


def _knob_table(costs: Any, param: str) -> dict[str, dict[str, float]]:
    """``costs`` (knob -> {value: seconds}) checked, values' keys normalised."""
    costs = costs or {}
    if not isinstance(costs, Mapping):
        raise SpecError(
            f"workload.params.{param}",
            f"must map knob names to {{value: seconds}}, got {type(costs).__name__}",
        )
    normalised: dict[str, dict[str, float]] = {}
    for knob, table in costs.items():
        where = f"workload.params.{param}.{knob}"
        if knob not in KNOBS:
            raise SpecError(where, f"unknown knob; allowed: {', '.join(KNOBS)}")
        if not isinstance(table, Mapping):
            raise SpecError(where, "must map knob values to seconds, e.g. {1: 0.3, 2: 0.1}")
        normalised[knob] = {}
        for value, seconds in table.items():
            if not _non_negative(seconds):
                raise SpecError(f"{where}.{value}", f"must be a number >= 0, got {seconds!r}")
            normalised[knob][_key(value)] = float(seconds)
    return normalised


def _non_negative(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )
