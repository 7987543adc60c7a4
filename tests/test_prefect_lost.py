"""The Prefect server lost mid-study, for real: a ``pipetune tune`` subprocess whose
Prefect server (or the watcher it runs under) is SIGKILLed while epochs run. Training
goes on; the study finishes, exits 0 with one ``warning:`` line, and MLflow holds every
epoch once. A server that comes back gets the task runs it missed, in order."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml
from known import synthetic_job, tune_env, wait_until_healthy

pytestmark = pytest.mark.slow

TRIALS, EPOCHS = 3, 3


def _start_tune(tmp_path: Path, name: str, env_extra: dict[str, str] | None = None
                ) -> subprocess.Popen:
    """A real ``pipetune tune`` of 3 trials x 3 epochs of ~1 s each, two at a time."""
    job = synthetic_job(name, trials=TRIALS)
    job["workload"]["params"]["base_seconds"] = 1.0
    job["search"]["max_concurrent"] = 2
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = tune_env(tmp_path)
    env.update(env_extra or {})
    return subprocess.Popen([sys.executable, "-m", "pipetune", "tune", "job.yaml"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _journal(tmp_path: Path) -> tuple[dict, int]:
    """The study's journal (study.json) and the epochs its events file says finished."""
    folders = list((tmp_path / "home" / "studies").glob("*"))
    if not folders:
        return {}, 0
    events = folders[0] / "events.jsonl"
    done = events.read_text(errors="replace").count('"kind": "result"') if events.exists() else 0
    study = folders[0] / "study.json"
    try:
        return json.loads(study.read_text()), done
    except (OSError, ValueError):
        return {}, done


def _wait_mid_study(proc: subprocess.Popen, tmp_path: Path, epochs: int = 2) -> None:
    deadline = time.monotonic() + 240
    while _journal(tmp_path)[1] < epochs:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the study never got going"
        time.sleep(0.1)


def _server_processes(proc: subprocess.Popen) -> tuple[psutil.Process, psutil.Process]:
    """The watcher (``python -m pipetune._watch``) and the ``prefect server start`` under it."""
    watcher = next(p for p in psutil.Process(proc.pid).children()
                   if "pipetune._watch" in " ".join(p.cmdline()))
    return watcher, watcher.children()[0]


