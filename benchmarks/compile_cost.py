"""What a ``torch.compile`` of the residual CNN costs once, against what it saves a step.

One training step of ``build_resnet(10, width, blocks)`` (batch 64 of 28x28, SGD, one
torch thread) eager, then compiled into a fresh inductor cache: the first compiled
step's time less a warm compiled step's is the compile. Printed as one JSON line per
size, with the graph's leaf modules and the compile in eager steps.

    .venv/bin/python benchmarks/compile_cost.py 16 1  16 3  24 2  32 2
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def measure(width: int, blocks: int) -> dict:
    import torch
    from torch import nn

    from pipetune.workloads.resnet import build_resnet

    torch.set_num_threads(1)
    model = build_resnet(10, width, blocks)
    leaves = sum(1 for m in model.modules() if not list(m.children()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

    def step(m: nn.Module) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()

    def per_step(m: nn.Module, n: int = 10) -> float:
        started = time.perf_counter()
        for _ in range(n):
            step(m)
        return (time.perf_counter() - started) / n

    for _ in range(3):
        step(model)
    eager = per_step(model)
    compiled = torch.compile(model)
    started = time.perf_counter()
    step(compiled)
    first = time.perf_counter() - started
    for _ in range(3):
        step(compiled)
    warm = per_step(compiled)
    return {"width": width, "blocks": blocks, "leaf_modules": leaves,
            "eager_step_s": round(eager, 4), "compiled_step_s": round(warm, 4),
            "compile_s": round(first - warm, 2),
            "compile_in_eager_steps": round((first - warm) / eager)}


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:]] or [16, 1, 16, 3, 24, 2, 32, 2]
    for width, blocks in zip(sizes[::2], sizes[1::2], strict=True):
        # each size in a fresh cache: a compile of its own, not a reuse
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile-cost-")
        print(json.dumps(measure(width, blocks)), flush=True)
