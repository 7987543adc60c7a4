"""Team mode end to end: everything through a real stack, no shared disk.

``pipetune stack up`` starts PostgreSQL, a Prefect server on it with a work pool and a
worker, an MLflow tracking server on it with the artifact proxy, and a Dask scheduler
with two workers, each in its own folder and HOME. Then, the way a team uses it:

1. the study deployment is registered on the stack's Prefect server and run with
   ``prefect deployment run``: the flow runs in the Prefect worker, its epochs on the
   Dask workers; one Dask worker is SIGKILLed mid-study and the study still finishes;
2. the records are read back from the servers: the MLflow runs (checkpoints are
   artifacts of the study's run, pruned to the best and last per trial), the ground
   truth's rows in PostgreSQL, the flow run in Prefect's PostgreSQL database;
3. a second user, with another HOME, tunes the same job with ``pipetune tune``: every
   trial finds the first study's record in the shared ground truth and probes nothing.

Everything is stopped by PID at the end, whatever happened.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from known import synthetic_job
from team import run_stack, skip_without_postgres, stack_folder

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack():
    """A running stack of two Dask workers: its state (``stack.json``)."""
    skip_without_postgres(psycopg=True)
    with stack_folder("pipetune-team-") as directory:
        started = time.monotonic()
        up = run_stack("up", "--dir", str(directory), "--workers", "2")
        assert up.returncode == 0, f"stack up failed:\n{up.stdout}\n{up.stderr}"
        state = json.loads((directory / "stack.json").read_text())
        state["up_wall_s"] = time.monotonic() - started
        yield state


def _user_env(state: dict, home: Path) -> dict[str, str]:
    """What a team member's shell has after ``eval "$(pipetune stack env)"``: the
    stack's addresses, and a HOME and pipetune home of their own."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "MLFLOW_", "PIPETUNE_"))}
    env.update(state["env"])
    env.update(HOME=str(home), PIPETUNE_HOME=str(home / ".pipetune"),
               PREFECT_HOME=str(home / ".prefect"), MLFLOW_DISABLE_TELEMETRY="true",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(REPO))
    return env


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> str:
    proc = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def _prefect(env: dict[str, str], *args: str) -> str:
    return _run([sys.executable, "-m", "prefect", *args], env)


def _api(state: dict, path: str, body: dict | None = None) -> object:
    import urllib.request

    request = urllib.request.Request(
        state["urls"]["prefect_api"].rstrip("/") + path, method="POST" if body else "GET",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())


def _finished_epochs(state: dict, flow_run_id: str) -> int:
    runs = _api(state, "/task_runs/filter", {
        "flow_runs": {"id": {"any_": [flow_run_id]}},
        "task_runs": {"name": {"like_": "epoch"}, "state": {"type": {"any_": ["COMPLETED"]}}},
    })
    return len(runs)


def _worker_pids(state: dict) -> list[int]:
    """The PIDs of the Dask worker processes (not their nannies), from the scheduler."""
    from distributed import Client

    with Client(state["env"]["PIPETUNE_DASK_ADDRESS"], timeout=30,
                set_as_default=False) as client:
        return sorted(client.run(os.getpid).values())


