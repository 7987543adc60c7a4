"""The execution path for real: epochs as plain Dask futures on process workers, the
model kept on its worker, process knobs on workers started for them, MLflow kept
whole when a study fails half-way."""

from __future__ import annotations

import os
import time

import pytest
from known import process_cluster, synthetic_job

from pipetune.runner import EpochTask
from pipetune.spec import ProfilerSpec
from pipetune.system.config import SystemConfig, process_resource
from pipetune.tuner import Phase

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    """Two process workers, one thread each, no OpenMP wait policy set; the process-knob
    test adds a third started for one."""
    with process_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    from distributed import Client

    with Client(cluster, set_as_default=False) as client:
        yield client


def epoch_task(tmp_path, trial: int, epoch: int, *, base_seconds: float = 0.0,
               system: SystemConfig | None = None, study: str = "exec") -> EpochTask:
    def ref(e: int) -> str:
        return str(tmp_path / study / f"trial-{trial}" / f"epoch-{e}.pt")

    return EpochTask(
        study_id=study, trial_id=trial, epoch=epoch,
        phase=Phase.PROFILE if epoch == 1 else Phase.TRAIN,
        system=system or SystemConfig(), workload="synthetic",
        workload_params={"train_samples": 64, "val_samples": 32, "base_seconds": base_seconds},
        hparams={"lr": 0.05}, seed=trial, checkpoint_in=ref(epoch - 1) if epoch > 1 else None,
        checkpoint_out=ref(epoch), profiler=ProfilerSpec(op_mix_steps=1),
    )


def test_a_trial_stays_on_the_worker_holding_its_model_unless_it_is_busy(client, tmp_path):
    from pipetune.backends import DaskBackend

    backend = DaskBackend(client)
    a1 = backend.run(epoch_task(tmp_path, 0, 1))
    b1 = backend.run(epoch_task(tmp_path, 1, 1))
    assert a1.address != b1.address  # a new trial goes where no model lives
    assert not a1.reused_model and not b1.reused_model

    a2 = backend.run(epoch_task(tmp_path, 0, 2))  # its worker is free: stay there
    assert a2.address == a1.address and a2.reused_model
    assert backend.placements[(0, 2)] == (a1.address, "holds the model")

    # Trial 1's slow epoch occupies trial 0's worker (both workers hold a model; the
    # first in order is taken), so trial 0's next epoch goes to the other worker and
    # rebuilds from the checkpoint.
    backend.submit(epoch_task(tmp_path, 2, 1, base_seconds=3.0))
    time.sleep(0.5)
    busy_worker = backend.placements[(2, 1)][0]
    a3_task = epoch_task(tmp_path, 0, 3)
    if busy_worker != a1.address:  # the slow epoch landed on the other worker
        a3_task = epoch_task(tmp_path, 1, 2)  # then it is trial 1 whose home is busy
    a3 = backend.run(a3_task)
    assert a3.address != busy_worker and not a3.reused_model
    assert backend.placements[(a3_task.trial_id, a3_task.epoch)][1] == "home busy"
    assert backend.wait().result is not None  # the slow epoch finished too


def test_moving_a_trial_gives_the_same_model_as_keeping_it(client, tmp_path):
    """Planned equals actual: epoch 2 in memory and epoch 2 rebuilt from the epoch-1
    checkpoint on another worker end with the same metrics."""
    from pipetune.runner import LiveTrials, run_epoch

    live = LiveTrials()
    run_epoch(epoch_task(tmp_path, 5, 1, study="same"), live=live)
    kept = run_epoch(epoch_task(tmp_path, 5, 2, study="same"), live=live)
    assert kept.reused_model
    from pipetune.checkpoints import flush_checkpoints

    flush_checkpoints()
    moved = run_epoch(epoch_task(tmp_path, 5, 2, study="same"), live=None)
    assert not moved.reused_model
    assert moved.metrics == pytest.approx(kept.metrics)
    assert moved.train_loss == pytest.approx(kept.train_loss)


def test_a_process_knob_runs_on_a_worker_started_for_it(cluster, client, tmp_path):
    """omp_wait_policy is read by OpenMP when torch loads: an epoch asking for active
    waiting runs on a worker started with it, and reads it back inside the epoch."""
    import copy

    import dask

    from pipetune.backends import DaskBackend
    from pipetune.dask.backend import EpochFailed

    backend = DaskBackend(client)
    asked = SystemConfig(omp_wait_policy="active")
    # No worker advertises it yet and none was started with it: refused, saying why.
    with pytest.raises(EpochFailed, match="OMP_WAIT_POLICY=ACTIVE"):
        backend.run(epoch_task(tmp_path, 7, 1, system=asked))

    spec = copy.deepcopy(cluster.new_spec)
    spec["options"]["env"] = {**spec["options"].get("env", {}), "OMP_WAIT_POLICY": "ACTIVE"}
    spec["options"]["resources"] = {"cores": 2, process_resource("omp_wait_policy", "active"): 1}
    base, cluster.new_spec = cluster.new_spec, spec
    try:
        with dask.config.set({"distributed.worker.multiprocessing-method": "spawn",
                              "distributed.worker.daemon": False}):
            cluster.scale(3)
            client.wait_for_workers(3, timeout=120)
    finally:
        cluster.new_spec = base
    backend = DaskBackend(client)
    result = backend.run(epoch_task(tmp_path, 8, 1, system=asked))
    assert result.actual["omp_wait_policy"] == "active"
    started_for_it = [a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()
                      if process_resource("omp_wait_policy", "active") in w["resources"]]
    assert result.address in started_for_it
    # An epoch that does not ask keeps the policy of the worker it lands on.
    plain = backend.run(epoch_task(tmp_path, 9, 1))
    expected = "active" if plain.address in started_for_it else "inherit"
    assert plain.actual["omp_wait_policy"] == expected


