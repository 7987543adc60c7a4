"""Training first (issue 31), as a user runs it: ``pipetune tune`` sends its first epoch
before its Prefect server answers, and the flow run created beside the training still
holds every task run of the study, those that ran before it existed included, and its
id is on the MLflow runs and in the journal."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import subprocess
import sys
from datetime import datetime

import pytest
import yaml
from known import synthetic_job, tune_env

pytestmark = pytest.mark.slow


def _marks(stdout: str) -> dict[str, float]:
    line = re.search(r"^start-up \(s from process start\): (.*)$", stdout, re.M).group(1)
    return {name: float(at) for name, at in
            (part.rsplit(" ", 1) for part in line.split(", "))}


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace(" ", "T").replace("Z", "+00:00")).timestamp()


def test_the_first_epoch_goes_out_before_prefect_answers_and_the_flow_run_gets_it_all(
        tmp_path):
    job = synthetic_job("first", trials=3)
    job["workload"]["params"]["base_seconds"] = 0.3
    job["search"]["max_concurrent"] = 2
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    proc = subprocess.run([sys.executable, "-m", "pipetune", "tune", "job.yaml"],
                          cwd=tmp_path, env=tune_env(tmp_path), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "warning:" not in proc.stderr, proc.stderr
    marks = _marks(proc.stdout)
    # The first epoch was sent before the Prefect server was even asked to answer.
    assert marks["first epoch"] < marks["Prefect server ready"], marks
    assert marks["cluster ready"] <= marks["first epoch"], marks

    (folder,) = (tmp_path / "home" / "studies").glob("first-*")
    journal = json.loads((folder / "study.json").read_text())
    flow_run_id = journal["flow_run_id"]
    assert flow_run_id and journal["parent_run_id"] and journal["status"] == "finished"
    with contextlib.closing(sqlite3.connect(tmp_path / "prefect" / "prefect.db")) as db:
        flow_runs = list(db.execute("SELECT id, name, state_type, start_time FROM flow_run"))
        task_runs = list(db.execute(
            "SELECT name, state_type, start_time, tags FROM task_run WHERE flow_run_id = ?",
            (flow_run_id,)))
    ((run_id, name, state, flow_start),) = flow_runs
    assert run_id == flow_run_id and name == journal["study_id"] and state == "COMPLETED"
    epochs = [t for t in task_runs if re.match(r"trial-\d+-epoch-\d+-", t[0])]
    assert len(epochs) == sum(1 for line in (folder / "events.jsonl").read_text().splitlines()
                              if '"kind": "result"' in line) == 9
    assert {t[1] for t in task_runs} == {"COMPLETED"}
    # The study's first epochs ran before its flow run existed; the run has them all.
    assert min(_ts(t[2]) for t in epochs) < _ts(flow_start)
    assert any(t[0].startswith("evaluate-best-checkpoint-of-trial-") for t in task_runs)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("pipetune").experiment_id])
    assert len(runs) == 4 and {r.info.status for r in runs} == {"FINISHED"}
    assert {r.data.tags.get("prefect.flow_run_id") for r in runs} == {flow_run_id}
    assert journal["parent_run_id"] in {r.info.run_id for r in runs}
