"""What one trial's MLflow record costs the recorder: the writes a one-epoch trial sends
(its run, params, the epoch's metrics and tags, its end's metrics and tags, the
profile table, its end), through :class:`pipetune.tracking.MlflowSink` as the recorder
makes them, timed per trial (wall and this process's CPU).

    python benchmarks/mlflow_writes.py [--trials 200] [--tracking-uri URI]

Default store: a fresh SQLite file in a temporary folder (the embedded default's kind).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def one_trial(sink, trial: int) -> None:
    run = ("trial", trial)
    now = int(time.time() * 1000)
    sink.create_child(trial)
    sink.log(run, [], [("lr", "0.01"), ("seed", "3")], [])
    sink.log(run, [(f"metric_{j}", 0.5, 1, now) for j in range(12)], [],
             [(f"epoch.001.tag_{j}", "v" * 40) for j in range(10)])
    sink.log(run, [("final_accuracy", 0.9, 1, now)], [(f"best_{j}", "x") for j in range(6)],
             [("outcome", "completed")])
    sink.log_profiles(run, [{"epoch": 1, "cpu_s": 0.1, "wall_s": 1.0}])
    sink.terminate(run, "FINISHED", now + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--tracking-uri", default=None)
    args = ap.parse_args()
    from mlflow.tracking import MlflowClient

    from pipetune.tracking import MlflowSink

    with tempfile.TemporaryDirectory() as tmp:
        uri = args.tracking_uri or f"sqlite:///{tmp}/mlflow.db"
        client = MlflowClient(uri)
        sink = MlflowSink(client=client, tracking_uri=uri, tags={"pipetune.study_id": "bench"})
        sink.open_study("pipetune-mlflow-writes", f"writes-{os.getpid()}", {}, [], [])
        for i in range(20):  # warm: first calls import and prepare
            one_trial(sink, 100_000 + i)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for i in range(args.trials):
            one_trial(sink, i)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        sink.finish_study(end=True)
    print(f"{args.trials} trials: {wall / args.trials * 1e3:.1f} ms wall, "
          f"{cpu / args.trials * 1e3:.1f} ms CPU a trial ({uri.split(':')[0]})")


if __name__ == "__main__":
    main()
