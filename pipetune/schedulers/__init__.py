"""Schedulers: whether a trial goes on after each epoch (early stopping).

``make_scheduler(spec.early_stopping, mode)`` builds the one a job spec names
(``asha`` or ``none``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipetune.errors import SpecError
from pipetune.policies import factory, register_scheduler
from pipetune.schedulers._asha import ASHAScheduler
from pipetune.schedulers._base import Decision, Scheduler
from pipetune.schedulers._noop import NoopScheduler

#: The built-in policies (the registry, with names a program registered and import
#: paths, is :mod:`pipetune.policies`).
POLICIES: tuple[str, ...] = ("asha", "none")


def _get(early_stopping: Any, key: str, default: Any = None) -> Any:
    if isinstance(early_stopping, Mapping):
        return early_stopping.get(key, default)
    return getattr(early_stopping, key, default)


def asha_from_spec(early_stopping: Any, mode: str = "max") -> ASHAScheduler:
    """``early_stopping.policy: asha``."""
    return ASHAScheduler(
        min_epochs=_get(early_stopping, "min_epochs", 1),
        max_epochs=_get(early_stopping, "max_epochs"),
        reduction_factor=_get(early_stopping, "reduction_factor", 2),
        mode=mode,
    )


def none_from_spec(early_stopping: Any, mode: str = "max") -> NoopScheduler:  # noqa: ARG001
    """``early_stopping.policy: none``: every trial runs ``max_epochs``."""
    return NoopScheduler(_get(early_stopping, "max_epochs"))


def make_scheduler(early_stopping: Any, mode: str = "max") -> Scheduler:
    """The scheduler an ``early_stopping`` spec section names: a built-in (``asha``,
    ``none``), a name registered with :func:`register_scheduler`, or an import path
    ``package.module:Factory`` called as ``Factory(early_stopping, mode)``.

    ``early_stopping`` is the job spec's ``EarlyStoppingSpec`` or a mapping with the
    same keys: ``policy``, ``max_epochs`` and, for ``asha``, ``min_epochs`` and
    ``reduction_factor``. ``mode`` is the objective's ``max`` or ``min``.
    """
    policy = _get(early_stopping, "policy", "asha")
    scheduler = factory("early_stopping.policy", policy, kind="scheduler")(early_stopping, mode)
    if not isinstance(scheduler, Scheduler):
        raise SpecError("early_stopping.policy", f"{policy!r} made a "
                        f"{type(scheduler).__name__}, not a pipetune.schedulers.Scheduler")
    return scheduler


__all__ = ["ASHAScheduler", "Decision", "NoopScheduler", "Scheduler", "asha_from_spec",
           "make_scheduler", "none_from_spec", "register_scheduler"]
