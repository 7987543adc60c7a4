"""Scale: Ray Tune's release-test shapes on this machine, whole process, start-up included.

Two shapes, after ``release/tune_tests/scalability_tests/`` in ray-project/ray:

* ``bookkeeping``: T trials of one 1 s epoch (the ``synthetic`` workload sleeping,
  PipeTune on, so that epoch is each trial's profiled first epoch) on S slots
  (``pipetune tune --workers S --cores-per-worker 1``); the minimum is T x 1 s / S.
* ``throughput``: C trials at once, each reporting an epoch every second for E epochs
  (default 60); the ideal rate is C results per second, the minimum E seconds.

With ``--keep-warm 0`` (the study then runs in the command's own process) the driver's
and the recorder's resident memory is sampled against the trials started: ``memory``
in the JSON holds both at trial 200, once the last trial started, and at the end (the
release tests' long-study shape: run ``bookkeeping --trials 2000 --keep-warm 0``).

Each run is one ``pipetune tune`` in a folder of its own (its own MLflow SQLite file,
Prefect home and pipetune home: the embedded default), after a 2-trial warm-up study
there (a machine that ran pipetune before: stores created and migrated, and the local
service kept warm, as by default; ``--keep-warm 0``: each command starts its own
server and cluster), timed from before the process starts to after it exits. Afterwards the
record is checked: every trial has exactly one MLflow run, with one ``train_loss`` per
epoch, and exactly one Prefect task run per epoch, in its final state. ``--peer ray``
runs the same shape under Ray Tune (the ``peers`` extra) in the same invocation, after
pipetune's.

    python benchmarks/scale.py bookkeeping --trials 1000 --slots 16 [--peer ray]
    python benchmarks/scale.py throughput --trials 16 --epochs 60
    python benchmarks/scale.py bookkeeping --trials 1000 --slots 16 --stack   # team stack

The last line is ``ratio R`` (pipetune's whole process over the minimum); ``--json
FILE`` keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from load import MemorySampler  # noqa: E402  (a sibling script: one sampler for both)


def job(name: str, trials: int, slots: int, epochs: int) -> dict:
    return {
        "name": name,
        "workload": {"name": "synthetic",
                     "params": {"base_seconds": 1.0, "train_samples": 16, "val_samples": 16}},
        "hyperparameters": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.1}},
        "search": {"algorithm": "random", "trials": trials, "seed": 0, "max_concurrent": slots},
        "early_stopping": {"policy": "none", "max_epochs": epochs},
    }


#: ``PIPETUNE_KEEP_WARM_S`` for the runs: None, the default (a warm local service, kept
#: between commands); "0", each command starts and stops its own server and cluster.
KEEP_WARM: str | None = None
#: The team stack's environment (``pipetune stack up``: PostgreSQL, Prefect, MLflow and
#: Dask servers), with ``--stack``; None: the embedded default.
STACK: dict[str, str] | None = None


def _env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "MLFLOW_", "PIPETUNE_"))}
    if KEEP_WARM is not None:
        env["PIPETUNE_KEEP_WARM_S"] = KEEP_WARM
    env.update(STACK or {})
    env.update(PIPETUNE_HOME=str(folder / "home"), PREFECT_HOME=str(folder / "prefect"),
               MLFLOW_DISABLE_TELEMETRY="true",
               PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
               PYTHONPATH=str(ROOT))
    return env


def growth(sampler: MemorySampler, early: int = 200) -> dict | None:
    """Driver and recorder memory at the first sample past ``early`` trials started
    (the warm-up's 2 counted too), at the first sample once the last trial started (the
    target's "from trial 200 to trial 2,000") and at the last sample (after the study's
    end: its summary, table and timeline drawn): MB each, and the growth."""
    after = [r for r in sampler.rows if r[1] >= early and r[3] > 0]
    if len(after) < 2:
        return None
    last_trial = next(r for r in after if r[1] == after[-1][1])
    (_, n0, d0, r0), (_, n1, d1, r1) = after[0], last_trial
    (_, _, d2, r2) = after[-1]
    return {"trials": [n0, n1], "driver_mb": [d0, d1], "recorder_mb": [r0, r1],
            "driver_growth": d1 / d0 - 1, "recorder_growth": r1 / r0 - 1,
            "at_end": {"driver_mb": d2, "recorder_mb": r2, "driver_growth": d2 / d0 - 1,
                       "recorder_growth": r2 / r0 - 1},
            "series": [[round(t, 1), n, round(d, 1), round(r, 1)]
                       for t, n, d, r in sampler.rows[::5]]}


def _tune(folder: Path, spec: dict, slots: int,
          memory: bool = False) -> tuple[str, float, MemorySampler | None]:
    path = folder / f"{spec['name']}.json"
    path.write_text(json.dumps(spec))
    started = time.monotonic()
    sized = [] if STACK else ["--workers", str(slots), "--cores-per-worker", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipetune", "tune", str(path), *sized],
        cwd=folder, env=_env(folder), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    sampler = MemorySampler(proc.pid, folder / "home" / "studies") if memory else None
    if sampler is not None:
        sampler.start()
    out, err = proc.communicate(timeout=7200)
    whole = time.monotonic() - started
    if sampler is not None:
        sampler.done.set()
        sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"pipetune tune exited {proc.returncode}:\n{err[-3000:]}")
    return out, whole, sampler


def run_pipetune(folder: Path, spec: dict, slots: int) -> dict:
    """A warm-up study first (2 trials: the Prefect database and the MLflow store are
    created and migrated, as on any machine that ran pipetune before), then the
    measured one, in the same folder."""
    folder.mkdir(parents=True, exist_ok=True)
    warm_up = {**spec, "name": "warm-up", "search": {**spec["search"], "trials": 2}}
    try:
        _tune(folder, warm_up, slots)
        out, whole, sampler = _tune(folder, spec, slots, memory=KEEP_WARM == "0")
    finally:  # the warm service the first command started, if any
        subprocess.run([sys.executable, "-m", "pipetune", "service", "stop"], cwd=folder,
                       env=_env(folder), capture_output=True, timeout=120)
    marks = dict((k.strip(), float(v)) for k, v in re.findall(
        r"([a-zA-Z -]+?) (\d+\.\d+)(?:,|$)", out.rsplit("start-up (s from process start):",
                                                      1)[-1].splitlines()[0]))
    tuning = float(re.search(r"tuning wall time ([\d.]+) s", out).group(1))
    busy = re.search(r"slots busy (\d+)%", out)
    return {"whole_s": whole, "tuning_s": tuning, "marks": marks,
            "slots_busy": int(busy.group(1)) / 100 if busy else None,
            "memory": growth(sampler) if sampler is not None else None,
            "records": records(folder, spec)}


def records(folder: Path, spec: dict) -> dict:
    """What the study's record holds, checked: one MLflow run per trial, each with one
    ``train_loss`` per epoch; one Prefect task run per epoch, each in a final state."""
    from mlflow.tracking import MlflowClient

    trials, epochs = spec["search"]["trials"], spec["early_stopping"]["max_epochs"]
    study = max((folder / "home" / "studies").glob(f"{spec['name']}-*"),
                key=lambda p: p.stat().st_mtime).name
    if STACK:
        return _stack_records(study, trials, epochs)
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    exp = client.get_experiment_by_name("pipetune")
    runs = client.search_runs(
        [exp.experiment_id],
        f"tags.`pipetune.kind` = 'trial' and tags.`pipetune.study_id` = '{study}'",
        max_results=50_000)
    ids = [r.data.tags.get("pipetune.trial_id") for r in runs]
    db = sqlite3.connect(folder / "mlflow.db")
    steps = db.execute(
        "SELECT run_uuid, COUNT(*), COUNT(DISTINCT step) FROM metrics "
        "WHERE key = 'train_loss' GROUP BY run_uuid").fetchall()
    once = {run for run, n, distinct in steps if n == distinct == epochs}
    prefect = sqlite3.connect(folder / "prefect" / "prefect.db")
    names = prefect.execute(
        "SELECT t.name, COUNT(*), SUM(t.state_type = 'COMPLETED') FROM task_run t "
        "JOIN flow_run f ON t.flow_run_id = f.id WHERE f.name = ? "
        "AND t.task_key LIKE 'train_epoch-%' GROUP BY t.name", (study,)).fetchall()
    return {
        "mlflow_trial_runs": len(runs), "mlflow_distinct_trials": len(set(ids)),
        "mlflow_metrics_once": sum(1 for r in runs if r.info.run_id in once),
        "mlflow_finished": sum(1 for r in runs if r.info.status == "FINISHED"),
        "prefect_epoch_task_runs": sum(n for _, n, _ in names),
        "prefect_distinct_epochs": len(names),
        "prefect_completed": sum(c or 0 for _, _, c in names),
        "complete": (len(runs) == len(set(ids)) == trials
                     and sum(1 for r in runs if r.info.run_id in once) == trials
                     and sum(n for _, n, _ in names) == len(names) == trials * epochs),
    }


def _stack_records(study: str, trials: int, epochs: int) -> dict:
    """:func:`records` on the team stack: MLflow through its server, Prefect through its
    API (both on PostgreSQL)."""
    import urllib.request

    from mlflow.tracking import MlflowClient

    assert STACK is not None
    client = MlflowClient(STACK["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("pipetune")
    runs = client.search_runs(
        [exp.experiment_id],
        f"tags.`pipetune.kind` = 'trial' and tags.`pipetune.study_id` = '{study}'",
        max_results=50_000)
    once = sum(1 for r in runs if sorted(m.step for m in client.get_metric_history(
        r.info.run_id, "train_loss")) == list(range(1, epochs + 1)))
    api = STACK["PREFECT_API_URL"].rstrip("/")

    def post(path: str, body: dict) -> list[dict]:
        request = urllib.request.Request(f"{api}/{path}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read())

    (flow_run,) = post("flow_runs/filter", {"flow_runs": {"name": {"any_": [study]}}})
    names: dict[str, list[str]] = {}
    offset = 0
    while True:
        page = post("task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run["id"]]}},
                                         "limit": 200, "offset": offset})
        for run in page:
            if run["task_key"].startswith("train_epoch-"):
                names.setdefault(run["name"], []).append(run["state_type"])
        if len(page) < 200:
            break
        offset += 200
    count = sum(len(v) for v in names.values())
    return {
        "mlflow_trial_runs": len(runs),
        "mlflow_distinct_trials": len({r.data.tags.get("pipetune.trial_id") for r in runs}),
        "mlflow_metrics_once": once,
        "mlflow_finished": sum(1 for r in runs if r.info.status == "FINISHED"),
        "prefect_epoch_task_runs": count, "prefect_distinct_epochs": len(names),
        "prefect_completed": sum(v.count("COMPLETED") for v in names.values()),
        "complete": (len(runs) == trials and once == trials
                     and count == len(names) == trials * epochs),
    }


def start_stack(work: Path, slots: int) -> dict[str, str]:
    """``pipetune stack up`` with ``slots`` one-core workers; its environment."""
    folder = work / "stack"
    subprocess.run([sys.executable, "-m", "pipetune", "stack", "up", "--dir", str(folder),
                    "--workers", str(slots), "--cores-per-worker", "1"], check=True,
                   env=_env(work), capture_output=True, timeout=600)
    return json.loads((folder / "stack.json").read_text())["env"]


def stop_stack(work: Path) -> None:
    subprocess.run([sys.executable, "-m", "pipetune", "stack", "down", "--dir",
                    str(work / "stack")], env=_env(work), capture_output=True, timeout=300)


RAY_SCRIPT = r"""
import json, sys, time
from ray import tune
import ray
trials, slots, epochs = map(int, sys.argv[1:4])
ray.init(num_cpus=slots, include_dashboard=False, log_to_driver=False,
         _temp_dir=sys.argv[4])
