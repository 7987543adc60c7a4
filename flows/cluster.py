"""The Dask task runner a study flow runs on."""

from __future__ import annotations

import os

import dask
from prefect_dask import DaskTaskRunner

from pipetune.system.config import MachineInfo


def embedded_cluster_kwargs(workers: int | None = None) -> dict:
    """A LocalCluster sized to this machine: process workers, one thread each.

    Every worker advertises the machine's cores as its ``cores`` resource, so any
    epoch fits any worker; the study loop admits epochs only while the cores their
    configs reserve fit in the machine (Dask resources are per worker, so it cannot
    hold a machine-wide budget across several workers by itself).
    """
    cores = MachineInfo.detect().cores
    env = {
        k: os.environ[k]
        for k in ("PREFECT_API_URL", "PREFECT_HOME", "PIPETUNE_HOME", "MLFLOW_DISABLE_TELEMETRY",
                  "PREFECT_SERVER_ANALYTICS_ENABLED", "DASK_LOGGING__DISTRIBUTED",
                  "PREFECT_LOGGING_LEVEL")
        if k in os.environ
    }
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


def task_runner(dask_address: str | None = None, workers: int | None = None) -> DaskTaskRunner:
    """Connect to ``dask_address`` if given, else start an embedded LocalCluster.

    Embedded workers are not daemonic, so an epoch may start DataLoader worker
    processes (the ``dataloader_workers`` knob). On an existing cluster, start the
    workers with ``DASK_DISTRIBUTED__WORKER__DAEMON=False`` for the same reason.
    """
    if dask_address:
        return DaskTaskRunner(address=dask_address)
    return DaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs=embedded_cluster_kwargs(workers),
    )


def cluster_core_budget(dask_address: str) -> int:
    """Sum of the ``cores`` resources the workers of an existing cluster advertise
    (a worker advertising none counts its threads)."""
    from distributed import Client

    with Client(dask_address, timeout=30) as client:
        info = client.scheduler_info()
    total = 0
    for worker in info.get("workers", {}).values():
        total += int(worker.get("resources", {}).get("cores", worker.get("nthreads", 1)))
    return max(total, 1)
