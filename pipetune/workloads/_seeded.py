"""Randomness a trial owns: parameters initialised and dropout masks drawn from the
trial's own generator, an epoch's seed mixed from (trial seed, epoch), and CPU copies of
state for checkpoints (:mod:`pipetune.workloads._classifier` says why)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


def _mix_seed(seed: int, epoch: int) -> int:
    return (seed * 1_000_003 + epoch * 7_919 + 17) % (2**63 - 1)


def _cpu_copy(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone(memory_format=torch.contiguous_format)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_cpu_copy(v) for v in obj)
    return obj


def init_parameters(model: nn.Module, generator: torch.Generator) -> None:
    """Initialise ``model`` from ``generator`` alone, the way torch does by default.

    Conv and linear weights: Kaiming-uniform with ``a=sqrt(5)``, biases uniform in
    ``+-1/sqrt(fan_in)``; embeddings: standard normal with the padding row zeroed.
    """
    import torch
    from torch import nn

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Conv1d | nn.Conv2d):
                nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=generator)
                if module.bias is not None:
                    fan_in = module.weight[0].numel()
                    bound = 1.0 / math.sqrt(fan_in)
                    nn.init.uniform_(module.bias, -bound, bound, generator=generator)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, generator=generator)
                if module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()


def seeded_dropout(x: torch.Tensor, p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Inverted dropout whose mask comes from ``generator`` (a CPU generator)."""
    import torch

    if p <= 0.0:
        return x
    keep = torch.rand(x.shape, generator=generator) >= p
    return x * keep.to(device=x.device, dtype=x.dtype) / (1.0 - p)
