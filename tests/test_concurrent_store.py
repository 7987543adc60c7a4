"""Several commands starting at once on one fresh MLflow SQLite store: all of them
create (or find) the schema and the experiment, and every run they write is kept."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

WRITER = textwrap.dedent("""
    import sys, time
    from mlflow.tracking import MlflowClient
    from pipetune.tracking import ensure_experiment
    uri, me, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
    while time.time() < start:  # all at once
        time.sleep(0.005)
    experiment = ensure_experiment(uri)
    client = MlflowClient(uri)
    run = client.create_run(experiment, tags={"writer": me})
    client.log_metric(run.info.run_id, "m", float(me))
    client.set_terminated(run.info.run_id)
""")


def test_four_writers_on_a_fresh_store_all_succeed(tmp_path):
    import time

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    start = time.time() + 8  # past every interpreter's imports
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, uri, str(i), str(start)],
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    errors = [p.communicate(timeout=180)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errors
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("pipetune")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.data.tags["writer"] for r in runs) == ["0", "1", "2", "3"]
    assert all(r.info.status == "FINISHED" for r in runs)
    assert sorted(r.data.metrics["m"] for r in runs) == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("commands", [2, 4])
def test_tune_commands_at_once_in_one_folder_all_finish(tmp_path, commands):
    import os
    from pathlib import Path

    import yaml
    from known import synthetic_job
    from mlflow.tracking import MlflowClient

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(synthetic_job("together", trials=2)))
    env = {**os.environ, "PIPETUNE_HOME": str(tmp_path / "home"),
           "PREFECT_HOME": str(tmp_path / "prefect"),
           "PYTHONPATH": os.pathsep.join(
               p for p in (str(root / "tests"), str(root), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("PREFECT_API_URL", None)
    procs = [subprocess.Popen([sys.executable, "-m", "pipetune", "tune", "job.yaml"],
                              cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for _ in range(commands)]
    errors = [p.communicate(timeout=900)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * commands, errors
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pipetune")
    runs = client.search_runs([experiment.experiment_id])
    studies = [r for r in runs if r.data.tags.get("pipetune.kind") == "study"]
    trials = [r for r in runs if r.data.tags.get("pipetune.kind") == "trial"]
    assert len(studies) == commands and len(trials) == 2 * commands
    assert all(r.info.status == "FINISHED" for r in runs)
    assert all(len(client.get_metric_history(t.info.run_id, "train_loss")) >= 1 for t in trials)
    # each embedded Prefect server running at the same time had a database of its own
    slots = {p.name for p in (tmp_path / "prefect").glob("prefect*.db")}
    assert "prefect.db" in slots and "prefect-1.db" in slots
    assert slots <= {"prefect.db"} | {f"prefect-{i}.db" for i in range(1, commands)}


def test_an_experiment_another_study_created_meanwhile_is_found(tmp_path, monkeypatch):
    """On a tracking server, two studies may both find no experiment and both create it
    (the file lock guards only a local SQLite store): the second gets
    RESOURCE_ALREADY_EXISTS, and takes the one the first made."""
    from mlflow.tracking import MlflowClient

    import pipetune.tracking as tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    made = MlflowClient(uri).create_experiment("pipetune")

    class Late(MlflowClient):
        """Asked first, the store has no experiment yet: the other study's is created
        between this client's look and its create."""

        looked = False

        def get_experiment_by_name(self, name):
            if not Late.looked:
                Late.looked = True
                return None
            return super().get_experiment_by_name(name)

    monkeypatch.setattr(tracking.store, "mlflow_client", Late)
    assert tracking.ensure_experiment(uri) == made
