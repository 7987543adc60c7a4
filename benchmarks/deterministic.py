"""What ``workload.deterministic: true`` costs: 5 LeNet-5 epochs on the bundled digits,
with and without torch's deterministic algorithms.

Each round builds a fresh model (same seed) and times its 5 epochs (train + evaluate,
what the switch wraps in an epoch task), once without and once with the switch, the
order alternating between rounds so drift on a shared machine falls on both. Prints
each round, the medians and the ratio (with / without)::

    python benchmarks/deterministic.py [--rounds 3] [--epochs 5] [--cores 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(deterministic: bool, epochs: int, config, hparams: dict) -> tuple[float, float]:
    """Seconds for ``epochs`` epochs of a fresh LeNet-5, and its last val_loss."""
    from pipetune.runner import deterministic_algorithms
    from pipetune.system.apply import applied_system_config
    from pipetune.workloads.lenet import LeNet5Workload

    workload = LeNet5Workload(dataset="digits")
    workload.setup(hparams, seed=7)
    elapsed, metrics = 0.0, {}
    for _ in range(epochs):
        started = time.perf_counter()
        with deterministic_algorithms(deterministic, config.device), \
                applied_system_config(config) as applied:
            workload.train_epoch(applied)
            metrics = workload.evaluate(applied)
        elapsed += time.perf_counter() - started
    return elapsed, metrics["val_loss"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--cores", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    import torch

    from pipetune.system.config import SystemConfig

    config = SystemConfig(cores=args.cores, device=args.device)
    hparams = {"lr": 0.05, "batch_size": 64}
    run(False, 1, config, hparams)  # warm-up: data loaded, kernels initialised
    times: dict[bool, list[float]] = {False: [], True: []}
    losses: dict[bool, set[float]] = {False: set(), True: set()}
    print(f"torch {torch.__version__}, {args.device}, cores={args.cores}, "
          f"{args.epochs} epochs per run, {args.rounds} rounds")
    for i in range(args.rounds):
        for deterministic in ((False, True) if i % 2 == 0 else (True, False)):
            seconds, loss = run(deterministic, args.epochs, config, hparams)
            times[deterministic].append(seconds)
            losses[deterministic].add(loss)
            print(f"round {i + 1} deterministic={deterministic!s:5}: {seconds:6.3f} s, "
                  f"val_loss {loss:.9f}")
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"median {args.epochs} epochs: without {off:.3f} s, with {on:.3f} s, "
          f"ratio {on / off:.3f}")
    print(f"distinct final val_loss across rounds: without {len(losses[False])}, "
          f"with {len(losses[True])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
