"""A job's own workload module on the Dask workers: found there, or shipped to them.

Built-in workloads need nothing. For an import-path workload (``mymod:MyWorkload``),
:func:`prepare_workers` runs before a study's first epoch:

- **workers of this host** (the embedded cluster): a worker plugin puts the folders
  this process looks in (:func:`pipetune.modules.added_folders`, and the module's own
  root) in front of every worker's ``sys.path``. The scheduler keeps plugins and hands
  them to workers that join later (a restarted one, a new OpenMP group), so a cluster
  started before the job file was read still finds the module.
- **any other cluster** (``--dask-address``): the module is shipped, with Dask's
  :class:`~distributed.diagnostics.plugin.UploadFile`: a top-level ``mymod.py`` as is,
  a package as a zip of its folder. Workers that join later get it too. A module
  installed here (site-packages) is not shipped: the workers must have it installed.

Then every worker resolves the workload; one that cannot fails the study before it
records anything, with a :class:`~pipetune.errors.WorkloadError` saying what to
install where.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import UploadFile, WorkerPlugin

from pipetune.errors import WorkloadError
from pipetune.modules import ModuleOrigin, added_folders, module_origin, one_line, workload_module

if TYPE_CHECKING:
    from distributed import Client

#: Largest package folder shipped (zipped); a bigger one must be installed on the workers.
MAX_SHIP_BYTES = 32 * 2**20
#: Name prefixes of pipetune's plugins on a scheduler.
FOLDERS_PLUGIN = "pipetune-import-folders"
SHIP_PLUGIN = "pipetune-ship-"
#: Never shipped with a package: caches and version-control folders.
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".mypy_cache", ".pytest_cache",
              ".ruff_cache", ".venv", "node_modules"}


class ImportFolders(WorkerPlugin):
    """Put ``front`` in front of a worker's ``sys.path`` and ``back`` at its end, as the
    driver has them (those not there yet)."""

    name = FOLDERS_PLUGIN

    def __init__(self, front: list[str], back: list[str] = ()):
        self.front, self.back = list(front), list(back)

    def setup(self, worker: Any = None) -> None:
        global _folders_added
        # A long-lived worker (the warm service's) ran an earlier job's plugin: its
        # folders go, so this job's modules are not found there first.
        for folder in _folders_added - {*self.front, *self.back}:
            with contextlib.suppress(ValueError):
                sys.path.remove(folder)
        front = [f for f in self.front if f not in sys.path]
        back = [f for f in self.back if f not in sys.path]
        sys.path[0:0] = front
        sys.path.extend(back)
        _folders_added = (_folders_added & {*self.front, *self.back}) | {*front, *back}
        importlib.invalidate_caches()


class ShippedWorkload(WorkerPlugin):
    """Install a workload class sent by value (:mod:`pipetune.workloads.shipped`) on a
    worker, and on every worker that joins later."""

    idempotent = True  # the same content is not sent again

    def __init__(self, workload: str, data: bytes):
        self.workload, self.data = workload, data

    def setup(self, worker: Any = None) -> None:
        from pipetune.workloads import shipped

        shipped.install(self.workload, self.data)


#: Folders :class:`ImportFolders` put on this worker's path.
_folders_added: set[str] = set()


def check_workload(workload: str) -> str | None:
    """Run on a worker: None when ``workload`` resolves there, else why not (one line)."""
    importlib.invalidate_caches()
    try:
        from pipetune.workloads import resolve_workload

        resolve_workload(workload)
    except WorkloadError as e:
        return " ".join(str(e).split())
    except Exception as e:  # noqa: BLE001 - reported to the driver as one line
        return one_line(e)
    return None


def _failures(client: Client, workload: str) -> dict[str, str]:
    results = client.run(check_workload, workload, on_error="return")
    # An exception object here is a worker that went away meanwhile, not an answer.
    return {addr: r for addr, r in results.items() if isinstance(r, str)}


def prepare_workers(client: Client, workload: str, *, ship: bool, where: str) -> str:
    """Make every worker of ``client``'s cluster (and every later one) able to import
    ``workload``'s module: with ``ship``, send it to them; else give them this host's
    folders. Returns what was done, in words; raises :class:`WorkloadError` when a
    worker still cannot resolve the workload."""
    from pipetune.workloads import shipped

    data = shipped.blob(workload)
    if data is not None:  # a class no import path reaches (a notebook's): by value
        name = f"{SHIP_PLUGIN}{workload.removeprefix(shipped.PREFIX)}"
        client.register_plugin(ShippedWorkload(workload, data), name=name)
        failures = _failures(client, workload)
        if failures:
            _unregister(client, name)
            addr, why = next(iter(sorted(failures.items())))
            raise WorkloadError(
                f"workload {workload!r} (sent by value) cannot be loaded on the Dask workers "
                f"of {where}: {addr}: {why}; what its class imports must be installed there")
        return f"sent {workload} to the workers by value"
    module = workload_module(workload)
    if module is None:
        return "built-in workload: nothing to do"
    origin = module_origin(module)
    if not ship:
        front, back = list(added_folders(appended=False)), list(added_folders(appended=True))
        if origin.root and not origin.installed and origin.root not in front + back:
            back.append(origin.root)  # found here some other way: it only adds names there
        client.register_plugin(ImportFolders(front, back))
        done = f"folders on the workers' path: {', '.join(front + back) or 'none'}"
        plugin = None
    elif origin.installed or origin.path is None:
        done, plugin = f"{origin.top} expected installed on the workers", None
    else:
        plugin = _ship(client, origin, workload, where)
        done = f"shipped {origin.path} to the workers"
    failures = _failures(client, workload)
    if failures:
        if plugin is not None:  # a later worker must not try a module that cannot load
            _unregister(client, plugin)
        raise WorkloadError(_refusal(workload, origin, failures, where, ship=ship))
    return done


def _ship(client: Client, origin: ModuleOrigin, workload: str, where: str) -> str:
    """Register an upload of ``origin``'s module (replacing an older version's); returns
    the plugin's name."""
    assert origin.path is not None
    with tempfile.TemporaryDirectory(prefix="pipetune-ship-") as tmp:
        if origin.is_package:
            digest = _zip_package(origin.path, Path(tmp) / "package.zip", workload)
            upload = Path(tmp) / f"{origin.top}-{digest}.zip"
            os.replace(Path(tmp) / "package.zip", upload)
        else:
            digest = hashlib.sha256(Path(origin.path).read_bytes()).hexdigest()[:16]
            upload = Path(origin.path)
        plugin = UploadFile(str(upload), load=True)
    plugin.idempotent = True  # the same content is not sent (nor reloaded) again
    name = f"{SHIP_PLUGIN}{origin.top}-{digest}"
    stale = [n for n in client.run_on_scheduler(_plugin_names)
             if n.startswith(f"{SHIP_PLUGIN}{origin.top}-") and n != name]
    for old in stale:
        _unregister(client, old)
    try:
        client.register_plugin(plugin, name=name)
    except Exception as e:  # noqa: BLE001 - the import failed on a worker: said below
        _unregister(client, name)
        raise WorkloadError(_refusal(workload, origin, {"a worker": one_line(e)}, where,
                                     ship=True)) from None
    return name


