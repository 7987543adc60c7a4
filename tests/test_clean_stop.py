"""A real ``pipetune tune`` told to stop by a real signal: it exits within 10 s with
``128 + signum``, every process it started is gone, and MLflow keeps the runs, ended
KILLED, with every epoch logged before the signal."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from known import synthetic_job, tune_env

pytestmark = pytest.mark.slow



def _epochs_logged(db: Path) -> int:
    if not db.exists():
        return 0
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            return con.execute(
                "select count(*) from metrics where key = 'train_loss'").fetchone()[0]
    except sqlite3.OperationalError:  # tables not made yet, or busy
        return 0


def _epochs_finished(tmp_path: Path) -> int:
    """Finished epochs in the study journal, which the engine appends as each one
    lands (MLflow's record is batched and can lag the study by many epochs)."""
    return sum(line.count('"kind": "result"')
               for events in (tmp_path / "home" / "studies").glob("*/events.jsonl")
               for line in events.read_text(errors="replace").splitlines())


def _start_tune(tmp_path: Path, name: str, *extra: str, args: tuple[str, ...] | None = None,
                **popen: object) -> subprocess.Popen:
    """A real ``pipetune tune`` of a study long enough to be stopped part-way, in its
    own homes; the embedded server, cluster and recorder are its children. ``args``:
    the command's arguments in place of ``job.yaml *extra``."""
    job = synthetic_job(name, trials=8)
    job["workload"]["params"]["base_seconds"] = 3.0
    job["search"]["max_concurrent"] = 2
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = tune_env(tmp_path)
    args = args if args is not None else ("job.yaml", *extra)
    return subprocess.Popen([sys.executable, "-m", "pipetune", "tune", *args],
                            cwd=tmp_path, env=env, **popen)


def _resume_finishes_the_study(tmp_path: Path, name: str,
                               args: tuple[str, ...] = ("job.yaml", "--resume")) -> None:
    """``tune --resume`` finishes the stopped study in the same MLflow runs: every
    epoch of the study logged exactly once, so none that finished ran again."""
    db = tmp_path / "mlflow.db"
    before = _epochs_logged(db)
    proc = _start_tune(tmp_path, name, args=args, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    resumed = int(re.search(r"(\d+) finished epochs taken over", out).group(1))
    assert resumed >= 2 and resumed <= before

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("pipetune").experiment_id])
    parents = [r for r in runs if r.data.tags.get("pipetune.kind") == "study"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"  # the same run, continued
    trials = [r for r in runs if r.data.tags.get("pipetune.kind") == "trial"]
    assert len(trials) == 8 and {r.info.status for r in trials} == {"FINISHED"}
    for run in trials:
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_loss"))
        assert steps == [1, 2, 3], (run.data.tags["pipetune.trial_id"], steps)
    assert parents[0].data.metrics["study_epochs_run"] == 24


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_stops_tune_cleanly(signum, tmp_path):
    proc = _start_tune(tmp_path, "stopped", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    db = tmp_path / "mlflow.db"
    try:
        deadline = time.monotonic() + 240
        # Under way: two epochs done, and the recorder up (its first MLflow write seen).
        while (_epochs_finished(tmp_path) < 2 or _epochs_logged(db) < 1) \
                and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert _epochs_finished(tmp_path) >= 2, "the study never got going"
        started = psutil.Process(proc.pid).children(recursive=True)
        assert started, "tune started no processes?"
        sent = time.monotonic()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    assert took <= 10, f"exit took {took:.1f} s"
    assert "Traceback" not in err, err
    assert ("interrupted" if signum == signal.SIGINT else signal.Signals(signum).name) in err
    _, alive = psutil.wait_procs(started, timeout=max(0.1, 10 - took))
    running = [p for p in alive if _running(p)]
    assert not running, [p.pid for p in running]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("pipetune")
    runs = client.search_runs([exp.experiment_id])
    parent = [r for r in runs if r.data.tags.get("pipetune.kind") == "study"]
    assert len(parent) == 1 and parent[0].info.status == "KILLED"
    trials = [r for r in runs if r.data.tags.get("pipetune.kind") == "trial"]
    assert trials and all(r.info.status in ("KILLED", "FINISHED") for r in trials)
    logged = sum(len(client.get_metric_history(r.info.run_id, "train_loss")) for r in trials)
    assert logged == _epochs_finished(tmp_path) >= 2  # every finished epoch is in MLflow
    if signum == signal.SIGTERM:
        _resume_finishes_the_study(tmp_path, "stopped")


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (a dead child nobody reaped yet holds nothing)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_nothing_outlives_a_sigkilled_tune_by_20_s(tmp_path):
    proc = _start_tune(tmp_path, "killed", stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while _epochs_finished(tmp_path) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.2)
        started = psutil.Process(proc.pid).children(recursive=True)
        names = {" ".join(p.cmdline()[1:4]) for p in started}
        assert any("prefect" in n for n in names), names  # the server is among them
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    _, alive = psutil.wait_procs(started, timeout=20)
    running = [p for p in alive if _running(p)]
    assert not running, [" ".join(p.cmdline()[:4]) for p in running]
    # the job file after --resume, as people write it: the job, its newest study resumed
    _resume_finishes_the_study(tmp_path, "killed", args=("--resume", "job.yaml"))
