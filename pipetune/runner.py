"""Run one epoch of one trial: the unit of work an executor (Dask, or a plain loop) runs.

:func:`run_epoch` is pure with respect to the study: it takes the trial's model from
the process's :class:`LiveTrials` (or rebuilds it from the checkpoint reference),
trains one epoch under a system config while profiling it, evaluates, writes the next
checkpoint and returns an :class:`EpochResult`. It never logs
to MLflow and never touches the ground truth.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pipetune.profiler.profile import EpochMeasurement
from pipetune.spec.sections import ProfilerSpec
from pipetune.states import Phase
from pipetune.system.config import SystemConfig


@dataclass(frozen=True)
class EpochTask:
    """Everything a worker needs to run one epoch; small and picklable."""

    study_id: str
    trial_id: int
    epoch: int
    phase: Phase
    system: SystemConfig
    workload: str
    workload_params: dict[str, Any]
    hparams: dict[str, Any]
    seed: int
    checkpoint_in: str | None
    checkpoint_out: str
    #: How the epoch is profiled: the job's ``profiler`` section, its defaults included.
    profiler: ProfilerSpec = field(default_factory=ProfilerSpec)
    #: Cores a pinned epoch (``system.pin_cores``) runs on, given by the executor so
    #: that co-running pinned epochs do not share cores; empty: the process's first.
    cpus: tuple[int, ...] = ()
    #: Seconds the epoch may run once sent to its worker (``workload.epoch_timeout_s``).
    timeout_s: float | None = None
    #: Train and evaluate with torch's deterministic algorithms (``workload.deterministic``).
    deterministic: bool = False
    #: The compile cache's name (``pipetune.compile_cache``; empty: the shared one).
    compile_cache: str = ""
    #: Trials of this study that ended, whose live models the worker drops first (the
    #: driver sends a trial's release with the next epoch to its worker, not as a task).
    release: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return f"trial-{self.trial_id}-epoch-{self.epoch}"


@dataclass(frozen=True)
class EpochFailure:
    """An epoch that raised, as the worker saw it: sent back as the epoch's answer (not
    raised through the executor, whose own failure logging would print the traceback
    as a string on the terminal for every trial).

    ``where`` is the innermost frame of the traceback outside installed libraries and
    the standard library (the user's code, or pipetune's loop calling it), else the
    innermost frame: two failures with the same ``kind`` are the same bug even when
    their messages differ by a shape or a value.
    """

    type: str
    message: str
    traceback: str
    where: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException, skip: int = 0) -> EpochFailure:
        """``exc`` as a failure; ``skip``: frames of the caller's own to leave out."""
        import traceback as tb

        trace = exc.__traceback__
        for _ in range(skip):
            trace = trace.tb_next if trace is not None and trace.tb_next else trace
        frames = tb.extract_tb(trace)
        own = [f for f in frames if not _library_frame(f.filename)]
        frame = (own or frames)[-1] if frames else None
        where = f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else ""
        text = "".join(tb.format_exception(type(exc), exc, trace))
        return cls(type=type(exc).__name__, message=str(exc), traceback=text, where=where)

    @property
    def kind(self) -> tuple[str, str]:
        """What makes two failures the same: the exception's type and where it was raised."""
        return self.type, self.where or self.message

    def line(self, limit: int = 300) -> str:
        """``Type: message`` on one line (the message's first line, cut at ``limit``)."""
        first = (self.message.strip().splitlines() or [""])[0]
        if len(first) > limit:
            first = first[: limit - 3].rstrip() + "..."
        return f"{self.type}: {first}" if first else self.type


def _library_frame(filename: str) -> bool:
    import sysconfig

    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return ("site-packages" in filename or "dist-packages" in filename
            or any(filename.startswith(r) for r in roots) or filename.startswith("<"))


