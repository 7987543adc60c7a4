"""Team mode against the embedded default: stack start-up, per-epoch overhead, a study.

In one run, so the ratios share the machine's noise:

1. ``pipetune stack up`` in a fresh folder (PostgreSQL, Prefect server + worker, MLflow
   server with the artifact proxy, a Dask scheduler and 2 workers of 2 cores each, as
   the embedded cluster's workers each advertise the machine's 2 cores: the README
   example probes ``cores: 2``): its start-up, per component, from ``stack.json``;
2. the same jobs through ``pipetune tune``, as a user runs it, twice each way:
   *embedded* (a Prefect server started for the run, a LocalCluster, MLflow on SQLite,
   checkpoints and ground truth on local disk) and *stack* (every URL from
   ``pipetune stack env``: PostgreSQL-backed servers, epochs on the stack's workers,
   checkpoints through MLflow's proxy, the ground truth in PostgreSQL):

   - **Z**, zero-length epochs (synthetic, 16 samples, no sleep; 4 trials x 8 epochs,
     PipeTune off): the fixed orchestration cost per epoch;
   - **B**, the README example (``examples/lenet_digits.yaml``): a full study;

   read back from each study's MLflow parent run: median overhead per epoch, the
   overhead's share of the critical path, tuning wall time, epochs; and the whole
   command's wall time;
3. ``pipetune stack down``.

    python benchmarks/team_stack.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def zero_job() -> dict:
    return {
        "name": "zero-epochs",
        "workload": {"name": "synthetic", "params": {"train_samples": 16, "val_samples": 16}},
        "hyperparameters": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.1}},
        "search": {"algorithm": "random", "trials": 4, "seed": 0, "max_concurrent": 2},
        "early_stopping": {"policy": "none", "max_epochs": 8},
        "pipetune": {"enabled": False},
    }


def _pipetune(*args: str, env: dict[str, str], timeout: float = 1800) -> tuple[str, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipetune", *args], env=env, cwd=env["PWD"],
                          capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"pipetune {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout + proc.stderr, wall


def _env(home: Path, extra: dict[str, str]) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "MLFLOW_", "PIPETUNE_"))}
    env.update(extra)
    env.update(PIPETUNE_HOME=str(home / ".pipetune"), PREFECT_HOME=str(home / ".prefect"),
               MLFLOW_DISABLE_TELEMETRY="true", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PWD=str(home), PYTHONPATH=str(ROOT))
    return env


def _study_metrics(tracking_uri: str, out: str) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("pipetune")
    run = client.search_runs([exp.experiment_id], "tags.`pipetune.kind` = 'study'",
                             order_by=["start_time DESC"], max_results=1)[0]
    assert run.info.run_id in out, "the newest study run is not the one just printed"
    # the study run's metrics are named study_<summary key> (pipetune.tracking.tracker)
    return {k.removeprefix("study_"): v for k, v in run.data.metrics.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pipetune-team-bench-"))
    stack_dir = work / "stack"
    (work / "zero.yaml").write_text(json.dumps(zero_job()))
    jobs = {"Z": str(work / "zero.yaml"), "B": str(ROOT / "examples" / "lenet_digits.yaml")}
    rows: list[dict] = []
    try:
        t0 = time.monotonic()
        _pipetune("stack", "up", "--dir", str(stack_dir), "--workers", "2",
                  "--cores-per-worker", "2",
                  env=_env(work / "admin", {}))
        up_wall = time.monotonic() - t0
        state = json.loads((stack_dir / "stack.json").read_text())
        print(f"stack up: {up_wall:.1f} s wall; per component (s): "
              + ", ".join(f"{k} {v:.1f}" for k, v in state["startup_s"].items()), flush=True)
        for repeat in range(args.repeats):
            for mode in ("embedded", "stack"):
                for label, job in jobs.items():
                    home = work / f"{mode}-{label}-{repeat}"
                    env = _env(home, state["env"] if mode == "stack" else {})
                    if mode == "stack":  # cold, as each embedded run is: no earlier records
                        _pipetune("groundtruth", "clear", "--yes", env=env)
                    out, wall = _pipetune("tune", job, env=env)
                    uri = (state["env"]["MLFLOW_TRACKING_URI"] if mode == "stack"
                           else f"sqlite:///{home / 'mlflow.db'}")
                    m = _study_metrics(uri, out)
                    row = {"job": label, "mode": mode, "repeat": repeat, "process_s": wall,
                           "tuning_s": m["tuning_wall_s"], "epochs": m["epochs_run"],
                           "overhead_ms": 1000 * m["orchestration_overhead_s_median"],
                           "share": m["orchestration_share"],
                           "best": m.get("best_value", float("nan"))}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "pipetune", "stack", "down", "--dir",
                        str(stack_dir)], capture_output=True, timeout=300)
        print(f"stack down: {time.monotonic() - t0:.1f} s", flush=True)
        from pipetune.stack import Postgres

        Postgres(stack_dir / "postgres").remove()
        shutil.rmtree(work, ignore_errors=True)
    print("\n| job | mode | overhead per epoch (median ms) | overhead share | tuning s | "
          "whole command s | epochs |")
    print("|---|---|---|---|---|---|---|")
    for label in jobs:
        for mode in ("embedded", "stack"):
            mine = [r for r in rows if r["job"] == label and r["mode"] == mode]
            print(f"| {label} | {mode} | "
                  + " / ".join(f"{r['overhead_ms']:.0f}" for r in mine) + " | "
                  + " / ".join(f"{100 * r['share']:.1f}%" for r in mine) + " | "
                  + " / ".join(f"{r['tuning_s']:.1f}" for r in mine) + " | "
                  + " / ".join(f"{r['process_s']:.1f}" for r in mine) + " | "
                  + " / ".join(f"{r['epochs']:.0f}" for r in mine) + " |")
        emb = statistics.median(r["tuning_s"] for r in rows
                                if r["job"] == label and r["mode"] == "embedded")
        stk = statistics.median(r["tuning_s"] for r in rows
                                if r["job"] == label and r["mode"] == "stack")
        print(f"\n{label}: stack / embedded tuning time = {stk / emb:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
