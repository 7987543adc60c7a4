"""Random search: every dimension sampled independently."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from pipetune.searchers._base import Searcher
from pipetune.space import Distribution


class RandomSearcher(Searcher):
    """Draws each hyperparameter independently from its distribution; never exhausted."""

    def __init__(
        self, space: Mapping[str, Distribution], *, mode: str = "max", seed: int = 0
    ) -> None:
        super().__init__(space, mode=mode, seed=seed)
        self._rng = random.Random(seed)

    def _suggest(self, trial_id: int) -> dict[str, Any] | None:
        return {name: dist.sample(self._rng) for name, dist in self.space.items()}
