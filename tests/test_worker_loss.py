"""Fault injection on a real Dask cluster of process workers: workers SIGKILLed in the
middle of an epoch. A worker lost once costs nothing (the epoch runs again on another
worker from the trial's last checkpoint); an epoch that kills every worker it runs
on fails its own trial, with the reason, and the study goes on."""

from __future__ import annotations

import pytest
from known import process_cluster, synthetic_job

from pipetune.checkpoints import CheckpointStore
from pipetune.spec import JobSpec
from pipetune.study import Study
from pipetune.system.config import MachineInfo

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skip(reason="known bug, open in issue 10: a worker killed right after an "
                     "epoch loses that epoch's background checkpoint write, and the retry "
                     "waits 60 s for it, then fails the trial with the wrong reason (seen in "
                     "1 of 4 runs); waiting for the write before the next epoch trains hung"),
]

MACHINE = MachineInfo(cores=2)


def test_a_lost_worker_is_retried_and_a_killing_epoch_fails_only_its_trial(
        tmp_path, monkeypatch):
    from distributed import Client

    from pipetune.backends import DaskBackend

    monkeypatch.setenv("PIPETUNE_KILL_MARKS", str(tmp_path))
    job = synthetic_job("worker-loss", trials=3)
    job["workload"]["name"] = "killing_workload:KillingWorkload"
    job["hyperparameters"] = {"hidden": {"type": "choice", "values": [8, 16, 32]}}
    job["search"] = {"algorithm": "grid", "trials": 3, "seed": 0, "max_concurrent": 2}
    job["system"]["space"] = {}
    spec = JobSpec.from_dict(job, machine=MACHINE)
    with process_cluster(n_workers=2, cores=1) as cluster, \
            Client(cluster, set_as_default=False) as client:
        study = Study(spec, study_id="loss", checkpoints=CheckpointStore(tmp_path / "ck"),
                      core_budget=2, machine=MACHINE)
        backend = DaskBackend(client)
        study.run(backend)
        # Dask's nannies restart the killed workers: the cluster is whole afterwards.
        client.wait_for_workers(2, timeout=60)
    by_hidden = {t.params["hidden"]: t for t in study.trials.values()}
    assert study.done and len(by_hidden) == 3
    killer = by_hidden[8]
    assert killer.state == "failed" and killer.epochs_run == 1
    assert killer.error.startswith("worker died: every worker that ran this epoch died")
    assert "memory limit" in killer.error
    # Lost its worker once, in epoch 2: ran again elsewhere from epoch 1's checkpoint.
    once = by_hidden[16]
    assert once.state == "completed" and [r.epoch for r in once.results] == [1, 2, 3]
    assert not once.results[1].reused_model  # rebuilt from the checkpoint, not memory
    assert once.results[1].worker != once.results[0].worker
    assert by_hidden[32].state == "completed" and by_hidden[32].epochs_run == 3
    assert study.summary().failed == 1
