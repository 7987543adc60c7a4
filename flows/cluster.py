"""The Dask cluster a study runs its epochs on, started once per process.

A study never waits for a cluster inside its clock: ``pipetune tune`` starts the
embedded cluster while the Prefect server comes up, and every study of one process
(``bench``, ``stream``, ``serve``) reuses it. For many ``pipetune tune`` runs, keep
one cluster running and pass ``--dask-address`` (see the README).
"""

from __future__ import annotations

import atexit
import os
import threading

from pipetune.system.config import MachineInfo

_lock = threading.Lock()
_cluster = None
_clients: dict[str, object] = {}

#: Environment the embedded workers inherit from the driver, when set.
WORKER_ENV = ("PREFECT_API_URL", "PREFECT_HOME", "PIPETUNE_HOME", "MLFLOW_DISABLE_TELEMETRY",
              "PREFECT_SERVER_ANALYTICS_ENABLED", "DASK_LOGGING__DISTRIBUTED",
              "PREFECT_LOGGING_LEVEL", "PYTHONPATH")


def embedded_cluster_kwargs(workers: int | None = None) -> dict:
    """A LocalCluster sized to this machine: process workers, one thread each.

    Every worker advertises the machine's cores as its ``cores`` resource, so any
    epoch fits any worker; the study engine admits epochs only while the cores their
    configs reserve fit in the machine (Dask resources are per worker, so it cannot
    hold a machine-wide budget across several workers by itself). Workers are not
    daemonic, so an epoch may start DataLoader worker processes.
    """
    import dask

    cores = MachineInfo.detect().cores
    env = {k: os.environ[k] for k in WORKER_ENV if k in os.environ}
    dask.config.set({"distributed.worker.daemon": False})
    env["DASK_DISTRIBUTED__WORKER__DAEMON"] = "False"
    return {
        "n_workers": max(1, min(workers or cores, cores)),
        "threads_per_worker": 1,
        "processes": True,
        "resources": {"cores": cores},
        "host": "127.0.0.1",
        "dashboard_address": "127.0.0.1:0",
        "env": env,
        "preload": ["flows.worker_setup"],
    }


def shared_cluster(workers: int | None = None):
    """This process's embedded LocalCluster, started (workers warm) on first call."""
    global _cluster
    with _lock:
        if _cluster is None or _cluster.status.name in ("closed", "closing", "failed"):
            from distributed import LocalCluster

            kwargs = embedded_cluster_kwargs(workers)
            cluster = LocalCluster(**kwargs)
            client = _client_for(cluster.scheduler_address)
            client.wait_for_workers(kwargs["n_workers"], timeout=120)
            _cluster = cluster
            atexit.register(close_shared_cluster)
        return _cluster


def close_shared_cluster() -> None:
    global _cluster
    with _lock:
        cluster, _cluster = _cluster, None
        if cluster is None:
            return
        client = _clients.pop(cluster.scheduler_address, None)
        if client is not None:
            client.close()
        cluster.close()


def _client_for(address: str):
    from distributed import Client

    client = _clients.get(address)
    if client is None or client.status in ("closed", "closing"):
        client = Client(address, set_as_default=False, timeout=30)
        _clients[address] = client
    return client


def client_for(address: str | None = None):
    """A client on ``address``, or on the shared embedded cluster (started if needed);
    one client per address per process."""
    if address is None:
        address = shared_cluster().scheduler_address
    with _lock:
        return _client_for(address)


def cluster_core_budget(dask_address: str) -> int:
    """Sum of the ``cores`` resources the workers of an existing cluster advertise
    (a worker advertising none counts its threads)."""
    from distributed import Client

    with Client(dask_address, timeout=30, set_as_default=False) as client:
        info = client.scheduler_info(n_workers=-1)
    total = 0
    for worker in info.get("workers", {}).values():
        total += int(worker.get("resources", {}).get("cores", worker.get("nthreads", 1)))
    return max(total, 1)
