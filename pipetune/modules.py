"""Where a job's own workload module is found, here and on the workers.

A job naming ``mymod:MyWorkload`` finds ``mymod`` as ``python job.py`` would find a
module beside it: in **the job file's folder**, then in **the working folder**, then on
the usual Python path. :func:`make_job_importable` (called by
:func:`pipetune.spec.load_spec`) puts those two folders in front of ``sys.path`` and of
``PYTHONPATH`` (so processes this one starts find them too), only for a job whose
workload is an import path outside pipetune; built-in workloads change nothing.
Inside :func:`pipetune.confine.enforced` (a deployment run in a long-lived worker) the
job file's folder is appended instead, and the environment is left alone, so a job
can never shadow a module that is already importable.

The Dask side (:mod:`pipetune.dask.ship`) reads :func:`added_folders` and
:func:`module_origin` to give the workers the same folders, or to ship the module.

>>> module_origin("json").installed
True
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import site
import sys
import sysconfig
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_lock = threading.Lock()
#: Folders added to sys.path by this process -> whether at its end (appended).
_added: dict[str, bool] = {}


def workload_module(name: Any) -> str | None:
    """The module an import-path workload name (``pkg.mod:Class``) imports, or None for
    a built-in name, a malformed one, or one of pipetune's own modules."""
    if not isinstance(name, str) or ":" not in name:
        return None
    module = name.strip().partition(":")[0].strip()
    top = module.split(".", 1)[0]
    if not module or top == "pipetune":
        return None
    return module


def job_folders(job_path: str | os.PathLike[str]) -> list[str]:
    """The folders a job file's own modules are looked up in: the job file's folder,
    then the working folder (once if they are one)."""
    folders = [os.path.realpath(Path(job_path).expanduser().parent), os.path.realpath(os.getcwd())]
    return list(dict.fromkeys(folders))


def make_job_importable(job_path: str | os.PathLike[str], data: Any) -> list[str]:
    """Make the job file's folder and the working folder importable when ``data`` (the
    parsed job file) names an import-path workload; returns the folders added."""
    workload = data.get("workload") if isinstance(data, Mapping) else None
    name = workload.get("name") if isinstance(workload, Mapping) else None
    if workload_module(name) is None:
        return []
    from pipetune import confine

    if confine.active() is not None:  # never shadow what a long-lived worker imports
        return make_importable(job_folders(job_path)[:1], append=True, environ=False)
    return make_importable(job_folders(job_path))


def _norm(entry: str) -> str:
    return os.path.realpath(entry or os.getcwd())


def make_importable(
    folders: Iterable[str], *, append: bool = False, environ: bool = True
) -> list[str]:
    """Put ``folders`` (in this order) in front of ``sys.path`` (at its end with
    ``append``) unless already there, and with ``environ`` in front of ``PYTHONPATH``
    too. Returns the folders added; :func:`added_folders` remembers every one."""
    added: list[str] = []
    with _lock:
        present = {_norm(p) for p in sys.path if isinstance(p, str)}
        wanted = [f for f in dict.fromkeys(os.path.realpath(f) for f in folders)
                  if f not in present and os.path.isdir(f)]
        if append:
            sys.path.extend(wanted)
        else:
            sys.path[0:0] = wanted
        added.extend(wanted)
        for folder in wanted:
            _added.setdefault(folder, append)
        if environ and wanted:
            current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [f for f in wanted if f not in current] + current)
    if added:
        importlib.invalidate_caches()
    return added


def added_folders(appended: bool | None = None) -> tuple[str, ...]:
    """Every folder :func:`make_importable` added in this process, first added first;
    with ``appended``, only those it appended (True) or put in front (False)."""
    with _lock:
        return tuple(f for f, back in _added.items() if appended is None or back == appended)


@dataclass(frozen=True)
class ModuleOrigin:
    """Where the top-level package or module of ``module`` lives in this process."""

    #: The module as the job names it (``team.models``) and its top level (``team``).
    module: str
    top: str
    #: The folder that makes ``top`` importable (what goes on a worker's ``sys.path``).
    root: str | None
    #: What to ship: the top-level ``.py`` file, or the package's folder.
    path: str | None
    is_package: bool
    #: Part of an installation (site-packages, the standard library): not shipped.
    installed: bool
    #: The installed distribution providing it, when there is one (``team-models``).
    distribution: str | None = None


def _install_dirs() -> list[str]:
    dirs = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(site.getsitepackages() if hasattr(site, "getsitepackages") else ())
    dirs.add(site.getusersitepackages() if hasattr(site, "getusersitepackages") else None)
    return [os.path.realpath(d) for d in dirs if d]


def install_dirs() -> tuple[str, ...]:
    """The folders of this interpreter's installation (the standard library,
    site-packages): what is under them is not a user's or a checkout's own code."""
    return tuple(_install_dirs())


def _under(path: str, folders: Iterable[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip(os.sep) + os.sep) for f in folders)


def module_origin(module: str) -> ModuleOrigin:
    """Find (importing nothing not yet imported) where ``module``'s top level lives."""
    top = module.split(".", 1)[0]
    loaded = sys.modules.get(top)
    spec = getattr(loaded, "__spec__", None) if loaded is not None else None
    if spec is None:
        spec = importlib.util.find_spec(top)
    if spec is None:
        return ModuleOrigin(module, top, None, None, False, False)
    locations = list(spec.submodule_search_locations or [])
    origin = spec.origin if spec.has_location else None
    if locations:  # a package (a namespace one has no __init__.py, no origin)
        path = os.path.realpath(os.path.dirname(origin) if origin else locations[0])
        root, is_package = os.path.dirname(path), True
    elif origin:
        path = os.path.realpath(origin)
        root, is_package = os.path.dirname(path), False
    else:  # built into the interpreter
        return ModuleOrigin(module, top, None, None, False, True)
    installed = _under(path, _install_dirs()) or not (is_package or path.endswith(".py"))
    return ModuleOrigin(module, top, root, path, is_package, installed,
                        _distribution(top) if installed else None)


def _distribution(top: str) -> str | None:
    try:
        from importlib.metadata import packages_distributions

        names = packages_distributions().get(top) or []
    except Exception:  # noqa: BLE001 - broken metadata: no name to suggest
        return None
    return names[0] if names else None


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line (whitespace runs folded), cut at ``limit``."""
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = [
    "ModuleOrigin",
    "added_folders",
    "job_folders",
    "make_importable",
    "make_job_importable",
    "module_origin",
    "one_line",
    "workload_module",
]
