"""Where the engine's own seconds go in a simulation: the searcher, the ground truth.

A simulated study runs the real policies; to say what each costs per decision at
scale, the searcher and the ground truth are handed to the engine wrapped in a
:class:`Stopwatch` that adds up the wall seconds of their calls. The wrappers are
subclasses of the real interfaces and pass every call through unchanged.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pipetune.groundtruth import GroundTruth
from pipetune.searchers import Searcher

T = TypeVar("T")


class Stopwatch:
    """Wall seconds and calls, by what was called."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def timed(self, name: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        began = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.seconds[name] += time.perf_counter() - began
            self.calls[name] += 1

    def total(self, prefix: str) -> float:
        return sum(s for name, s in self.seconds.items() if name.startswith(prefix))


class TimedSearcher(Searcher):
    """``inner``, its ``ask`` and ``tell`` timed on ``watch`` as ``searcher.*``."""

    def __init__(self, inner: Searcher, watch: Stopwatch):
        super().__init__(inner.space, mode=inner.mode, seed=inner.seed)
        self.inner, self.watch = inner, watch

    @property
    def size(self) -> Any:  # a grid's size bounds the trials left (one_time.trials_left)
        return getattr(self.inner, "size", None)

    def ask(self) -> Any:
        return self.watch.timed("searcher.ask", self.inner.ask)

    def tell(self, trial_id: int, value: float | None, state: Any) -> None:
        self.watch.timed("searcher.tell", self.inner.tell, trial_id, value, state)

    def _suggest(self, trial_id: int) -> dict[str, Any] | None:  # pragma: no cover
        raise NotImplementedError("TimedSearcher asks its inner searcher")

    def _observe(self, trial_id: int, value: float | None,
                 state: Any) -> None:  # pragma: no cover
        raise NotImplementedError("TimedSearcher tells its inner searcher")


class TimedGroundTruth(GroundTruth):
    """A ground truth whose engine-facing calls are timed on ``watch`` as
    ``groundtruth.*`` (what the engine calls on the critical path)."""

    def __init__(self, location: Any, watch: Stopwatch, **kwargs: Any):
        super().__init__(location, **kwargs)
        self.watch = watch

    def lookup(self, *args: Any, **kwargs: Any) -> Any:
        return self.watch.timed("groundtruth.lookup", super().lookup, *args, **kwargs)

    def remember(self, *args: Any, **kwargs: Any) -> None:
        self.watch.timed("groundtruth.remember", super().remember, *args, **kwargs)

    def known(self, *args: Any, **kwargs: Any) -> Any:
        return self.watch.timed("groundtruth.known", super().known, *args, **kwargs)

    def one_time_figures(self, *args: Any, **kwargs: Any) -> Any:
        return self.watch.timed("groundtruth.one_time", super().one_time_figures,
                                *args, **kwargs)


def per_call_ms(watch: Stopwatch) -> Mapping[str, float]:
    return {name: 1000.0 * s / max(watch.calls[name], 1) for name, s in watch.seconds.items()}
