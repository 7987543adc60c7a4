"""The searcher interface: ask for a configuration, tell how it did."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipetune.errors import SpecError
from pipetune.space import Distribution
from pipetune.states import TrialState

MODES: tuple[str, ...] = ("max", "min")


@dataclass(frozen=True)
class TrialSuggestion:
    """A configuration to try: ``params`` maps each hyperparameter name to a value."""

    trial_id: int
    params: dict[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.trial_id, int) or isinstance(self.trial_id, bool):
            raise TypeError(f"trial_id must be an int, got {self.trial_id!r}")
        if self.trial_id < 0:
            raise ValueError(f"trial_id must be >= 0, got {self.trial_id}")
        if not isinstance(self.params, dict):
            raise TypeError(f"params must be a dict, got {type(self.params).__name__}")


class Searcher(ABC):
    """Decides which hyperparameters to try next, from what it was told so far.

    Ask/tell: ``ask()`` returns a :class:`TrialSuggestion` with a fresh ``trial_id``
    (0, 1, 2, ...), or ``None`` once the searcher has nothing left to propose; the
    caller runs the trial and reports it once with ``tell``. Several trials may be
    asked before any is told. The same seed and the same sequence of ask/tell calls
    give the same sequence of configurations.

    >>> from pipetune.space import Choice
    >>> from pipetune.searchers import GridSearcher
    >>> s = GridSearcher({"bs": Choice((32, 64))})
    >>> first = s.ask(); first.params
    {'bs': 32}
    >>> s.tell(first.trial_id, 0.9, TrialState.COMPLETE)
    """

    def __init__(
        self, space: Mapping[str, Distribution], *, mode: str = "max", seed: int = 0
    ) -> None:
        if mode not in MODES:
            raise SpecError("objective.mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
        for name, dist in space.items():
            if not isinstance(dist, Distribution):
                raise TypeError(f"space[{name!r}] is not a Distribution: {dist!r}")
        self.space: dict[str, Distribution] = dict(space)
        self.mode = mode
        self.seed = seed
        self._next_id = 0
        self._pending: set[int] = set()
        self._told: dict[int, tuple[float | None, TrialState]] = {}

    def ask(self) -> TrialSuggestion | None:
        """The next configuration to try, or ``None`` when the searcher is exhausted."""
        params = self._suggest(self._next_id)
        if params is None:
            return None
        suggestion = TrialSuggestion(self._next_id, params)
        self._pending.add(self._next_id)
        self._next_id += 1
        return suggestion

    def tell(self, trial_id: int, value: float | None, state: TrialState) -> None:
        """Report how trial ``trial_id`` ended.

        ``value`` is the objective (the metric named in the job's ``objective``):
        final for ``COMPLETE``, last observed for ``STOPPED``, ``None`` for ``FAILED``.
        A ``COMPLETE`` trial whose value is missing or not finite counts as failed.
        """
        state = TrialState(state)
        if state is TrialState.RUNNING:
            raise ValueError(f"trial {trial_id}: tell() is for an ended trial, not a running one")
        if trial_id not in self._pending:
            why = "was already told" if trial_id in self._told else "was never asked"
            raise ValueError(f"trial {trial_id} {why}")
        if value is not None:
            value = float(value)
        if state is TrialState.COMPLETE and (value is None or not math.isfinite(value)):
            state = TrialState.FAILED
        self._pending.discard(trial_id)
        self._told[trial_id] = (value, state)
        self._observe(trial_id, value, state)

    @property
    def told(self) -> dict[int, tuple[float | None, TrialState]]:
        """What each finished trial was told as: ``trial_id -> (value, state)``."""
        return dict(self._told)

    @abstractmethod
    def _suggest(self, trial_id: int) -> dict[str, Any] | None:
        """Parameters for trial ``trial_id``, or ``None`` when exhausted."""

    def _observe(  # noqa: B027 - optional hook
        self, trial_id: int, value: float | None, state: TrialState
    ) -> None:
        """Learn from a finished trial; model-free searchers ignore it."""
