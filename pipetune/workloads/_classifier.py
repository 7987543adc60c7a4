"""What the built-in workloads share: a torch classifier trained by mini-batches.

:class:`TorchClassifierWorkload` implements the whole :class:`Workload` contract
(hyperparameter checks, the training loop under an applied system config,
evaluation, checkpoints); a subclass supplies the data, the model and the
optimiser.

Reproducibility: all randomness comes from the workload's own generators, never
from torch's global RNG, so trials sharing a process (Dask worker threads) cannot
disturb each other. Parameters are initialised and dropout masks drawn from one
CPU generator seeded with the trial seed (its state is part of the checkpoint);
each epoch's shuffle uses a generator seeded from (trial seed, epoch number), so
the batch order does not depend on the number of data-loader workers.
"""

from __future__ import annotations

import math
import numbers
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pipetune.errors import SpecError, WorkloadError
from pipetune.system.apply import AppliedConfig, applied_context
from pipetune.system.config import SystemConfig
from pipetune.workloads._base import StepHook, TrainStats, Workload
from pipetune.workloads._seeded import (
    _cpu_copy,
    _mix_seed,
    init_parameters,
)

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class ClassifierData:
    """Tensors of one dataset: inputs and int64 labels of the train and val splits."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    num_classes: int
    #: Anything the model needs to know about the data, e.g. ``vocab_size``.
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HParam:
    """One hyperparameter: default, type and allowed range (``low`` inclusive unless
    ``low_open``; ``high`` exclusive)."""

    default: float | int
    kind: type = float
    low: float = 0.0
    low_open: bool = True
    high: float | None = None

    def coerce(self, field_name: str, value: Any) -> float | int:
        ok_type = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if ok_type and self.kind is int:
            ok_type = float(value).is_integer()
        if not ok_type:
            what = "an integer" if self.kind is int else "a number"
            raise SpecError(field_name, f"must be {what}, got {value!r}")
        value = self.kind(value)
        too_low = value <= self.low if self.low_open else value < self.low
        too_high = self.high is not None and value >= self.high
        if too_low or too_high or (self.kind is float and not math.isfinite(value)):
            bounds = f"{'>' if self.low_open else '>='} {self.low:g}"
            if self.high is not None:
                bounds += f" and < {self.high:g}"
            raise SpecError(field_name, f"must be {bounds}, got {value!r}")
        return value


def _refuse_unknown(given: Mapping[str, Any], known: Mapping[str, Any], where: str,
                    what: str) -> None:
    """A :class:`SpecError` at ``where.<name>`` for the first name of ``given`` not in
    ``known``, saying ``what`` it is not and what is allowed."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise SpecError(f"{where}.{unknown[0]}", f"{what}; allowed: {', '.join(known)}")


