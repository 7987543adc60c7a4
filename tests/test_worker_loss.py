"""Fault injection on a real Dask cluster of process workers: workers SIGKILLed in the
middle of an epoch. A worker lost once costs nothing (the epoch runs again on another
worker from the trial's last checkpoint); an epoch that kills every worker it runs
on fails its own trial, with the reason, and the study goes on."""

from __future__ import annotations

import pytest
from known import process_cluster, synthetic_job

from pipetune.checkpoints import CheckpointStore
from pipetune.engine.study import Study
from pipetune.spec import JobSpec
from pipetune.system.config import MachineInfo

pytestmark = [
    pytest.mark.slow,
]

MACHINE = MachineInfo(cores=2)
#: What one epoch can claim on the 1-core workers these tests start, as the study flow
#: reads it from the cluster: a trial left alone must not be given more (it was, and its
#: epoch was refused, when its two siblings had died first).
ONE_CORE_WORKERS = MachineInfo(cores=1)


def three_trial_spec(name: str, workload: str, **workload_options) -> JobSpec:
    """Trials with hidden sizes 8, 16 and 32 (in that order), two at once."""
    job = synthetic_job(name, trials=3)
    job["workload"].update(name=f"killing_workload:{workload}", **workload_options)
    job["hyperparameters"] = {"hidden": {"type": "choice", "values": [8, 16, 32]}}
    job["search"] = {"algorithm": "grid", "trials": 3, "seed": 0, "max_concurrent": 2}
    job["system"]["space"] = {}
    return JobSpec.from_dict(job, machine=MACHINE)


def test_a_lost_worker_is_retried_and_a_killing_epoch_fails_only_its_trial(
        tmp_path, monkeypatch):
    from distributed import Client

    from pipetune.backends import DaskBackend

    monkeypatch.setenv("PIPETUNE_KILL_MARKS", str(tmp_path))
    spec = three_trial_spec("worker-loss", "KillingWorkload")
    with process_cluster(n_workers=2, cores=1) as cluster, \
            Client(cluster, set_as_default=False) as client:
        study = Study(spec, study_id="loss", checkpoints=CheckpointStore(tmp_path / "ck"),
                      core_budget=2, machine=ONE_CORE_WORKERS)
        backend = DaskBackend(client)
        study.run(backend)
        # Dask's nannies restart the killed workers: the cluster is whole afterwards.
        client.wait_for_workers(2, timeout=60)
    by_hidden = {t.params["hidden"]: t for t in study.trials.values()}
    assert study.done and len(by_hidden) == 3
    killer = by_hidden[8]
    assert killer.state == "failed" and killer.epochs_run == 1
    assert killer.error.startswith("worker died: all 2 workers that ran this epoch died")
    assert "memory limit" in killer.error
    # Lost its worker once, in epoch 2: ran again elsewhere from epoch 1's checkpoint.
    once = by_hidden[16]
    assert once.state == "completed" and [r.epoch for r in once.results] == [1, 2, 3], \
        (once.error, backend.resent, backend.placements)
    assert not once.results[1].reused_model  # rebuilt from the checkpoint, not memory
    assert once.results[1].worker != once.results[0].worker
    assert by_hidden[32].state == "completed" and by_hidden[32].epochs_run == 3, \
        by_hidden[32].error
    assert study.summary().failed == 1
    # The driver sent each of the two epochs once more; the killer's second death was final.
    assert sorted(backend.resent) == sorted([(killer.trial_id, 2), (once.trial_id, 2)])


def test_a_hung_epoch_times_out_its_trial_and_frees_its_worker(tmp_path):
    import time

    from distributed import Client

    from pipetune.backends import DaskBackend

    spec = three_trial_spec("hung", "HangingWorkload", epoch_timeout_s=10)
    with process_cluster(n_workers=2, cores=1) as cluster, \
            Client(cluster, set_as_default=False) as client:
        study = Study(spec, study_id="hung", checkpoints=CheckpointStore(tmp_path / "ck"),
                      core_budget=2, machine=ONE_CORE_WORKERS)
        backend = DaskBackend(client)
        started = time.monotonic()
        study.run(backend)
        took = time.monotonic() - started
        client.wait_for_workers(2, timeout=60)
        hung_on = backend.placements[(0, 2)][0]
        # Restarted: a new process, so a new address; the hung thread is gone with it.
        assert hung_on not in client.scheduler_info(n_workers=-1)["workers"]
    by_hidden = {t.params["hidden"]: t for t in study.trials.values()}
    hung = by_hidden[8]
    assert hung.state == "failed" and hung.epochs_run == 1
    assert hung.error.startswith("timeout: the epoch ran longer than its 10 s")
    assert all(by_hidden[h].state == "completed" and by_hidden[h].epochs_run == 3
               for h in (16, 32))
    assert took < 300  # the hung epoch sleeps for an hour


def test_a_system_space_wider_than_the_cluster_workers_is_refused_before_recording(
        prefect_api_url, tmp_path, monkeypatch):
    """Probes of cores=2 and 3 on workers advertising 1 core could never start: with no
    value of the knob left, the job is refused at start, naming the field, with no
    journal and no MLflow run written (one value that fits and the others are only
    dropped: tests/test_space_fit.py)."""
    from mlflow.tracking import MlflowClient

    from flows.study import study_flow
    from pipetune.errors import SystemConfigError

    monkeypatch.setenv("PIPETUNE_HOME", str(tmp_path / "home"))
    job = synthetic_job("too-wide", trials=2)
    job["system"]["space"] = {"cores": [2, 3]}
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with process_cluster(n_workers=1, cores=1) as cluster, \
            pytest.raises(SystemConfigError) as refused:
        study_flow(job=job, tracking_uri=uri, checkpoint_root=str(tmp_path / "ck"),
                   groundtruth_path=str(tmp_path / "gt.json"),
                   dask_address=cluster.scheduler_address)
    assert refused.value.field == "system.space.cores"
    assert "largest worker advertises 1 core)" in refused.value.message
    assert not (tmp_path / "home" / "studies").exists()
    assert MlflowClient(uri).search_experiments() == [] or not MlflowClient(uri).search_runs(
        [e.experiment_id for e in MlflowClient(uri).search_experiments()])

