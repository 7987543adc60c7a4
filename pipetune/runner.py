"""Run one epoch of one trial: the unit of work an executor (Dask, or a plain loop) runs.

:func:`run_epoch` is pure with respect to the study: it reads a checkpoint reference,
trains one epoch under a system config while profiling it, evaluates, writes the next
checkpoint and returns an :class:`EpochResult`. It never logs to MLflow and never
touches the ground truth.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from pipetune.profiler.profile import EpochMeasurement
from pipetune.system.config import SystemConfig
from pipetune.tuner import Phase


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
    op_mix_steps: int = 10
    perf: str = "auto"
    watts_per_core: float = 10.0

    @property
    def name(self) -> str:
        return f"trial-{self.trial_id}-epoch-{self.epoch}"


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
    eval_s: float = 0.0
    checkpoint_s: float = 0.0

    def cost(self, objective: str) -> float:
        return self.measurement.cost(objective)


def run_epoch(task: EpochTask) -> EpochResult:
    """Train, profile, evaluate and checkpoint one epoch of one trial."""
    from pipetune.checkpoints import CheckpointStore
    from pipetune.profiler import EpochProfiler
    from pipetune.system.apply import applied_system_config
    from pipetune.workloads import resolve_workload

    started = time.time()
    workload = resolve_workload(task.workload)(**task.workload_params)
    workload.setup(task.hparams, task.seed)
    if task.checkpoint_in is not None:
        CheckpointStore.load(workload, task.checkpoint_in)
    profiler = EpochProfiler(
        op_mix_steps=task.op_mix_steps,
        perf=task.perf,
        watts_per_core=task.watts_per_core,
        device=task.system.device,
    )
    setup_done = time.time()
    with applied_system_config(task.system) as applied:
        # The operator mix is sampled in the profiled epoch only: it is what the ground
        # truth matches on, and later epochs keep the cheap counters.
        stats, measurement = profiler.measure(
            lambda hook: workload.train_epoch(task.system, on_step=hook),
            profile_ops=task.phase is Phase.PROFILE,
        )
        eval_start = time.time()
        metrics = workload.evaluate(task.system)
        eval_s = time.time() - eval_start
    save_start = time.time()
    CheckpointStore.save(workload, task.checkpoint_out)
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
        eval_s=eval_s,
        checkpoint_s=checkpoint_s,
    )


def evaluate_checkpoint(task: EpochTask, checkpoint: str) -> dict[str, float]:
    """Rebuild a trial's workload from ``checkpoint`` and evaluate it."""
    from pipetune.checkpoints import CheckpointStore
    from pipetune.system.apply import applied_system_config
    from pipetune.workloads import resolve_workload

    workload = resolve_workload(task.workload)(**task.workload_params)
    workload.setup(task.hparams, task.seed)
    CheckpointStore.load(workload, checkpoint)
    with applied_system_config(task.system):
        return {k: float(v) for k, v in workload.evaluate(task.system).items()}
