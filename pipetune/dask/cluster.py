"""The Dask cluster a study runs its epochs on, started once per process.

A study never waits for a cluster inside its clock: ``pipetune tune`` starts the
embedded cluster while the Prefect server comes up, and every study of one process
(``bench``, ``stream``, ``serve``) reuses it. For many ``pipetune tune`` runs, keep
one cluster running and pass ``--dask-address`` (see the README).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from typing import Any

from pipetune.dask.cores import worker_cores
from pipetune.dask.size import embedded_size
from pipetune.errors import PipetuneError
from pipetune.system.config import MachineInfo, process_resource

_lock = threading.Lock()
_cluster = None
_clients: dict[str, object] = {}
#: The warm service's scheduler (pipetune.service), standing in for this process's own
#: embedded cluster: its workers are this machine's, sized and set up as those would be.
_warm_address: str | None = None


def use_warm_cluster(address: str | None) -> None:
    """Let :func:`client_for` reach the warm service's cluster at ``address`` instead of
    starting an embedded one (None: back to the embedded cluster)."""
    global _warm_address
    _warm_address = address


def warm_cluster_address() -> str | None:
    return _warm_address

#: Environment the embedded workers inherit from the driver, when set.
WORKER_ENV = ("PREFECT_API_URL", "PREFECT_HOME", "PIPETUNE_HOME", "MLFLOW_DISABLE_TELEMETRY",
              "PREFECT_SERVER_ANALYTICS_ENABLED", "DASK_LOGGING__DISTRIBUTED",
              "PREFECT_LOGGING_LEVEL", "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "PYTHONPATH")


def embedded_cluster_kwargs(workers: int | None = None) -> dict:
    """A LocalCluster sized to this machine, or as the user sized it
    (:func:`size_embedded_cluster`): process workers, one thread (one slot) each.

    Unsized, every worker advertises the machine's cores as its ``cores`` resource, so
    any epoch fits any worker; the study engine admits epochs only while the cores their
    configs reserve fit in the machine (Dask resources are per worker, so it cannot
    hold a machine-wide budget across several workers by itself). Sized, each worker
    advertises ``--cores-per-worker``, the engine's budget is every worker's, and the
    system space is judged by one worker's cores. Workers are not daemonic, so an epoch
    may start DataLoader worker processes.
    """
    import dask

    machine_cores = MachineInfo.detect().cores
    size = embedded_size()
    sized_workers, cores = size.resolve(machine_cores)
    if workers is None:
        workers = sized_workers
    elif not size.sized:
        workers = min(workers, machine_cores)
    env = {k: os.environ[k] for k in WORKER_ENV if k in os.environ}
    dask.config.set({
        "distributed.worker.daemon": False,
        # Dask's nanny sets MALLOC_TRIM_THRESHOLD_=65536 in its workers, so glibc hands
        # freed memory back to the OS at every turn and torch re-faults it: a LeNet-5
        # epoch took 1.2 s with it and 0.6 s without (benchmarks/RESULTS.md).
        "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
        # The driver sends an epoch whose worker died once more itself
        # (pipetune.backends.DaskBackend): Dask's own retry would also count a death
        # against every epoch merely queued on the dying worker.
        "distributed.scheduler.allowed-failures": 0,
        **QUIET_CLUSTER,
    })
    env["DASK_DISTRIBUTED__WORKER__DAEMON"] = "False"
    policy = os.environ.get("OMP_WAIT_POLICY", WORKER_PROCESS_ENV["OMP_WAIT_POLICY"]).lower()
    return {
        "n_workers": max(1, workers),
        "threads_per_worker": 1,
        "processes": True,
        "resources": {"cores": cores, process_resource("omp_wait_policy", policy): 1},
        "host": "127.0.0.1",
        "dashboard_address": "127.0.0.1:0",
        # Each worker's share of the machine's memory: past 95% its nanny restarts it,
        # and the epoch it ran counts as a worker death (retried once, then failed).
        "memory_limit": "auto",
        "env": env,
        "preload": ["pipetune.dask.worker_setup"],
    }


#: What Dask keeps that a long study does not need. Its developers' logs are 1,000
#: entries long, one per connection: each batched stream's recent messages, the
#: transition log, each event topic. A message that sent a task holds the task's
#: arguments, so the scheduler kept the last 1,000 epochs sent to each worker (16,000
#: on 16 workers), and the client the last 1,000 it sent. Over a 2,000-trial study on
#: 16 slots that was most of the driver's growth. Set for the cluster and for every
#: client this process opens.
LOW_LEVEL_LOGS = {"distributed.admin.low-level-log-length": 16}

#: What an embedded cluster does not do on its own clock. Dask's statistical profiler
#: samples every worker's stack every 10 ms (a thread taking the GIL beside the epoch),
#: the event loops tick every 20 ms, the nannies read memory every 100 ms: measured
#: here, an idle warm service (pipetune.service) used 15% of a core with them.
QUIET_CLUSTER = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "500ms",
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.worker.memory.monitor-interval": "500ms",
    **LOW_LEVEL_LOGS,
}


def quiet_env() -> dict[str, str]:
    """:data:`QUIET_CLUSTER` as the environment of a ``dask`` command (the team stack's
    scheduler and workers). Measured on ``pipetune stack up --workers 16``: their 32
    worker and nanny processes used 288 CPU-s over a 1,000-trial study of sleeping
    epochs, with Dask's profiler sampling each every 10 ms."""
    return {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): str(value)
            for key, value in QUIET_CLUSTER.items()}


