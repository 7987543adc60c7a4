"""The function API: a PyTorch workload given by a few functions, pipetune owning the rest.

You write a model factory, a data factory and, if the defaults do not fit, an
optimiser factory, a loss and metrics; :func:`torch_workload` turns them into a
:class:`~pipetune.workloads.Workload` subclass a job file names by import path
(``my_module:workload``). pipetune owns the training loop, the data loaders, the
system knobs (threads, data-loader workers, device, precision, memory format),
seeding, checkpoints and profiling: it is :class:`TorchClassifierWorkload`'s
machinery with your functions in its hooks.

>>> from pipetune.workloads import TorchWorkload, torch_workload   # doctest: +SKIP
>>> workload = torch_workload(TorchWorkload(model=build, data=splits))  # doctest: +SKIP

What the functions get (dicts are fresh copies; change them freely):

- ``model(hparams) -> nn.Module``: ``hparams`` is the trial's hyperparameters, every
  declared one present (defaults fill the gaps).
- ``data(params) -> (train, val)``: ``params`` is the job's ``workload.params`` with
  the declared defaults filled in; each split is a ``torch.utils.data.Dataset`` whose
  items are ``(input, target)`` pairs, or an ``(inputs, targets)`` pair of tensors.
  Called once per process and set of params (cached).
- ``optimizer(parameters, hparams) -> torch.optim.Optimizer``: ``parameters`` is the
  list of the model's parameters. Default: SGD with ``lr`` (and ``momentum`` when
  declared).
- ``loss(outputs, targets) -> scalar tensor``: default cross-entropy (a classifier's
  logits and int64 class labels).
- ``metrics``: name -> ``fn(outputs, targets)`` computed once on the whole validation
  split (outputs and targets concatenated), returning a number or a one-element
  tensor. ``val_loss`` (``loss`` on the validation split) is always reported; with the
  default loss and no metrics given they are ``accuracy`` and ``val_loss``. The first
  name is the job's default objective.

Every function is found again on each Dask worker by importing your module: define
them at module level (no lambdas or closures), so the workload also pickles.
"""

from __future__ import annotations

import collections
import math
import numbers
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipetune.errors import SpecError
from pipetune.workloads._classifier import HParam
from pipetune.workloads._function_loop import FunctionWorkload

if TYPE_CHECKING:
    import torch

#: ``batch_size`` when a workload does not declare it.
DEFAULT_BATCH_SIZE = 32
#: ``lr`` of the default optimiser when a workload does not declare it.
DEFAULT_LR = 0.01


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of rows whose largest output is the target class (0..1)."""
    return float((outputs.argmax(dim=1) == targets).double().mean().item())


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The default loss: mean cross-entropy of logits against int64 class labels."""
    import torch.nn.functional as F

    return F.cross_entropy(outputs, targets)


@dataclass(frozen=True, eq=False)
class TorchWorkload:
    """The functions of a PyTorch workload (see the module doc for what each gets).

    ``hparams`` declares the hyperparameters and their defaults: a plain value accepts
    any value of its type (``0.1`` any finite float, ``32`` any int, ``"adam"`` any
    string), an :class:`HParam` also a range (``HParam(0.9, low=0.0, low_open=False,
    high=1.0)``). A job tuning a name not declared here is refused at validation.
    ``batch_size`` is always a hyperparameter (default 32, >= 1), and ``lr`` one when
    ``optimizer`` is the default (0.01).

    ``params`` declares ``workload.params`` and their defaults; a job giving another
    name is refused. ``check_params(params)`` runs when the workload is built (also
    at validation, before anything trains): raise
    :class:`~pipetune.errors.WorkloadParamError` for a bad value
    (``WorkloadParamError("hidden_layers", "must be >= 1")``).

    ``init_weights``: ``True`` re-initialises every Linear, Conv and Embedding layer
    from the trial seed alone (torch's default scheme), so a trial is reproducible in
    whichever process or thread builds it; ``False`` keeps what ``model`` built
    (pretrained weights, your own initialisation). Either way ``model`` runs with
    torch's global RNG seeded from the trial seed. Randomness inside the model's
    forward (``nn.Dropout``) draws from torch's global RNG: not checkpointed, and
    shared by trials training side by side in one process.
    """

    model: Callable[[dict[str, Any]], Any]
    data: Callable[[dict[str, Any]], Any]
    optimizer: Callable[[list[Any], dict[str, Any]], Any] | None = None
    loss: Callable[[Any, Any], Any] | None = None
    metrics: Mapping[str, Callable[[Any, Any], Any]] | None = None
    hparams: Mapping[str, Any] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)
    check_params: Callable[[dict[str, Any]], None] | None = None
    #: Shown in messages (``workload 'wine-mlp': ...``); default: ``module:attribute``.
    name: str = ""
    init_weights: bool = True

    def __post_init__(self) -> None:
        for attr in ("model", "data"):
            if not callable(getattr(self, attr)):
                raise TypeError(f"TorchWorkload.{attr} must be a function, got "
                                f"{getattr(self, attr)!r}")
        for attr in ("optimizer", "loss", "check_params"):
            value = getattr(self, attr)
            if value is not None and not callable(value):
                raise TypeError(f"TorchWorkload.{attr} must be a function or None, got {value!r}")
        if self.metrics is not None:
            if not isinstance(self.metrics, Mapping) or not all(
                isinstance(k, str) and k and callable(v) for k, v in self.metrics.items()
            ):
                raise TypeError("TorchWorkload.metrics must map names to functions "
                                "fn(outputs, targets)")
        for attr in ("hparams", "params"):
            value = getattr(self, attr)
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                raise TypeError(f"TorchWorkload.{attr} must map names to default values")
        # Frozen: keep private copies, so changing the caller's dicts changes nothing.
        object.__setattr__(self, "hparams", dict(self.hparams))
        object.__setattr__(self, "params", dict(self.params))
        if self.metrics is not None:
            object.__setattr__(self, "metrics", dict(self.metrics))
        for name, default in self.hparams.items():
            _hparam_spec(name, default)  # a bad declaration fails here, at import

    def loss_function(self) -> Callable[[Any, Any], Any]:
        """``loss``, or :func:`cross_entropy` when none is given."""
        return self.loss or cross_entropy

    def metric_functions(self) -> dict[str, Callable[[Any, Any], Any]]:
        """Name -> function of every metric reported, the default objective first."""
        loss = self.loss_function()
        given = self.metrics
        if given is None:
            given = {"accuracy": accuracy} if self.loss is None else {}
        return {**given, "val_loss": given.get("val_loss", loss)}

    def hparam_specs(self) -> dict[str, Any]:
        """Name -> :class:`HParam` (or a typed check) of every hyperparameter."""
        specs = {name: _hparam_spec(name, value) for name, value in self.hparams.items()}
        specs.setdefault("batch_size", _hparam_spec("batch_size", DEFAULT_BATCH_SIZE))
        if self.optimizer is None:
            specs.setdefault("lr", HParam(DEFAULT_LR))
        return specs


