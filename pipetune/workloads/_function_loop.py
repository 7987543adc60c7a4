"""The loop of a function workload (:func:`pipetune.workloads.torch_workload`).

:class:`FunctionWorkload` is :class:`TorchClassifierWorkload` with the user's
functions in its hooks and its loop generalised to any Dataset, loss and metrics;
:mod:`pipetune.workloads._function` holds the functions (:class:`TorchWorkload`)
and makes the subclasses.
"""

from __future__ import annotations

import collections
import json
import numbers
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pipetune.errors import WorkloadError
from pipetune.system.apply import AppliedConfig, applied_context
from pipetune.system.config import SystemConfig
from pipetune.workloads._classifier import TorchClassifierWorkload, _mix_seed

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pipetune.workloads._function import TorchWorkload

#: Datasets kept per function workload and process (one per set of params).
_CACHED_DATASETS = 4
#: Model factories run one at a time per process: each runs under torch's global RNG
#: seeded from the trial seed, which is process-wide state.
_BUILD_LOCK = threading.Lock()


@dataclass(frozen=True)
class TorchSplits:
    """A function workload's data: the train and validation splits as Datasets."""

    train: Any
    val: Any


def _as_dataset(split: Any, which: str, workload: str) -> Any:
    import torch
    from torch.utils.data import Dataset, TensorDataset

    if isinstance(split, Dataset):
        return split
    if isinstance(split, tuple | list) and len(split) == 2 and all(
        isinstance(t, torch.Tensor) for t in split
    ):
        inputs, targets = split
        if len(inputs) != len(targets):
            raise WorkloadError(f"workload {workload!r}: data() {which} split has "
                                f"{len(inputs)} inputs but {len(targets)} targets")
        return TensorDataset(inputs, targets)
    raise WorkloadError(
        f"workload {workload!r}: data() must return (train, val), each a torch Dataset or "
        f"an (inputs, targets) pair of tensors; the {which} split is {type(split).__name__}"
    )


def _to(batch: Any, device: torch.device, four_d: torch.memory_format | None = None) -> Any:
    """``batch`` (a tensor, or a tuple, list or dict of them) on ``device``."""
    import torch

    if isinstance(batch, torch.Tensor):
        batch = batch.to(device, non_blocking=True)
        if four_d is not None and batch.dim() == 4:
            batch = batch.contiguous(memory_format=four_d)
        return batch
    if isinstance(batch, tuple | list):
        return type(batch)(_to(b, device, four_d) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device, four_d) for k, v in batch.items()}
    return batch


