"""The study flow for real: a Prefect server, a Dask cluster of process workers,
real (tiny) training, MLflow on SQLite, checkpoints on disk."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest
from known import process_cluster, synthetic_job

from pipetune.system.config import SystemConfig
from pipetune.tuner import EpochObservation, Phase, SystemTuner

pytestmark = pytest.mark.slow

JOB = synthetic_job("flow-test", seed=7)


@pytest.fixture(scope="module")
def cluster(prefect_api_url):
    """A real Dask cluster of process workers, started after PREFECT_API_URL is set
    (the workers inherit it) and kept warm across the flow runs of this module."""
    with process_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("flow")
    return {
        "tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
        "checkpoints": str(root / "checkpoints"),
        "groundtruth": str(root / "groundtruth.json"),
    }


def run_study(cluster, store, job=JOB, **params):
    from flows.study import study_flow

    return study_flow(
        job=job,
        dask_address=cluster.scheduler_address,
        tracking_uri=store["tracking_uri"],
        checkpoint_root=store["checkpoints"],
        groundtruth_path=store["groundtruth"],
        core_budget=2,
        **params,
    )


def children(client, summary):
    runs = client.search_runs(
        [summary["experiment_id"]],
        filter_string=f"tags.mlflow.parentRunId = '{summary['parent_run_id']}'",
    )
    return sorted(runs, key=lambda r: int(r.data.tags["pipetune.trial_id"]))


def artifact_paths(client, run_id, path=None):
    out = []
    for item in client.list_artifacts(run_id, path):
        out += artifact_paths(client, run_id, item.path) if item.is_dir else [item.path]
    return out


@pytest.fixture(scope="module")
def cold(cluster, store):
    # As `pipetune tune` runs it: the run loggers at INFO, so the flow run's Logs tab
    # gets the study's lines (the CLI raises only its console handler to WARNING).
    # Prefect configures its loggers when first imported: import it first.
    import flows.study

    runs = logging.getLogger("prefect.flow_runs")
    level = runs.level
    runs.setLevel(logging.INFO)
    try:
        return run_study(cluster, store)
    finally:
        runs.setLevel(level)
        flows.study.drain_prefect()  # sent now, while the session's server is up


def test_study_records_parent_and_trial_runs_in_mlflow(cold, store):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store["tracking_uri"])
    parent = client.get_run(cold["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["prefect.flow_run_id"] == cold["flow_run_id"]
    assert parent.data.metrics["study_trials"] == 3
    assert parent.data.metrics["study_epochs_run"] == 9
    assert parent.data.metrics["study_tuning_wall_s"] > 0
    assert parent.data.tags["energy_source"] == "estimate"
    assert {"job.json", "spaces.json", "trials.csv", "timeline.png",
            "best_model/best_model.pt", "best_model/best_model.json"} <= set(
        artifact_paths(client, parent.info.run_id))

    trials = children(client, cold)
    assert len(trials) == 3
    for run in trials:
        assert run.data.tags["prefect.flow_run_id"] == cold["flow_run_id"]
        assert run.data.tags["outcome"] == "completed"
        assert "lr" in run.data.params
        losses = client.get_metric_history(run.info.run_id, "train_loss")
        assert [m.step for m in sorted(losses, key=lambda m: m.step)] == [1, 2, 3]
        knob = client.get_metric_history(run.info.run_id, "sys_interop_threads")
        assert sorted(m.step for m in knob) == [1, 2, 3]
        assert run.data.tags["epoch.001.phase"] == "profile"
        assert "profiles.csv" in artifact_paths(client, run.info.run_id)
        # The run covers its epochs, from the first one's start on its worker; the wait
        # before (a worker starting, the workload's build) is its startup_s.
        epochs_s = sum(m.value for m in
                       client.get_metric_history(run.info.run_id, "epoch_seconds"))
        assert run.info.end_time - run.info.start_time >= 1000 * epochs_s - 5
        (startup,) = client.get_metric_history(run.info.run_id, "startup_s")
        assert startup.step == 1 and startup.value >= 0

    # Trial 0 found nothing to match, probed both one-knob candidates and kept the
    # cheaper; later trials were that same job (a known job: epoch 1 under its config)
    # and skipped probing.
    first = trials[0]
    assert first.data.tags["groundtruth"] == "miss"
    assert [first.data.tags[f"epoch.00{e}.phase"] for e in (2, 3)] == ["probe", "probe"]
    assert cold["probe_epochs"] == 2
    assert first.data.tags["epoch.002.system"] == "cores=1 interop=2 workers=0"
    assert first.data.tags["epoch.003.system"] == "cores=1 interop=1 workers=1"
    # Each decision's gist as its tag, short enough for MLflow's tag chips; the whole
    # reason of every epoch in the trial run's description.
    assert first.data.tags["epoch.002.decision"].startswith("probe 1/2: ")
    note = first.data.tags["mlflow.note.content"]
    for epoch in (1, 2, 3):
        tag = first.data.tags[f"epoch.00{epoch}.decision"]
        assert len(tag) <= 48 and f"- epoch {epoch} (" in note
        assert tag.rstrip("\u2026") in note
    assert "- epoch 2 (probe, cores=1 interop=2 workers=0): probe 1/2: " in note
    # What the probe's decision weighed, as figures: the epochs the trial had left.
    assert json.loads(first.data.tags["epoch.002.weighed"]) == {"expected_epochs": 2,
                                                                "sure_epochs": 2}
    # It settled on what the tuner's rule picks from the costs it recorded (which of
    # the three wins is the machine's call: on a busy 2-core runner the default can).
    costs = {m.step: m.value for m in
             client.get_metric_history(first.info.run_id, "cost_per_sample")}
    knobs = {name: {m.step: int(m.value) for m in
                    client.get_metric_history(first.info.run_id, f"sys_{name}")}
             for name in ("cores", "interop_threads", "dataloader_workers")}
    history = [
        EpochObservation(epoch=e, phase=Phase(first.data.tags[f"epoch.00{e}.phase"]),
                         system=SystemConfig(**{k: v[e] for k, v in knobs.items()}),
                         cost=costs[e])
        for e in (1, 2, 3)
    ]
    expected, _ = SystemTuner(history[0].system, {}).best_observed(history)
    assert first.data.tags["system.final"] == expected.label()
    for run in trials[1:]:
        assert run.data.tags["groundtruth"] == "hit"
        assert run.data.tags["system.final"] == expected.label()


def test_prefect_shows_each_trial_as_a_chain_of_tasks(cold):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(cold["flow_run_id"])
        assert flow_run.state.is_completed()
        # Prefect stores task runs from the events their engine (and pipetune's recorder)
        # sends, in batches (flushed every second on the servers pipetune starts): the
        # last one may land a moment after the flow run ends.
        deadline = time.monotonic() + 15
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
            )
            if all(r.state.is_final() for r in runs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    by_name = {r.name: r for r in runs}
    assert len(by_name) == len(runs)  # one task run per epoch and per decision
    for trial in range(3):
        chain = sorted((r for r in runs if r.name.startswith(f"trial-{trial}-")),
                       key=lambda r: r.start_time)
        names = [r.name for r in chain]
        # epoch 1 (profile) -> lookup -> tune -> epoch 2 -> tune -> epoch 3, in time order;
        # trials 1 and 2 are the job trial 0 recorded (a known job): their epoch 1 runs
        # under its config and confirms it, with no profile lookup.
        lookup = [f"trial-{trial}-profile-lookup"] if trial == 0 else []
        assert names[0] == f"trial-{trial}-epoch-1-profile", names
        assert names[1:2 + len(lookup)] == [*lookup, f"trial-{trial}-tune-after-epoch-1"], names
        names = [names[0], *names[1 + len(lookup):]]
        assert names[2].startswith(f"trial-{trial}-epoch-2-"), names
        assert names[3] == f"trial-{trial}-tune-after-epoch-2", names
        assert names[4].startswith(f"trial-{trial}-epoch-3-") and len(names) == 5, names
        for before, run in zip(chain, chain[1:], strict=False):
            assert run.state.is_completed(), (run.name, run.state)
            assert run.start_time >= before.end_time  # each starts after the one before
            # ... and the UI draws it as that one's successor
            assert [i.id for i in run.task_inputs["wait_for"]] == [before.id]
        assert chain[0].state.is_completed()
        assert chain[0].task_inputs.get("wait_for", []) == []
        # An epoch's task run is Running from its start on the worker, after it was
        # sent (its expected start); how long it ran there is said in its final state.
        for run in chain:
            if re.search(r"-epoch-\d+-(profile|probe|train)$", run.name):
                assert run.expected_start_time <= run.start_time < run.end_time, run.name
                assert run.state.message.startswith("ran "), (run.name, run.state.message)
                assert run.total_run_time.total_seconds() == pytest.approx(
                    (run.end_time - run.start_time).total_seconds(), abs=0.01)
    others = [r for r in runs if not r.name.startswith("trial-")]
    assert [r.name for r in others] == [
        f"evaluate-best-checkpoint-of-trial-{int(cold['best_trial'])}"]
    assert others[0].state.is_completed()


def test_the_flow_run_is_named_after_its_study_and_logs_what_the_study_did(cold):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    study = cold["study_id"]
    with get_client(sync_client=True) as client:

        assert client.read_flow_run(cold["flow_run_id"]).name == study
        deadline = time.monotonic() + 30  # logs reach the server in the background
        while True:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(
                any_=[cold["flow_run_id"]])))
            messages = [entry.message for entry in logs]
            if any(m.startswith(f"study {study} done in") for m in messages):
                break
            assert time.monotonic() < deadline, messages
            time.sleep(0.5)
    assert any(m.startswith(f"study {study}: synthetic, 3 trials") for m in messages), messages
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[cold["flow_run_id"]])))
    # A table whose links open the study's run and its runs table in the Model-training view.
    assert "| study run | [" in artifact.data
    assert f"/#/experiments/{cold['experiment_id']}/runs/{cold['parent_run_id']}" \
        "?workflowType=machine_learning)" in artifact.data
    assert "searchFilter=tags.%60pipetune.study_id%60+%3D+%27" + study in artifact.data
    # Each trial's two decisions (after epochs 1 and 2), and its end.
    for trial in range(3):
        decided = [m for m in messages if m.startswith(f"trial {trial} after epoch ")]
        assert len(decided) == 2, messages
        assert any(m.startswith(f"trial {trial} completed after 3 epoch(s): accuracy ")
                   for m in messages), messages


def test_an_ended_trial_keeps_its_last_and_best_checkpoints(cold, store):
    """Every epoch wrote one; when the trial ended, the pruning policy (best-and-last)
    deleted all but its last and the epoch best by the objective."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store["tracking_uri"])
    root = Path(store["checkpoints"]) / cold["study_id"]
    pruned = 0
    for run in children(client, cold):
        trial = int(run.data.tags["pipetune.trial_id"])
        history = client.get_metric_history(run.info.run_id, "accuracy")
        best = max(history, key=lambda m: (m.value, -m.step)).step  # first of the best
        kept = {f"epoch-{e:03d}.pt" for e in (best, 3)}
        files = {p.name for p in (root / f"trial-{trial:03d}").glob("*.pt")}
        assert files == kept, (trial, [(m.step, m.value) for m in history])
        pruned += 3 - len(files)
    assert pruned == cold["checkpoints_pruned"] >= 1


