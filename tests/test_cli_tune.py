"""`pipetune tune`, `groundtruth` and `ui` as a user runs them: real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from known import synthetic_job

ROOT = Path(__file__).resolve().parents[1]
PIPETUNE = [sys.executable, "-m", "pipetune"]

TINY_JOB = synthetic_job("cli-tiny")


def run(args, cwd, env_extra=None, input_text=None, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL",)}
    env["PIPETUNE_HOME"] = str(cwd / "home")
    env.update(env_extra or {})
    return subprocess.run(PIPETUNE + args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, input=input_text)


@pytest.fixture
def job_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(TINY_JOB))
    return path


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--trials", "0"], "--trials"),
        (["--dask-address", "not an address"], "--dask-address"),
        (["--tracking-uri", "nonsense"], "--tracking-uri"),
    ],
)
def test_bad_options_exit_2_and_record_nothing(tmp_path, job_file, args, field):
    proc = run(["tune", str(job_file), *args], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert field in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_a_broken_job_file_exits_2_naming_the_field(tmp_path):
    bad = {**TINY_JOB, "search": {**TINY_JOB["search"], "algorithm": "annealing"}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    proc = run(["tune", str(path)], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "search.algorithm" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_a_corrupt_ground_truth_stops_tune_before_it_records_anything(tmp_path, job_file):
    import json

    gt = tmp_path / "home" / "groundtruth.json"
    gt.parent.mkdir()
    raw = json.dumps({"version": 1, "records": [{"features": {}, "cost": "NaN"}]})
    gt.write_text(raw)
    proc = run(["tune", str(job_file)], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "pipetune groundtruth repair" in proc.stderr
    assert not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "home" / "studies").exists()
    assert gt.read_text() == raw  # left as it was


@pytest.mark.slow
def test_tune_on_the_embedded_default_then_groundtruth_commands(tmp_path, job_file):
    proc = run(["tune", str(job_file), "--trials", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "MLflow: run" in out and "pipetune ui" in out
    assert "probe epochs 2" in out, out  # trial 0 probed both candidates, trial 1 matched it
    assert "ground-truth hits 1/2" in out, out

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pipetune")
    parents = client.search_runs([experiment.experiment_id], "tags.`pipetune.kind` = 'study'")
    assert len(parents) == 1
    assert parents[0].data.params["search.trials"] == "2"  # the --trials override
    assert parents[0].data.tags["prefect.flow_run_id"]

    listing = run(["groundtruth", "list"], tmp_path, timeout=120)
    assert listing.returncode == 0
    assert "1 records" in listing.stdout and "interop=2" in listing.stdout

    kept = run(["groundtruth", "clear"], tmp_path, input_text="n\n", timeout=120)
    assert kept.returncode == 1 and "left as it was" in kept.stdout
    assert "1 records" in run(["groundtruth", "list"], tmp_path, timeout=120).stdout
    cleared = run(["groundtruth", "clear", "--yes"], tmp_path, timeout=120)
    assert cleared.returncode == 0 and "removed 1 records" in cleared.stdout
    assert "0 records" in run(["groundtruth", "list"], tmp_path, timeout=120).stdout


def test_an_unreachable_dask_address_is_a_clean_error(tmp_path, job_file):
    from pipetune.net import free_port

    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    proc = run(["tune", str(job_file), "--dask-address", address], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert f"--dask-address: cannot reach {address}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_tune_on_an_existing_dask_cluster(tmp_path, job_file, prefect_api_url):
    import dask
    from distributed import LocalCluster

    # Workers started by hand, as on a real cluster, advertising a `cores` resource; the
    # CLI runs against the scheduler's address. The workers never talk to Prefect.
    with dask.config.set({"distributed.worker.daemon": False}), LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, resources={"cores": 2},
        host="127.0.0.1", dashboard_address="127.0.0.1:0",
    ) as cluster:
        proc = run(["tune", str(job_file), "--trials", "1", "--dask-address",
                    cluster.scheduler_address], tmp_path,
                   env_extra={"PREFECT_API_URL": prefect_api_url})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "MLflow: run" in proc.stdout
        assert f"flow runs at {prefect_api_url.removesuffix('/api')}" in proc.stdout


def test_ui_without_a_store_says_what_to_do(tmp_path):
    proc = run(["ui"], tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "pipetune tune" in proc.stderr and "Traceback" not in proc.stderr