#: Imported once in the fork server the embedded workers are forked from, so each worker
#: starts with torch, its optimiser stack (torch._dynamo: 1.5 s at the first optimiser
#: step otherwise) and the epoch code loaded instead of importing them itself.
FORKSERVER_PRELOAD = ["distributed", "torch", "torch._dynamo", "pipetune.dask.backend",
                      "pipetune.runner", "pipetune.profiler", "pipetune.workloads"]


def _use_forkserver() -> None:
    """Start embedded workers by forking a server that has torch imported (about 1.5 s
    of CPU saved per worker on this machine). OpenMP reads its settings when torch
    loads, so the fork server gets the worker environment's OpenMP settings first."""
    import dask
    from distributed.utils import get_mp_context

    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    for key, value in WORKER_PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    ctx = get_mp_context()  # lets Dask set its own preload list once, then ours wins
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)


def launch_forkserver() -> None:
    """Start the embedded workers' fork server now, importing torch and the epoch code
    (:data:`FORKSERVER_PRELOAD`), and return at once: ``pipetune tune`` calls it first
    thing, so the imports run beside its own start-up instead of after it (measured: the
    cluster ready 2.7 s after the process started, against 4.5 s when the fork server
    started with the cluster). The cluster started later forks its workers from it."""
    import multiprocessing
    from multiprocessing import forkserver

    for key, value in WORKER_PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    forkserver.ensure_running()


def stop_forkserver() -> None:
    """Stop this process's fork server now, if one runs (the embedded cluster closed):
    killed, not asked, since it holds nothing to write. Asked (its pipe closed), it
    unloads torch as it exits, a second after the command, holding the command's output
    open that long (measured: whoever reads ``pipetune tune``'s output waited 1.0 s
    past its last line for it)."""
    import signal
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    lock = getattr(server, "_lock", None)
    if server is None or lock is None or not hasattr(server, "_stop_unlocked"):
        return
    with lock:
        pid = getattr(server, "_forkserver_pid", None)
        if pid is None:
            return
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            server._stop_unlocked()


