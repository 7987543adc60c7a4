"""Applying a :class:`SystemConfig` to the current process, and undoing it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from pipetune.system.config import SystemConfig


@dataclass
class AppliedConfig:
    """What :func:`applied_system_config` actually changed.

    ``notes`` lists knobs that could not be honoured as asked, with why (torch
    allows inter-op threads to be set only once per process, before first use).
    """

    config: SystemConfig
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def applied_system_config(config: SystemConfig) -> Iterator[AppliedConfig]:
    """Set torch threads and CUDA backend flags from ``config``; restore them on exit.

    Data-loader workers, autocast precision and channels_last are read by the
    workload when it builds its loader and runs its steps (see :func:`autocast_for`).
    """
    import torch

    applied = AppliedConfig(config)
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
        yield applied
    finally:
        torch.set_num_threads(saved_threads)
        if saved_cuda is not None:
            (
                torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cudnn.allow_tf32,
                torch.backends.cudnn.benchmark,
            ) = saved_cuda


def autocast_for(config: SystemConfig) -> contextlib.AbstractContextManager:
    """The autocast context a training step should run under for ``config``."""
    import torch

    if config.device == "cuda" and config.precision != "fp32":
        dtype = torch.bfloat16 if config.precision == "bf16" else torch.float16
        return torch.autocast(device_type="cuda", dtype=dtype)
    return contextlib.nullcontext()
