"""Grid search: the cartesian product of per-dimension grids."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from pipetune.searchers._base import Searcher
from pipetune.space import Distribution


class GridSearcher(Searcher):
    """Walks the cartesian product of ``dist.grid(grid_points)`` over the dimensions.

    The order is fixed: the last dimension of the space varies fastest. ``seed`` is
    accepted for a uniform interface and ignored. ``ask`` returns ``None`` after the
    last grid point.
    """

    def __init__(
        self,
        space: Mapping[str, Distribution],
        *,
        mode: str = "max",
        seed: int = 0,
        grid_points: int = 3,
    ) -> None:
        super().__init__(space, mode=mode, seed=seed)
        if not isinstance(grid_points, int) or grid_points < 1:
            raise ValueError(f"grid_points must be an integer >= 1, got {grid_points!r}")
        self.grid_points = grid_points
        self._axes = {name: dist.grid(grid_points) for name, dist in self.space.items()}
        self._points = itertools.product(*self._axes.values())

    @property
    def size(self) -> int:
        """How many configurations the grid holds."""
        return math.prod(len(axis) for axis in self._axes.values())

    def _suggest(self, trial_id: int) -> dict[str, Any] | None:
        point = next(self._points, None)
        if point is None:
            return None
        return dict(zip(self._axes, point, strict=True))
