"""Applying a :class:`SystemConfig` to the current process, and undoing it."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipetune.errors import SystemConfigError, WorkloadError
from pipetune.system.config import SystemConfig

if TYPE_CHECKING:
    import torch


@dataclass
class AppliedConfig:
    """A :class:`SystemConfig` as a training step uses it: the one place where every
    knob a workload honours is turned into what torch needs.

    :func:`applied_system_config` yields one after setting the process-wide knobs
    (threads, pinning, TF32, cuDNN); :func:`applied_context` makes one from a plain
    config without touching the process. A workload reads ``device``,
    ``memory_format``, ``loader_options()``, ``autocast()`` and ``grad_scaler()``
    instead of the knobs, so none can be forgotten.

    ``notes`` lists knobs that could not be honoured as asked, with why (torch
    allows inter-op threads to be set only once per process, before first use).
    """

    config: SystemConfig
    notes: list[str] = field(default_factory=list)
    #: What the process really runs under during the epoch, read back: torch threads,
    #: the OpenMP wait policy of the process, the cores its threads may run on.
    actual: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        """The device to train on; :class:`WorkloadError` when cuda is asked and torch
        sees none."""
        import torch

        if self.config.device == "cuda" and not torch.cuda.is_available():
            raise WorkloadError("system.device is cuda but torch sees no CUDA device here")
        return torch.device(self.config.device)

    @property
    def memory_format(self) -> torch.memory_format:
        """``torch.channels_last`` with ``channels_last``, else ``torch.contiguous_format``."""
        import torch

        return torch.channels_last if self.config.channels_last else torch.contiguous_format

    def loader_options(self) -> dict[str, Any]:
        """Keyword arguments for a ``DataLoader`` under this config: ``num_workers``
        (``dataloader_workers``), ``persistent_workers=False``, ``pin_memory`` on cuda,
        and a fork context for workers where fork exists. Workers asked in a daemonic
        process (which may not start any) raise :class:`WorkloadError`."""
        workers = self.config.dataloader_workers
        if workers > 0 and multiprocessing.current_process().daemon:
            raise WorkloadError(
                f"system.dataloader_workers={workers} needs worker processes, but this process "
                "is daemonic and may not start any (a Dask worker: set the Dask config "
                "distributed.worker.daemon to False)"
            )
        options: dict[str, Any] = {
            "num_workers": workers,
            "persistent_workers": False,
            "pin_memory": self.config.device == "cuda",
        }
        if workers > 0 and "fork" in multiprocessing.get_all_start_methods():
            options["multiprocessing_context"] = "fork"
        return options

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context a step runs under: ``precision`` (bf16 on the CPU or
        cuda, fp16 on cuda); none for fp32."""
        import torch

        config = self.config
        if config.precision != "fp32":
            dtype = torch.bfloat16 if config.precision == "bf16" else torch.float16
            return torch.autocast(device_type=config.device, dtype=dtype)
        return contextlib.nullcontext()

    def training_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """What a training step calls: ``model`` itself, or with ``compile`` a
        ``torch.compile`` wrapper of it (default mode). Nothing is kept on the model:
        dynamo caches compiled code per process by the model's code and guards, so
        wrapping the same model again, or another instance of the same architecture,
        reuses it (measured: 0.0 s against 8.6 s for the first compile). The wrapper
        shares the model's parameters, so ``model.state_dict()`` (eager keys, no
        ``_orig_mod.``) is the checkpoint either way, and the model still copies and
        pickles. Compiled code is cached on disk under :func:`compile_cache_dir`."""
        if not self.config.compile:
            return model
        import torch

        if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
            use_compile_cache()
        return torch.compile(model)

    def grad_scaler(self, state: Mapping[str, Any] | None = None) -> Any:
        """A ``torch.amp.GradScaler`` for fp16 on cuda, loaded from ``state`` when that
        is not empty; ``None`` for any other config (no loss scaling)."""
        import torch

        if self.config.device != "cuda" or self.config.precision != "fp16":
            return None
        scaler = torch.amp.GradScaler("cuda")
        if state:
            scaler.load_state_dict(dict(state))
        return scaler


#: Moves the compile cache (a shared folder in team mode); default under the home.
COMPILE_CACHE_ENV = "PIPETUNE_COMPILE_CACHE"
_OWN_CACHE_ENV = "PIPETUNE_SET_INDUCTOR_CACHE"


def compile_cache_dir() -> str:
    """Where torch.compile keeps what it compiled, across processes and studies:
    ``$PIPETUNE_COMPILE_CACHE``, else ``compile-cache`` under the pipetune home."""
    from pipetune.home import pipetune_home

    raw = os.environ.get(COMPILE_CACHE_ENV, "").strip()
    return raw or str(pipetune_home() / "compile-cache")


