"""Workload classes that no import path reaches: defined in a notebook or a script's
``__main__``, or inside a function. :func:`ship` gives one a name in this module
(``pipetune.workloads.shipped:<Class>_<digest>``) that :func:`~pipetune.workloads.resolve_workload`
resolves like any import path; the class goes to the Dask workers *by value*
(cloudpickle) with the study (:func:`pipetune.dask.ship.prepare_workers`), and each
worker :func:`install`\\ s it here under the same name.

A class an import path does reach (``package.module:Class``, importable here) is not
shipped by value: it is named by that path, and its module reaches the workers as a job
file's does (:mod:`pipetune.dask.ship`).

A function workload (:func:`~pipetune.workloads.torch_workload`) made in a notebook
goes as its :class:`~pipetune.workloads.TorchWorkload` (the functions by value) and is
made into a class again on the worker: its class holds a lock, which no pickle takes.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import threading
from typing import Any

from pipetune.errors import WorkloadError

#: What a shipped class's workload name starts with.
PREFIX = f"{__name__}:"

_lock = threading.Lock()
#: Name (after :data:`PREFIX`) -> the class, in this process.
_classes: dict[str, type] = {}
#: Name -> the pickled class (or function workload's spec), as shipped.
_blobs: dict[str, bytes] = {}


def import_path(cls: type) -> str | None:
    """``module:QualName`` of ``cls`` where that path imports it here, else None (a
    class of ``__main__``, or one defined inside a function)."""
    module, qualname = getattr(cls, "__module__", ""), getattr(cls, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname:
        return None
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return f"{module}:{qualname}" if obj is cls else None


def workload_name(workload: Any) -> str:
    """The name a job gives ``workload`` (a :class:`~pipetune.workloads.Workload`
    subclass): its import path where one reaches it, else a shipped name (:func:`ship`)."""
    from pipetune.workloads import Workload

    if not (inspect.isclass(workload) and issubclass(workload, Workload)):
        raise WorkloadError(
            f"workload must be a pipetune.workloads.Workload subclass (a class, or "
            f"torch_workload(...)'s result), got {workload!r}")
    return import_path(workload) or ship(workload)


def ship(cls: type) -> str:
    """Name ``cls`` in this module, pickled by value for the workers; the same class
    content gets the same name."""
    import cloudpickle

    from pipetune.workloads._function import FunctionWorkload

    function_spec = getattr(cls, "spec", None) if issubclass(cls, FunctionWorkload) else None
    payload = ("function", function_spec) if function_spec is not None else ("class", cls)
    try:
        blob = cloudpickle.dumps(payload)
    except Exception as exc:  # noqa: BLE001 - any pickling failure, said in one line
        raise WorkloadError(
            f"workload {cls.__qualname__!r} cannot be sent to the workers: "
            f"{type(exc).__name__}: {exc} (define it in a module the workers can import "
            "and name it package.module:Class)") from None
    name = f"{_identifier(cls.__qualname__)}_{hashlib.sha256(blob).hexdigest()[:12]}"
    with _lock:
        _blobs[name] = blob
        _classes[name] = _rebuilt(name, payload)
    return PREFIX + name


def blob(workload: str) -> bytes | None:
    """What :func:`ship` pickled for ``workload`` (a shipped name), or None."""
    return _blobs.get(workload.removeprefix(PREFIX)) if workload.startswith(PREFIX) else None


def install(workload: str, data: bytes) -> None:
    """On a worker: make ``workload`` (a shipped name) resolve to what ``data`` holds."""
    import cloudpickle

    name = workload.removeprefix(PREFIX)
    with _lock:
        if name in _classes:
            return
        _blobs[name] = data
        _classes[name] = _rebuilt(name, cloudpickle.loads(data))


def _rebuilt(name: str, payload: tuple[str, Any]) -> type:
    kind, value = payload
    if kind == "function":
        from pipetune.workloads._function import _make_class

        cls = _make_class(value, __name__, name)
        cls.name = PREFIX + name
        return cls
    return value


def _identifier(qualname: str) -> str:
    last = qualname.rsplit(".", 1)[-1]
    return last if last.isidentifier() else "workload"


def __getattr__(attr: str) -> Any:
    # resolve_workload imports this module and reads the shipped name off it.
    try:
        return _classes[attr]
    except KeyError:
        raise AttributeError(
            f"no workload {attr!r} was shipped to this process (it reaches the Dask "
            "workers with the study that ships it)") from None
