"""Epochs as plain functions on a Dask cluster, models kept on their workers.

No Prefect runs on the workers: a task submitted here is a bare Dask future (1-2 ms
of overhead, against 0.24-0.31 s for a Prefect task run executed on a worker). Each
worker process keeps the workloads of the trials it ran last (:data:`LIVE_TRIALS`),
and a trial's next epoch is sent to the worker that holds its model whenever that
worker is free; otherwise to a free worker, which rebuilds it from the checkpoint.
``allow_other_workers`` lets Dask move it if the chosen worker is lost.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
import uuid
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from pipetune.backends.base import EpochBackend, EpochOutcome, describe
from pipetune.checkpoints import attempt_ref
from pipetune.dask.frozen import FrozenWorkers, epoch_ident
from pipetune.dask.on_scheduler import allowed_failures, task_states
from pipetune.dask.placement import Placement, placed_on
from pipetune.dask.worker_side import (
    remote_epoch,
    remote_evaluate,
    remote_refuse,
    remote_release,
)

logger = logging.getLogger(__name__)

#: How many times the driver sends an epoch again after its worker died, counting any
#: retries the scheduler makes itself (``distributed.scheduler.allowed-failures``).
EPOCH_RETRIES = 1

if TYPE_CHECKING:
    from distributed import Client, Future

    from pipetune.runner import EpochResult, EpochTask


# -- the driver side ---------------------------------------------------------------------

@dataclasses.dataclass
class _Sent:
    """An epoch on the cluster: its future, the worker chosen, when it was sent."""

    task: EpochTask
    future: Future
    worker: str | None
    sent: float


class DaskBackend(FrozenWorkers, EpochBackend):
    """Submits epochs to ``client``'s cluster, each claiming ``resources={"cores": n}``.

    The driver places every epoch itself, and sends it only to a worker with a free
    thread and the cores it asks for (an epoch queued inside a worker behind another
    would share that worker's fate: Dask counts a death against every task assigned
    to the dying worker). Until then it waits here. Hence:

    * **worker loss**: an epoch whose worker died is sent once more (``retries``;
      none if the scheduler retries itself) from the trial's last checkpoint; dying
      again fails its trial as ``worker died: ...``.
    * **a frozen worker** (stopped, swapping, stuck in a call that holds the GIL: its
      heartbeats stop while its connection stays open): a worker running an epoch
      whose last heartbeat the scheduler saw more than :attr:`FROZEN_S` ago (20 s;
      on a cluster of over 200 workers, where Dask spaces heartbeats out, 10 of its
      heartbeat intervals) is retired: its epochs are sent again from their trials'
      last checkpoints (the freeze counts as a death: an epoch that freezes every
      worker it runs on fails its trial as ``worker froze: ...``), it is restarted
      through its nanny (the embedded cluster keeps its worker count) or, without
      one, removed from the cluster. The driver looks every :attr:`FROZEN_CHECK_S`,
      so a freeze is acted on within about 22 s of the worker's last heartbeat on the
      embedded cluster (heartbeats every 0.5 s up to 10 workers). A worker that wakes
      up afterwards changes nothing: its future was cancelled and its result is not
      read, and every resent epoch writes its checkpoint to a reference of its own
      (:func:`pipetune.checkpoints.attempt_ref`), so the late write of the first
      attempt lands beside the checkpoint the trial goes on from, not over it.
    * **timeouts**: past its ``timeout_s`` (from when it was sent) an epoch fails its
      trial and its worker is restarted; an epoch no worker can run fails at once.
    """

    #: How often the driver looks again when an epoch waits for a free worker.
    POLL_S = 0.1
    #: How long the driver waits for a cluster with no worker at all.
    NO_WORKER_S = 120.0

    def __init__(self, client: Client, retries: int | None = None):
        self.client = client
        #: Resends of an epoch whose worker froze: Dask never retries those (the
        #: driver cancels them), so its ``allowed-failures`` does not count here.
        self.freeze_retries = EPOCH_RETRIES if retries is None else retries
        if retries is None:
            dask_retries = client.run_on_scheduler(allowed_failures)
            retries = max(0, EPOCH_RETRIES - dask_retries)
        self.retries = retries
        self._lock = threading.RLock()
        #: Where each epoch goes: the workers, each trial's home, pinned CPUs.
        self.placer = Placement(client)
        self._queue: deque[EpochTask] = deque()
        self._sent: dict[str, _Sent] = {}
        self._done: queue.SimpleQueue[Future] = queue.SimpleQueue()
        self._ready: deque[EpochOutcome] = deque()
        self._deaths: Counter[tuple[str, int, int]] = Counter()
        self._no_worker_since: float | None = None
        #: (trial, epoch) -> the worker it was sent to and why, for tests and reports.
        self.placements: dict[tuple[int, int], tuple[str | None, str]] = {}
        #: (trial, epoch) of every epoch sent again after its worker died or froze.
        self.resent: list[tuple[int, int]] = []
        #: Workers retired as frozen -> the wall-clock time (``time.time()``) it was done.
        self.retired: dict[str, float] = {}
        self._frozen_checked = -math.inf
        #: (worker, study) -> trials ended whose models that worker may drop (release).
        self._unreleased: dict[tuple[str, str], list[int]] = {}

    # -- placement -------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Send every queued epoch that has a free worker now; refuse the impossible.

        The worker list is the one asked of the scheduler up to :attr:`Placement.
        WORKERS_TTL_S` ago, asked again (at most every :attr:`POLL_S`) only when an
        epoch finds no worker in it: with 32 workers, asking at every dispatch cost the
        scheduler and the driver a listing of every worker ten times a second."""
        with self._lock:
            if not self._queue:
                return
            workers = self.placer.workers()
            fresh = not self.placer.older_than(self.POLL_S)
            if self._place(workers, final=fresh) and not fresh:
                self._place(self.placer.workers(fresh=True), final=True)

    def _place(self, workers: dict[str, dict[str, float]], *, final: bool) -> bool:
        """Send what ``workers`` can run now; whether an epoch found none. Refused (no
        worker could ever run it) only on a ``final`` list, one just asked for."""
        if not workers:
            if not final:
                return True
            self._no_worker_since = self._no_worker_since or time.monotonic()
            if time.monotonic() - self._no_worker_since > self.NO_WORKER_S:
                while self._queue:
                    self._ready.append(EpochOutcome(self._queue.popleft(), error=(
                        f"no worker: the cluster has had no worker for "
                        f"{self.NO_WORKER_S:.0f} s")))
            return True
        self._no_worker_since = None
        unplaced = False
        for task in list(self._queue):
            resources = self.placer.resources(task, workers)
            never = self.placer.never(task, workers, resources)
            if never is not None and not final:
                unplaced = True
                continue
            if never is not None:
                self._queue.remove(task)
                self._send(task, None, "refused", remote_refuse, *never)
                continue
            worker, why = self.placer.choose(
                task, workers, resources, ((s.worker, s.task) for s in self._sent.values()))
            if worker is None:
                unplaced = True
                continue
            self._queue.remove(task)
            cpus = self.placer.pin(task, worker, workers)
            release = tuple(self._unreleased.pop((worker, task.study_id), ()))
            if cpus or release:
                task = dataclasses.replace(task, cpus=cpus or task.cpus, release=release)
            self._send(task, worker, why, remote_epoch, task, resources=resources,
                       **placed_on(worker))
        return unplaced

    def _send(self, task: EpochTask, worker: str | None, why: str, fn: Any, *args: Any,
              **options: Any) -> None:
        key = f"{task.name}-{task.phase.value}-{uuid.uuid4().hex[:8]}"
        future = self.client.submit(fn, *args, key=key, pure=False, **options)
        self._sent[key] = _Sent(task, future, worker, time.monotonic())
        self.placements[(task.trial_id, task.epoch)] = (worker, why)
        future.add_done_callback(self._done.put)

    # -- outcomes --------------------------------------------------------------------
    def _fetch(self, futures: list[Future]) -> dict[str, Any]:
        """The results of those of ``futures`` that finished, fetched together (Dask
        gathers them in one request a worker) when there are several: 16-32 epochs
        ending at once were fetched one round trip after another, each next epoch sent
        only after its own. Empty when there is one, or when a fetch failed: each
        future is then settled on its own, its error with it."""
        with self._lock:  # not one already settled (a future can be queued twice)
            finished = list({f.key: f for f in futures
                             if f.status == "finished" and f.key in self._sent}.values())
        if len(finished) < 2:
            return {}
        try:
            return dict(zip((f.key for f in finished), self.client.gather(finished),
                            strict=True))
        except Exception:  # noqa: BLE001 - a worker lost meanwhile: settled one by one
            return {}

    def _settle(self, future: Future, fetched: dict[str, Any]) -> EpochOutcome | None:
        """The outcome of a finished future (its result from ``fetched`` when there),
        or None when it is not one (any more) or its epoch was sent again after its
        worker died."""
        from distributed.scheduler import KilledWorker

        with self._lock:
            sent = self._sent.pop(future.key, None)
            if sent is None:  # timed out, or cancelled: already answered
                return None
            task = sent.task
            self.placer.unpin(sent.worker, task.cpus)
        try:
            result = fetched[future.key] if future.key in fetched else future.result()
        except BaseException as exc:  # noqa: BLE001 - KilledWorker, CancelledError, ...
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            with self._lock:
                if isinstance(exc, KilledWorker):
                    self.placer.stale()  # the dead worker must not be chosen
                    ident = epoch_ident(task)
                    self._deaths[ident] += 1
                    self.placer.home.pop((task.study_id, task.trial_id), None)
                    if self._deaths[ident] <= self.retries:
                        self._again(task)
                        return None
            return EpochOutcome(task, error=self._why(exc, self._deaths[epoch_ident(task)]))
        finally:
            # Let go of the result on the cluster at once: a future still held when its
            # worker dies would have Dask run the finished epoch again elsewhere.
            future.release()
        from pipetune.runner import EpochFailure

        if isinstance(result, EpochFailure):  # the workload raised; its worker is fine
            with self._lock:
                self.placer.home.pop((task.study_id, task.trial_id), None)
            return EpochOutcome.failed(task, result)
        with self._lock:
            if result.address:
                self.placer.home[(task.study_id, task.trial_id)] = result.address
        return EpochOutcome(task, result=result)

    def _again(self, task: EpochTask) -> None:
        """Queue ``task`` first, to be sent again after its worker died or froze, with a
        checkpoint reference of its own (the lost worker may still write the first)."""
        deaths = self._deaths[epoch_ident(task)]
        self.resent.append((task.trial_id, task.epoch))
        self._queue.appendleft(dataclasses.replace(
            task, cpus=(), checkpoint_out=attempt_ref(task.checkpoint_out, deaths + 1)))

    def _reroute(self) -> None:
        """Queue again every epoch the scheduler cannot place (``no-worker``: sent to a
        worker that has gone since, from a stale worker list, or asking for what no
        live worker has): Dask would hold it for ever."""
        with self._lock:
            waiting = {k: s for k, s in self._sent.items()
                       if s.future.status == "pending"
                       and time.monotonic() - s.sent > self.POLL_S * 10}
        if not waiting:
            return
        states = self.client.run_on_scheduler(task_states, keys=list(waiting))
        with self._lock:
            lost = [s for k, s in waiting.items()
                    if states.get(k) == "no-worker" and k in self._sent]
            for sent in lost:
                del self._sent[sent.future.key]
                self.placer.unpin(sent.worker, sent.task.cpus)
                self._queue.appendleft(dataclasses.replace(sent.task, cpus=()))
            if lost:
                self.placer.stale()
        for sent in lost:
            logger.warning("%s could not be placed on %s (gone?); sending it again",
                           sent.task.name, sent.worker)
        if lost:
            self.client.cancel([s.future for s in lost], force=True)

    def _why(self, exc: BaseException, deaths: int) -> str:
        """The reason a failed epoch gives its trial: a worker that died (killed, or
        restarted by its nanny over its memory limit) is named as such."""
        from distributed.scheduler import KilledWorker

        if not isinstance(exc, KilledWorker):
            return describe(exc)
        self.placer.workers(fresh=True)
        memory = self.placer.memory_limit
        limit = (f"; each worker's memory limit is {memory / 2**30:.1f} GiB, a worker past "
                 "95% of it is restarted" if memory else "")
        runs = f"all {deaths} workers that ran this epoch" if deaths > 1 else "its worker"
        return f"worker died: {runs} died while running it{limit}"

    def _time_out(self) -> None:
        """Fail every epoch past its timeout, and restart the worker it hangs on."""
        now = time.monotonic()
        with self._lock:
            late = [s for s in self._sent.values()
                    if s.task.timeout_s is not None and now - s.sent > s.task.timeout_s]
            for sent in late:
                del self._sent[sent.future.key]
                self.placer.unpin(sent.worker, sent.task.cpus)
                self.placer.home.pop((sent.task.study_id, sent.task.trial_id), None)
                self._ready.append(EpochOutcome(sent.task, error=(
                    f"timeout: the epoch ran longer than its {sent.task.timeout_s:g} s "
                    "(workload.epoch_timeout_s); its worker was restarted to free its cores")))
        for sent in late:
            self.client.cancel([sent.future], force=True)
            if sent.worker:
                try:
                    self.client.restart_workers([sent.worker], raise_for_error=False)
                except Exception as exc:  # noqa: BLE001 - a worker without a nanny
                    logger.warning("could not restart worker %s after a timeout: %s",
                                   sent.worker, describe(exc))

    def _next(self, want: EpochTask | None = None) -> EpochOutcome:
        """The next finished epoch (with ``want``: that one's, keeping others for later)."""
        while True:
            with self._lock:
                for outcome in list(self._ready):
                    if want is None or epoch_ident(outcome.task) == epoch_ident(want):
                        self._ready.remove(outcome)
                        return outcome
            self._dispatch()
            try:
                future = self._done.get(timeout=self.POLL_S if self._queue else 1.0)
            except queue.Empty:
                # Dask runs every done-callback of the process on one thread: one that
                # blocks elsewhere would hold ours back, so look at the futures too.
                with self._lock:
                    done = [s.future for s in self._sent.values() if s.future.done()]
                for each in done:
                    self._done.put(each)
                self._time_out()
                self._find_frozen()
                self._reroute()
                continue
            batch = [future]
            while True:  # every other epoch that ended meanwhile, settled with it
                try:
                    batch.append(self._done.get_nowait())
                except queue.Empty:
                    break
            fetched = self._fetch(batch)
            for each in batch:
                outcome = self._settle(each, fetched)
                if outcome is not None:
                    with self._lock:
                        self._ready.append(outcome)
            self._time_out()
            self._find_frozen()

    # -- the EpochBackend interface ------------------------------------------------------
    def submit(self, task: EpochTask) -> None:
        """Queue ``task``; it is sent as soon as a worker is free for it."""
        with self._lock:
            self._queue.append(task)
        self._dispatch()

    def wait(self) -> EpochOutcome:
        return self._next()

    def run(self, task: EpochTask) -> EpochResult:
        """Run one epoch and wait for it (others finishing meanwhile are kept for
        :meth:`wait`); raise :class:`EpochFailed` if it failed."""
        self.submit(task)
        outcome = self._next(task)
        if outcome.error is not None:
            raise EpochFailed(outcome.error)
        assert outcome.result is not None
        return outcome.result

    def release(self, study_id: str, trial_id: int | None = None) -> None:
        with self._lock:
            if trial_id is not None:  # its model goes with the next epoch sent there
                home = self.placer.home.pop((study_id, trial_id), None)
                if home:
                    self._unreleased.setdefault((home, study_id), []).append(trial_id)
                return
            for key in [k for k in self.placer.home if k[0] == study_id]:
                del self.placer.home[key]
            self._unreleased = {k: v for k, v in self._unreleased.items() if k[1] != study_id}
        # Not on a retired worker (a frozen one never answers), nor failing on a
        # worker that leaves meanwhile: its models and pending writes go with it.
        # A worker that froze while idle (never retired: only busy workers are
        # watched) would never answer: the broadcast is given FROZEN_S, then left.
        live = list(self.placer.workers(fresh=True))
        if live:
            asked = threading.Thread(
                target=self.client.run, args=(remote_release, study_id, None),
                kwargs={"workers": live, "on_error": "return"}, daemon=True,
                name="pipetune-release")
            asked.start()
            asked.join(self.FROZEN_S)
            if asked.is_alive():
                logger.warning("releasing study %s: a worker did not answer within "
                               "%.0f s (frozen?); its models go when it does",
                               study_id, self.FROZEN_S)

    def cancel(self) -> None:
        with self._lock:
            self._queue.clear()
            futures = [s.future for s in self._sent.values()]
            self._sent.clear()
        if futures:
            self.client.cancel(futures, force=True)

    def evaluate(self, task: EpochTask, checkpoint: str) -> dict[str, float]:
        home = self.placer.home.get((task.study_id, task.trial_id))
        if home not in self.placer.workers(fresh=True):
            home = None  # a task held for a gone worker would wait for ever
        return self.client.submit(
            remote_evaluate, task, checkpoint, pure=False,
            resources={"cores": task.system.cores}, **placed_on(home),
        ).result()


class EpochFailed(RuntimeError):
    """An epoch task failed on the cluster; the message says how."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args)