def failing_safely(run: Any, task: EpochTask, **kwargs: Any) -> EpochResult | EpochFailure:
    """``run(task, **kwargs)``, with an exception it raises returned as an
    :class:`EpochFailure` (what the executors send back for a failed epoch)."""
    try:
        return run(task, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the study decides what a failure means
        return EpochFailure.from_exception(exc, skip=1)


@dataclass(frozen=True)
class EpochResult:
    """What one epoch did, returned to the study loop."""

    trial_id: int
    epoch: int
    phase: Phase
    system: SystemConfig
    train_loss: float
    metrics: dict[str, float]
    measurement: EpochMeasurement
    checkpoint: str
    batch_size: int
    started: float
    finished: float
    worker: str
    notes: list[str] = field(default_factory=list)
    #: Seconds spent in the worker around the training itself: building the workload
    #: and loading its checkpoint, evaluating, saving the next checkpoint.
    setup_s: float = 0.0
    #: Of ``setup_s``, the workload's constructor (its data, cached per process after
    #: the first build), and on the process's first build of the workload all of
    #: setup: the workload's own one-time cost, which any tuner pays in its process.
    build_s: float = 0.0
    eval_s: float = 0.0
    checkpoint_s: float = 0.0
    #: Whether the model came from memory (the trial's previous epoch ran here) rather
    #: than being rebuilt from its checkpoint.
    reused_model: bool = False
    #: The executor's name for where it ran (a Dask worker address), for locality.
    address: str = ""
    #: The config as the worker process really ran it, read back inside the epoch
    #: (torch threads, OpenMP wait policy, cores its threads could use).
    actual: dict[str, Any] = field(default_factory=dict)
    #: ``torch.__version__`` of the process that ran the epoch.
    torch_version: str = ""
    #: The workload's model graph signature (epoch 1 and profiled epochs; else "").
    graph: str = ""

    def cost(self, objective: str) -> float:
        return self.measurement.cost(objective)


class LiveTrials:
    """Workloads kept in memory between a trial's epochs, in one process.

    A trial's next epoch that lands in the same process continues from memory instead
    of rebuilding the model and reloading its checkpoint. An entry is only reused when
    it is exactly the state the task asks to start from (its ``checkpoint_in``), so a
    retried or moved epoch never continues from a newer state. At most ``capacity``
    workloads are kept, least recently used dropped first.
    """

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, int], tuple[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, task: EpochTask) -> Any | None:
        """The workload left at ``task.checkpoint_in``, removed from the cache; else None."""
        with self._lock:
            entry = self._entries.pop((task.study_id, task.trial_id), None)
        if entry is None or task.checkpoint_in is None or entry[0] != task.checkpoint_in:
            return None
        return entry[1]

    def keep(self, task: EpochTask, workload: Any) -> None:
        with self._lock:
            self._entries[(task.study_id, task.trial_id)] = (task.checkpoint_out, workload)
            self._entries.move_to_end((task.study_id, task.trial_id))
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def drop(self, study_id: str, trial_id: int | None = None) -> int:
        """Forget one trial's workload, or every workload of a study; return how many."""
        with self._lock:
            keys = [k for k in self._entries
                    if k[0] == study_id and (trial_id is None or k[1] == trial_id)]
            for key in keys:
                del self._entries[key]
        return len(keys)

    def __len__(self) -> int:
        return len(self._entries)


#: This process's live workloads (one per Dask worker process).
LIVE_TRIALS = LiveTrials()
_BUILT: set[str] = set()


def _first_build(task: EpochTask) -> bool:
    """Whether this is the process's first build of this workload with these params."""
    import json

    key = f"{task.workload}:{json.dumps(task.workload_params, sort_keys=True, default=str)}"
    if key in _BUILT:
        return False
    _BUILT.add(key)
    return True


def run_epoch(task: EpochTask, live: LiveTrials | None = None, address: str = "") -> EpochResult:
    """Train, profile, evaluate and checkpoint one epoch of one trial.

    With ``live`` the model stays in memory for the trial's next epoch; without it,
    everything is rebuilt from the checkpoint. Either way the checkpoint is on
    storage before the result is returned (a store that refuses it fails the epoch
    with :class:`~pipetune.errors.CheckpointWriteError`).
    """
    from pipetune.checkpoints import CheckpointStore
    from pipetune.profiler import EpochProfiler
    from pipetune.system.apply import applied_system_config

    started = time.time()
    workload, build_s = _workload_for(task, live, started)
    reused = build_s is None
    build_s = build_s or 0.0
    profiler = EpochProfiler(
        op_mix_steps=task.profiler.op_mix_steps,
        perf=task.profiler.perf,
        watts_per_core=task.profiler.watts_per_core,
        device=task.system.device,
    )
    if task.system.compile:
        from pipetune.system.apply import use_compile_cache

        use_compile_cache(task.compile_cache)
    setup_done = time.time()
    with deterministic_algorithms(task.deterministic, task.system.device), \
            applied_system_config(task.system, task.cpus) as applied:
        # The operator mix is sampled in the profiled epoch only: it is what the ground
        # truth matches on, and later epochs keep the cheap counters.
        stats, measurement = profiler.measure(
            lambda hook: workload.train_epoch(applied, on_step=hook),
            profile_ops=task.phase is Phase.PROFILE,
        )
        eval_start = time.time()
        metrics = workload.evaluate(applied)
        eval_s = time.time() - eval_start
    save_start = time.time()
    # Written before the result goes back: an epoch whose checkpoint a full or refusing
    # store would not take fails here, naming the store and the OS error, rather than
    # reported done with a state nothing can resume from.
    CheckpointStore.save(workload, task.checkpoint_out)
    if live is not None:
        live.keep(task, workload)
    checkpoint_s = time.time() - save_start
    return EpochResult(
        trial_id=task.trial_id,
        epoch=task.epoch,
        phase=task.phase,
        system=task.system,
        train_loss=float(stats.loss),
        metrics={k: float(v) for k, v in metrics.items()},
        measurement=measurement,
        checkpoint=task.checkpoint_out,
        batch_size=workload.batch_size,
        started=started,
        finished=time.time(),
        worker=f"{socket.gethostname()}:{os.getpid()}",
        notes=list(applied.notes),
        setup_s=setup_done - started,
        build_s=build_s,
        eval_s=eval_s,
        checkpoint_s=checkpoint_s,
        reused_model=reused,
        address=address,
        actual=dict(applied.actual),
        torch_version=_torch_version(),
        graph=workload.graph_signature() if task.epoch == 1 or task.phase is Phase.PROFILE
        else "",
    )


