"""The :class:`Workload` interface: what pipetune needs from a model to tune it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pipetune.system.apply import AppliedConfig
from pipetune.system.config import SystemConfig

#: Called by a workload after every optimiser step (the profiler samples steps with it).
StepHook = Callable[[], None]


@dataclass(frozen=True)
class TrainStats:
    """What one training epoch did: mean training loss, samples and steps seen."""

    loss: float
    samples: int
    steps: int


class Workload(ABC):
    """A trainable job, plugged in by import path ``package.module:Class``.

    Lifecycle inside one epoch task: ``W(**params)`` -> ``setup(hparams, seed)`` ->
    ``load(path)`` (after epoch 1) -> ``train_epoch(system)`` -> ``evaluate(system)``
    -> ``save(path)``. Construction must be cheap to repeat (cache loaded data per
    process); nothing may be downloaded.

    ``batch_size`` is known after ``setup`` (it is usually a hyperparameter); the
    ground truth buckets configs by it.
    """

    #: Name used in job files for built-ins, e.g. ``lenet5``.
    name: ClassVar[str] = ""
    #: Metrics ``evaluate`` returns, the first one being the default objective.
    metrics: ClassVar[tuple[str, ...]] = ("accuracy", "val_loss")

    def __init__(self, **params: Any) -> None:
        self.params = dict(params)

    @abstractmethod
    def setup(self, hparams: Mapping[str, Any], seed: int) -> None:
        """Build model, optimiser and data loaders' settings from hyperparameters."""

    @property
    @abstractmethod
    def batch_size(self) -> int: ...

    @abstractmethod
    def train_epoch(
        self, system: AppliedConfig | SystemConfig, on_step: StepHook | None = None
    ) -> TrainStats:
        """Train one epoch under ``system``, the :class:`~pipetune.system.apply.AppliedConfig`
        the caller got from ``applied_system_config`` (threads, pinning and CUDA flags
        already set).

        Every knob reads as an attribute, as on a :class:`SystemConfig`:
        ``system.cores``, ``system.interop_threads``, ``system.dataloader_workers``,
        ``system.omp_wait_policy``, ``system.pin_cores``, ``system.device``,
        ``system.precision``, ``system.tf32``, ``system.cudnn_benchmark``,
        ``system.channels_last``, ``system.compile``. ``system.device`` equals both
        ``"cpu"`` and ``torch.device("cpu")`` and goes wherever torch takes a device.
        Better than reading knobs, take what they mean from the helpers, so none is
        forgotten: ``device``, ``memory_format``, ``loader_options()`` (DataLoader
        keyword arguments), ``autocast()``, ``grad_scaler(state)`` and
        ``training_model(model)`` (the model, compiled under ``compile``);
        ``system.config`` is the :class:`SystemConfig` itself (``label()``,
        ``to_dict()``, ``replace()``). This is public API (README "What is public").

        When called by hand a plain :class:`SystemConfig` is accepted too:
        ``applied_context(system)`` turns either into an ``AppliedConfig``. Call
        ``on_step()`` after each optimiser step when given.
        """

    @abstractmethod
    def evaluate(self, system: AppliedConfig | SystemConfig) -> dict[str, float]:
        """Metrics on the held-out split under ``system`` (an ``AppliedConfig``: knobs as
        attributes and the helpers, see :meth:`train_epoch`; a plain
        :class:`SystemConfig` when called by hand); keys include every name in
        ``metrics``."""

    def graph_signature(self) -> str:
        """A short digest of the model's structure after ``setup`` (its module types and
        parameter shapes), or ``""`` when unknown. Two trials with the same signature
        train the same graph, so what one learned about compiling it holds for the
        other. Optional."""
        return ""

    def predict(self) -> Any:
        """Model outputs (logits tensor) on the held-out split, in a fixed order.

        Optional: pipetune never calls it; the built-in workloads offer it for
        comparing a model kept in memory with one rebuilt from its checkpoint."""
        raise NotImplementedError(f"{type(self).__name__} does not implement predict()")

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Model, optimiser and RNG state; loadable by ``torch.load(weights_only=True)``."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def save(self, path: str | Path) -> None:
        import torch

        torch.save(self.state_dict(), path)

    def load(self, path: str | Path) -> None:
        import torch

        self.load_state_dict(torch.load(path, weights_only=True))
