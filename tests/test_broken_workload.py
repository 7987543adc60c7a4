"""A study stops on a broken workload, and every error reads once.

Trials that keep failing with the same exception (the same type raised at the same
place) before any epoch has finished mean the workload's code is broken: the study
stops after ``search.stop_after_failures`` of them (default ``max_concurrent + 1``)
instead of spending its budget. A failure only some trials hit fails those trials and
the study goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from known import synthetic_job

from pipetune.checkpoints import CheckpointStore
from pipetune.engine.journal import StudyJournal
from pipetune.engine.study import Study, run_study_locally
from pipetune.spec import JobSpec
from pipetune.states import TrialState
from pipetune.system.config import MachineInfo

HERE = Path(__file__).resolve().parent
MACHINE = MachineInfo(cores=2)


def broken_job(name: str, *, trials: int, workload: str = "broken_workload:ShapeBug",
               max_concurrent: int = 2, **search) -> dict:
    job = synthetic_job(name, trials=trials)
    job["workload"]["name"] = workload
    job["workload"]["params"] = {"train_samples": 128, "val_samples": 64}
    # The batch size is in the bug's message ("(16x16 and 32x8)"): the failures differ
    # in their messages and are still one bug.
    job["hyperparameters"] = {"lr": {"type": "loguniform", "low": 0.01, "high": 0.1},
                              "batch_size": {"type": "choice", "values": [16, 32]},
                              "hidden": {"type": "choice", "values": [8, 16]}}
    job["search"].update(max_concurrent=max_concurrent, **search)
    job["early_stopping"] = {"policy": "none", "max_epochs": 2}
    return job


def study_of(tmp_path: Path, job: dict) -> Study:
    spec = JobSpec.from_dict(job, machine=MACHINE)
    journal = StudyJournal(tmp_path / "studies", job["name"]).create(job=spec.to_dict())
    return Study(spec, study_id=job["name"], checkpoints=CheckpointStore(tmp_path / "ck"),
                 core_budget=2, machine=MACHINE, journal=journal)


def test_a_broken_workload_stops_after_max_concurrent_plus_one_same_failures(tmp_path):
    study = run_study_locally(study_of(tmp_path, broken_job("shape", trials=40)))
    assert study.broken is not None
    # max_concurrent 2: the third failure stops it, and no more than three trials start.
    assert len(study.trials) == 3
    assert all(t.state == TrialState.FAILED for t in study.trials.values())
    messages = {t.failure.message for t in study.trials.values()}
    assert len(messages) == 2, messages  # two batch sizes, two messages, one bug
    line = study.broken.line
    assert "\n" not in line
    assert "broken_workload:ShapeBug" in line and "RuntimeError: mat1 and mat2" in line
    assert "search.stop_after_failures: 3" in line
    kept = Path(study.broken.traceback_file)
    assert kept.is_file() and kept.parent == tmp_path / "studies" / "shape" / "failures"
    assert str(kept) in line
    text = kept.read_text()
    assert text.startswith("study shape, workload broken_workload:ShapeBug, trial ")
    assert "Traceback (most recent call last)" in text
    assert "failing_safely" not in text  # pipetune's own wrapper is left out
    assert "F.linear" in text or "linear.py" in text
    kinds = [e.kind for e in study.journal.events()]
    assert kinds.count("start") == 3 and kinds.count("failed") == 3 and kinds[-1] == "broken"


def test_the_limit_is_a_job_field_and_zero_never_stops(tmp_path):
    one = run_study_locally(study_of(tmp_path / "a", broken_job(
        "one", trials=10, stop_after_failures=1)))
    assert one.broken is not None and len(one.trials) == 1
    never = run_study_locally(study_of(tmp_path / "b", broken_job(
        "never", trials=6, stop_after_failures=0)))
    assert never.broken is None
    assert len(never.trials) == 6
    assert all(t.state == TrialState.FAILED for t in never.trials.values())


def test_a_failure_only_some_trials_hit_fails_those_and_the_study_goes_on(tmp_path):
    # Seed 5 proposes hidden 16, 16, 8, 16, 8, 8, 8, 8: a hidden-16 trial finishes its
    # first epoch before any failure, so five hidden-8 failures (past the limit of 2)
    # are one trial's problem each, not a broken workload.
    job = broken_job("narrow", trials=8, workload="broken_workload:NarrowBug",
                     max_concurrent=1, seed=5)
    job["hyperparameters"] = {"hidden": {"type": "choice", "values": [8, 16]}}
    study = run_study_locally(study_of(tmp_path, job))
    assert study.broken is None
    hidden = [study.trials[i].params["hidden"] for i in sorted(study.trials)]
    assert hidden[:2] == [16, 16] and hidden.count(8) >= 3
    for trial in study.trials.values():
        expected = TrialState.FAILED if trial.params["hidden"] == 8 else TrialState.COMPLETE
        assert trial.state == expected, (trial.trial_id, trial.params, trial.error)
    failed = [t for t in study.trials.values() if t.state == TrialState.FAILED]
    assert all(Path(t.traceback_file).is_file() for t in failed)


def test_the_same_bug_in_the_first_trials_stops_even_a_workload_that_is_only_partly_broken(
        tmp_path):
    # Seed 2 proposes hidden 8, 8, 8, ...: nothing has trained yet when the limit is met.
    job = broken_job("unlucky", trials=8, workload="broken_workload:NarrowBug",
                     max_concurrent=1, seed=2, stop_after_failures=2)
    job["hyperparameters"] = {"hidden": {"type": "choice", "values": [8, 16]}}
    study = run_study_locally(study_of(tmp_path, job))
    assert study.broken is not None and len(study.trials) == 2


# -- the command, as a user runs it ------------------------------------------------------


def test_tune_stops_a_40_trial_study_of_a_broken_workload_with_one_line(tmp_path):
    """The issue's case: a workload that fails in its first step, 40 trials, two at a
    time, on the embedded default (local Prefect server, Dask LocalCluster, SQLite)."""
    shutil.copy(HERE / "broken_workload.py", tmp_path / "broken_workload.py")
    job = broken_job("broken-cli", trials=40)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PIPETUNE_HOME=str(tmp_path / "home"), PREFECT_HOME=str(tmp_path / "prefect"))
    proc = subprocess.run([sys.executable, "-m", "pipetune", "tune", "job.yaml"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "Compute Failed" not in out, out[-5000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    assert "broken_workload:ShapeBug is broken" in errors[0]
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied" in errors[0]
    failed_lines = [line for line in out.splitlines() if " failed: RuntimeError" in line]
    assert 1 <= len(failed_lines) <= 3, out[-3000:]

    (folder,) = (tmp_path / "home" / "studies").iterdir()
    header = json.loads((folder / "study.json").read_text())
    assert header["status"] == "failed" and "is broken" in header["reason"]
    journal = StudyJournal(folder.parent, folder.name)
    kinds = [e.kind for e in journal.events()]
    started = kinds.count("start")
    assert started <= 3 and kinds.count("failed") == started and kinds[-1] == "broken"
    kept = sorted((folder / "failures").iterdir())
    assert len(kept) == started
    assert str(kept[-1]) in errors[0] or any(str(k) in errors[0] for k in kept)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pipetune")
    (parent,) = client.search_runs([experiment.experiment_id], "tags.`pipetune.kind` = 'study'")
    assert parent.info.status == "FAILED"
    assert "RuntimeError: mat1 and mat2" in parent.data.tags["pipetune.failure"]
    trials = client.search_runs([experiment.experiment_id], "tags.`pipetune.kind` = 'trial'")
    assert len(trials) == started
    for run in trials:
        assert run.info.status == "FAILED"
        assert run.data.tags["error"].startswith("RuntimeError: mat1 and mat2")
        text = Path(client.download_artifacts(run.info.run_id, "traceback.txt",
                                              str(tmp_path / run.info.run_id))).read_text()
        assert "Traceback (most recent call last)" in text and "linear" in text


def test_a_resumed_study_still_knows_where_its_failed_trials_tracebacks_are(tmp_path):
    job = broken_job("kept", trials=6, stop_after_failures=2, max_concurrent=1)
    first = run_study_locally(study_of(tmp_path, job))
    kept = {t.trial_id: t.traceback_file for t in first.trials.values()}
    assert len(kept) == 2 and all(Path(f).is_file() for f in kept.values())
    spec = JobSpec.from_dict(job, machine=MACHINE)
    journal = StudyJournal(tmp_path / "studies", "kept")
    again = Study(spec, study_id="kept", checkpoints=CheckpointStore(tmp_path / "ck"),
                  core_budget=2, machine=MACHINE, journal=journal)
    again.replay(journal.events(), checkpoint_exists=CheckpointStore.exists)
    assert {t.trial_id: t.traceback_file for t in again.trials.values()} == kept
    assert all(t.state == TrialState.FAILED for t in again.trials.values())