def _workload_for(task: EpochTask, live: LiveTrials | None, started: float,
                  ) -> tuple[Any, float | None]:
    """``(workload, build_s)``: the trial's model still in memory (``build_s`` None), or
    one built and set up, from the trial's checkpoint when it has one; ``build_s`` the
    seconds building took from ``started`` (the process's first build: data loaded,
    libraries initialised, counted in)."""
    from pipetune.checkpoints import CheckpointStore
    from pipetune.workloads import resolve_workload

    workload = live.take(task) if live is not None else None
    if workload is not None:
        if task.checkpoint_in is not None:
            CheckpointStore.wait_written(task.checkpoint_in)
        return workload, None
    workload = resolve_workload(task.workload)(**task.workload_params)
    build_s = time.time() - started
    workload.setup(task.hparams, task.seed)
    if _first_build(task):  # data loaded, libraries initialised: once per process
        build_s = time.time() - started
    if task.checkpoint_in is not None:
        CheckpointStore.load(workload, task.checkpoint_in)
    return workload, build_s


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


_DETERMINISTIC_LOCK = threading.Lock()
#: Epochs inside :func:`deterministic_algorithms` in this process, and what was set before
#: the first of them (the switch is process-wide; the last one out restores it).
_deterministic_users = 0
_deterministic_before: tuple[bool, bool, bool] = (False, False, False)


@contextmanager
def deterministic_algorithms(enabled: bool, device: str = "cpu") -> Iterator[None]:
    """Within the block, torch's deterministic algorithms when ``enabled`` (and on CUDA
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless the process has its own value); after
    it, the process's previous setting and environment. Off: nothing is touched."""
    global _deterministic_users, _deterministic_before
    if not enabled:
        yield
        return
    import torch

    with _DETERMINISTIC_LOCK:
        if _deterministic_users == 0:
            _deterministic_before = (torch.are_deterministic_algorithms_enabled(),
                                     torch.is_deterministic_algorithms_warn_only_enabled(),
                                     False)
        if device.startswith("cuda") and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
            _deterministic_before = (*_deterministic_before[:2], True)
        torch.use_deterministic_algorithms(True)
        _deterministic_users += 1
    try:
        yield
    finally:
        with _DETERMINISTIC_LOCK:
            _deterministic_users -= 1
            if _deterministic_users == 0:
                enabled_before, warn_only, set_cublas = _deterministic_before
                torch.use_deterministic_algorithms(enabled_before, warn_only=warn_only)
                if set_cublas:
                    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def evaluate_checkpoint(task: EpochTask, checkpoint: str) -> dict[str, float]:
    """Rebuild a trial's workload from ``checkpoint`` and evaluate it."""
    from pipetune.checkpoints import CheckpointStore
    from pipetune.system.apply import applied_system_config
    from pipetune.workloads import resolve_workload

    workload = resolve_workload(task.workload)(**task.workload_params)
    workload.setup(task.hparams, task.seed)
    CheckpointStore.load(workload, checkpoint)
    with deterministic_algorithms(task.deterministic, task.system.device), \
            applied_system_config(task.system) as applied:
        return {k: float(v) for k, v in workload.evaluate(applied).items()}