#: Set in the embedded workers' process environment before torch loads. Passive OpenMP
#: waiting: an idle OpenMP thread sleeps instead of spinning on a core another trial
#: needs (measured here under load: one cores=2 epoch took 11.7 s spinning, 0.92 s
#: passive; benchmarks/RESULTS.md).
WORKER_PROCESS_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def shared_cluster(workers: int | None = None):
    """This process's embedded LocalCluster, started (workers warm) on first call."""
    global _cluster
    with _lock:
        if _cluster is None or _cluster.status.name in ("closed", "closing", "failed"):
            from distributed import LocalCluster

            _use_forkserver()
            kwargs = embedded_cluster_kwargs(workers)
            # More workers than cores (a sized cluster): the first epochs go out on the
            # first cores' workers; the rest start beside them and take epochs as they
            # come (measured: 16 workers ready 0.7 s after 2 on this machine).
            wanted = kwargs["n_workers"]
            first = min(wanted, max(1, MachineInfo.detect().cores))
            for attempt in range(1, CLUSTER_START_ATTEMPTS + 1):
                cluster = None
                try:
                    cluster = LocalCluster(**{**kwargs, "n_workers": first})
                    client = _client_for(cluster.scheduler_address)
                    client.wait_for_workers(first, timeout=120)
                    if wanted > first:
                        cluster.scale(wanted)
                    break
                except Exception as e:  # noqa: BLE001 - a worker died while starting, ...
                    _close_quietly(cluster)
                    if attempt == CLUSTER_START_ATTEMPTS:
                        raise ClusterStartError(
                            f"the embedded Dask cluster did not start ({attempt} attempts; "
                            f"last: {type(e).__name__}: {e}); pass --dask-address to use "
                            "a cluster of your own") from None
            _cluster = cluster
            atexit.register(close_shared_cluster)
        return _cluster


#: Tries to start the embedded cluster (a worker dying while it starts fails the start).
CLUSTER_START_ATTEMPTS = 2


class ClusterStartError(PipetuneError):
    """The embedded Dask cluster could not be started."""


def _close_quietly(cluster: Any) -> None:
    if cluster is None:
        return
    client = _clients.pop(cluster.scheduler_address, None)
    with contextlib.suppress(Exception):
        if client is not None:
            client.close()
        cluster.close()


def process_knob_values(spec) -> set[str]:
    """The OpenMP wait policies a job's epochs may ask for (default, space, and
    ``system.omp_wait_policy`` hyperparameters), ``inherit`` left out."""
    values = {spec.system.default.omp_wait_policy, *spec.system.space.get("omp_wait_policy", [])}
    dist = spec.hyperparameters.get("system.omp_wait_policy")
    values.update(getattr(dist, "values", ()) or ())
    return {str(v) for v in values} - {"inherit"}


def ensure_worker_groups(policies: set[str]) -> None:
    """Give the embedded cluster workers started with each OpenMP wait policy asked
    for, as many as it has of its first group (each a fresh *spawned* process, so
    OpenMP reads the policy when torch loads; the fork server's workers inherit its)."""
    import copy

    import dask

    missing = missing_worker_groups(policies)
    if not missing:
        return
    if _warm_address is not None:
        raise PipetuneError(f"the warm service's workers have no OpenMP wait policy "
                            f"{', '.join(missing)}: run with PIPETUNE_KEEP_WARM_S=0")
    cluster = shared_cluster()
    client = client_for(None)
    per_group = embedded_cluster_kwargs()["n_workers"]
    base = cluster.new_spec
    total = len(cluster.worker_spec)
    try:
        for policy in missing:
            spec = copy.deepcopy(base)
            options = spec["options"]
            options["env"] = {**options.get("env", {}), "OMP_WAIT_POLICY": policy.upper()}
            options["resources"] = {
                k: v for k, v in options["resources"].items()
                if not k.startswith("omp_wait_policy:")
            } | {process_resource("omp_wait_policy", policy): 1}
            cluster.new_spec = spec
            total += per_group
            with dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}):
                cluster.scale(total)
                client.wait_for_workers(total, timeout=120)
    finally:
        cluster.new_spec = base


def missing_worker_groups(policies: set[str]) -> list[str]:
    """The OpenMP wait policies in ``policies`` no worker of the embedded (or warm)
    cluster was started with."""
    client = client_for(None)
    workers = client.scheduler_info(n_workers=-1)["workers"].values()
    present = {name.split(":", 1)[1] for w in workers for name in w.get("resources", {})
               if name.startswith("omp_wait_policy:")}
    return sorted(policies - present)


