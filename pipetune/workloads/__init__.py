"""Workloads: the jobs pipetune tunes. Built-ins by name, anything else by import path.

>>> resolve_workload("lenet5").__name__
'LeNet5Workload'

This module stays light (no torch at import time): built-in classes are imported
only when resolved.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from pipetune import confine
from pipetune.errors import WorkloadError
from pipetune.modules import added_folders, one_line
from pipetune.workloads._base import StepHook, TrainStats, Workload

#: Built-in workload names -> import paths of their classes.
BUILTIN_WORKLOADS: dict[str, str] = {
    "lenet5": "pipetune.workloads.lenet:LeNet5Workload",
    "textcnn": "pipetune.workloads.textcnn:TextCNNWorkload",
    "synthetic": "pipetune.workloads.synthetic:SyntheticWorkload",
    "resnet": "pipetune.workloads.resnet:ResNetWorkload",
}

_LAZY_CLASSES = {
    **{path.rsplit(":", 1)[1]: path for path in BUILTIN_WORKLOADS.values()},
    # The API for your own workloads (README "Your own model").
    "ClassifierData": "pipetune.workloads._classifier:ClassifierData",
    "HParam": "pipetune.workloads._classifier:HParam",
    "TorchClassifierWorkload": "pipetune.workloads._classifier:TorchClassifierWorkload",
    "TorchWorkload": "pipetune.workloads._function:TorchWorkload",
    "accuracy": "pipetune.workloads._function:accuracy",
    "cross_entropy": "pipetune.workloads._function:cross_entropy",
    "torch_workload": "pipetune.workloads._function:torch_workload",
}

__all__ = [
    "BUILTIN_WORKLOADS",
    "ClassifierData",
    "HParam",
    "LeNet5Workload",
    "ResNetWorkload",
    "StepHook",
    "SyntheticWorkload",
    "TextCNNWorkload",
    "TorchClassifierWorkload",
    "TorchWorkload",
    "TrainStats",
    "Workload",
    "accuracy",
    "cross_entropy",
    "resolve_workload",
    "torch_workload",
]


def _import_path(path: str, label: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr or ":" in attr:
        raise WorkloadError(
            f"workload {label!r} is neither a built-in ({', '.join(BUILTIN_WORKLOADS)}) "
            f"nor an import path of the form package.module:Class"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure while importing user code
        raise WorkloadError(
            f"workload {label!r}: cannot import module {module_name!r}: {one_line(exc)}"
            f"{_where_looked(module_name, exc)}"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise WorkloadError(
                f"workload {label!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    return obj


def _where_looked(module_name: str, exc: Exception) -> str:
    """Where a job's own module was looked for, when it is the one not found."""
    if not (isinstance(exc, ModuleNotFoundError)
            and exc.name in (module_name, module_name.split(".", 1)[0])):
        return ""
    folders = added_folders()  # none: not a job file's driver (a worker, a dict)
    if not folders:
        return ""
    return (f"; pipetune looks in the job file's folder and the working folder "
            f"({', '.join(folders)}), then on PYTHONPATH and the installed packages")


def resolve_workload(name: str) -> type[Workload]:
    """The :class:`Workload` subclass for a built-in name or a ``package.module:Class`` path.

    Raises :class:`WorkloadError` with a one-line reason: an unknown name (listing the
    built-ins), a module that fails to import, a missing attribute, or something that
    is not a concrete Workload subclass. Inside :func:`pipetune.confine.enforced`, an
    import path whose module that policy does not allow raises
    :class:`~pipetune.errors.ConfinementError` before anything is imported.
    """
    if not isinstance(name, str) or not name.strip():
        raise WorkloadError(
            f"workload must be a built-in name ({', '.join(BUILTIN_WORKLOADS)}) or "
            f"package.module:Class, got {name!r}"
        )
    name = name.strip()
    if name in BUILTIN_WORKLOADS:
        return _import_path(BUILTIN_WORKLOADS[name], name)
    if ":" not in name:
        raise WorkloadError(
            f"unknown workload {name!r}; built-ins: {', '.join(BUILTIN_WORKLOADS)}, "
            f"or give an import path package.module:Class"
        )
    from pipetune._own_packages import OWN_PACKAGES

    top = name.partition(":")[0].strip().split(".", 1)[0]
    if top in OWN_PACKAGES:
        raise WorkloadError(
            f"workload {name!r}: {top!r} is one of pipetune's own packages "
            f"({', '.join(sorted(OWN_PACKAGES))}), which a module of yours cannot stand in "
            "for; rename your module")
    policy = confine.active()
    if policy is not None:  # a deployment run: refuse a module it may not import, unrun
        policy.check_workload(name)
    obj = _import_path(name, name)
    if not (inspect.isclass(obj) and issubclass(obj, Workload)):
        raise WorkloadError(
            f"workload {name!r} is not a subclass of pipetune.workloads.Workload (got {obj!r})"
        )
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise WorkloadError(f"workload {name!r} is abstract; it does not implement: {missing}")
    return obj


def __getattr__(attr: str) -> Any:
    # Built-in classes are importable from here without importing torch up front.
    if attr in _LAZY_CLASSES:
        return _import_path(_LAZY_CLASSES[attr], attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
