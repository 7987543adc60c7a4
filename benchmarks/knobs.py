"""What the CPU knobs are worth on this machine, measured on real LeNet-5 epochs.

Each case runs two trials' epochs *at the same time* in two fresh worker processes
(as two co-running trials of a study do), back to back in one run, so the ratios
share the machine's noise:

- ``omp_wait_policy``: a cores=2 epoch beside a cores=1 co-runner, with OpenMP
  threads spinning (``active``) or sleeping (``passive``) when idle;
- ``pin_cores``: two cores=1 epochs, free to move between cores or pinned to
  disjoint cores;
- ``threads vs co-runners``: the two co-runners with cores=1 each, or with cores=2 each.

    python benchmarks/knobs.py [--epochs 3] [--samples 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r'''
import json, sys, time
from pipetune.runner import EpochTask, LiveTrials, run_epoch
from pipetune.spec import ProfilerSpec
from pipetune.system.config import SystemConfig
from pipetune.tuner import Phase
spec = json.loads(sys.argv[1])
live = LiveTrials()
times = []
for epoch in range(1, spec["epochs"] + 1):
    task = EpochTask(study_id="knobs", trial_id=spec["trial"], epoch=epoch,
        phase=Phase.TRAIN, system=SystemConfig(**spec["system"]), workload="lenet5",
        workload_params={"dataset": "digits", "train_samples": spec["samples"],
                         "val_samples": 200},
        hparams={"lr": 0.05, "batch_size": 32, "momentum": 0.5}, seed=spec["trial"],
        checkpoint_in=f"{spec['dir']}/{spec['trial']}-{epoch - 1}.pt" if epoch > 1 else None,
        checkpoint_out=f"{spec['dir']}/{spec['trial']}-{epoch}.pt",
        profiler=ProfilerSpec(op_mix_steps=1),
        cpus=tuple(spec.get("cpus", ())))
    r = run_epoch(task, live=live)
    times.append(r.measurement.wall_s)
print(json.dumps({"epoch_s": times, "actual": r.actual}))
'''


def corun(cases: list[dict], env_extra: dict[str, str], epochs: int, samples: int) -> list[dict]:
    """Start one process per case at once; return each one's epoch times."""
    work = tempfile.mkdtemp(prefix="pipetune-knobs-")
    procs = []
    for trial, case in enumerate(cases):
        spec = {"trial": trial, "epochs": epochs, "samples": samples, "dir": work, **case}
        env = {**os.environ, **env_extra}
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec)],
                                      env=env, stdout=subprocess.PIPE, text=True))
    out = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=900)
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def median_after_first(result: dict) -> float:
    times = result["epoch_s"]
    return statistics.median(times[1:] if len(times) > 1 else times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1400)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    rows = []

    def case(name: str, cases: list[dict], env: dict[str, str]) -> None:
        res = corun(cases, env, args.epochs, args.samples)
        rows.append({"case": name, "epoch_s": [median_after_first(r) for r in res],
                     "actual": [r["actual"] for r in res]})
        print(f"{name}: median epoch s per co-runner "
              f"{[round(median_after_first(r), 3) for r in res]}", flush=True)

    two = {"system": {"cores": min(2, cores)}}
    one = {"system": {"cores": 1}}
    for policy in ("ACTIVE", "PASSIVE"):
        case(f"omp {policy.lower()}: cores=2 beside cores=1", [two, one],
             {"OMP_WAIT_POLICY": policy})
    for policy in ("ACTIVE", "PASSIVE"):
        case(f"omp {policy.lower()}: cores=2 beside cores=2", [two, two],
             {"OMP_WAIT_POLICY": policy})
    case("unpinned: cores=1 beside cores=1", [one, one], {"OMP_WAIT_POLICY": "PASSIVE"})
    pinned = [{"system": {"cores": 1, "pin_cores": True}, "cpus": [i % cores]}
              for i in range(2)]
    case("pinned to disjoint cores: cores=1 beside cores=1", pinned,
         {"OMP_WAIT_POLICY": "PASSIVE"})
    print("\n| case | median epoch s (co-runner 1, 2) | sum |")
    print("|---|---|---:|")
    for r in rows:
        print(f"| {r['case']} | {', '.join(f'{t:.3f}' for t in r['epoch_s'])} | "
              f"{sum(r['epoch_s']):.3f} |")
    Path("benchmarks/results").mkdir(parents=True, exist_ok=True)
    Path("benchmarks/results/knobs.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