def use_compile_cache(name: str = "") -> str:
    """Point inductor's on-disk caches (FX graphs, AOT autograd, kernels) at
    :func:`compile_cache_dir` (its subfolder ``name`` when given); return the folder.
    Without a name, a ``TORCHINDUCTOR_CACHE_DIR`` the process was started with is
    kept. Inductor reads the variable whenever it needs the folder, so an epoch sets it
    before it compiles."""
    if not name and os.environ.get(_OWN_CACHE_ENV) is None:
        current = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "").strip()
        if current:
            return current
    folder = os.path.join(compile_cache_dir(), name) if name else compile_cache_dir()
    os.makedirs(folder, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    os.environ[_OWN_CACHE_ENV] = "1"  # set by us: a later epoch may move it
    return folder


def applied_context(system: SystemConfig | AppliedConfig) -> AppliedConfig:
    """``system`` as an :class:`AppliedConfig`: returned unchanged when it is one, else
    wrapped without touching the process (threads, pinning and CUDA flags are set only
    by :func:`applied_system_config`). For workloads called by hand with a plain
    :class:`SystemConfig`."""
    if isinstance(system, AppliedConfig):
        return system
    if isinstance(system, SystemConfig):
        return AppliedConfig(system)
    raise TypeError(f"expected a SystemConfig or AppliedConfig, got {type(system).__name__}")


def process_omp_wait_policy() -> str:
    """The OpenMP wait policy this process started with (``inherit``: none set)."""
    value = os.environ.get("OMP_WAIT_POLICY", "").strip().lower()
    return value if value in ("passive", "active") else "inherit"


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # pragma: no cover - not Linux
        return [0]


@contextlib.contextmanager
def _pinned(cpus: Sequence[int]) -> Iterator[None]:
    """Every thread of this process on ``cpus`` (threads started later inherit it from
    the thread that starts them); each thread's affinity restored on exit."""
    saved: dict[int, set[int]] = {}
    for tid in _threads():
        with contextlib.suppress(OSError):  # a thread may have ended meanwhile
            saved[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)
    try:
        yield
    finally:
        for tid, mask in saved.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, mask)


@contextlib.contextmanager
def applied_system_config(
    config: SystemConfig, cpus: Sequence[int] = ()
) -> Iterator[AppliedConfig]:
    """Set torch threads, core pinning and CUDA backend flags from ``config``; restore
    them on exit. ``cpus`` are the cores a pinned epoch may use (the executor gives
    co-running epochs disjoint sets); with none given, the first ``cores`` of the
    process's own. An ``omp_wait_policy`` other than the process's raises
    :class:`SystemConfigError`: OpenMP reads it at start-up, so it cannot be applied
    here, and running anyway would measure the wrong config.

    The yielded :class:`AppliedConfig` carries the rest (device, data-loader options,
    memory format, autocast, loss scaler); the caller passes it to the workload.
    """
    import torch

    process_policy = process_omp_wait_policy()
    if config.omp_wait_policy not in ("inherit", process_policy):
        raise SystemConfigError(
            "system.omp_wait_policy",
            f"{config.omp_wait_policy} needs a worker process started with "
            f"OMP_WAIT_POLICY={config.omp_wait_policy.upper()} (this one has "
            f"{process_policy}); start one with that environment and "
            f"--resources 'omp_wait_policy:{config.omp_wait_policy}=1'",
        )
    applied = AppliedConfig(config)
    pin = contextlib.nullcontext()
    if config.pin_cores:
        own = sorted(os.sched_getaffinity(0))
        chosen = list(cpus) or own[: config.cores]
        if len(chosen) < config.cores:
            applied.notes.append(f"pin_cores: {config.cores} cores asked, {len(chosen)} given")
        pin = _pinned(chosen)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(config.cores)
    if torch.get_num_interop_threads() != config.interop_threads:
        try:
            torch.set_num_interop_threads(config.interop_threads)
        except RuntimeError:
            applied.notes.append(
                f"interop_threads={config.interop_threads} not applied: torch fixes inter-op "
                f"threads at first use (stays {torch.get_num_interop_threads()})"
            )
    saved_cuda: tuple[bool, bool, bool] | None = None
    if config.device == "cuda":
        saved_cuda = (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
        )
        torch.backends.cuda.matmul.allow_tf32 = config.tf32
        torch.backends.cudnn.allow_tf32 = config.tf32
        torch.backends.cudnn.benchmark = config.cudnn_benchmark
    try:
        with pin:
            applied.actual = {
                "threads": torch.get_num_threads(),
                "omp_wait_policy": process_policy,
                "cpus": sorted(os.sched_getaffinity(0)),
            }
            yield applied
    finally:
        torch.set_num_threads(saved_threads)
        if saved_cuda is not None:
            (
                torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cudnn.allow_tf32,
                torch.backends.cudnn.benchmark,
            ) = saved_cuda


def autocast_for(config: SystemConfig | AppliedConfig) -> contextlib.AbstractContextManager:
    """The autocast context a training step should run under for ``config``."""
    return applied_context(config).autocast()