def _study_runs(client, study_id: str) -> tuple[object, list[object]]:
    exp = client.get_experiment_by_name("pipetune")
    runs = client.search_runs([exp.experiment_id], f"tags.`pipetune.study_id` = '{study_id}'")
    (parent,) = [r for r in runs if r.data.tags.get("pipetune.kind") == "study"]
    children = client.search_runs(
        [exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return parent, children


def test_a_team_tunes_through_the_stack(stack, tmp_path):
    from mlflow.tracking import MlflowClient

    from pipetune.stack import Postgres

    job = synthetic_job("team-job", trials=3)
    job["workload"]["params"]["base_seconds"] = 1.5  # long enough to kill a worker mid-way
    job["search"]["max_concurrent"] = 2

    # -- 1. the first user deploys the study flow and runs it on the stack ---------------
    alice = _user_env(stack, tmp_path / "alice")
    _prefect(alice, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml",
             "--name", "on-demand")
    out = _prefect(alice, "deployment", "run", "pipetune-study/on-demand",
                   "--param", f"job={json.dumps(job)}")
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)

    deadline = time.monotonic() + 300
    while _finished_epochs(stack, flow_run_id) < 2:
        assert time.monotonic() < deadline, "the deployed study never got going"
        time.sleep(0.5)
    pids = _worker_pids(stack)
    assert len(pids) == 2
    psutil.Process(pids[0]).kill()  # SIGKILL a worker process, mid-study

    while True:
        flow_run = _api(stack, f"/flow_runs/{flow_run_id}")
        if flow_run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            break
        assert time.monotonic() < deadline, f"flow run still {flow_run['state']['type']}"
        time.sleep(1)
    assert flow_run["state"]["type"] == "COMPLETED", flow_run["state"]

    # -- 2. the records, read back from the servers ----------------------------------------
    client = MlflowClient(stack["urls"]["mlflow"])
    exp = client.get_experiment_by_name("pipetune")
    parents = client.search_runs(
        [exp.experiment_id],
        f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.`pipetune.kind` = 'study'")
    assert len(parents) == 1
    study_id = parents[0].data.tags["pipetune.study_id"]
    parent, trials = _study_runs(client, study_id)
    assert parent.info.status == "FINISHED" and parent.data.metrics["study_best_value"] > 0
    assert len(trials) == 3
    assert {t.info.status for t in trials} == {"FINISHED"}, [
        (t.data.tags.get("outcome"), t.data.tags.get("error")) for t in trials]
    assert parent.data.metrics["study_probe_epochs"] >= 1  # a fresh ground truth: it probed
    # Each trial's profile table, written through the server's artifact proxy.
    for t in trials:
        assert "profiles.csv" in [a.path for a in client.list_artifacts(t.info.run_id)]
    # Checkpoints are artifacts of the study's run, at most best + last per trial.
    for trial in range(3):
        folder = f"checkpoints/{study_id}/trial-{trial:03d}"
        kept = [f.path for f in client.list_artifacts(parent.info.run_id, folder)]
        assert 1 <= len(kept) <= 2, (folder, kept)
    assert {f.path for f in client.list_artifacts(parent.info.run_id, "best_model")} >= {
        "best_model/best_model.pt", "best_model/best_model.json"}

    pg = Postgres(Path(stack["dir"]) / "postgres", port=stack["postgres"]["port"])
    records = pg.psql("SELECT count(*) FROM pipetune_groundtruth_records", "pipetune")
    assert int(records.strip()) >= 1
    state_of_run = pg.psql(
        f"SELECT state_type FROM flow_run WHERE id = '{flow_run_id}'", "prefect").strip()
    assert state_of_run == "COMPLETED"
    assert int(pg.psql("SELECT count(*) FROM runs", "mlflow").strip()) >= 4

    # -- 3. a second user, another HOME, the same job: the shared ground truth answers ----
    bob = _user_env(stack, tmp_path / "bob")
    job_file = tmp_path / "bob" / "team-job.yaml"
    job_file.write_text(json.dumps(job))
    out = _run([sys.executable, "-m", "pipetune", "tune", str(job_file)], bob, timeout=600)
    assert not (tmp_path / "bob" / "mlflow.db").exists()  # recorded in the server, not here
    second = client.search_runs(
        [exp.experiment_id], "tags.`pipetune.kind` = 'study'", order_by=["start_time DESC"],
        max_results=1)[0]
    assert second.info.run_id != parent.info.run_id and second.info.run_id in out
    assert second.info.status == "FINISHED"
    assert second.data.metrics["study_groundtruth_hits"] == 3, second.data.metrics
    assert second.data.metrics["study_probe_epochs"] == 0, second.data.metrics