def close_warm_client() -> None:
    """At a study's end on the warm service's cluster: its workers note the code they
    hold (:mod:`pipetune.dask.fresh`), and this process lets go of the cluster."""
    from pipetune.dask.fresh import note_workers_code

    address = _warm_address
    if address is None:
        return
    with _lock:
        client = _clients.pop(address, None)
    if client is not None:
        note_workers_code(client)
        with contextlib.suppress(Exception):
            client.close()


def close_shared_cluster() -> None:
    global _cluster
    with _lock:
        cluster, _cluster = _cluster, None
        if cluster is None:
            return
        client = _clients.pop(cluster.scheduler_address, None)
        if client is not None:
            client.close()
        # Workers leaving a closing cluster may still hold a finished fire-and-forget
        # task (a trial's release); the scheduler warns that it "will be recomputed
        # elsewhere", which nothing will: not a warning for whoever ran the study.
        with _quiet("distributed.scheduler"):
            cluster.close()


@contextlib.contextmanager
def _quiet(logger_name: str):
    import logging

    log = logging.getLogger(logger_name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _client_for(address: str):
    from distributed import Client

    from pipetune.dask.address import client_security

    client = _clients.get(address)
    if client is None or client.status in ("closed", "closing"):
        import dask

        dask.config.set(LOW_LEVEL_LOGS)  # read by the client's stream when it opens
        client = Client(address, set_as_default=False, timeout=30, security=client_security())
        _clients[address] = client
    return client


def client_for(address: str | None = None):
    """A client on ``address``, or on the shared embedded cluster (started if needed);
    one client per address per process."""
    if address is None:
        address = _warm_address or shared_cluster().scheduler_address
    with _lock:
        return _client_for(address)


def cluster_core_budget(dask_address: str) -> int:
    """Sum of the ``cores`` resources the workers of an existing cluster advertise
    (a worker advertising none counts its threads)."""
    from distributed import Client

    from pipetune.dask.address import client_security

    with Client(dask_address, timeout=10, set_as_default=False,
                security=client_security()) as client:
        info = client.scheduler_info(n_workers=-1)
    total = 0
    for worker in info.get("workers", {}).values():
        total += int(worker_cores(worker))
    return max(total, 1)


def check_cluster_fits(client: Any, spec: Any, *, embedded: bool = False) -> tuple[Any, ...]:
    """The job as the cluster can run it: ``(machine, spec, drops)``.

    Space values needing more cores than the cluster's largest worker advertises (such
    an epoch could never start) are left out of ``spec`` and listed in ``drops``
    (:meth:`pipetune.spec.JobSpec.fit`); a default, or a knob none of whose values fits,
    is refused, naming the field, before the study records anything. ``machine`` is
    this machine as an epoch sees it (its cores: the largest worker's), or None when no
    worker is up yet (then nothing is dropped: the backend waits for a worker and
    refuses what cannot fit). ``embedded``: the workers are this machine's own."""
    import dataclasses

    workers = client.scheduler_info(n_workers=-1).get("workers", {})
    largest = max((int(worker_cores(w)) for w in workers.values()), default=0)
    if not largest:
        return None, spec, ()
    machine = dataclasses.replace(MachineInfo.detect(), cores=largest)
    cores = f"{largest} core" if largest == 1 else f"{largest} cores"
    note = (f"each embedded worker offers {cores} (--cores-per-worker)"
            if embedded and embedded_size().sized else f"this machine has {cores}" if embedded
            else f"the cluster's largest worker advertises {cores}")
    fitted, drops = spec.fit(machine, cores_note=note)
    return machine, fitted, drops


def prepare_workload(client: Any, spec: Any, dask_address: str | None) -> str:
    """Before a study's first epoch, make its workload's own module loadable on every
    worker (built-ins need nothing): the embedded cluster's workers get this process's
    folders on their path (a plugin, so workers that start later get them too); a
    cluster at ``dask_address`` is shipped the module. A worker that still cannot load
    it fails the study now, with what to install where (:mod:`pipetune.dask.ship`)."""
    from pipetune.dask.ship import prepare_workers

    return prepare_workers(client, spec.workload.name, ship=bool(dask_address),
                           where=dask_address or "the embedded cluster")
