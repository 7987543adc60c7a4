"""Load: many studies at once on one stack, and one long study, through ``pipetune tune``.

In one run, so the figures share the machine's noise:

1. **long**: one study of ``--trials`` (500) short trials (synthetic, 16 samples, no
   sleep, 2 epochs each, 2 at a time, PipeTune off: the loop, the journal and the
   record are what is loaded), with a 20-trial study of the same job first as the
   baseline. While it runs, every second: the resident memory of the driver (the
   ``pipetune tune`` process) and of its recorder process, against the trials started
   so far (read off the study's journal). Afterwards, from MLflow: every trial has
   exactly one run, and each run exactly one ``train_loss`` value per epoch.
2. **embedded**: ``--studies`` (8) ``pipetune tune`` commands at once in one folder
   (one MLflow SQLite store, one ground truth, one pipetune home; each its own Prefect
   server and Dask cluster, as the embedded default starts them), 4 trials x 3 epochs
   each; every command exits 0 and every study's records are complete, once.
3. **stack** (``--stack``): the same 8 commands at once against one team stack
   (``pipetune stack up``: PostgreSQL, Prefect, MLflow and Dask servers).

Per-epoch fixed cost: each study's ``study_orchestration_overhead_s_median``.

    python benchmarks/load.py [--trials 500] [--studies 8] [--stack]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from team_stack import _env  # noqa: E402  (a sibling script: one way to build the env)


def short_job(name: str, trials: int, epochs: int) -> dict:
    return {
        "name": name,
        "workload": {"name": "synthetic", "params": {"train_samples": 16, "val_samples": 16}},
        "hyperparameters": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.1}},
        "search": {"algorithm": "random", "trials": trials, "seed": 0, "max_concurrent": 2},
        "early_stopping": {"policy": "none", "max_epochs": epochs},
        "pipetune": {"enabled": False},
    }


class MemorySampler(threading.Thread):
    """Every second: RSS (MB) of a ``pipetune tune`` process and of its recorder, and
    how many trials its study's journal says have started."""

    def __init__(self, pid: int, studies: Path):
        super().__init__(daemon=True)
        self.pid, self.studies = pid, studies
        self.rows: list[tuple[float, int, float, float]] = []
        self.done = threading.Event()

    def _trials(self) -> int:
        started = 0
        for events in self.studies.glob("*/events.jsonl"):
            with open(events, "rb") as fh:
                started += sum(1 for line in fh if b'"kind": "start"' in line)
        return started

    def run(self) -> None:
        import psutil

        proc = psutil.Process(self.pid)
        t0 = time.monotonic()
        while not self.done.wait(1.0):
            try:
                driver = proc.memory_info().rss / 2**20
                recorder = sum(c.memory_info().rss for c in proc.children(recursive=True)
                               if "pipetune.sidecar" in " ".join(c.cmdline())) / 2**20
            except psutil.Error:
                continue
            self.rows.append((time.monotonic() - t0, self._trials(), driver, recorder))


def _tune(job: dict, home: Path, env_extra: dict[str, str], *,
          sample: bool = False) -> tuple[subprocess.CompletedProcess, MemorySampler | None, float]:
    home.mkdir(parents=True, exist_ok=True)
    job_file = home / f"{job['name']}.json"
    job_file.write_text(json.dumps(job))
    env = _env(home, env_extra)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pipetune", "tune", str(job_file)],
                            env=env, cwd=home, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    sampler = None
    if sample:
        sampler = MemorySampler(proc.pid, home / ".pipetune" / "studies")
        sampler.start()
    out, err = proc.communicate(timeout=7200)
    if sampler is not None:
        sampler.done.set()
        sampler.join()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done, sampler, time.monotonic() - started