@dataclass(frozen=True)
class _Typed:
    """A non-numeric hyperparameter: any value of its default's type."""

    default: Any

    def coerce(self, field_name: str, value: Any) -> Any:
        kind = type(self.default)
        if self.default is not None and (type(value) is not kind):
            raise SpecError(field_name, f"must be a {kind.__name__}, got {value!r}")
        return value


def _hparam_spec(name: str, default: Any) -> Any:
    if hasattr(default, "coerce") and hasattr(default, "default"):
        return default  # an HParam, or anything that checks like one
    is_number = isinstance(default, numbers.Real) and not isinstance(default, bool)
    if not is_number:
        return _Typed(default)
    kind = int if isinstance(default, numbers.Integral) else float
    if name == "batch_size":
        if kind is not int or default < 1:
            raise ValueError(f"hyperparameter batch_size must default to an int >= 1, "
                             f"got {default!r}")
        return HParam(default, int, low=1, low_open=False)
    if not math.isfinite(default):
        raise ValueError(f"hyperparameter {name} must default to a finite number, got {default}")
    return HParam(kind(default), kind, low=-math.inf)


def _make_class(spec: TorchWorkload, module: str, default_name: str) -> type[FunctionWorkload]:
    class_name = default_name if default_name.isidentifier() else "workload"
    label = spec.name or f"{module}:{class_name}"  # what a job file names it by
    namespace = {
        "__module__": module,
        "__qualname__": class_name,
        "__doc__": f"The function workload {label!r} (made by pipetune.workloads.torch_workload).",
        "name": label,
        "spec": spec,
        "metrics": tuple(spec.metric_functions()),
        "hparam_specs": spec.hparam_specs(),
        "param_defaults": dict(spec.params),
        "_data_cache": collections.OrderedDict(),
        "_data_lock": threading.Lock(),
    }
    return type(class_name, (FunctionWorkload,), namespace)


def torch_workload(spec: TorchWorkload | None = None, /, **fields: Any) -> Any:
    """A :class:`Workload` subclass from a :class:`TorchWorkload` or its fields.

    Three spellings; the result goes in a module-level name a job file points at::

        workload = torch_workload(TorchWorkload(model=build, data=splits, ...))
        workload = torch_workload(model=build, data=splits, hparams={"lr": 0.05})

        @torch_workload(data=splits, hparams={"lr": 0.05})   # decorating the model
        def wine_mlp(hparams): ...                           # job file: my_module:wine_mlp

    The class is named after the module attribute holding it (found when it is first
    built or pickled), so it pickles by reference like a hand-written class.
    """
    caller = sys._getframe(1).f_globals.get("__name__", __name__)
    if spec is not None:
        if fields:
            raise TypeError("torch_workload() takes a TorchWorkload or its fields, not both")
        if not isinstance(spec, TorchWorkload):
            raise TypeError(f"torch_workload() expected a TorchWorkload, got {spec!r}")
        return _make_class(spec, caller, spec.name or "workload")
    if "model" in fields:
        built = TorchWorkload(**fields)
        return _make_class(built, caller, built.name or "workload")

    def decorate(model: Callable[[dict[str, Any]], Any]) -> type[FunctionWorkload]:
        built = TorchWorkload(model=model, **fields)
        return _make_class(built, caller, getattr(model, "__name__", "workload"))

    return decorate

