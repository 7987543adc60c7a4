"""Orchestration overhead of a study: Prefect + Dask + MLflow around each epoch's compute.

Runs, in one process and one go (so the ratios share the machine's noise):

Z. zero-length epochs: the synthetic workload on 16 samples with no sleep, 5 trials x
   10 epochs (50 epochs): what is left per epoch is the fixed orchestration cost,
A. a job whose epoch is a fixed sleep (the synthetic workload with ``base_seconds``),
B. the README example (``examples/lenet_digits.yaml``),

each through the real path ``pipetune tune`` takes: a local Prefect server on
127.0.0.1, ``study_flow`` on the process's embedded Dask LocalCluster and its
recorder process (each started once, before the first study, outside every clock),
MLflow on SQLite. Per
epoch it splits the time around the compute into: Prefect/Dask round trip (submit ->
result, minus the worker's time), worker extra (workload rebuild, checkpoint load and
save) and loop gap (result -> next epoch submitted: lookup, tuning, MLflow logging).

    python benchmarks/orchestration_overhead.py [--sleep 2.0] [--trials 4] [--epochs 3]

Targets (issue 9): Z median overhead per epoch <= 30 ms; A share <= 5%; B share <= 10%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sleep_job(sleep: float, trials: int, epochs: int, samples: int = 256,
              name: str = "fixed-sleep") -> dict:
    return {
        "name": name,
        "workload": {"name": "synthetic",
                     "params": {"base_seconds": sleep, "train_samples": samples,
                                "val_samples": samples // 2}},
        "hyperparameters": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.1}},
        "system": {"default": {"cores": 1}, "space": {"dataloader_workers": [0, 1]}},
        "search": {"algorithm": "random", "trials": trials, "seed": 0, "max_concurrent": 2},
        "profiler": {"op_mix_steps": 1},
        "early_stopping": {"policy": "none", "max_epochs": epochs},
    }


def report(name: str, summary: dict, command_s: float) -> dict:
    rows = summary["epoch_timings"]
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("compute_s", "overhead_s", "round_trip_s", "worker_extra_s", "loop_gap_s")}
    print(f"\n== {name}: {len(rows)} epochs, tuning wall {summary['tuning_wall_s']:.1f} s, "
          f"whole run (server + cluster start included) {command_s:.1f} s")
    print("per epoch, median s: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    print(f"overhead share of the epochs' critical path: {summary['orchestration_share']:.1%}")
    print("epoch rows (trial, epoch, compute, round trip, worker extra, loop gap):")
    for r in sorted(rows, key=lambda r: (r["trial"], r["epoch"])):
        print(f"  {r['trial']} {r['epoch']} {r['compute_s']:.2f} {r['round_trip_s']:.3f} "
              f"{r['worker_extra_s']:.3f} {r['loop_gap_s']:.3f}")
    return {"name": name, **med, "share": summary["orchestration_share"],
            "tuning_wall_s": summary["tuning_wall_s"], "command_s": command_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sleep", type=float, default=2.0, help="seconds per epoch in job A")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--example", default=str(ROOT / "examples" / "lenet_digits.yaml"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pipetune-overhead-"))
    os.environ["PIPETUNE_HOME"] = str(work / "home")
    os.environ["PREFECT_HOME"] = str(work / "prefect")
    for key, value in {"PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_LOGGING_LEVEL": "WARNING",
                       "DASK_LOGGING__DISTRIBUTED": "warning"}.items():
        os.environ.setdefault(key, value)

    from pipetune.prefect_server import LocalPrefectServer

    started = time.time()
    server = LocalPrefectServer(log_path=work / "prefect.log").start()
    server_s = time.time() - started
    os.environ["PREFECT_API_URL"] = server.api_url
    print(f"Prefect server healthy after {server_s:.1f} s")
    try:
        from flows.study import study_flow
        from pipetune.dask.cluster import close_shared_cluster, shared_cluster
        from pipetune.sidecar import shared_host
        from pipetune.tracking import ensure_experiment

        t0 = time.time()
        shared_cluster()
        print(f"embedded cluster warm after {time.time() - t0:.1f} s (outside every clock)")
        t0 = time.time()
        shared_host(preload=("mlflow.tracking", "pandas", "prefect.client.orchestration",
                             "tasks.task_run_sink")).wait_ready()
        print(f"recorder process ready after {time.time() - t0:.1f} s (outside every clock)")
        ensure_experiment(f"sqlite:///{work / 'mlflow.db'}")
        results = []
        for name, job in (("Z zero-length epochs", sleep_job(0.0, 5, 10, 16, "zero-length")),
                          ("A fixed sleep", sleep_job(args.sleep, args.trials, args.epochs)),
                          ("B README example", args.example)):
            t0 = time.time()
            summary = study_flow(job=job, tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
            results.append(report(name, summary, time.time() - t0))
    finally:
        close_shared_cluster()
        server.stop()
    print("\n| job | epochs' median compute s | median overhead s | round trip | worker extra"
          " | loop gap | overhead share | tuning wall s | run s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r['compute_s']:.2f} | {r['overhead_s']:.3f} | "
              f"{r['round_trip_s']:.3f} | {r['worker_extra_s']:.3f} | {r['loop_gap_s']:.3f} | "
              f"{r['share']:.1%} | {r['tuning_wall_s']:.1f} | {r['command_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
