"""Searchers: what hyperparameters to try next (ask/tell).

``make_searcher("tpe", space, mode="max", seed=0)`` builds one by the name a job spec
uses (``random``, ``grid``, ``tpe``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipetune.errors import SpecError
from pipetune.searchers._base import Searcher, TrialState, TrialSuggestion
from pipetune.searchers._grid import GridSearcher
from pipetune.searchers._random import RandomSearcher
from pipetune.searchers._tpe import TPESearcher
from pipetune.space import Distribution

#: Job-spec algorithm name -> searcher class.
SEARCHERS: dict[str, type[Searcher]] = {
    "random": RandomSearcher,
    "grid": GridSearcher,
    "tpe": TPESearcher,
}


def make_searcher(
    algorithm: str,
    space: Mapping[str, Distribution],
    *,
    mode: str = "max",
    seed: int = 0,
    **options: Any,
) -> Searcher:
    """The searcher named ``algorithm`` over ``space``.

    ``options`` go to the class, e.g. ``grid_points=3`` for ``grid`` or
    ``n_startup_trials=5`` for ``tpe``.
    """
    try:
        cls = SEARCHERS[algorithm]
    except KeyError:
        raise SpecError(
            "search.algorithm", f"must be one of {', '.join(SEARCHERS)}, got {algorithm!r}"
        ) from None
    return cls(space, mode=mode, seed=seed, **options)


__all__ = [
    "SEARCHERS",
    "GridSearcher",
    "RandomSearcher",
    "Searcher",
    "TPESearcher",
    "TrialState",
    "TrialSuggestion",
    "make_searcher",
]
