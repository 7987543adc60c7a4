"""Workers that stop answering while running an epoch (stopped, swapping, stuck in a
call that holds the GIL: their heartbeats stop while their connections stay open): the
part of :class:`pipetune.dask.backend.DaskBackend` that finds, retires and restarts
them. Its docstring says what a study sees."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from pipetune.backends.base import EpochOutcome, describe
from pipetune.dask.on_scheduler import remove_worker, silent_workers

if TYPE_CHECKING:
    from collections import Counter, deque

    from distributed import Client

    from pipetune.dask.placement import Placement
    from pipetune.runner import EpochTask

logger = logging.getLogger("pipetune.dask.backend")


def epoch_ident(task: EpochTask) -> tuple[str, int, int]:
    """An epoch's identity across resends: its deaths are counted under it."""
    return task.study_id, task.trial_id, task.epoch


class FrozenWorkers:
    """Mixed into the backend; uses its client, lock, epochs sent, placement and
    resends (the attributes declared here)."""

    #: Seconds without a heartbeat after which a worker running an epoch is frozen.
    FROZEN_S = 20.0
    #: How often the driver asks the scheduler when each busy worker was last heard.
    FROZEN_CHECK_S = 1.0

    client: Client
    placer: Placement
    freeze_retries: int
    retired: dict[str, float]
    _lock: Any
    _sent: dict[str, Any]
    _ready: deque[EpochOutcome]
    _deaths: Counter[tuple[str, int, int]]
    _frozen_checked: float

    def _again(self, task: EpochTask) -> None:
        raise NotImplementedError

    def _find_frozen(self) -> None:
        """Retire every worker running an epoch that has not sent a heartbeat for
        :attr:`FROZEN_S` (asked of the scheduler at most every :attr:`FROZEN_CHECK_S`)."""
        now = time.monotonic()
        if now - self._frozen_checked < self.FROZEN_CHECK_S:
            return
        self._frozen_checked = now
        with self._lock:  # a finished epoch waiting to be settled is not lost
            busy = {s.worker for s in self._sent.values()
                    if s.worker and not s.future.done()} - self.placer.retiring
        if not busy:
            return
        silent = self.client.run_on_scheduler(silent_workers, workers=sorted(busy),
                                              frozen_s=self.FROZEN_S)
        for worker, seconds in sorted(silent.items()):
            self._retire(worker, seconds)

    def _retire(self, worker: str, silent_s: float) -> None:
        """Take ``worker`` out of placement, send its epochs again (or fail them past
        their retries), and restart it through its nanny in the background."""
        with self._lock:
            self.retired[worker] = time.time()
            self.placer.retire(worker)
            lost = [s for s in self._sent.values()
                    if s.worker == worker and not s.future.done()]
            for sent in lost:
                del self._sent[sent.future.key]
                self.placer.unpin(worker, sent.task.cpus)
                ident = epoch_ident(sent.task)
                self._deaths[ident] += 1
                if self._deaths[ident] <= self.freeze_retries:
                    self._again(sent.task)
                else:
                    self._ready.append(EpochOutcome(sent.task, error=(
                        f"worker froze: the worker running this epoch sent no heartbeat "
                        f"for {silent_s:.0f} s, after {self._deaths[ident] - 1} other "
                        "worker(s) that ran it were lost")))
        logger.warning("worker %s sent no heartbeat for %.0f s while running %s: retiring "
                       "it and sending its epochs again", worker, silent_s,
                       ", ".join(s.task.name for s in lost) or "nothing")
        if lost:
            self.client.cancel([s.future for s in lost], force=True)
        threading.Thread(target=self._restart_frozen, args=(worker,), daemon=True,
                         name=f"pipetune-retire-{worker}").start()

    def _restart_frozen(self, worker: str) -> None:
        """Restart ``worker`` through its nanny (which kills a stopped process), or remove
        it from the cluster when it has none (woken, it finds itself unknown to the
        scheduler and closes); off the driver's loop (seconds)."""
        try:
            info = self.client.scheduler_info(n_workers=-1).get("workers", {})
            if (info.get(worker) or {}).get("nanny"):
                done = self.client.restart_workers([worker], timeout=60,
                                                   raise_for_error=False)
                fresh = done.get(worker) == "OK"
            else:
                if worker in info:
                    self.client.run_on_scheduler(remove_worker, address=worker)
                fresh = True
        except Exception as exc:  # noqa: BLE001 - the cluster closing meanwhile
            logger.warning("could not retire frozen worker %s: %s", worker, describe(exc))
            return
        if fresh:
            # Restarted, or gone: a worker at this address from now on is a new process
            # (a nanny restarts it on the same address when its port is fixed), and a
            # woken one that was removed closes itself.
            with self._lock:
                self.placer.back(worker)
