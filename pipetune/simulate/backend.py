"""An epoch backend on a simulated clock: nodes, cores, and epochs played from records.

:class:`SimulatedBackend` is a real :class:`~pipetune.backends.base.EpochBackend`: the
engine, its searcher, its scheduler (ASHA) and the system tuner run unchanged above
it, and only the epochs are not run. Each submitted epoch becomes ready ``gap_s``
after the moment it was submitted (the orchestration around an epoch, measured),
starts on the node that fits its ``cores`` most tightly as soon as one has them free
(a node never lends cores to another), and lasts what :class:`EpochTimes` says such
an epoch lasted. :meth:`wait` moves the clock to the next epoch to finish and
returns it, as a real backend returns the next epoch that finishes.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipetune.backends.base import EpochBackend, EpochOutcome
from pipetune.errors import PipetuneError

if TYPE_CHECKING:
    from pipetune.runner import EpochTask
    from pipetune.simulate.times import EpochTimes


@dataclass
class Usage:
    """What the simulated cluster spent: epochs, the cores they held, their energy."""

    epochs: int = 0
    core_s: float = 0.0
    energy_j: float = 0.0
    #: Most epochs running at once.
    peak_running: int = 0
    #: Wall seconds this process spent inside the backend (not the engine's).
    backend_wall_s: float = 0.0
    #: Seconds each epoch waited, once ready, for a node with its cores free.
    waited_s: list[float] = field(default_factory=list)


class SimulatedBackend(EpochBackend):
    """``nodes`` x ``cores_per_node`` cores, epochs played by ``times`` (module doc)."""

    def __init__(self, times: EpochTimes, *, nodes: int, cores_per_node: int,
                 gap_s: float | None = None):
        if nodes < 1 or cores_per_node < 1:
            raise PipetuneError("a simulated cluster needs at least one node of one core")
        self.times = times
        self.nodes, self.cores_per_node = nodes, cores_per_node
        self.gap_s = times.gap_s if gap_s is None else gap_s
        self.clock = 0.0
        self.usage = Usage()
        #: Nodes by how many cores they have free: the tightest fit is found by count.
        self._free = [cores_per_node] * nodes
        self._by_free: list[set[int]] = [set() for _ in range(cores_per_node + 1)]
        self._by_free[cores_per_node] = set(range(nodes))
        #: Most cores each node has held at once: an epoch that takes it past that
        #: starts a new worker process there, which builds the workload first.
        self._peak_held = [0] * nodes
        self._ready: deque[tuple[float, EpochTask]] = deque()
        self._running: list[tuple[float, int, int, EpochOutcome]] = []  # (end, seq, node, ..)
        self._seq = 0

    # -- the interface --------------------------------------------------------------------
    def submit(self, task: EpochTask) -> None:
        began = time.perf_counter()
        if task.system.cores > self.cores_per_node:
            raise PipetuneError(f"an epoch of trial {task.trial_id} claims "
                                f"{task.system.cores} cores; a simulated node has "
                                f"{self.cores_per_node} (--cores-per-node)")
        self._ready.append((self.clock + self.gap_s, task))
        self._place()
        self.usage.backend_wall_s += time.perf_counter() - began

    def wait(self) -> EpochOutcome:
        began = time.perf_counter()
        if not self._running:
            raise PipetuneError("the simulated cluster has nothing running to wait for")
        end, _, node, outcome = heapq.heappop(self._running)
        self.clock = max(self.clock, end)
        self._hold(node, -outcome.task.system.cores)
        self._place()
        self.usage.backend_wall_s += time.perf_counter() - began
        return outcome

    def cancel(self) -> None:
        self._ready.clear()
        self._running.clear()

    # -- placing epochs on nodes ------------------------------------------------------------
    def _place(self) -> None:
        """Start every ready epoch a node has room for, in the order they came."""
        waiting: deque[tuple[float, EpochTask]] = deque()
        while self._ready:
            ready, task = self._ready.popleft()
            node = self._fit(task.system.cores)
            if node is None:
                waiting.append((ready, task))
                continue
            self._start(node, max(ready, self.clock), ready, task)
        self._ready = waiting

    def _fit(self, cores: int) -> int | None:
        for free in range(cores, self.cores_per_node + 1):
            if self._by_free[free]:
                return min(self._by_free[free])
        return None

    def _hold(self, node: int, cores: int) -> None:
        self._by_free[self._free[node]].discard(node)
        self._free[node] -= cores
        self._by_free[self._free[node]].add(node)

    def _start(self, node: int, start: float, ready: float, task: EpochTask) -> None:
        self._hold(node, task.system.cores)
        result = self.times.play(task, start, worker=f"sim-node-{node}")
        held = self.cores_per_node - self._free[node]
        if held > self._peak_held[node]:  # on a new worker process: the build first
            self._peak_held[node] = held
            result = dataclasses.replace(
                result, finished=result.finished + self.times.first_build_s,
                build_s=self.times.first_build_s, setup_s=result.setup_s + self.times.first_build_s)
        usage = self.usage
        usage.epochs += 1
        usage.core_s += task.system.cores * (result.finished - result.started)
        usage.energy_j += result.measurement.energy_j
        usage.waited_s.append(start - ready)
        self._seq += 1
        heapq.heappush(self._running, (result.finished, self._seq, node,
                                       EpochOutcome(task, result=result)))
        usage.peak_running = max(usage.peak_running, len(self._running))