def _mlflow_holds_every_epoch_once(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("pipetune").experiment_id])
    parents = [r for r in runs if r.data.tags.get("pipetune.kind") == "study"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    trials = [r for r in runs if r.data.tags.get("pipetune.kind") == "trial"]
    assert len(trials) == TRIALS and {r.info.status for r in trials} == {"FINISHED"}
    for run in trials:
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_loss"))
        assert steps == list(range(1, EPOCHS + 1)), (run.data.tags["pipetune.trial_id"], steps)
    assert parents[0].data.metrics["study_epochs_run"] == TRIALS * EPOCHS


def _prefect_record(tmp_path: Path) -> tuple[str, list[tuple[str, str]]]:
    """From the embedded server's database: the flow run's state, and each task run of
    the study (name, state)."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(tmp_path / "prefect" / "prefect.db")) as db:
        [flow_state] = [r[0] for r in db.execute("SELECT state_type FROM flow_run")]
        task_runs = list(db.execute("SELECT name, state_type FROM task_run "
                                    "WHERE name LIKE 'trial-%'"))
    return flow_state, task_runs


def _lose_the_server_mid_study(tmp_path: Path, victim: str,
                               env_extra: dict[str, str] | None = None) -> tuple[str, str]:
    """A ``pipetune tune`` whose embedded server (or the watcher it runs under) is
    SIGKILLed mid-study: the command exits 0 with one `warning:` line, no traceback,
    the journal finished and MLflow whole; its (stdout, that warning line)."""
    proc = _start_tune(tmp_path, f"lost-{victim}", env_extra)
    try:
        _wait_mid_study(proc, tmp_path)
        watcher, server = _server_processes(proc)
        (watcher if victim == "watcher" else server).kill()
        assert _journal(tmp_path)[1] < TRIALS * EPOCHS, "killed too late: the study was done"
        # The server goes with its watcher, at once; a server started again is another.
        _, alive = psutil.wait_procs([server], timeout=5)
        assert not alive, "the prefect server outlived its SIGKILLed watcher"
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, err[-3000:]
    assert "Traceback" not in err and "Error logging to API" not in err, err[-3000:]
    assert "MLflow: run" in out
    assert _journal(tmp_path)[0]["status"] == "finished"
    _mlflow_holds_every_epoch_once(tmp_path)
    return out, warnings[0]


@pytest.mark.parametrize("victim", ["server", "watcher"])
def test_a_study_outlives_its_prefect_server_started_again(tmp_path, victim):
    """The embedded server, SIGKILLed (or the watcher it runs under) mid-study, is
    started again on its port and database: one `warning:` line says so, and Prefect
    ends up with the whole record, the flow run Completed."""
    _, warning = _lose_the_server_mid_study(tmp_path, victim)
    assert "started again" in warning, warning
    flow_state, task_runs = _prefect_record(tmp_path)
    assert flow_state == "COMPLETED"
    epochs = [name for name, _ in task_runs if "-epoch-" in name and "tune-after" not in name]
    assert len(epochs) == TRIALS * EPOCHS, sorted(task_runs)
    assert {state for _, state in task_runs} == {"COMPLETED"}, sorted(task_runs)


@pytest.mark.parametrize("victim", ["server", "watcher"])
def test_a_study_outlives_its_prefect_server(tmp_path, victim):
    """Not started again (``PIPETUNE_PREFECT_RESTARTS=0``): the study still finishes,
    exit 0, one `warning:` line saying what Prefect lacks."""
    _, warning = _lose_the_server_mid_study(tmp_path, victim,
                                            {"PIPETUNE_PREFECT_RESTARTS": "0"})
    assert "Prefect" in warning and "started again" not in warning, warning


def _api(url: str, path: str, body: dict) -> list[dict]:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_task_runs_caught_up_in_order_after_a_server_restart(tmp_path):
    """A Prefect server of the user's (``PREFECT_API_URL``), SIGKILLed mid-study and
    started again on its port and database: the task-run states sent while it was gone
    reach it, in order, and the flow run ends Completed."""
    from pipetune.prefect_server import LocalPrefectServer

    with _prefect_home(tmp_path / "server-home"):  # the server's database, kept
        first = LocalPrefectServer(log_path=tmp_path / "server.log").start()
    url, port = first.api_url, first.port
    # No retries inside Prefect's client: what comes back is the recorder's own doing,
    # not a call that happened to be retried past the outage.
    proc = _start_tune(tmp_path, "restarted", {
        "PREFECT_API_URL": url, "PIPETUNE_PREFECT_CATCH_UP_S": "90",
        "PREFECT_CLIENT_MAX_RETRIES": "0"})
    second = None
    try:
        _wait_mid_study(proc, tmp_path)
        _, server = _server_processes_of(first)
        server.kill()
        first.stop()  # reaps the dead watcher, lets go of the database
        sent_while_down = _journal(tmp_path)[1]
        with _prefect_home(tmp_path / "server-home"):
            second = LocalPrefectServer(port=port, log_path=tmp_path / "server.log").launch()
        wait_until_healthy(url, second.process, tmp_path / "server.log")
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        journal, epochs = _journal(tmp_path)
        assert journal["status"] == "finished" and epochs == TRIALS * EPOCHS
        assert sent_while_down < epochs  # some epochs ended while the server was gone
        flow_run_id = journal["flow_run_id"]
        task_runs = _api(url, "/task_runs/filter", {
            "flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200})
        flow_run = _api(url, "/flow_runs/filter", {
            "flow_runs": {"id": {"any_": [flow_run_id]}}})[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        if second is not None:
            second.stop()
    assert flow_run["state"]["type"] == "COMPLETED"
    ours = [t for t in task_runs if any(tag.startswith("trial-") for tag in t["tags"])]
    epochs_recorded = [t for t in ours if t["name"].startswith("trial-") and "epoch-" in
                       t["name"] and "tune-after" not in t["name"]]
    assert len(epochs_recorded) == TRIALS * EPOCHS, sorted(t["name"] for t in ours)
    assert {t["state"]["type"] for t in ours} == {"COMPLETED"}
    for trial in range(TRIALS):  # each trial one chain, linked in the order it ran
        chain = sorted((t for t in ours if f"trial-{trial}" in t["tags"]),
                       key=lambda t: t["start_time"])
        for before, after in zip(chain, chain[1:], strict=False):
            waited = [i["id"] for i in after["task_inputs"].get("wait_for", [])]
            assert waited == [before["id"]], (before["name"], after["name"])


def _server_processes_of(server) -> tuple[psutil.Process, psutil.Process]:
    watcher = psutil.Process(server.process.pid)
    return watcher, watcher.children()[0]


@contextlib.contextmanager
def _prefect_home(path: Path):
    before = os.environ["PREFECT_HOME"]
    os.environ["PREFECT_HOME"] = str(path)
    try:
        yield
    finally:
        os.environ["PREFECT_HOME"] = before
