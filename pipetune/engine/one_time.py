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
