"""A study's ``best_model/`` is a reproducible record: downloaded from MLflow and loaded
by its own recipe in a fresh process, it gives back the metric it was recorded with.
And ``workload.deterministic`` switches torch's deterministic algorithms on for an
epoch, and back after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from known import synthetic_job
from mlflow.tracking import MlflowClient

from pipetune.backends import LocalBackend
from pipetune.checkpoints import CheckpointStore
from pipetune.engine.study import Study
from pipetune.runner import deterministic_algorithms, run_epoch
from pipetune.spec import JobSpec, split_system_params
from pipetune.tracking import StudyTracker
from pipetune.workloads.synthetic import SyntheticWorkload


def joint_synthetic_job() -> dict:
    """Synthetic, joint tuning: ``system.interop_threads`` is a hyperparameter that
    must not reach the workload's setup(); objective val_loss (not a count)."""
    job = synthetic_job("repro-synthetic", seed=3, trials=2)
    job["workload"]["params"]["cost_by_knob"] = {}
    job["hyperparameters"] = {
        "lr": {"type": "loguniform", "low": 0.01, "high": 0.1},
        "hidden": {"type": "choice", "values": [8, 16]},
        "system.interop_threads": {"type": "choice", "values": [1, 2]},
    }
    job["system"]["space"] = {}
    job["pipetune"] = {"enabled": False}
    job["early_stopping"] = {"policy": "none", "max_epochs": 2}
    job["objective"] = {"metric": "val_loss", "mode": "min", "system": "time"}
    job["profiler"] = {"perf": "off"}
    return job


def lenet_job() -> dict:
    """LeNet-5 on the bundled digits with deterministic algorithms, probing a knob."""
    job = synthetic_job("repro-lenet", seed=5, trials=2)
    job["workload"] = {"name": "lenet5", "deterministic": True,
                       "params": {"dataset": "digits", "train_samples": 300, "val_samples": 120}}
    job["hyperparameters"] = {"lr": {"type": "loguniform", "low": 0.01, "high": 0.1},
                              "batch_size": {"type": "choice", "values": [32, 64]}}
    job["system"]["space"] = {"cores": [1, 2]}
    job["early_stopping"] = {"policy": "none", "max_epochs": 3}
    job["objective"] = {"metric": "val_loss", "mode": "min", "system": "time"}
    job["profiler"] = {"perf": "off"}
    return job


def run_tracked_study(job: dict, tmp_path) -> tuple[Study, MlflowClient, str]:
    """A real study in this process, recorded in MLflow as the flow records one."""
    spec = JobSpec.from_dict(job)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = StudyTracker(client.tracking_uri, spec, client=client)
    study = Study(spec, study_id=spec.name, checkpoints=CheckpointStore(tmp_path / "ck"))
    started = time.time()

    def on_step(event) -> None:
        if event.ended:
            tracker.end_trial(event.trial, metric=study.metric)

    study.run(LocalBackend(), on_step=on_step, on_result=tracker.log_epoch)
    tracker.finish(study, wall_s=time.time() - started)
    return study, client, tracker.parent_run_id


@pytest.mark.parametrize("job", [joint_synthetic_job, lenet_job], ids=["synthetic", "lenet5"])
def test_best_model_reloads_in_a_fresh_process_to_its_recorded_metric(job, tmp_path):
    study, client, run_id = run_tracked_study(job(), tmp_path)
    best = study.best_trial()
    assert best is not None
    folder = client.download_artifacts(run_id, "best_model", str(tmp_path / "download"))
    assert sorted(os.listdir(folder)) == ["best_model.json", "best_model.pt",
                                          "load_best_model.py"]
    with open(os.path.join(folder, "best_model.json")) as f:
        record = json.load(f)

    hparams, _ = split_system_params(best.params, study.spec.system.default)
    assert not any(k.startswith("system.") for k in record["hyperparameters"])
    assert record["hyperparameters"] == hparams  # what setup() got, nothing more
    assert record["params"] == best.params
    assert record["seed"] == best.seed
    assert record["metric"] == study.metric == "val_loss"
    assert record["value"] == best.last_value("val_loss")
    assert record["workload"] == study.spec.workload.name
    assert record["workload_import_path"].startswith("pipetune.workloads.")
    assert record["workload_params"] == study.spec.workload.params
    assert record["evaluated_under"] == best.results[-1].system.to_dict()
    assert record["system"] == best.final_system.to_dict()
    assert record["deterministic"] is study.spec.workload.deterministic
    assert record["torch_version"] == torch.__version__
    with open(os.path.join(folder, "load_best_model.py")) as f:
        assert f.read() == record["load_recipe"]
    assert ("torch.use_deterministic_algorithms(True)" in record["load_recipe"]) \
        is study.spec.workload.deterministic

    # A fresh interpreter: nothing of this process (its cached data, its live models).
    done = subprocess.run([sys.executable, "-c", record["load_recipe"]], cwd=folder,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    metric, got, said, recorded = done.stdout.split()
    assert (metric, said) == ("val_loss", "recorded")
    assert float(recorded) == record["value"]
    assert abs(float(got) - record["value"]) <= 1e-6, (got, record["value"])


def test_a_deterministic_job_trains_its_epochs_deterministically(tmp_path, monkeypatch):
    seen: list[bool] = []
    evaluate = SyntheticWorkload.evaluate

    def evaluate_and_look(self, system):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return evaluate(self, system)

    monkeypatch.setattr(SyntheticWorkload, "evaluate", evaluate_and_look)
    job = synthetic_job("repro-flag", trials=1)
    job["profiler"] = {"perf": "off"}
    for deterministic in (False, True):
        job["workload"]["deterministic"] = deterministic
        job["workload"]["params"]["cost_by_knob"] = {}
        spec = JobSpec.from_dict(job)
        assert spec.to_dict()["workload"]["deterministic"] is deterministic
        study = Study(spec, study_id=f"flag-{deterministic}",
                      checkpoints=CheckpointStore(tmp_path / str(deterministic)))
        (task,) = study.launchable()
        assert task.deterministic is deterministic
        run_epoch(task)
        assert seen.pop() is deterministic
        assert not torch.are_deterministic_algorithms_enabled()  # put back after the epoch
    assert JobSpec.from_dict(synthetic_job("default")).workload.deterministic is False


def test_the_deterministic_switch_restores_what_was_set_before(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        with deterministic_algorithms(True):
            assert torch.are_deterministic_algorithms_enabled()
            assert not torch.is_deterministic_algorithms_warn_only_enabled()
            assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # CPU: left alone
        assert torch.is_deterministic_algorithms_warn_only_enabled()  # as before
        torch.use_deterministic_algorithms(False)
        with deterministic_algorithms(True, "cuda"):
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
            with deterministic_algorithms(True, "cuda"):  # a second epoch in the process
                pass
            assert torch.are_deterministic_algorithms_enabled()  # the first one still runs
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        assert not torch.are_deterministic_algorithms_enabled()
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the process's own value
        with deterministic_algorithms(True, "cuda"):
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        with deterministic_algorithms(False, "cuda"):
            assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
