"""A package's names loaded on first use (PEP 562): ``__getattr__, __dir__ =
lazy_names(__name__, {"Name": "package.module", ...})`` at the bottom of its
``__init__``, so importing the package imports none of its heavy modules until a name
is asked for (a peer's fresh process, a study that trains before Prefect is loaded)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, where: Mapping[str, str],
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name of ``where`` imported from
    its module when first asked for, then kept in the package."""
    def getattr_(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return getattr_, dir_
