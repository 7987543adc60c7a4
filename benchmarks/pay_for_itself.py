"""Does pipetune pay for itself? Whole-process seconds per epoch against plain Optuna.

For one job file, in one run, each in a fresh process as a user would start it:

- ``optuna-plain``: ``python -m pipetune.bench.optuna_plain`` (TPE + successive halving,
  one torch thread per trial, as many trials at once as cores);
- ``optuna-compiled``: the same, every trial compiled (``system.default.compile``),
  into a fresh compile cache of its own;
- ``ray-tune``: ``python -m pipetune.bench.ray_tune`` (Ray Tune: OptunaSearch TPE +
  ASHA, one CPU and one torch thread per trial, as many trials at once as cores);
  skipped with one line when Ray is not installed (``pip install 'pipetune[peers]'``);
- ``pipetune-cold``: ``pipetune tune`` with a fresh pipetune home (empty ground truth
  and compile cache), a fresh MLflow store and no warm service (it starts one);
- ``pipetune-warm``: ``pipetune tune`` again on the same home (the ground truth and
  compile cache the cold run left, and the warm service it kept: its Prefect server and
  Dask cluster, ``pipetune.service``, once its spare driver and recorder wait, up to
  60 s; stopped at the end).

Printed per strategy: whole-process seconds, epochs trained, seconds per epoch, its
ratio to the better Optuna, best accuracy and, for pipetune, the share of the cores
kept busy over the tuning time (sum over epochs of seconds x cores the epoch reserved,
over tuning wall x cores) and whole process minus tuning time.

    .venv/bin/python benchmarks/pay_for_itself.py benchmarks/jobs/resnet_mnist.yaml
    .venv/bin/python benchmarks/pay_for_itself.py benchmarks/jobs/lenet_mnist.yaml --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def job_dict(path: Path) -> dict:
    """The job as pipetune reads it, the bench section resolved (datasets, fallback)."""
    from pipetune.bench import load_bench_job

    return load_bench_job(path).spec.to_dict()


def env_for(home: Path, cache: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PIPETUNE_SET_INDUCTOR_CACHE",
                        "TORCHINDUCTOR_CACHE_DIR")}
    env.update(PIPETUNE_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               MLFLOW_DISABLE_TELEMETRY="true",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120")
    env.setdefault("PREFECT_HOME", str(home / "prefect"))
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    return env


#: The strategies run in a fresh process of their own module, no pipetune around them.
PEER_MODULES = {"optuna-plain": "pipetune.bench.optuna_plain",
                "optuna-compiled": "pipetune.bench.optuna_plain",
                "ray-tune": "pipetune.bench.ray_tune"}
STRATEGIES = ("optuna-plain", "optuna-compiled", "ray-tune", "pipetune-cold", "pipetune-warm")


def run_peer(job: dict, work: Path, name: str) -> dict | None:
    """A peer strategy (optuna-plain, optuna-compiled, ray-tune) in a fresh process;
    None, after its one line on stderr, when its library is not installed."""
    from pipetune.bench import peer_unavailable
    from pipetune.bench.ray_tune import EXIT_UNAVAILABLE

    line = peer_unavailable(name)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
        return None
    data = json.loads(json.dumps(job))
    data["pipetune"]["enabled"] = False
    if name == "optuna-compiled":
        data["system"]["default"]["compile"] = True
    path = work / f"{name}.json"
    path.write_text(json.dumps(data))
    out = work / f"{name}-result.json"
    env = env_for(work / f"{name}-home", work / f"{name}-cache")
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", PEER_MODULES[name], str(path),
                           "--json", str(out)], env=env, capture_output=True, text=True)
    wall = time.time() - started
    if name == "ray-tune" and proc.returncode == EXIT_UNAVAILABLE:  # ray without ray.tune
        print(proc.stderr.strip().splitlines()[-1], file=sys.stderr, flush=True)
        return None
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed: {proc.stderr[-2000:]}")
    result = json.loads(out.read_text())
    return {"strategy": name, "process_s": wall, "epochs": result["epochs_run"],
            "best": result["best_value"], "tuning_s": result["tuning_wall_s"]}


def run_pipetune(job: dict, work: Path, name: str, home: Path) -> dict:
    import mlflow

    path = work / "pipetune-job.json"
    path.write_text(json.dumps(job))
    db = work / f"{name}.db"
    uri = f"sqlite:///{db}"
    env = env_for(home, None)
    started = time.time()
    proc = subprocess.run([str(BIN / "pipetune"), "tune", str(path), "--tracking-uri", uri],
                          env=env, cwd=work, capture_output=True, text=True)
    wall = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed: {proc.stderr[-2000:]}")
    client = mlflow.MlflowClient(uri)
    (exp,) = [e for e in client.search_experiments() if e.name != "Default"]
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    # the study run's metrics are named study_<summary key> (pipetune.tracking.tracker)
    m = {k.removeprefix("study_"): v for k, v in parent.data.metrics.items()}
    busy = 0.0
    for child in (r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id):
        secs = client.get_metric_history(child.info.run_id, "epoch_seconds")
        cores = {x.step: x.value for x in client.get_metric_history(child.info.run_id,
                                                                     "sys_cores")}
        busy += sum(x.value * cores.get(x.step, 1.0) for x in secs)
    from pipetune.system.config import MachineInfo

    budget = MachineInfo.detect().cores
    tuning = m["tuning_wall_s"]
    return {"strategy": name, "process_s": wall, "epochs": int(m["epochs_run"]),
            "best": m.get("best_value"), "tuning_s": tuning,
            "busy": busy / (tuning * budget) if tuning > 0 else float("nan"),
            "outside_tuning_s": wall - tuning, "probes": int(m["probe_epochs"]),
            "slots_busy": m.get("slots_busy"),
            "hits": f"{int(m['groundtruth_hits'])}/{int(m['groundtruth_lookups'])}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--skip", default="", help="comma-separated strategies to leave out "
                        f"(of {', '.join(STRATEGIES)})")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    unknown = sorted(skip - set(STRATEGIES))
    if unknown:
        parser.error(f"--skip: unknown strategy {', '.join(unknown)}")
    job = job_dict(args.job.resolve())
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipetune-pays-") as tmp:
        work = Path(tmp)
        home = work / "pipetune-home"
        for name in STRATEGIES:
            if name in skip:
                continue
            if name in PEER_MODULES:
                row = run_peer(job, work, name)
            else:
                if name == "pipetune-warm":
                    settle(home, work)
                row = run_pipetune(job, work, name, home)
            if row is not None:
                rows.append(row)
                print(json.dumps(row), flush=True)
        stop_service(home, work)
    per_epoch = {r["strategy"]: r["process_s"] / r["epochs"] for r in rows if r["epochs"]}
    optuna = [per_epoch[n] for n in ("optuna-plain", "optuna-compiled") if n in per_epoch]
    ref = min(optuna) if optuna else None
    print(f"\n{job['name']}: whole-process seconds per epoch")
    print(f"{'strategy':16} {'process s':>9} {'epochs':>6} {'s/epoch':>8} {'vs best optuna':>14} "
          f"{'best acc':>8} {'busy':>5} {'outside tuning s':>16}")
    for r in rows:
        pe = per_epoch.get(r["strategy"])
        ratio = f"{pe / ref:.2f}x" if ref and pe else "-"
        busy = f"{r['busy']:.0%}" if "busy" in r else "-"
        outside = f"{r['outside_tuning_s']:.1f}" if "outside_tuning_s" in r else "-"
        best = f"{r['best']:.4f}" if r["best"] is not None else "-"
        print(f"{r['strategy']:16} {r['process_s']:9.1f} {r['epochs']:6d} {pe or 0:8.2f} "
              f"{ratio:>14} {best:>8} {busy:>5} {outside:>16}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def settle(home: Path, work: Path, timeout: float = 60.0) -> None:
    """Until the warm service pipetune-cold left is idle with its spare driver and
    recorder waiting (a user's next command rarely follows within seconds; the spares
    warm up at idle priority after a command): the warm run is a warm machine's."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run([str(BIN / "pipetune"), "service", "status"], cwd=work,
                             env=env_for(home, None), capture_output=True, text=True).stdout
        if "spare driver and recorder waiting" in out and "in use" not in out:
            return
        time.sleep(1.0)
    print("pipetune-warm: the warm service's spares were not ready after "
          f"{timeout:.0f} s; running anyway", file=sys.stderr, flush=True)


def stop_service(home: Path, work: Path) -> None:
    """Stop the warm service pipetune-cold left for pipetune-warm (pipetune.service)."""
    subprocess.run([str(BIN / "pipetune"), "service", "stop"], env=env_for(home, None),
                   cwd=work, capture_output=True, timeout=120)


if __name__ == "__main__":
    sys.exit(main())