def test_pinned_co_running_epochs_get_disjoint_cores(client, tmp_path):
    from pipetune.backends import DaskBackend

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    backend = DaskBackend(client)
    pinned = SystemConfig(pin_cores=True)
    for trial in (20, 21):
        backend.submit(epoch_task(tmp_path, trial, 1, base_seconds=1.0, system=pinned))
    results = [backend.wait().result for _ in range(2)]
    cpus = [tuple(r.actual["cpus"]) for r in results]
    assert all(len(c) == 1 for c in cpus) and cpus[0] != cpus[1]


def test_mlflow_keeps_every_epoch_of_a_study_that_fails_half_way(prefect_api_url, cluster,
                                                                 tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.study import study_flow
    from pipetune.groundtruth import GroundTruth

    gt_path = tmp_path / "groundtruth.json"
    GroundTruth(str(gt_path)).clear()
    job = synthetic_job("half-way", seed=3, trials=3)
    job["workload"] = {
        "name": "corrupting_workload:CorruptingWorkload",
        "params": {**job["workload"]["params"], "corrupt_path": str(gt_path)},
    }
    job["hyperparameters"] = {"hidden": {"type": "choice", "values": [16, 48]}}
    job["search"] = {"algorithm": "grid", "trials": 2, "seed": 0, "max_concurrent": 1}
    # Trial 0 (hidden 16) is the one that must be recorded whole; trial 1 (hidden 48,
    # another job) corrupts the ground truth in its first epoch, so the lookup after it
    # fails the study.
    job["workload"]["params"]["corrupt_hidden_above"] = 32
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(Exception, match="ground"):
        study_flow(job=job, tracking_uri=uri, checkpoint_root=str(tmp_path / "ck"),
                   groundtruth_path=str(gt_path), core_budget=2,
                   dask_address=cluster.scheduler_address)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("pipetune")
    parents = client.search_runs([exp.experiment_id], "tags.`pipetune.kind` = 'study'")
    assert len(parents) == 1 and parents[0].info.status == "FAILED"
    kids = client.search_runs(
        [exp.experiment_id], f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    by_trial = {int(k.data.tags["pipetune.trial_id"]): k for k in kids}
    assert set(by_trial) == {0, 1}
    first = by_trial[0]
    assert first.info.status == "FINISHED" and first.data.tags["outcome"] == "completed"
    assert sorted(m.step for m in client.get_metric_history(first.info.run_id,
                                                            "train_loss")) == [1, 2, 3]
    second = by_trial[1]
    assert second.info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(second.info.run_id, "train_loss")] == [1]


def test_an_ended_trial_s_model_goes_with_the_next_epoch_sent_to_its_worker(tmp_path):
    """A trial's release is no task of its own: the next epoch sent to the worker that
    holds its model drops it first, so the workers hold only live trials' models."""
    from distributed import Client

    from pipetune.backends import DaskBackend

    with process_cluster() as cluster, Client(cluster, set_as_default=False) as client:
        _release_rides_on_the_next_epoch(client, tmp_path, DaskBackend(client))


def _release_rides_on_the_next_epoch(client, tmp_path, backend) -> None:
    def held() -> dict[str, int]:
        return client.run(lambda: sum(1 for key in __import__(
            "pipetune.runner", fromlist=["LIVE_TRIALS"]).LIVE_TRIALS._entries
            if key[0] == "rel"))

    first = [backend.run(epoch_task(tmp_path, t, 1, study="rel")) for t in (0, 1)]
    assert sorted(held().values()) == [1, 1]
    for t in (0, 1):
        backend.release("rel", t)
    later = [backend.run(epoch_task(tmp_path, t, 1, study="rel")) for t in (2, 3)]
    assert {r.address for r in later} == {r.address for r in first}
    assert sorted(held().values()) == [1, 1]  # trials 2 and 3 only, one per worker
    backend.release("rel")
    assert sum(held().values()) == 0


def test_epochs_that_ended_together_are_fetched_together(cluster, tmp_path):
    """Results of epochs that ended while the driver was busy are fetched in one
    request, not one round trip after another (16-32 at once on many slots)."""
    from distributed import Client

    from pipetune.backends import DaskBackend

    class CountingClient(Client):  # the outer edge: Dask's own client, its gathers seen
        gathered: list[int] = []

        def gather(self, futures, *args, **kwargs):
            self.gathered.append(len(futures))
            return super().gather(futures, *args, **kwargs)

    with CountingClient(cluster, set_as_default=False) as client:
        backend = DaskBackend(client)
        for trial in (30, 31):
            backend.submit(epoch_task(tmp_path, trial, 1, base_seconds=0.3))
        deadline = time.monotonic() + 60
        while len([f for f in client.futures.values() if f.status == "finished"]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        results = [backend.wait().result for _ in range(2)]
    assert sorted(r.trial_id for r in results) == [30, 31]
    assert all(r.metrics for r in results)
    assert CountingClient.gathered == [2]
