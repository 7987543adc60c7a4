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
import math
import threading
import time
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any

from distributed import as_completed, fire_and_forget, get_worker

from pipetune.backends._base import EpochBackend, EpochOutcome, describe
from pipetune.system.config import PROCESS_KNOBS, process_resource

if TYPE_CHECKING:
    from distributed import Client, Future

    from pipetune.runner import EpochResult, EpochTask


# -- what runs on the workers -----------------------------------------------------------

def remote_epoch(task: EpochTask) -> EpochResult:
    """Run ``task`` in this worker process, keeping the model for the trial's next epoch."""
    from pipetune.runner import LIVE_TRIALS, run_epoch

    return run_epoch(task, live=LIVE_TRIALS, address=get_worker().address)


def remote_refuse(message_field: str, message: str) -> None:
    """Run in place of an epoch no worker of the cluster can run as asked."""
    from pipetune.errors import SystemConfigError

    raise SystemConfigError(message_field, message)


def remote_evaluate(task: EpochTask, checkpoint: str) -> dict[str, float]:
    from pipetune.runner import evaluate_checkpoint

    return evaluate_checkpoint(task, checkpoint)


def remote_release(study_id: str, trial_id: int | None) -> int:
    """Drop live workloads; for a whole study also wait for its checkpoint writes."""
    from pipetune.checkpoints import flush_checkpoints
    from pipetune.runner import LIVE_TRIALS

    dropped = LIVE_TRIALS.drop(study_id, trial_id)
    if trial_id is None:
        flush_checkpoints()
    return dropped


# -- the driver side ---------------------------------------------------------------------