class TorchClassifierWorkload(Workload):
    """A :class:`Workload` for a torch classifier; subclasses fill in the hooks.

    Public: import it from :mod:`pipetune.workloads`. It owns the training loop
    (mini-batches of ``batch_size``, cross-entropy, the system config applied through
    the :class:`~pipetune.system.apply.AppliedConfig`: device, data-loader workers,
    autocast, loss scaling, memory format), seeding (see the module doc),
    evaluation (``accuracy`` and ``val_loss``), ``predict`` and checkpoints (model,
    optimiser, epoch, RNG and loss-scaler state). A subclass supplies:

    - ``name``: shown in messages; ``metrics`` if it changes ``evaluate``;
    - ``hparam_specs``: hyperparameter name -> :class:`HParam` (default, type,
      range); it must include ``batch_size``. A job tuning another name, or a range
      reaching outside one, is refused at validation; ``setup`` fills the defaults
      and ``self.hparams`` holds the values;
    - ``param_defaults``: ``workload.params`` name -> default; ``self.settings``
      holds them merged with the job's;
    - ``_check_params()`` (optional): check ``self.settings`` and raise
      :class:`~pipetune.errors.WorkloadParamError` (a :class:`SpecError`) naming the
      param, e.g. ``WorkloadParamError("train_samples", "must be >= 1")``;
    - ``_load_data()``: a :class:`ClassifierData`, cached per process (an
      ``functools.lru_cache`` on a module-level loader keyed by the settings), as the
      workload is rebuilt for every trial and after every restart;
    - ``_build_model(data, hparams)``: the ``nn.Module``; its Linear, Conv and
      Embedding layers are then initialised from the trial seed
      (:func:`init_parameters`);
    - ``_build_optimizer(model, hparams)``: the ``torch.optim.Optimizer``;
    - ``_before_epoch(system, steps)`` and ``_after_step()`` (optional): called
      around the loop;
    - ``_loss(outputs, targets)``, ``_to_device(x, y, device, memory_format)``,
      ``_batch_len(targets)`` and ``_step_model(model, ctx)`` (optional): the loop's
      loss (cross-entropy), how a batch reaches the device, how many samples it holds,
      and what a step calls (the model, compiled under ``system.compile``).

    Unknown params raise :class:`SpecError` on ``workload.params.<name>``, unknown
    or out-of-range hyperparameters on ``hyperparameters.<name>``. For anything the
    loop does not cover (another loss, non-tensor data, your own metrics) use
    :func:`~pipetune.workloads.torch_workload` or subclass :class:`Workload`.
    """

    hparam_specs: ClassVar[dict[str, HParam]] = {}
    param_defaults: ClassVar[dict[str, Any]] = {}
    eval_batch_size: ClassVar[int] = 1024

    def __init__(self, **params: Any) -> None:
        _refuse_unknown(params, self.param_defaults, "workload.params",
                        f"unknown parameter of workload {self.name!r}")
        super().__init__(**params)
        #: Params with defaults filled in.
        self.settings: dict[str, Any] = {**self.param_defaults, **params}
        self._check_params()
        self.hparams: dict[str, Any] | None = None
        self._seed = 0
        self._epoch = 0
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._rng: torch.Generator | None = None
        self._scaler_state: dict[str, Any] = {}
        self._device = "cpu"

    # -- hooks --------------------------------------------------------------------
    def _check_params(self) -> None:
        """Validate ``self.settings``; raise :class:`SpecError` on ``workload.params.*``."""

    @abstractmethod
    def _load_data(self) -> ClassifierData:
        """The dataset for ``self.settings``, from a per-process cache."""

    @abstractmethod
    def _build_model(self, data: ClassifierData, hparams: Mapping[str, Any]) -> nn.Module: ...

    @abstractmethod
    def _build_optimizer(
        self, model: nn.Module, hparams: Mapping[str, Any]
    ) -> torch.optim.Optimizer: ...

    def _before_epoch(self, system: SystemConfig, steps: int) -> None:
        """Called before an epoch's first step, with the number of steps it will take."""

    def _after_step(self) -> None:
        """Called after every optimiser step, before ``on_step``."""

    # -- helpers ------------------------------------------------------------------
    def _int_param(self, name: str, minimum: int = 1, optional: bool = True) -> None:
        value = self.settings[name]
        if value is None and optional:
            return
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise SpecError(
                f"workload.params.{name}", f"must be an integer >= {minimum}, got {value!r}"
            )

    def _choice_param(self, name: str, allowed: tuple[str, ...]) -> None:
        if self.settings[name] not in allowed:
            raise SpecError(
                f"workload.params.{name}",
                f"must be one of {', '.join(allowed)}; got {self.settings[name]!r}",
            )

    @property
    def data(self) -> ClassifierData:
        return self._load_data()

    @property
    def epoch(self) -> int:
        """Epochs trained so far (restored from a checkpoint by ``load``)."""
        return self._epoch

    @property
    def batch_size(self) -> int:
        if self.hparams is None:
            raise WorkloadError(f"workload {self.name!r}: batch_size is known only after setup()")
        return int(self.hparams["batch_size"])

    def trained_model(self) -> nn.Module:
        """The model (built by ``setup``, its weights as trained or loaded)."""
        return self._require_setup()[0]

    def _require_setup(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self._model is None or self._optimizer is None:
            raise WorkloadError(f"workload {self.name!r}: call setup(hparams, seed) first")
        return self._model, self._optimizer

    # -- Workload -----------------------------------------------------------------
    def setup(self, hparams: Mapping[str, Any], seed: int) -> None:
        """Check ``hparams`` (defaults fill the gaps), build model and optimiser from ``seed``."""
        import torch

        _refuse_unknown(hparams, self.hparam_specs, "hyperparameters",
                        f"not a hyperparameter of workload {self.name!r}")
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
            raise SpecError("seed", f"must be an integer, got {seed!r}")
        seed = int(seed)
        self.hparams = {
            name: spec.coerce(f"hyperparameters.{name}", hparams.get(name, spec.default))
            for name, spec in self.hparam_specs.items()
        }
        data = self.data
        self._seed = seed
        self._epoch = 0
        self._scaler_state = {}
        self._rng = torch.Generator().manual_seed(seed % (2**63 - 1))
        model = self._build_model(data, self.hparams)
        init_parameters(model, self._rng)
        self._model = model
        self._device = "cpu"
        self._optimizer = self._build_optimizer(model, self.hparams)

    def _place(self, ctx: AppliedConfig) -> torch.device:
        model, optimizer = self._require_setup()
        device = ctx.device
        fmt = ctx.memory_format
        if device.type != self._device:
            # Moving parameters leaves optimiser state (momentum, Adam moments) behind;
            # reloading the optimiser's own state dict casts it to the parameters' device.
            opt_state = optimizer.state_dict()
            model.to(device=device, memory_format=fmt)
            optimizer.load_state_dict(opt_state)
            self._device = device.type
        else:
            model.to(memory_format=fmt)
        return device

    def _loader(self, data: ClassifierData, ctx: AppliedConfig) -> Any:
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        generator = torch.Generator().manual_seed(_mix_seed(self._seed, self._epoch))
        return DataLoader(
            TensorDataset(data.train_x, data.train_y),
            batch_size=self.batch_size,
            shuffle=True,
            generator=generator,
            **ctx.loader_options(),
        )

    # -- the loop's hooks: a batch to the device, its loss, its size ---------------------
    def _to_device(self, x: Any, y: Any, device: torch.device, four_d: Any) -> tuple[Any, Any]:
        x = x.to(device, non_blocking=True)
        if x.dim() == 4:
            x = x.contiguous(memory_format=four_d)
        return x, y.to(device, non_blocking=True)

    def _loss(self, outputs: Any, targets: Any) -> Any:
        import torch.nn.functional as F

        return F.cross_entropy(outputs.float(), targets)

    @staticmethod
    def _batch_len(targets: Any) -> int:
        return len(targets)

    def _step_model(self, model: nn.Module, ctx: AppliedConfig) -> Any:
        """What a training step calls: :meth:`AppliedConfig.training_model` (the model,
        compiled under ``compile``)."""
        return ctx.training_model(model)

    def train_epoch(
        self, system: AppliedConfig | SystemConfig, on_step: StepHook | None = None
    ) -> TrainStats:
        """One pass over the training split, shuffled from (seed, epoch); see the class doc."""
        import torch

        ctx = applied_context(system)
        model, optimizer = self._require_setup()
        device = self._place(ctx)
        data = self.data
        loader = self._loader(data, ctx)
        self._before_epoch(ctx.config, len(loader))
        scaler = ctx.grad_scaler(self._scaler_state)
        four_d = ctx.memory_format
        model.train()
        step_model = self._step_model(model, ctx)  # the model, or its compiled wrapper
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        samples = steps = 0
        for x, y in loader:
            x, y = self._to_device(x, y, device, four_d)
            optimizer.zero_grad(set_to_none=True)
            with ctx.autocast():
                outputs = step_model(x)
            loss = self._loss(outputs, y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            n = self._batch_len(y)
            loss_sum += loss.detach().double() * n
            samples += n
            steps += 1
            self._after_step()
            if on_step is not None:
                on_step()
        if scaler is not None:
            self._scaler_state = scaler.state_dict()
        self._epoch += 1
        mean_loss = float(loss_sum.item()) / samples if samples else float("nan")
        return TrainStats(loss=mean_loss, samples=samples, steps=steps)

    def _val_logits(self, device: torch.device, ctx: AppliedConfig | None) -> torch.Tensor:
        import contextlib

        import torch

        model, _ = self._require_setup()
        data = self.data
        model.eval()
        chunks = []
        cast = ctx.autocast() if ctx is not None else contextlib.nullcontext()
        channels_last = ctx is not None and ctx.memory_format == torch.channels_last
        with torch.no_grad(), cast:
            for start in range(0, len(data.val_x), self.eval_batch_size):
                x = data.val_x[start : start + self.eval_batch_size].to(device)
                if x.dim() == 4 and channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                chunks.append(model(x).float())
        model.train()
        return torch.cat(chunks)

    def evaluate(self, system: AppliedConfig | SystemConfig) -> dict[str, float]:
        """``accuracy`` (0..1) and mean cross-entropy ``val_loss`` on the validation split."""
        import torch.nn.functional as F

        ctx = applied_context(system)
        device = self._place(ctx)
        logits = self._val_logits(device, ctx)
        y = self.data.val_y.to(device)
        return {
            "accuracy": float((logits.argmax(dim=1) == y).double().mean().item()),
            "val_loss": float(F.cross_entropy(logits, y).item()),
        }

    def predict(self) -> torch.Tensor:
        """Float32 logits (N_val, classes) on the validation split, on the CPU, fp32."""
        import torch

        return self._val_logits(torch.device(self._device), None).cpu()

    def graph_signature(self) -> str:
        """sha1 (16 hex digits) of the model's module types and parameter and buffer
        shapes."""
        import hashlib

        model, _ = self._require_setup()
        parts = [f"{name}:{type(m).__name__}" for name, m in model.named_modules()]
        parts += [f"{name}:{tuple(t.shape)}" for name, t in model.state_dict().items()]
        return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """CPU copies of model and optimiser state, epoch, seed, RNG and loss-scaler state."""
        model, optimizer = self._require_setup()
        assert self._rng is not None
        return {
            "model": _cpu_copy(model.state_dict()),
            "optimizer": _cpu_copy(optimizer.state_dict()),
            "epoch": self._epoch,
            "seed": self._seed,
            "rng": self._rng.get_state(),
            "scaler": dict(self._scaler_state),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        model, optimizer = self._require_setup()
        assert self._rng is not None
        missing = [k for k in ("model", "optimizer", "epoch", "rng") if k not in state]
        if missing:
            raise WorkloadError(
                f"checkpoint is not a {self.name!r} state: missing {', '.join(missing)}"
            )
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise WorkloadError(
                f"checkpoint does not fit workload {self.name!r} with these hyperparameters: "
                f"{first}"
            ) from exc
        self._epoch = int(state["epoch"])
        self._seed = int(state.get("seed", self._seed))
        self._rng.set_state(state["rng"])
        self._scaler_state = dict(state.get("scaler") or {})