def _unregister(client: Client, name: str) -> None:
    with contextlib.suppress(Exception):  # already gone
        client.unregister_worker_plugin(name)


def _plugin_names(dask_scheduler: Any = None) -> list[str]:
    return list(getattr(dask_scheduler, "worker_plugins", {}))


def _zip_package(folder: str, out: Path, workload: str) -> str:
    """Zip package ``folder`` (as ``<name>/...``, folders included so a namespace
    package imports from the zip); returns a digest of its files."""
    base = Path(folder)
    digest = hashlib.sha256()
    total = 0
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for root, dirs, files in os.walk(base):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
            rel = Path(root).relative_to(base.parent)
            z.write(root, str(rel))
            for name in sorted(files):
                if name.endswith((".pyc", ".pyo")):
                    continue
                path = Path(root) / name
                total += path.stat().st_size
                if total > MAX_SHIP_BYTES:
                    raise WorkloadError(
                        f"workload {workload!r}: the package folder {folder} holds more than "
                        f"{MAX_SHIP_BYTES // 2**20} MiB, more than pipetune ships to Dask "
                        f"workers; install {base.name} on every worker instead "
                        f"(pip install in the workers' Python environment)")
                z.write(path, str(rel / name))
                digest.update(str(rel / name).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _refusal(workload: str, origin: ModuleOrigin, failures: dict[str, str], where: str,
             *, ship: bool) -> str:
    addr, why = next(iter(sorted(failures.items())))
    more = f" (and {len(failures) - 1} more workers)" if len(failures) > 1 else ""
    head = (f"workload {workload!r} cannot be loaded on the Dask workers of {where}: "
            f"{addr}: {why}{more}")
    if not ship:
        return (f"{head}; the workers run {sys.executable} with this host's folders "
                f"{', '.join(added_folders()) or '(none added)'} on their path")
    if origin.installed or origin.path is None:
        dist = origin.distribution or origin.top
        version = _version(origin.distribution)
        why = ("it is installed here" if origin.path is None or origin.is_package
               or origin.path.endswith(".py") else f"{origin.path} is not Python source")
        return (f"{head}; {origin.top!r} is not shipped ({why}): install it on every "
                f"worker: pip install {dist}{version}")
    if origin.is_package:
        return (f"{head}; pipetune shipped the package folder {origin.path}: install what it "
                "imports from outside it on every worker (pip install in the workers' "
                "Python environment)")
    return (f"{head}; pipetune shipped {origin.path} alone: install what it imports on every "
            f"worker (pip install in the workers' Python environment), or make it a package "
            f"(a folder with an __init__.py holding {origin.top}.py and the modules it "
            f"imports: a package is shipped whole)")


def _version(distribution: str | None) -> str:
    if not distribution:
        return ""
    try:
        from importlib.metadata import version

        return f"=={version(distribution)}"
    except Exception:  # noqa: BLE001 - no version to pin
        return ""


__all__ = ["MAX_SHIP_BYTES", "ImportFolders", "ShippedWorkload", "check_workload",
           "prepare_workers"]
