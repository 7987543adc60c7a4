"""``pipetune tune``'s start-up: what starts beside the first epoch (the job check,
the cluster, the Prefect server, the workers' freshness), and the marks the command
prints of where its start-up went (``start-up (s from process start): ...``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time

from pipetune.errors import PipetuneError


class Startup:
    """Wall-clock marks from the process's start, printed as where start-up went."""

    def __init__(self) -> None:
        self.t0 = COMMAND_STARTED or process_start_time()
        self.marks: dict[str, float] = {}

    def mark(self, name: str, at: float | None = None) -> None:
        self.marks[name] = (at if at is not None else time.time()) - self.t0

    def line(self) -> str:
        return "start-up (s from process start): " + ", ".join(
            f"{k} {v:.1f}" for k, v in sorted(self.marks.items(), key=lambda kv: kv[1]))


#: When the command started, where it is not this process (a warm service's driver
#: running it: :mod:`pipetune.cli.handover`); None: this process's start.
COMMAND_STARTED: float | None = None


def process_start_time() -> float:
    """When this process started, on the wall clock. On Linux to the clock tick (from
    ``/proc``: the start in ticks since boot against the uptime now); psutil's
    ``create_time`` counts from a boot time in whole seconds, up to 1 s off."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process().create_time()


_KEEP_WARM_HINT = "--keep-warm 0 starts them per command"


class BackgroundStartup:
    """What ``tune`` does before its study: the job's check and the embedded (or warm)
    cluster; and, on the way out, the cluster's close beside the server's stop."""

    def __init__(self, args: argparse.Namespace, marks: Startup, warm=None) -> None:
        self.args = args
        self.marks = marks
        self.warm = warm
        self.cluster_started = False
        self.closing: threading.Thread | None = None
        # the checked job, set by check_job
        self.spec = None
        self.tracking_uri: str | None = None
        self.core_budget = None

    def check_job(self) -> None:
        from pipetune.session import StudyOptions, check_study
        from pipetune.spec import JobSpec, load_spec
        from pipetune.tracking import default_tracking_uri

        args = self.args
        job = args.job if isinstance(args.job, JobSpec) else load_spec(args.job)
        spec = job.with_overrides(
            trials=args.trials, pipetune_enabled=False if args.no_pipetune else None
        )
        # Before anything starts (one line, exit 2): the study to resume must exist, the
        # ground truth read; the same checks open_study makes, from the same function.
        check_study(spec, StudyOptions(resume=args.resume))
        self.marks.mark("job checked")
        self.spec = spec
        self.tracking_uri = args.tracking_uri or default_tracking_uri()
        from pipetune.dask.size import embedded_size
        from pipetune.system.config import MachineInfo

        self.core_budget = embedded_size().core_budget(MachineInfo.detect().cores)
        if args.dask_address:
            from pipetune.dask.cluster import cluster_core_budget

            try:
                self.core_budget = cluster_core_budget(args.dask_address)
            except OSError as exc:
                raise PipetuneError(
                    f"--dask-address: cannot reach {args.dask_address}: {exc}") from exc

    def start_cluster(self) -> None:
        if self.args.dask_address:
            return
        if self.warm is not None and self._use_warm_cluster():
            return
        from pipetune.dask.cluster import shared_cluster

        self.cluster_started = True
        shared_cluster()
        self.marks.mark("cluster ready")

    def _use_warm_cluster(self) -> bool:
        """The warm service's workers, fresh for this job; False (the embedded cluster
        instead) for a job asking for an OpenMP wait policy they were not started with."""
        from pipetune.dask.cluster import client_for, process_knob_values, use_warm_cluster
        from pipetune.dask.fresh import freshen_workers

        record = self.warm.wait_cluster()
        if process_knob_values(self.spec) - {str(record.get("omp_wait_policy", "")).lower()}:
            from pipetune.dask.cluster import launch_forkserver

            launch_forkserver()
            return False
        use_warm_cluster(record["dask_address"])
        restarted = freshen_workers(client_for(None), _job_folders(self.spec))
        self.marks.mark("cluster ready")
        if restarted:
            self.marks.mark("workers restarted")
        self.warm_used = True
        return True

    warm_used = False

    def close_cluster(self) -> None:  # beside the server's stop, not after it
        if "flows.study" in sys.modules:  # what Prefect holds goes while its API is up
            with contextlib.suppress(Exception):
                sys.modules["flows.study"].drain_prefect(timeout=1)
        if self.warm_used and self.closing is None:
            from pipetune.dask.cluster import close_warm_client

            self.closing = threading.Thread(target=close_warm_client,
                                            name="pipetune-note-workers")
            self.closing.start()
            return
        if not self.cluster_started or self.closing is not None:  # no cluster started here
            return
        from pipetune.dask.cluster import close_shared_cluster

        self.closing = threading.Thread(target=close_shared_cluster,
                                        name="pipetune-close-cluster")
        self.closing.start()

    def join_closing(self) -> None:
        if self.closing is not None:
            self.closing.join()
        if not self.warm_used:  # the workers are gone: their fork server goes now too
            from pipetune.dask.cluster import stop_forkserver

            stop_forkserver()


def _job_folders(spec) -> list[str]:
    """Where the job's own code comes from: the folders put on the path for it and its
    workload module's (nothing for a built-in workload)."""
    from pipetune.modules import added_folders, module_origin, workload_module

    folders = list(added_folders())
    module = workload_module(spec.workload.name)
    if module is not None:
        origin = module_origin(module)
        if origin.root and not origin.installed:
            folders.append(origin.root)
    return folders
