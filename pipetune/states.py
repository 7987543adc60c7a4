"""The states and answers every layer shares: an epoch's phase, a trial's state, the
ground truth's answer for a profile. Low in the library's layers (above only the
system config and the errors, which is all it imports)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from pipetune.system.config import SystemConfig


class Phase(StrEnum):
    """What an epoch is for: the profiled first epoch, a probe of a candidate, training."""

    PROFILE = "profile"
    PROBE = "probe"
    TRAIN = "train"


class TrialState(StrEnum):
    """Where a trial is: running, or how it ended (as told to its searcher)."""

    #: Proposed and not ended yet.
    RUNNING = "running"
    #: Ran to ``max_epochs``; its value is the final objective.
    COMPLETE = "completed"
    #: Ended early by the scheduler; its value is the last one observed.
    STOPPED = "stopped"
    #: Crashed; it has no value.
    FAILED = "failed"


@dataclass(frozen=True)
class GroundTruthMatch:
    """The ground truth's answer for one profile (see :meth:`GroundTruth.lookup`).

    ``hit`` means the profile is similar to a known cluster *and* that cluster has a
    best config for the batch-size bucket and objective. ``cluster`` and ``distance``
    name the nearest cluster even on a miss; ``bound`` is the distance within which a
    profile counts as similar to it. ``support`` is the number of trials behind
    ``config``.
    """

    hit: bool
    config: SystemConfig | None
    cost: float | None
    cluster: int | None
    bucket: int | None
    distance: float
    bound: float
    support: int
    reason: str
    #: What ``config`` cost once in the trials behind it (objective units, per epoch
    #: that paid it: a compile), and how much faster per sample it ran than their
    #: default; ``None`` when the records predate these figures.
    one_time: float | None = None
    speedup: float | None = None
    #: Set on an answer for a *known job* (:meth:`GroundTruth.known`): the model graph
    #: signature its records were made with; a trial's first epoch confirms it.
    known_graph: str | None = None
    #: What ``cost`` counts (``core_seconds``, ``seconds``, ``joules`` per sample; None:
    #: not recorded), so a study compares it only with a cost of its own kind.
    cost_unit: str | None = None

    def __post_init__(self) -> None:
        if self.hit and self.config is None:
            raise ValueError("a ground-truth hit needs a config")

    @classmethod
    def miss(cls, reason: str, *, bucket: int | None = None) -> GroundTruthMatch:
        """A miss with nothing to compare against (empty store, no lookup made, ...)."""
        return cls(False, None, None, None, bucket, math.inf, 0.0, 0, reason)
