"""The README's "Your own model" example, run the way the README says:
``cd examples/custom_workload && pipetune tune job.yaml`` (the console script, no
PYTHONPATH), for the function-style and the class-style workload, each twice: the
second run of a job finds the first's profiles in the ground truth and probes nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "custom_workload"

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("job", "every_trial_hits"), [
    # ASHA stops most trials after epoch 1 (no lookup yet), and batch_size is tuned: the
    # ground truth is keyed by batch-size bucket, so a bucket the first run never
    # recorded still probes once.
    ("job.yaml", False),
    ("digits_job.yaml", True),  # every trial runs 3 epochs at one batch size
])
def test_the_example_tunes_from_its_folder_and_recurs_from_the_ground_truth(
        job, every_trial_hits, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PREFECT_API_URL")}
    env.update(PIPETUNE_HOME=str(tmp_path / "home"), MLFLOW_TRACKING_URI=uri,
               PIPETUNE_GROUNDTRUTH=str(tmp_path / "groundtruth.db"))
    script = Path(sys.executable).with_name("pipetune")
    runs = []
    for _ in range(2):
        proc = subprocess.run([str(script), "tune", job], cwd=EXAMPLE, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs.append(proc.stdout)
    assert not (EXAMPLE / "mlflow.db").exists()  # written where MLFLOW_TRACKING_URI says
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("pipetune")
    first, second = sorted(
        client.search_runs([exp.experiment_id], "tags.`pipetune.kind` = 'study'"),
        key=lambda r: r.info.start_time)
    assert first.data.metrics["study_probe_epochs"] >= 1, runs[0]
    assert second.data.metrics["study_groundtruth_hits"] >= 1, runs[1]
    if every_trial_hits:
        assert second.data.metrics["study_probe_epochs"] == 0, runs[1]
        assert second.data.metrics["study_groundtruth_hits"] == second.data.metrics["study_trials"]
    assert {first.info.status, second.info.status} == {"FINISHED"}
    assert {f.path for f in client.list_artifacts(second.info.run_id, "best_model")} >= {
        "best_model/best_model.pt", "best_model/best_model.json"}
