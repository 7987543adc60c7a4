"""Applying a :class:`SystemConfig` to the current process, and undoing it."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipetune.errors import SystemConfigError, WorkloadError
from pipetune.system.config import KNOBS, SystemConfig

if TYPE_CHECKING:
    import torch


class Device(str):
    """The device a step trains on: the knob's string (``"cpu"``, ``"cuda"``) that is
    also what torch takes for a device.

    It compares equal to the string (``system.device == "cuda"``, as code written
    against :class:`SystemConfig` does) and to the matching ``torch.device``
    (``system.device == torch.device("cpu")``), and has ``torch.device``'s ``type`` and
    ``index``. Anything taking a device accepts it: ``tensor.to(d)``,
    ``module.to(d)``, ``torch.zeros(2, device=d)``, ``torch.device(d)``,
    ``torch.autocast(device_type=d)``.

    >>> Device("cpu") == "cpu", Device("cpu").type, Device("cpu").index
    (True, 'cpu', None)
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        torch = sys.modules.get("torch")  # no torch imported: other is no torch.device
        if torch is not None and isinstance(other, torch.device):
            return torch.device(str(self)) == other
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = str.__hash__

    @property
    def type(self) -> str:
        """``cpu`` or ``cuda``, as ``torch.device.type``."""
        return str(self).partition(":")[0]

    @property
    def index(self) -> int | None:
        """The device's ordinal (``cuda:1`` -> 1), ``None`` when not given."""
        _, _, index = str(self).partition(":")
        return int(index) if index else None


class _Knob:
    """A knob of the :class:`SystemConfig`, read through an :class:`AppliedConfig`
    (``system.cores`` as ``system.config.cores``); read-only."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj.config, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(
            f"system.{self.name} is read-only: a workload trains under the config it is given"
        )


#: What a :class:`SystemConfig` has besides its knobs (methods such as ``label()``,
#: ``replace()``, ``to_dict()``): still answered by an :class:`AppliedConfig`, with a
#: DeprecationWarning naming ``system.config.<name>``.
_CONFIG_ONLY: frozenset[str] = frozenset(
    name for name in dir(SystemConfig) if not name.startswith("_") and name not in KNOBS
)


@dataclass
class AppliedConfig:
    """A :class:`SystemConfig` as a training step uses it: the one place where every
    knob a workload honours is turned into what torch needs.

    :func:`applied_system_config` yields one after setting the process-wide knobs
    (threads, pinning, TF32, cuDNN); :func:`applied_context` makes one from a plain
    config without touching the process. It is what ``Workload.train_epoch`` and
    ``Workload.evaluate`` are given.

    Public (README "What is public"): every knob reads as an attribute, as on a
    :class:`SystemConfig` (``system.cores``, ``system.dataloader_workers``,
    ``system.precision``, ``system.channels_last``, ...; ``system.device`` is a
    :class:`Device`, equal to ``"cpu"`` and to ``torch.device("cpu")``). The helpers
    turn knobs into what torch needs, so none can be forgotten: ``device``,
    ``memory_format``, ``loader_options()``, ``autocast()``, ``grad_scaler()`` and
    ``training_model()``; ``config`` is the :class:`SystemConfig` itself. Its other
    members (``label()``, ``replace()``, ``to_dict()``, ...) still answer here with a
    DeprecationWarning: use ``system.config.<name>``.

    >>> system = applied_context(SystemConfig(cores=2, dataloader_workers=1))
    >>> system.cores, system.dataloader_workers, system.device == "cpu"
    (2, 1, True)

    ``notes`` lists knobs that could not be honoured as asked, with why (torch
    allows inter-op threads to be set only once per process, before first use).
    """

    config: SystemConfig
    notes: list[str] = field(default_factory=list)
    #: What the process really runs under during the epoch, read back: torch threads,
    #: the OpenMP wait policy of the process, the cores its threads may run on.
    actual: dict[str, Any] = field(default_factory=dict)

    # Every knob but device (below) as a read-only attribute: the public API.
    cores = _Knob()
    interop_threads = _Knob()
    dataloader_workers = _Knob()
    omp_wait_policy = _Knob()
    pin_cores = _Knob()
    precision = _Knob()
    tf32 = _Knob()
    cudnn_benchmark = _Knob()
    channels_last = _Knob()
    compile = _Knob()

    def __hash__(self) -> int:  # hashable as the SystemConfig was (equal ones hash alike)
        return hash(self.config)

    def __getattr__(self, name: str) -> Any:
        # Only for names not found otherwise. Read config from __dict__: while an
        # instance is being unpickled or copied it has none yet, and must not recurse.
        config = self.__dict__.get("config")
        if config is None or name not in _CONFIG_ONLY:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(
            f"system.{name} is deprecated on the AppliedConfig a workload is given (it "
            f"answers the knobs and its helpers); use system.config.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(config, name)

    @property
    def device(self) -> Device:
        """The device to train on, a :class:`Device`: the knob's string that torch also
        takes as a device; :class:`WorkloadError` when cuda is asked and torch sees
        none."""
        import torch

        if self.config.device == "cuda" and not torch.cuda.is_available():
            raise WorkloadError("system.device is cuda but torch sees no CUDA device here")
        return Device(self.config.device)

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


assert all(hasattr(AppliedConfig, knob) for knob in KNOBS), "every knob reads as an attribute"


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