def _batch_len(batch: Any) -> int:
    """Rows in ``batch``: the length of its first tensor."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    elif isinstance(batch, tuple | list):
        batch = batch[0]
    return len(batch)


def _floats(outputs: Any) -> Any:
    """Floating outputs as float32 (they may be fp16/bf16 under autocast)."""
    import torch

    if isinstance(outputs, torch.Tensor) and outputs.is_floating_point():
        return outputs.float()
    return outputs


def _number(value: Any, what: str) -> float:
    import torch

    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise WorkloadError(f"{what} returned a tensor of {value.numel()} elements, "
                                "not one number")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise WorkloadError(f"{what} must return a number, got {type(value).__name__}")
    return float(value)


class FunctionWorkload(TorchClassifierWorkload):
    """The :class:`Workload` :func:`torch_workload` makes; its ``spec`` holds the functions.

    The loop is :class:`TorchClassifierWorkload`'s (same seeding, checkpoints and
    system config), generalised to any Dataset, loss and metrics.
    """

    spec: ClassVar[TorchWorkload]
    _data_cache: ClassVar[collections.OrderedDict[str, TorchSplits]]
    _data_lock: ClassVar[threading.Lock]

    def __init__(self, **params: Any) -> None:
        _locate(type(self))
        super().__init__(**params)
        self._factory_state: dict[str, Any] | None = None

    def __reduce_ex__(self, protocol: Any) -> Any:
        _locate(type(self))  # pickled by reference: the class must be found by name
        return super().__reduce_ex__(protocol)

    # -- TorchClassifierWorkload hooks ------------------------------------------------
    def _check_params(self) -> None:
        check = self.spec.check_params
        if check is not None:
            check(dict(self.settings))

    def _load_data(self) -> TorchSplits:  # type: ignore[override]
        cls = type(self)
        key = json.dumps(self.settings, sort_keys=True, default=repr)
        with cls._data_lock:
            cached = cls._data_cache.get(key)
            if cached is None:
                got = self.spec.data(dict(self.settings))
                if not isinstance(got, tuple | list) or len(got) != 2:
                    raise WorkloadError(f"workload {self.name!r}: data() must return "
                                        f"(train, val), got {type(got).__name__}")
                cached = TorchSplits(_as_dataset(got[0], "train", self.name),
                                     _as_dataset(got[1], "val", self.name))
                if len(cached.val) == 0:
                    raise WorkloadError(f"workload {self.name!r}: the validation split is empty")
                cls._data_cache[key] = cached
                while len(cls._data_cache) > _CACHED_DATASETS:
                    cls._data_cache.popitem(last=False)
            cls._data_cache.move_to_end(key)
            return cached

    def _build_model(self, data: Any, hparams: Mapping[str, Any]) -> nn.Module:
        import torch
        from torch import nn

        with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._seed % (2**63 - 1))
            model = self.spec.model(dict(hparams))
        if not isinstance(model, nn.Module):
            raise WorkloadError(f"workload {self.name!r}: model() must return a "
                                f"torch.nn.Module, got {type(model).__name__}")
        if not self.spec.init_weights:  # restored before the optimiser is built
            self._factory_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return model

    def _build_optimizer(self, model: nn.Module, hparams: Mapping[str, Any]) -> Any:
        import torch

        if self._factory_state is not None:
            model.load_state_dict(self._factory_state)
            self._factory_state = None
        parameters = list(model.parameters())
        if self.spec.optimizer is None:
            return torch.optim.SGD(parameters, lr=hparams["lr"],
                                   momentum=float(hparams.get("momentum", 0.0)))
        optimizer = self.spec.optimizer(parameters, dict(hparams))
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise WorkloadError(f"workload {self.name!r}: optimizer() must return a "
                                f"torch.optim.Optimizer, got {type(optimizer).__name__}")
        return optimizer

    def _loader(self, data: Any, ctx: AppliedConfig) -> Any:
        import torch
        from torch.utils.data import DataLoader

        generator = torch.Generator().manual_seed(_mix_seed(self._seed, self._epoch))
        return DataLoader(data.train, batch_size=self.batch_size, shuffle=True,
                          generator=generator, **ctx.loader_options())

    def _loss(self, outputs: Any, targets: Any) -> Any:
        return self.spec.loss_function()(_floats(outputs), targets)

    def _to_device(self, x: Any, y: Any, device: Any, four_d: Any) -> tuple[Any, Any]:
        return _to(x, device, four_d), _to(y, device)

    @staticmethod
    def _batch_len(targets: Any) -> int:
        return _batch_len(targets)

    def _val_outputs(self, device: torch.device, ctx: AppliedConfig | None) -> tuple[Any, Any]:
        """Model outputs and targets on the whole validation split, in its order."""
        import contextlib

        import torch
        from torch.utils.data import DataLoader, TensorDataset

        model, _ = self._require_setup()
        val = self.data.val
        four_d = ctx.memory_format if ctx is not None else None
        cast = ctx.autocast() if ctx is not None else contextlib.nullcontext()
        step = self.eval_batch_size
        if isinstance(val, TensorDataset) and len(val.tensors) == 2:
            inputs, targets = val.tensors
            batches: Any = ((inputs[i : i + step], targets[i : i + step])
                            for i in range(0, len(inputs), step))
        else:
            options = ctx.loader_options() if ctx is not None else {}
            batches = DataLoader(val, batch_size=step, shuffle=False, **options)
        outputs, all_targets = [], []
        model.eval()
        try:
            with torch.no_grad(), cast:
                for x, y in batches:
                    out = model(_to(x, device, four_d))
                    outputs.append(_floats(out))
                    all_targets.append(_to(y, device))
        finally:
            model.train()
        return torch.cat(outputs), torch.cat(all_targets)

    def _val_logits(self, device: torch.device, ctx: AppliedConfig | None) -> torch.Tensor:
        return self._val_outputs(device, ctx)[0]

    def evaluate(self, system: AppliedConfig | SystemConfig) -> dict[str, float]:
        """Every metric (``val_loss`` included) on the whole validation split."""
        ctx = applied_context(system)
        device = self._place(ctx)
        outputs, targets = self._val_outputs(device, ctx)
        return {
            name: _number(fn(outputs, targets), f"workload {self.name!r}: metric {name!r}")
            for name, fn in self.spec.metric_functions().items()
        }


def _locate(cls: type[FunctionWorkload]) -> None:
    """Name ``cls`` after the module attribute that holds it, so pickle finds it (and
    messages say ``module:attribute`` unless its ``TorchWorkload`` has a ``name``)."""
    module = sys.modules.get(cls.__module__)
    if module is None or getattr(module, cls.__qualname__, None) is cls:
        return
    for attr, value in list(vars(module).items()):
        if value is cls:
            cls.__qualname__ = cls.__name__ = attr
            if not cls.spec.name:
                cls.name = f"{cls.__module__}:{attr}"
            return