class DaskBackend(EpochBackend):
    """Submits epochs to ``client``'s cluster, each claiming ``resources={"cores": n}``.

    Use :meth:`submit` / :meth:`wait`, or call :meth:`run` from several threads (the
    Prefect flow does: one task run per epoch, each driving one Dask future).
    """

    WORKERS_TTL_S = 2.0

    def __init__(self, client: Client):
        self.client = client
        self._lock = threading.Lock()
        self._home: dict[tuple[str, int], str] = {}
        self._busy: Counter[str] = Counter()
        self._chosen: dict[str, str | None] = {}  # future key -> worker it was sent to
        self._running: dict[str, tuple[EpochTask, Future]] = {}
        self._completed = as_completed(loop=client.loop)
        self._workers_cache: dict[str, dict[str, float]] = {}
        self._cpus_in_use: dict[str, set[int]] = {}
        self._workers_at = -math.inf
        #: (trial, epoch) -> the worker it was sent to and why, for tests and reports.
        self.placements: dict[tuple[int, int], tuple[str | None, str]] = {}

    # -- placement -------------------------------------------------------------------
    def _workers(self) -> dict[str, dict[str, float]]:
        """The cluster's workers and the resources each advertises, asked of the
        scheduler at most every :attr:`WORKERS_TTL_S` (each ask is a round trip)."""
        now = time.monotonic()
        if now - self._workers_at > self.WORKERS_TTL_S:
            info = self.client.scheduler_info(n_workers=-1).get("workers", {})
            self._workers_cache = {addr: dict(w.get("resources") or {})
                                   for addr, w in sorted(info.items())}
            self._workers_at = now
        return self._workers_cache

    def _resources(self, task: EpochTask, workers: dict[str, dict[str, float]]) -> dict:
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

    def _choose(self, task: EpochTask, workers: dict[str, dict[str, float]],
                resources: dict[str, float]) -> tuple[str | None, str]:
        able = [w for w, res in workers.items()
                if all(res.get(k, 0) >= v for k, v in resources.items() if k != "cores")]
        home = self._home.get((task.study_id, task.trial_id))
        if home in able and self._busy[home] == 0:
            return home, "holds the model"
        free = [w for w in able if self._busy[w] == 0]
        if free:
            # Prefer a worker no live trial calls home, so models are not pushed out.
            homes = set(self._home.values())
            free.sort(key=lambda w: (w in homes, w))
            return free[0], "home busy" if home in able else "new trial"
        return None, "no free worker"

    def _pin(self, task: EpochTask, worker: str | None,
             workers: dict[str, dict[str, float]]) -> tuple[int, ...]:
        """Cores for a pinned epoch on ``worker``'s host, none of them used by another
        pinned epoch running there."""
        if not task.system.pin_cores or worker is None:
            return ()
        host = _host(worker)
        total = int(max((res.get("cores", 1) for w, res in workers.items()
                         if _host(w) == host), default=1))
        used = self._cpus_in_use.setdefault(host, set())
        chosen = tuple(c for c in range(total) if c not in used)[: task.system.cores]
        used.update(chosen)
        return chosen

    def start(self, task: EpochTask) -> Future:
        """Send ``task`` to the cluster now; return its Dask future."""
        with self._lock:
            workers = self._workers()
            resources = self._resources(task, workers)
            worker, why = self._choose(task, workers, resources)
            key = f"{task.name}-{task.phase.value}-{uuid.uuid4().hex[:8]}"
            needs = [k for k in resources if k != "cores"]
            if needs and not any(all(r.get(k, 0) for k in needs) for r in workers.values()):
                field = "system." + ",".join(sorted(k.split(":")[0] for k in needs))
                future = self.client.submit(
                    remote_refuse, field, f"no worker of the cluster advertises "
                    f"{', '.join(needs)}: start one with that environment", key=key, pure=False)
            else:
                cpus = self._pin(task, worker, workers)
                if cpus:
                    task = dataclasses.replace(task, cpus=cpus)
                future = self.client.submit(
                    remote_epoch, task, key=key, pure=False, resources=resources,
                    **_placed_on(worker),
                )
            if worker:
                self._busy[worker] += 1
            self._chosen[key] = worker
            self._running[key] = (task, future)
            self.placements[(task.trial_id, task.epoch)] = (worker, why)
        return future

    def settle(self, task: EpochTask, future: Future) -> EpochOutcome:
        """Block until ``future`` is done; return its outcome and update placement."""
        try:
            result = future.result()
            outcome = EpochOutcome(task, result=result)
        except BaseException as exc:  # noqa: BLE001 - KilledWorker, CancelledError, ...
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            outcome = EpochOutcome(task, error=self._why(exc))
        with self._lock:
            worker = self._chosen.pop(future.key, None)
            self._running.pop(future.key, None)
            if worker:
                self._busy[worker] -= 1
                self._cpus_in_use.get(_host(worker), set()).difference_update(task.cpus)
            if outcome.result is not None and outcome.result.address:
                self._home[(task.study_id, task.trial_id)] = outcome.result.address
        return outcome

    def _why(self, exc: BaseException) -> str:
        """The reason a failed epoch gives its trial: a worker that died (killed, or
        restarted by its nanny over its memory limit) is named as such."""
        from distributed.scheduler import KilledWorker

        if not isinstance(exc, KilledWorker):
            return describe(exc)
        limits = {w.get("memory_limit") for w in
                  self.client.scheduler_info(n_workers=-1).get("workers", {}).values()}
        limit = (f"; each worker's memory limit is {max(limits) / 2**30:.1f} GiB, a worker "
                 "past 95% of it is restarted" if limits and all(limits) else "")
        return f"worker died: every worker that ran this epoch died while running it{limit} " \
               f"({describe(exc)})"

    def run(self, task: EpochTask) -> EpochResult:
        """Run one epoch and wait for it; raise :class:`EpochFailed` if it failed."""
        outcome = self.settle(task, self.start(task))
        if outcome.error is not None:
            raise EpochFailed(outcome.error)
        assert outcome.result is not None
        return outcome.result

    # -- the EpochBackend interface ------------------------------------------------------
    def submit(self, task: EpochTask) -> Future:
        """Send ``task`` now; :meth:`wait` returns it when done. Returns its future."""
        future = self.start(task)
        self._completed.add(future)
        return future

    def wait(self) -> EpochOutcome:
        future = next(self._completed)
        with self._lock:
            task, _ = self._running[future.key]
        return self.settle(task, future)

    def release(self, study_id: str, trial_id: int | None = None) -> None:
        with self._lock:
            if trial_id is not None:
                home = self._home.pop((study_id, trial_id), None)
            else:
                home = None
                for key in [k for k in self._home if k[0] == study_id]:
                    del self._home[key]
        if trial_id is not None:
            if home:
                fire_and_forget(self.client.submit(
                    remote_release, study_id, trial_id, workers=[home],
                    allow_other_workers=False, pure=False, key=f"release-{uuid.uuid4().hex}"))
        else:
            self.client.run(remote_release, study_id, None)

    def cancel(self) -> None:
        with self._lock:
            futures = [f for _, f in self._running.values()]
        if futures:
            self.client.cancel(futures, force=True)

    def evaluate(self, task: EpochTask, checkpoint: str) -> dict[str, float]:
        home = self._home.get((task.study_id, task.trial_id))
        return self.client.submit(
            remote_evaluate, task, checkpoint, pure=False,
            resources={"cores": task.system.cores}, **_placed_on(home),
        ).result()


def _host(address: str) -> str:
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


def _placed_on(worker: str | None) -> dict[str, Any]:
    """Submit options that prefer ``worker`` but let Dask move the task if it is lost."""
    return {"workers": [worker], "allow_other_workers": True} if worker else {}


class EpochFailed(RuntimeError):
    """An epoch task failed on the cluster; the message says how."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args)
