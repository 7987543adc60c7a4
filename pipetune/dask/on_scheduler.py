"""What the driver runs *on the Dask scheduler* (``client.run_on_scheduler``): each
function takes the scheduler as ``dask_scheduler`` and answers from its state and its
clock."""

from __future__ import annotations

import time
from typing import Any


def task_states(dask_scheduler: Any, keys: list[str]) -> dict[str, str]:
    """The scheduler's state of each of ``keys`` still known (run on the scheduler)."""
    return {k: dask_scheduler.tasks[k].state for k in keys if k in dask_scheduler.tasks}


def silent_workers(dask_scheduler: Any, workers: list[str],
                    frozen_s: float) -> dict[str, float]:
    """Of ``workers``, those whose last heartbeat is older than ``frozen_s``, or than 10
    of the heartbeat intervals the scheduler gives its workers, whichever is longer;
    each with its seconds of silence (run on the scheduler, on its clock)."""
    from distributed.scheduler import heartbeat_interval

    now = time.time()
    bound = max(frozen_s, 10 * heartbeat_interval(len(dask_scheduler.workers)))
    out = {}
    for address in workers:
        ws = dask_scheduler.workers.get(address)
        if ws is not None and now - ws.last_seen > bound:
            out[address] = now - ws.last_seen
    return out


async def remove_worker(dask_scheduler: Any, address: str) -> None:
    """Drop ``address`` from the cluster (run on the scheduler); its tasks are lost."""
    await dask_scheduler.remove_worker(address=address, close=True,
                                       stimulus_id=f"pipetune-frozen-{time.time()}")


def allowed_failures(dask_scheduler: Any) -> int:
    """How many worker deaths the scheduler forgives a task (run on the scheduler)."""
    return int(dask_scheduler.allowed_failures)
