"""Schedulers: whether a trial goes on after each epoch (early stopping).

``make_scheduler(spec.early_stopping, mode)`` builds the one a job spec names
(``asha`` or ``none``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipetune.errors import SpecError
from pipetune.schedulers._asha import ASHAScheduler
from pipetune.schedulers._base import Decision, Scheduler
from pipetune.schedulers._noop import NoopScheduler

POLICIES: tuple[str, ...] = ("asha", "none")


def make_scheduler(early_stopping: Any, mode: str = "max") -> Scheduler:
    """The scheduler an ``early_stopping`` spec section names.

    ``early_stopping`` is the job spec's ``EarlyStoppingSpec`` or a mapping with the
    same keys: ``policy``, ``max_epochs`` and, for ``asha``, ``min_epochs`` and
    ``reduction_factor``. ``mode`` is the objective's ``max`` or ``min``.
    """

    def get(key: str, default: Any = None) -> Any:
        if isinstance(early_stopping, Mapping):
            return early_stopping.get(key, default)
        return getattr(early_stopping, key, default)

    policy = get("policy", "asha")
    if policy == "none":
        return NoopScheduler(get("max_epochs"))
    if policy == "asha":
        return ASHAScheduler(
            min_epochs=get("min_epochs", 1),
            max_epochs=get("max_epochs"),
            reduction_factor=get("reduction_factor", 2),
            mode=mode,
        )
    raise SpecError(
        "early_stopping.policy", f"must be one of {', '.join(POLICIES)}, got {policy!r}"
    )


__all__ = ["ASHAScheduler", "Decision", "NoopScheduler", "Scheduler", "make_scheduler"]
