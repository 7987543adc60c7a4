"""Where each epoch goes on a Dask cluster: the workers the scheduler lists and what each
advertises, the worker holding each trial's model (its *home*), the cores and threads
the epochs already sent hold, CPUs pinned per host, and workers being retired.

The driver (:class:`~pipetune.dask.backend.DaskBackend`) asks :meth:`Placement.choose`
for a worker with a free thread and the cores an epoch asks for; an epoch no worker
could ever run is named by :meth:`Placement.never`.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pipetune.dask.cores import worker_cores
from pipetune.system.config import PROCESS_KNOBS, process_resource

if TYPE_CHECKING:
    from distributed import Client

    from pipetune.runner import EpochTask


class Placement:
    """The driver's view of ``client``'s workers, for placing epochs."""

    #: Seconds the scheduler's worker list is reused (each ask is a round trip).
    WORKERS_TTL_S = 2.0

    def __init__(self, client: Client):
        self.client = client
        #: (study id, trial id) -> the worker holding the trial's model.
        self.home: dict[tuple[str, int], str] = {}
        #: Retired workers still listed by the scheduler, left out of placement.
        self.retiring: set[str] = set()
        #: The largest memory limit of a worker, kept from the last list that had
        #: workers: the reason a dead worker gives.
        self.memory_limit = 0
        self._cpus_in_use: dict[str, set[int]] = {}
        self._workers_cache: dict[str, dict[str, float]] = {}
        self._threads: dict[str, int] = {}
        self._cores: dict[str, float] = {}
        self._workers_at = -math.inf

    def workers(self, fresh: bool = False) -> dict[str, dict[str, float]]:
        """The cluster's workers and the resources each advertises, asked of the
        scheduler at most every :attr:`WORKERS_TTL_S`."""
        now = time.monotonic()
        if fresh or now - self._workers_at > self.WORKERS_TTL_S:
            info = self.client.scheduler_info(n_workers=-1).get("workers", {})
            # A retired worker stays listed until its restart or removal is through (a
            # worker coming back later at the same address is a new one).
            self.retiring &= set(info)
            info = {a: w for a, w in info.items() if a not in self.retiring}
            self._workers_cache = {addr: dict(w.get("resources") or {})
                                   for addr, w in sorted(info.items())}
            self._threads = {addr: int(w.get("nthreads") or 1) for addr, w in info.items()}
            self._cores = {addr: worker_cores(w, claimable=True) for addr, w in info.items()}
            self.memory_limit = max((w.get("memory_limit") or 0 for w in info.values()),
                                    default=0) or self.memory_limit
            self._workers_at = now
        return self._workers_cache

    def older_than(self, seconds: float) -> bool:
        """Whether the worker list was asked for more than ``seconds`` ago."""
        return time.monotonic() - self._workers_at > seconds

    def stale(self) -> None:
        """The next :meth:`workers` asks the scheduler again (a worker died or left)."""
        self._workers_at = -math.inf

    def resources(self, task: EpochTask, workers: dict[str, dict[str, float]]) -> dict:
        """``cores``, plus the resource of each process knob the epoch sets, when the
        cluster has workers advertising it (else the worker checks, and refuses, itself)."""
        resources: dict[str, float] = {"cores": task.system.cores}
        advertised = {name for res in workers.values() for name in res}
        for knob in PROCESS_KNOBS:
            value = getattr(task.system, knob)
            name = process_resource(knob, value)
            if value != "inherit" and any(n.startswith(f"{knob}:") for n in advertised):
                resources[name] = 1
        return resources

    def never(self, task: EpochTask, workers: dict[str, dict[str, float]],
              resources: dict[str, float]) -> tuple[str, str] | None:
        """(field, why) when no worker of the cluster could ever run ``task``."""
        needs = [k for k in resources if k != "cores"]
        if needs and not any(all(r.get(k, 0) for k in needs) for r in workers.values()):
            field = "system." + ",".join(sorted(k.split(":")[0] for k in needs))
            return field, (f"no worker of the cluster advertises {', '.join(needs)}: "
                           "start one with that environment")
        most = max((self._cores.get(w, 0) for w in workers), default=0)
        if task.system.cores > most:
            return "system.cores", (f"{task.system.cores} cores asked, but the cluster's "
                                    f"largest worker advertises {most:g} (resource 'cores')")
        return None

    def choose(self, task: EpochTask, workers: dict[str, dict[str, float]],
               resources: dict[str, float],
               running: Iterable[tuple[str | None, EpochTask]]) -> tuple[str | None, str]:
        """A worker for ``task`` with a free thread and its cores beside the epochs
        ``running`` (worker, task), and why: the trial's home first, then a worker no
        live trial calls home (so models are not pushed out); None when none is free."""
        used_cores: Counter[str] = Counter()
        used_threads: Counter[str] = Counter()
        for worker, each in running:
            if worker:
                used_cores[worker] += each.system.cores
                used_threads[worker] += 1
        free = [w for w, res in workers.items()
                if all(res.get(k, 0) >= v for k, v in resources.items() if k != "cores")
                and self._cores.get(w, 0) - used_cores[w] >= task.system.cores
                and self._threads.get(w, 1) > used_threads[w]]
        home = self.home.get((task.study_id, task.trial_id))
        if home in free:
            return home, "holds the model"
        if free:
            homes = set(self.home.values())
            free.sort(key=lambda w: (w in homes, w))
            return free[0], "home busy" if home in workers else "new trial"
        return None, "no free worker"

    def pin(self, task: EpochTask, worker: str | None,
            workers: dict[str, dict[str, float]]) -> tuple[int, ...]:
        """Cores for a pinned epoch on ``worker``'s host, none of them used by another
        pinned epoch running there."""
        if not task.system.pin_cores or worker is None:
            return ()
        on = host(worker)
        total = int(max((self._cores.get(w, 0) for w in workers if host(w) == on),
                        default=1))
        used = self._cpus_in_use.setdefault(on, set())
        chosen = tuple(c for c in range(total) if c not in used)[: task.system.cores]
        used.update(chosen)
        return chosen

    def unpin(self, worker: str | None, cpus: Iterable[int]) -> None:
        """``cpus`` of ``worker``'s host are free again (its epoch ended)."""
        if worker:
            self._cpus_in_use.get(host(worker), set()).difference_update(cpus)

    def retire(self, worker: str) -> None:
        """``worker`` is out of placement until :meth:`back`; no trial calls it home."""
        self.retiring.add(worker)
        self.stale()
        for key in [k for k, home in self.home.items() if home == worker]:
            del self.home[key]

    def back(self, worker: str) -> None:
        """A retired worker was restarted or removed: its address may be placed again."""
        self.retiring.discard(worker)
        self.stale()


def host(address: str) -> str:
    """The host of a worker's address (``tcp://10.0.0.5:4000`` -> ``10.0.0.5``)."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


def placed_on(worker: str | None) -> dict[str, Any]:
    """Submit options that prefer ``worker`` but let Dask move the task if it is lost."""
    return {"workers": [worker], "allow_other_workers": True} if worker else {}
