"""pipetune's own top-level packages (``flows``, ``tasks``, ``deployments``) found where
pipetune is installed, whatever comes first on ``sys.path``.

A job's folder goes in front of ``sys.path`` (its workload module is found as ``python
job.py`` would find it), so a user's own ``tasks.py`` beside the job would otherwise
stand in for pipetune's ``tasks`` in every process that imports it after (the recorder
wrote no task run: 13 ``prefect-2 failed`` lines). Importing :mod:`pipetune` puts a
finder in front of ``sys.meta_path`` that looks those three names up beside the
``pipetune`` package only; a workload module of one of these names is refused by name
(:func:`pipetune.modules.workload_module`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

#: Top-level packages installed with pipetune (``pyproject.toml``'s package list).
OWN_PACKAGES = frozenset({"flows", "tasks", "deployments"})
_ROOT = str(Path(__file__).resolve().parent.parent)


class _OwnPackages(importlib.abc.MetaPathFinder):
    """Finds :data:`OWN_PACKAGES` beside ``pipetune`` (their submodules follow their
    package's ``__path__`` as usual)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ARG002 - the protocol's
        if fullname not in OWN_PACKAGES:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [_ROOT])


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, _OwnPackages) for f in sys.meta_path):
        sys.meta_path.insert(0, _OwnPackages())