def _records(uri: str, job_names: list[str], epochs: int) -> dict[str, dict]:
    """Per study (by job name): its trial runs, and whether each has exactly one
    ``train_loss`` per epoch (no value missing, none twice)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("pipetune")
    out: dict[str, dict] = {}
    for name in job_names:
        studies = [s for s in client.search_runs([exp.experiment_id],
                                                 "tags.`pipetune.kind` = 'study'",
                                                 max_results=1000)
                   if s.data.tags.get("pipetune.study_id", "").startswith(name + "-")]
        trials = []
        for study in studies:
            trials += client.search_runs(
                [exp.experiment_id],
                f"tags.`mlflow.parentRunId` = '{study.info.run_id}'", max_results=5000)
        histories = [sorted(m.step for m in client.get_metric_history(t.info.run_id,
                                                                      "train_loss"))
                     for t in trials]
        out[name] = {
            "studies": len(studies),
            "trials": len(trials),
            "trial_ids": len({t.data.tags.get("pipetune.trial_id", t.info.run_name)
                              for t in trials}),
            "exactly_once": all(h == list(range(1, epochs + 1)) for h in histories),
            "finished": all(t.info.status == "FINISHED" for t in trials),
            "overhead_ms": [1000 * s.data.metrics.get("study_orchestration_overhead_s_median",
                                                      float("nan")) for s in studies],
        }
    return out


def long_study(work: Path, trials: int) -> list[str]:
    lines = ["## One long study", ""]
    rows = []
    for n in (20, trials):
        home = work / f"long-{n}"
        done, sampler, wall = _tune(short_job(f"long{n}", n, 2), home, {}, sample=True)
        if done.returncode != 0:
            raise SystemExit(f"tune of {n} trials failed:\n{done.stderr[-3000:]}")
        rec = _records(f"sqlite:///{home / 'mlflow.db'}", [f"long{n}"], 2)[f"long{n}"]
        peak_driver = max((r[2] for r in sampler.rows), default=float("nan"))
        peak_recorder = max((r[3] for r in sampler.rows), default=float("nan"))
        rows.append((n, wall, rec, sampler.rows, peak_driver, peak_recorder))
        print(json.dumps({"trials": n, "wall_s": wall, **{k: v for k, v in rec.items()},
                          "peak_driver_mb": peak_driver, "peak_recorder_mb": peak_recorder}),
              flush=True)
    lines += ["| trials | command s | trial runs | one value per epoch, once | "
              "overhead per epoch (median ms) | peak driver MB | peak recorder MB |",
              "|---:|---:|---:|---|---:|---:|---:|"]
    for n, wall, rec, _rows, pd, pr in rows:
        lines.append(f"| {n} | {wall:.0f} | {rec['trials']} | "
                     f"{'yes' if rec['exactly_once'] and rec['trials'] == n else 'NO'} | "
                     f"{statistics.fmean(rec['overhead_ms']):.0f} | {pd:.0f} | {pr:.0f} |")
    samples = rows[-1][3]
    lines += ["", f"Memory against trials started ({trials}-trial study):", "",
              "| trials started | driver MB | recorder MB |", "|---:|---:|---:|"]
    marks = sorted({min(trials, m) for m in (1, 50, 100, 200, 300, 400, 500, trials)})
    for mark in marks:
        at = [r for r in samples if r[1] >= mark]
        if at:
            lines.append(f"| {mark} | {at[0][2]:.0f} | {at[0][3]:.0f} |")
    return lines


def many_at_once(work: Path, studies: int, label: str,
                 env_extra: dict[str, str], uri: str | None) -> list[str]:
    home = work / f"many-{label}"
    home.mkdir(parents=True, exist_ok=True)
    names = [f"{label}{i}" for i in range(studies)]
    results: list[tuple[subprocess.CompletedProcess, float]] = [None] * studies  # type: ignore

    def one(i: int) -> None:
        done, _s, wall = _tune(short_job(names[i], 4, 3), home, env_extra)
        results[i] = (done, wall)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(studies)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    codes = [r[0].returncode for r in results]
    failed = [r[0].stderr[-2000:] for r in results if r[0].returncode != 0]
    rec = _records(uri or f"sqlite:///{home / 'mlflow.db'}", names, 3)
    complete = sum(1 for n in names if rec[n]["studies"] == 1 and rec[n]["trials"] == 4
                   and rec[n]["exactly_once"] and rec[n]["finished"])
    overhead = [o for n in names for o in rec[n]["overhead_ms"]]
    print(json.dumps({"mode": label, "codes": codes, "wall_s": wall, "records": rec}),
          flush=True)
    for err in failed:
        print(err, file=sys.stderr)
    return [f"## {studies} studies at once: {label}", "",
            f"- exit codes: {codes}; all {studies} took {wall:.0f} s together",
            f"- studies whose records are complete and once (1 study run, 4 trial runs, "
            f"3 `train_loss` values each, all FINISHED): {complete}/{studies}",
            "- overhead per epoch, median of each study (ms): "
            + ", ".join(f"{o:.0f}" for o in overhead), ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=500)
    ap.add_argument("--studies", type=int, default=8)
    ap.add_argument("--parts", default="long,embedded", help="long, embedded, stack")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    work = Path(tempfile.mkdtemp(prefix="pipetune-load-"))
    report: list[str] = [f"# Load ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
                         f"{os.cpu_count()} cores)", ""]
    if "long" in parts:
        report += long_study(work, args.trials) + [""]
    if "embedded" in parts:
        report += many_at_once(work, args.studies, "embedded", {}, None)
    if "stack" in parts:
        stack_dir = work / "stack"
        subprocess.run([sys.executable, "-m", "pipetune", "stack", "up", "--dir",
                        str(stack_dir), "--workers", "2"], check=True,
                       env=_env(work / "admin", {}), cwd=work, capture_output=True)
        try:
            state = json.loads((stack_dir / "stack.json").read_text())
            report += many_at_once(work, args.studies, "stack", state["env"],
                                   state["env"]["MLFLOW_TRACKING_URI"])
        finally:
            subprocess.run([sys.executable, "-m", "pipetune", "stack", "down", "--dir",
                            str(stack_dir)], capture_output=True, timeout=300)
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
