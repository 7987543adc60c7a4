"""The system config: the knobs a trial's training runs under.

A :class:`SystemConfig` is a small frozen value. It travels to Dask workers, is
logged as metrics, and is the unit the system tuner chooses between.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from pipetune.errors import SystemConfigError

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
DEVICES: tuple[str, ...] = ("cpu", "cuda")

#: Knobs that only mean something on a CUDA device. ``precision`` and ``channels_last``
#: work on the CPU too (bf16 only where the processor computes it natively, see
#: :meth:`SystemConfig.check_machine`; fp16 autocast only on CUDA).
CUDA_KNOBS: tuple[str, ...] = ("tf32", "cudnn_benchmark")
#: Knobs with a one-time cost per process and model (``compile``: tracing and code
#: generation, again for a new input shape) that later epochs earn back, or not: the
#: tuner weighs it against the epochs a trial has left.
ONE_TIME_KNOBS: tuple[str, ...] = ("compile",)
#: CPU flags (``/proc/cpuinfo``) that mean native bf16 arithmetic.
CPU_BF16_FLAGS: tuple[str, ...] = ("avx512_bf16", "amx_bf16", "bf16")  # bf16: aarch64
#: Where the CPU flags are read; the environment variable names another file (a
#: container that hides ``/proc``, or a test that plays another processor).
CPUINFO_ENV = "PIPETUNE_CPUINFO"
OMP_WAIT_POLICIES: tuple[str, ...] = ("inherit", "passive", "active")
#: Knobs the OpenMP runtime reads once, when torch loads: an epoch asking for a value
#: other than its worker process's needs a worker *started* with it. The Dask backend
#: routes such an epoch to a worker advertising the resource :func:`process_resource`
#: names (the embedded cluster starts those workers); anywhere else it fails, saying so.
PROCESS_KNOBS: tuple[str, ...] = ("omp_wait_policy",)


def process_resource(knob: str, value: str) -> str:
    """The Dask resource a worker started for a process knob's value advertises."""
    return f"{knob}:{value}"


@dataclass(frozen=True)
class MachineInfo:
    """What this machine can honour. ``cores`` is the number of usable CPU cores."""

    cores: int
    cuda_devices: int = 0
    #: The processor's feature flags as ``/proc/cpuinfo`` lists them (empty: unknown).
    cpu_flags: frozenset[str] = frozenset()

    @property
    def cpu_bf16(self) -> bool:
        """Whether the CPU computes bf16 natively (:data:`CPU_BF16_FLAGS`)."""
        return any(f in self.cpu_flags for f in CPU_BF16_FLAGS)

    @classmethod
    def detect(cls) -> MachineInfo:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        return cls(cores=cores, cuda_devices=_cuda_devices(), cpu_flags=read_cpu_flags())


def _cuda_devices() -> int:
    """CUDA devices torch can use. Without a GPU's device node (NVIDIA's, or ROCm's
    ``/dev/kfd``) there is none, and torch is not imported to say so: ``pipetune tune``
    checks a job before it needs torch (1 s of CPU beside the cluster's start)."""
    import glob
    import sys

    if "torch" not in sys.modules and not (glob.glob("/dev/nvidia[0-9]*")
                                           or os.path.exists("/dev/kfd")):
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - torch missing or broken CUDA: no GPU
        return 0