def trainable(config):
    for epoch in range(epochs):
        time.sleep(1.0)
        tune.report({"loss": config["lr"] / (epoch + 1)})
tuner = tune.Tuner(tune.with_resources(trainable, {"cpu": 1}),
                   param_space={"lr": tune.loguniform(0.01, 0.1)},
                   tune_config=tune.TuneConfig(num_samples=trials, max_concurrent_trials=slots,
                                               metric="loss", mode="min"),
                   run_config=tune.RunConfig(storage_path=sys.argv[5], verbose=0))
results = tuner.fit()
print(json.dumps({"trials": len(results),
                  "reported": sum(len(r.metrics_dataframe) for r in results
                                  if r.metrics_dataframe is not None)}))
"""


def run_ray(folder: Path, trials: int, slots: int, epochs: int) -> dict | None:
    try:
        import ray  # noqa: F401
    except ImportError:
        print("ray-tune: skipped (pip install 'pipetune[peers]')", flush=True)
        return None
    folder.mkdir(parents=True, exist_ok=True)
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", RAY_SCRIPT, str(trials), str(slots),
                           str(epochs), temp, str(folder / "results")],
                          capture_output=True, text=True, timeout=14400)
    whole = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"ray tune exited {done.returncode}:\n{done.stderr[-3000:]}")
    return {"whole_s": whole, **json.loads(done.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=("bookkeeping", "throughput"))
    ap.add_argument("--trials", type=int, default=None,
                    help="bookkeeping: trials (default 1000); throughput: trials at once (16)")
    ap.add_argument("--slots", type=int, default=None,
                    help="worker slots (bookkeeping default 16; throughput: --trials)")
    ap.add_argument("--epochs", type=int, default=60, help="throughput: epochs per trial")
    ap.add_argument("--peer", choices=("ray",), action="append", default=[])
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--keep", action="store_true", help="keep the run folders")
    ap.add_argument("--keep-warm", default=None, metavar="SECONDS",
                    help="PIPETUNE_KEEP_WARM_S for the runs (default: pipetune's default, a "
                    "warm local service between commands; 0: each command cold)")
    ap.add_argument("--stack", action="store_true",
                    help="on the team stack (pipetune stack up, S one-core workers), not "
                    "the embedded default; its start is not timed")
    args = ap.parse_args(argv)
    global KEEP_WARM, STACK
    KEEP_WARM = args.keep_warm
    if args.shape == "bookkeeping":
        trials, epochs = args.trials or 1000, 1
        slots = args.slots or 16
    else:
        trials, epochs = args.trials or 16, args.epochs
        slots = args.slots or trials
    minimum = trials * epochs / slots if args.shape == "bookkeeping" else float(epochs)
    work = Path(tempfile.mkdtemp(prefix="pt-scale-"))
    out = {"shape": args.shape, "trials": trials, "slots": slots, "epochs": epochs,
           "keep_warm_s": KEEP_WARM or "default", "where": "stack" if args.stack else
           "embedded",
           "minimum_s": minimum, "cores": os.cpu_count(), "folder": str(work)}
    if args.stack:
        STACK = start_stack(work, slots)
    try:
        ours = run_pipetune(work / "pipetune", job("scale", trials, slots, epochs), slots)
    finally:
        if args.stack:
            stop_stack(work)
    out["pipetune"] = ours
    ours["ratio"] = ours["whole_s"] / minimum
    ended = ours["marks"].get("study done")
    flow = ours["marks"].get("flow ended")
    ours["record_behind_s"] = (flow - ended) if ended is not None and flow else None
    ours["results_per_s"] = trials * epochs / ours["tuning_s"]
    print(json.dumps({"pipetune": ours}), flush=True)
    if "ray" in args.peer:
        peer = run_ray(work / "ray", trials, slots, epochs)
        if peer is not None:
            peer["ratio"] = peer["whole_s"] / minimum
            out["ray-tune"] = peer
            print(json.dumps({"ray-tune": peer}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    rec = ours["records"]
    print(f"{args.shape}: {trials} trials x {epochs} epoch(s) of 1 s on {slots} slots, "
          f"minimum {minimum:.1f} s; pipetune whole {ours['whole_s']:.1f} s, tuning "
          f"{ours['tuning_s']:.1f} s, slots busy {ours['slots_busy']}, record "
          f"{'complete, once' if rec['complete'] else 'INCOMPLETE: ' + json.dumps(rec)}"
          + (f"; ray-tune whole {out['ray-tune']['whole_s']:.1f} s "
             f"(ratio {out['ray-tune']['ratio']:.2f})" if "ray-tune" in out else ""))
    mem = ours.get("memory")
    if mem:
        print(f"memory from trial {mem['trials'][0]} to {mem['trials'][1]}: driver "
              f"{mem['driver_mb'][0]:.0f} -> {mem['driver_mb'][1]:.0f} MB "
              f"({mem['driver_growth']:+.1%}), recorder {mem['recorder_mb'][0]:.0f} -> "
              f"{mem['recorder_mb'][1]:.0f} MB ({mem['recorder_growth']:+.1%}); after the "
              f"study's end: driver {mem['at_end']['driver_growth']:+.1%}, recorder "
              f"{mem['at_end']['recorder_growth']:+.1%}")
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    print(f"ratio {ours['ratio']:.3f}")
    return 0 if rec["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
