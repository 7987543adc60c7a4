"""Searchers: what hyperparameters to try next (ask/tell).

``make_searcher("tpe", space, mode="max", seed=0)`` builds one by the name a job spec
uses (``random``, ``grid``, ``tpe``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipetune.errors import SpecError
from pipetune.policies import factory, register_searcher
from pipetune.searchers._base import Searcher, TrialState, TrialSuggestion
from pipetune.searchers._grid import GridSearcher
from pipetune.searchers._random import RandomSearcher
from pipetune.searchers._tpe import TPESearcher
from pipetune.space import Distribution

#: The built-in searchers by the name a job spec uses (the registry, with names a
#: program registered and import paths, is :mod:`pipetune.policies`).
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
    grid_points: int = 3,
    **options: Any,
) -> Searcher:
    """The searcher ``algorithm`` names over ``space``: a built-in (``random``,
    ``grid``, ``tpe``), a name registered with :func:`register_searcher`, or an import
    path ``package.module:Factory``.

    ``grid_points`` (the job's ``search.grid_points``) is used by ``grid`` only, so a
    caller can pass it whatever the algorithm. Other ``options`` go to the factory,
    e.g. ``n_startup_trials=5`` for ``tpe``.

    >>> from pipetune.space import Uniform
    >>> make_searcher("grid", {"x": Uniform(0.0, 1.0)}, grid_points=2).size
    2
    """
    build = factory("search.algorithm", algorithm, kind="searcher")
    if build is GridSearcher:
        options["grid_points"] = grid_points
    searcher = build(space, mode=mode, seed=seed, **options)
    if not isinstance(searcher, Searcher):
        raise SpecError("search.algorithm", f"{algorithm!r} made a {type(searcher).__name__}, "
                                            "not a pipetune.searchers.Searcher")
    return searcher


__all__ = [
    "SEARCHERS",
    "GridSearcher",
    "RandomSearcher",
    "Searcher",
    "TPESearcher",
    "TrialState",
    "TrialSuggestion",
    "make_searcher",
    "register_searcher",
]