def test_second_run_of_the_same_job_hits_the_ground_truth(cold, cluster, store):
    from mlflow.tracking import MlflowClient

    warm = run_study(cluster, store)
    assert warm["probe_epochs"] == 0
    assert warm["groundtruth_hits"] == 3
    parent = MlflowClient(store["tracking_uri"]).get_run(warm["parent_run_id"])
    assert parent.data.metrics["study_probe_epochs"] == 0
    assert parent.data.metrics["study_groundtruth_hits"] == 3


def test_no_pipetune_runs_every_epoch_under_the_default(cluster, store):
    from mlflow.tracking import MlflowClient

    v1 = run_study(cluster, store, pipetune=False)
    client = MlflowClient(store["tracking_uri"])
    assert v1["probe_epochs"] == 0 and v1["groundtruth_lookups"] == 0
    for run in children(client, v1):
        phases = {v for k, v in run.data.tags.items() if k.endswith(".phase")}
        assert phases == {"train"}
        for knob, default in (("sys_interop_threads", 1), ("sys_dataloader_workers", 0)):
            history = client.get_metric_history(run.info.run_id, knob)
            assert len(history) == 3 and {m.value for m in history} == {default}


def test_a_failing_trial_fails_alone(cluster, store):
    from mlflow.tracking import MlflowClient

    job = {
        **JOB,
        "name": "flaky",
        "workload": {**JOB["workload"], "name": "flaky_workload:FlakyWorkload"},
        "hyperparameters": {"hidden": {"type": "choice", "values": [8, 16, 32]}},
        "search": {"algorithm": "grid", "trials": 3, "seed": 0, "max_concurrent": 2},
    }
    summary = run_study(cluster, store, job=job)
    assert summary["trials_failed"] == 1
    assert summary["trials_completed"] == 2
    failed = [row for row in summary["trials_table"] if row["outcome"] == "failed"]
    assert len(failed) == 1 and "hidden=8 breaks in epoch 2" in failed[0]["error"]
    client = MlflowClient(store["tracking_uri"])
    runs = {r.data.tags["outcome"]: r for r in children(client, summary)}
    assert runs["failed"].info.status == "FAILED"
    assert "hidden=8" in runs["failed"].data.tags["error"]
    parent = client.get_run(summary["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.metrics["study_trials_failed"] == 1


def test_a_corrupt_ground_truth_stops_the_study_before_it_records(cluster, store, tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.study import study_flow
    from pipetune.errors import GroundTruthError

    bad = tmp_path / "groundtruth.json"
    text = '{"records": [{"features": {"cpu_util": NaN}, "batch_size": 32}]}'
    bad.write_text(text)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(GroundTruthError, match=f"{bad}.*not a finite number"):
        study_flow(job=JOB, tracking_uri=uri, checkpoint_root=str(tmp_path / "ck"),
                   groundtruth_path=str(bad), core_budget=2,
                   dask_address=cluster.scheduler_address)
    assert bad.read_text() == text  # left as it was, for the user to look at
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("pipetune")
    assert experiment is None or client.search_runs([experiment.experiment_id]) == []
    assert not (tmp_path / "ck").exists()


def test_a_task_run_that_ends_soon_is_one_state_and_a_long_one_shows_running(
        prefect_api_url):
    """The recorder holds a task run's Running state HOLD_RUNNING_S before sending it:
    an epoch of a second is one event for the Prefect server (at 32 epochs a second it
    spent 10 ms of CPU an event), a long one is Running in Prefect while it runs."""
    import uuid

    from prefect import flow
    from prefect.client.orchestration import get_client

    from tasks.task_run_sink import TaskRunSink

    @flow(name="hold-running")
    def holder() -> None:
        pass

    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(holder)
        sink = TaskRunSink(prefect_api_url, str(flow_run.id))
        short, long = str(uuid.uuid4()), str(uuid.uuid4())
        sink.start(short, "train-epoch", "trial-0-epoch-1", 0, time.time())
        sink.start(long, "train-epoch", "trial-1-epoch-1", 1, time.time())
        sink.idle()
        sink.finish(short, time.time() + 0.5)
        time.sleep(sink.HOLD_RUNNING_S + 0.2)
        sink.idle()
        deadline = time.monotonic() + 30
        while True:  # the long one shows Running while it runs
            try:
                state = client.read_task_run(uuid.UUID(long)).state
            except Exception:  # noqa: BLE001 - not stored yet
                state = None
            if state is not None and state.name == "Running":
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.2)
        sink.finish(long, time.time())
        sink.close()
        states = {run: [s.name for s in sorted(client.read_task_run_states(uuid.UUID(run)),
                                                key=lambda s: s.timestamp)]
                  for run in (short, long)}
    assert states == {short: ["Completed"], long: ["Running", "Completed"]}
