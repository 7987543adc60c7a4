"""Checkpoints by URL: a folder, an fsspec URL, MLflow's artifact proxy; and pruning.

The proxy is a real ``mlflow server --serve-artifacts`` on loopback: checkpoints go in
over HTTP and come back as artifacts of the study's run, browsable in the UI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest
from known import wait_until_healthy

torch = pytest.importorskip("torch")

from pipetune.checkpoints import (  # noqa: E402
    CheckpointStore,
    attempt_ref,
    resolve_checkpoint_root,
)
from pipetune.errors import PipetuneError, StorageError  # noqa: E402
from pipetune.net import free_port  # noqa: E402
from pipetune.storage import resolve_location, storage_for  # noqa: E402


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A tracking server with the artifact proxy, on SQLite, for this module."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
         f"sqlite:///{root / 'mlflow.db'}", "--serve-artifacts", "--artifacts-destination",
         str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, cwd=root,
        env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(url, proc, root / "server.log")
    yield url, root / "artifacts"
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)
    log.close()


@dataclass
class _Result:  # the two fields of an EpochResult the pruning policy reads
    checkpoint: str
    metrics: dict[str, float] = field(default_factory=dict)


def test_mlflow_artifacts_uris_resolve_to_the_proxy():
    assert resolve_location("mlflow-artifacts:/1/abc/artifacts", "http://h:5000") == (
        "http://h:5000/api/2.0/mlflow-artifacts/artifacts/1/abc/artifacts")
    assert resolve_location("mlflow-artifacts://other:7000/x/y", "https://h") == (
        "https://other:7000/api/2.0/mlflow-artifacts/artifacts/x/y")
    assert resolve_location("mlflow-artifacts:/x", "http://h/prefix/") == (
        "http://h/prefix/api/2.0/mlflow-artifacts/artifacts/x")
    assert resolve_location("/data/ck", "http://h:5000") == "/data/ck"
    with pytest.raises(StorageError, match="needs an http"):
        resolve_location("mlflow-artifacts:/x", "sqlite:///m.db")
    with pytest.raises(StorageError, match="resolve"):
        storage_for("mlflow-artifacts:/x/y.pt")
    assert resolve_checkpoint_root("mlflow", "sqlite:///m.db", lambda: "/runs/1/r/artifacts") == (
        "/runs/1/r/artifacts/checkpoints")

    def no_call() -> str:
        raise AssertionError("the run's artifact URI is asked only for 'mlflow'")

    assert resolve_checkpoint_root("/data/ck", "http://h:5000", no_call) == "/data/ck"


@pytest.mark.parametrize("kind", ["folder", "memory"])
def test_checkpoints_round_trip_on_a_folder_and_an_fsspec_url(kind, tmp_path):
    root = str(tmp_path / "ck") if kind == "folder" else f"memory://ck-{time.time_ns()}"
    ref = CheckpointStore(root).ref("s", 1, 2)
    assert not CheckpointStore.exists(ref)
    CheckpointStore.write_state({"w": torch.arange(3.0)}, ref)
    assert CheckpointStore.exists(ref)
    assert torch.equal(CheckpointStore.read_state(ref)["w"], torch.arange(3.0))
    CheckpointStore.remove([ref, ref])  # twice: one already gone is fine
    assert not CheckpointStore.exists(ref)
    with pytest.raises(PipetuneError, match="did not appear within 0 s"):
        CheckpointStore.read_state(ref, wait_s=0)


def test_checkpoints_are_artifacts_of_the_study_run_through_the_proxy(mlflow_server):
    from mlflow.tracking import MlflowClient

    url, destination = mlflow_server
    client = MlflowClient(url)
    run = client.create_run(client.create_experiment(f"ck-{time.time_ns()}"))
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    root = resolve_checkpoint_root("mlflow", url, lambda: run.info.artifact_uri)
    assert root.startswith(f"{url}/api/2.0/mlflow-artifacts/artifacts/")
    store = CheckpointStore(root)
    refs = [store.ref("study", 3, epoch) for epoch in (1, 2)]
    for epoch, ref in enumerate(refs, 1):
        CheckpointStore.write_state({"epoch": torch.tensor(epoch)}, ref)
    assert storage_for(refs[0]).kind == "mlflow-artifacts"
    assert all(CheckpointStore.exists(r) for r in refs)
    assert not CheckpointStore.exists(store.ref("study", 3, 9))
    assert int(CheckpointStore.read_state(refs[1])["epoch"]) == 2
    listed = [f.path for f in client.list_artifacts(run.info.run_id, "checkpoints/study/trial-003")]
    assert listed == ["checkpoints/study/trial-003/epoch-001.pt",
                      "checkpoints/study/trial-003/epoch-002.pt"]
    # On the server's disk, under the run: what the MLflow UI shows.
    assert len(list(destination.rglob("trial-003/epoch-00*.pt"))) == 2
    CheckpointStore.remove(refs[:1])
    assert not CheckpointStore.exists(refs[0]) and CheckpointStore.exists(refs[1])


def test_a_stopped_proxy_is_one_clear_error(tmp_path):
    ref = f"http://127.0.0.1:{free_port()}/api/2.0/mlflow-artifacts/artifacts/1/r/x.pt"
    with pytest.raises(StorageError, match="127.0.0.1"):
        CheckpointStore.write_state({"w": torch.zeros(1)}, ref)


def test_pruning_keeps_the_last_and_the_best_checkpoint_of_an_ended_trial(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    results = [_Result(store.ref("s", 0, e), {"accuracy": acc})
               for e, acc in enumerate([0.5, 0.9, 0.7, 0.8], 1)]
    for r in results:
        CheckpointStore.write_state({"w": torch.zeros(1)}, r.checkpoint)
    assert CheckpointStore.prunable(results, "accuracy", "max") == [
        results[0].checkpoint, results[2].checkpoint]
    assert CheckpointStore.prunable(results, "accuracy", "min") == [
        results[1].checkpoint, results[2].checkpoint]
    assert CheckpointStore.prunable(results[:1], "accuracy", "max") == []
    gone = store.prune_trial(results, "accuracy", "max")
    assert store.wait_pruned() == 2
    assert [CheckpointStore.exists(r.checkpoint) for r in results] == [False, True, False, True]
    assert gone == [results[0].checkpoint, results[2].checkpoint]
    keep_all = CheckpointStore(tmp_path / "ck", keep="all")
    assert keep_all.prune_trial(results, "accuracy", "max") == [] and keep_all.wait_pruned() == 0
    with pytest.raises(PipetuneError, match="best-and-last, all"):
        CheckpointStore(tmp_path, keep="none")


@pytest.mark.parametrize("keep", CheckpointStore.KEEP_POLICIES)
def test_what_a_lost_worker_wrote_for_a_resent_epoch_is_deleted(tmp_path, keep):
    """Epoch 2 was sent again twice (its workers froze): the trial's result is the third
    attempt's file; the first attempt's late write and the second's are deleted at the
    trial's end, under either policy, and a write landing later at the study's end."""
    store = CheckpointStore(tmp_path / "ck", keep=keep)
    first = [store.ref("s", 0, e) for e in (1, 2, 3)]
    results = [_Result(first[0], {"accuracy": 0.5}),
               _Result(attempt_ref(first[1], 3), {"accuracy": 0.9}),
               _Result(first[2], {"accuracy": 0.7})]
    stale = [first[1], attempt_ref(first[1], 2)]
    for ref in [r.checkpoint for r in results] + stale[:1]:
        CheckpointStore.write_state({"w": torch.zeros(1)}, ref)
    store.prune_trial(results, "accuracy", "max")
    store.wait_pruned()
    assert not CheckpointStore.exists(stale[0])
    # The best (epoch 2's third attempt) and the last are kept either way.
    assert CheckpointStore.exists(results[1].checkpoint)
    assert CheckpointStore.exists(results[2].checkpoint)
    assert CheckpointStore.exists(results[0].checkpoint) == (keep == "all")
    CheckpointStore.write_state({"w": torch.zeros(1)}, stale[1])  # the second, woken late
    store.prune_superseded(results)
    assert store.wait_pruned() == 1 and not CheckpointStore.exists(stale[1])


def test_a_store_crosses_to_a_worker_without_its_pruner(tmp_path):
    import pickle

    store = CheckpointStore(tmp_path / "ck")
    store.prune_trial([_Result(store.ref("s", 0, e)) for e in (1, 2)], "accuracy", "max")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.root == store.root and clone.keep == store.keep
    store.wait_pruned()


