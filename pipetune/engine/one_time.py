"""What each worker has paid once: the one-time costs (a compile) it measured per model
graph and batch size, so a later trial on the same worker weighs what it will really pay.

A worker that compiled a model graph once compiles the same architecture for a new
trial in about no time (dynamo reuses what it traced; measured here: 0.0 s against
8.6 s for the first). The first one-time cost a worker pays for a graph is its *first*;
every later trial's first epoch under the same one-time knobs there is a *reuse*, and
what reuses measured is what the next trial on that worker is told it will pay.

>>> ledger = OneTimeLedger()
>>> ledger.paid("tcp://w1", "g", 64, ("compile",), 8.6)
>>> ledger.estimate("tcp://w1", "g", 64, ("compile",))
(0.0, 'assumed')
>>> ledger.paid("tcp://w1", "g", 64, ("compile",), 0.2)
>>> ledger.estimate("tcp://w1", "g", 64, ("compile",))
(0.2, 'measured')
>>> ledger.estimate("tcp://w2", "g", 64, ("compile",)) is None
True
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipetune.system.config import ONE_TIME_KNOBS

if TYPE_CHECKING:
    from pipetune.engine.trial import Trial
    from pipetune.runner import EpochResult

#: (worker address, model graph, batch size, one-time knobs that ran)
Key = tuple[str, str, int, tuple[str, ...]]


@dataclass
class _Paid:
    first: float
    reuses: list[float] = field(default_factory=list)


class OneTimeLedger:
    """Per worker, graph, batch size and one-time knobs: the first cost and the reuses."""

    def __init__(self) -> None:
        self._paid: dict[Key, _Paid] = {}

    def paid(self, address: str, graph: str, batch_size: int, knobs: tuple[str, ...],
             one_time: float) -> None:
        """A trial's first epoch under ``knobs`` on ``address`` cost ``one_time`` once (in
        the objective's units for the whole epoch)."""
        key = (address, graph, int(batch_size), tuple(sorted(knobs)))
        known = self._paid.get(key)
        if known is None:
            self._paid[key] = _Paid(float(one_time))
        else:
            known.reuses.append(float(one_time))

    def estimate(self, address: str, graph: str, batch_size: int,
                 knobs: tuple[str, ...]) -> tuple[float, str] | None:
        """What a new trial will pay once for ``knobs`` on ``address``, and whether that
        was ``measured`` (the median of the reuses there) or ``assumed`` (the worker
        paid its first only: a reuse costs about nothing); None where it paid nothing
        yet for this graph."""
        known = self._paid.get((address, graph, int(batch_size), tuple(sorted(knobs))))
        if known is None:
            return None
        if known.reuses:
            return statistics.median(known.reuses), "measured"
        return 0.0, "assumed"

    def note(self, trial: Trial, result: EpochResult) -> None:
        """``result``, the trial's newest epoch: where it is the first under its one-time
        knobs on its worker, what that worker paid, for the trials that come to it later."""
        knobs = result.system.one_time_knobs()
        earlier = trial.results[:-1]
        if not knobs or (earlier and earlier[-1].system.one_time_knobs() == knobs
                         and earlier[-1].address == result.address):
            return
        where = graph_of(trial)
        if where is not None:
            self.paid(*where, knobs, trial.history[-1].one_time)

    def for_next_epoch(self, trial: Trial) -> float | None:
        """What the one-time knobs cost on the worker of the trial's next epoch, where it
        paid them for this graph before (:meth:`estimate`); None where unknown."""
        where = graph_of(trial)
        if where is None:
            return None
        known = self.estimate(*where, ONE_TIME_KNOBS)
        return None if known is None else known[0]


def graph_of(trial: Trial) -> tuple[str, str, int] | None:
    """Where the trial's next epoch runs (the worker holding its model), its model graph
    and batch size; None before its first epoch or where unknown."""
    if not trial.results:
        return None
    graph = next((r.graph for r in trial.results if r.graph), "")
    last = trial.results[-1]
    return (last.address, graph, last.batch_size) if graph else None