def read_cpu_flags(path: str | None = None) -> frozenset[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (or ``$PIPETUNE_CPUINFO``);
    empty when the file is missing or lists none."""
    path = path or os.environ.get(CPUINFO_ENV, "").strip() or "/proc/cpuinfo"
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@dataclass(frozen=True)
class SystemConfig:
    """System knobs for one epoch of training.

    ``cores``: CPU cores reserved for the trial; sets torch intra-op threads and is
    the trial's Dask ``cores`` resource claim.
    ``interop_threads``: torch inter-op threads.
    ``dataloader_workers``: worker processes of the training DataLoader.
    ``omp_wait_policy``: how idle OpenMP threads wait, ``passive`` (sleep) or
    ``active`` (spin); ``inherit`` (the default) takes the worker process's setting.
    A process knob (:data:`PROCESS_KNOBS`): it needs a worker started with it.
    ``pin_cores``: pin the worker process's threads, for the epoch, to as many cores
    as the config reserves, disjoint from the cores of co-running pinned epochs.
    ``device``: ``cpu`` or ``cuda``. ``precision``: autocast to ``bf16`` (CPU with
    native bf16, or CUDA) or ``fp16`` (CUDA only); ``fp32`` is no autocast.
    ``channels_last``: NHWC memory format for 4-d inputs and conv weights.
    ``compile``: train through ``torch.compile(model)`` (default mode), a one-time
    cost per process and model (:data:`ONE_TIME_KNOBS`); checkpoints stay the eager
    model's. CUDA-only: ``tf32`` matmuls, ``cudnn_benchmark``.

    >>> SystemConfig(cores=2).replace(dataloader_workers=1).label()
    'cores=2 interop=1 workers=1'
    >>> SystemConfig(compile=True, channels_last=True).label()
    'cores=1 interop=1 workers=0 channels_last compiled'
    """

    cores: int = 1
    interop_threads: int = 1
    dataloader_workers: int = 0
    omp_wait_policy: str = "inherit"
    pin_cores: bool = False
    device: str = "cpu"
    precision: str = "fp32"
    tf32: bool = False
    cudnn_benchmark: bool = False
    channels_last: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        for name, (kind, allowed) in _RULES.items():
            v = getattr(self, name)
            if kind == "int" and (not isinstance(v, int) or isinstance(v, bool) or v < allowed):
                raise SystemConfigError(
                    f"system.{name}", f"must be an integer >= {allowed}, got {v!r}"
                )
            if kind == "enum" and v not in allowed:
                raise SystemConfigError(f"system.{name}", f"must be one of {allowed}, got {v!r}")
            if kind == "bool" and not isinstance(v, bool):
                raise SystemConfigError(f"system.{name}", "must be true or false")
        if self.device == "cpu":
            for name in CUDA_KNOBS:
                if getattr(self, name) != _DEFAULTS[name]:
                    raise SystemConfigError(
                        f"system.{name}",
                        f"is a CUDA knob; it needs device: cuda (got {getattr(self, name)!r} "
                        f"with device: cpu)",
                    )
            if self.precision == "fp16":
                raise SystemConfigError(
                    "system.precision",
                    "fp16 autocast needs device: cuda; on the CPU use bf16 (where the "
                    "processor has native bf16) or fp32",
                )

    # -- conversions -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The JSON schema of :meth:`to_dict`'s form, knobs left out taking defaults,
        read off the same rules ``__post_init__`` applies (the CUDA-only rule aside)."""
        return {
            "type": "object",
            "properties": {k: {**knob_json_schema(k), "default": _DEFAULTS[k]} for k in KNOBS},
            "additionalProperties": False,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SystemConfig:
        unknown = set(data) - set(KNOBS)
        if unknown:
            name = sorted(unknown)[0]
            raise SystemConfigError(f"system.{name}", f"unknown knob; allowed: {', '.join(KNOBS)}")
        return cls(**data)

    def replace(self, **changes: Any) -> SystemConfig:
        return dataclasses.replace(self, **changes)

    def label(self) -> str:
        """A short human label, naming only knobs that matter on its device."""
        parts = [
            f"cores={self.cores}",
            f"interop={self.interop_threads}",
            f"workers={self.dataloader_workers}",
        ]
        if self.omp_wait_policy != "inherit":
            parts.append(f"omp={self.omp_wait_policy}")
        if self.pin_cores:
            parts.append("pinned")
        if self.device == "cuda":
            parts += [
                "cuda",
                self.precision,
                *(k for k in ("tf32", "cudnn_benchmark") if getattr(self, k)),
            ]
        elif self.precision != "fp32":
            parts.append(self.precision)
        if self.channels_last:
            parts.append("channels_last")
        if self.compile:
            parts.append("compiled")
        return " ".join(parts)

    def as_metrics(self) -> dict[str, float]:
        """Every knob as a number, so MLflow can plot it per epoch."""
        return {
            "sys_cores": float(self.cores),
            "sys_interop_threads": float(self.interop_threads),
            "sys_dataloader_workers": float(self.dataloader_workers),
            # 0 inherit, 1 passive, 2 active
            "sys_omp_wait_policy": float(OMP_WAIT_POLICIES.index(self.omp_wait_policy)),
            "sys_pin_cores": float(self.pin_cores),
            "sys_cuda": 1.0 if self.device == "cuda" else 0.0,
            "sys_precision_bits": {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0}[self.precision],
            "sys_tf32": float(self.tf32),
            "sys_cudnn_benchmark": float(self.cudnn_benchmark),
            "sys_channels_last": float(self.channels_last),
            "sys_compile": float(self.compile),
        }

    # -- machine checks ----------------------------------------------------------
    def check_machine(self, machine: MachineInfo | None = None, where: str = "system") -> None:
        """Reject a config this machine cannot honour, naming the knob."""
        machine = machine or MachineInfo.detect()
        if self.cores > machine.cores:
            raise SystemConfigError(
                f"{where}.cores",
                f"{self.cores} cores requested but this machine has {machine.cores}",
            )
        if self.device == "cuda" and machine.cuda_devices == 0:
            raise SystemConfigError(
                f"{where}.device", "cuda requested but no CUDA device is available here"
            )
        if self.device == "cpu" and self.precision == "bf16" and not machine.cpu_bf16:
            raise SystemConfigError(
                f"{where}.precision",
                "bf16 on the CPU needs native bf16 (CPU flag "
                f"{' or '.join(CPU_BF16_FLAGS[:2])}; on Arm bf16), which this processor "
                "lacks; use fp32",
            )

    def one_time_knobs(self) -> tuple[str, ...]:
        """The knobs of :data:`ONE_TIME_KNOBS` this config turns on."""
        return tuple(k for k in ONE_TIME_KNOBS if getattr(self, k) != _DEFAULTS[k])


KNOBS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SystemConfig))

#: Each knob's own rule: ``("int", minimum)``, ``("enum", allowed)`` or ``("bool", None)``.
#: :class:`SystemConfig` checks values by it and JSON schemas are derived from it.
_RULES: dict[str, tuple[str, Any]] = {
    "cores": ("int", 1),
    "interop_threads": ("int", 1),
    "dataloader_workers": ("int", 0),
    "omp_wait_policy": ("enum", OMP_WAIT_POLICIES),
    "pin_cores": ("bool", None),
    "device": ("enum", DEVICES),
    "precision": ("enum", PRECISIONS),
    "tf32": ("bool", None),
    "cudnn_benchmark": ("bool", None),
    "channels_last": ("bool", None),
    "compile": ("bool", None),
}
assert tuple(_RULES) == KNOBS, "every knob has exactly one rule"


def knob_json_schema(knob: str) -> dict[str, Any]:
    """The JSON schema of one value of ``knob``."""
    kind, allowed = _RULES[knob]
    if kind == "int":
        return {"type": "integer", "minimum": allowed}
    if kind == "enum":
        return {"enum": list(allowed)}
    return {"type": "boolean"}
_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(SystemConfig) if f.default is not field
}
