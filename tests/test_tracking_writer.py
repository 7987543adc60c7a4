"""The study tracker writes MLflow in the background: real MLflow on a SQLite file."""

from __future__ import annotations

import threading

import pytest
from known import CONV_JOB, synthetic_job
from mlflow.tracking import MlflowClient

from pipetune.engine.study import Trial
from pipetune.profiler.profile import EpochMeasurement, Profile
from pipetune.runner import EpochResult
from pipetune.spec import JobSpec
from pipetune.tracking import (
    MAX_ENTITIES_PER_BATCH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_PER_BATCH,
    MAX_TAGS_PER_BATCH,
    StudyTracker,
    batches,
)
from pipetune.tuner import Phase

EPOCHS = 50
TRIALS = 3


class CountingClient(MlflowClient):
    """A real client that counts ``log_batch`` calls; the writer thread's calls can be
    held at a gate (so everything is queued before the writer gets to it), and a metric
    named ``boom`` makes ``log_batch`` raise."""

    def __init__(self, uri: str):
        super().__init__(uri)
        self.log_batch_calls = 0
        self.gate = threading.Event()
        self.gate.set()
        self._main = threading.get_ident()

    def _hold(self) -> None:
        if threading.get_ident() != self._main:
            assert self.gate.wait(60), "test never opened the gate"

    def create_run(self, *args, **kwargs):
        self._hold()
        return super().create_run(*args, **kwargs)

    def log_batch(self, run_id, metrics=(), params=(), tags=(), **kwargs):
        self._hold()
        self.log_batch_calls += 1
        if any(m.key == "boom" for m in metrics):
            raise RuntimeError("boom")
        return super().log_batch(run_id, metrics=metrics, params=params, tags=tags, **kwargs)


@pytest.fixture
def spec() -> JobSpec:
    return JobSpec.from_dict(synthetic_job("writer"))


@pytest.fixture
def client(tmp_path) -> CountingClient:
    return CountingClient(f"sqlite:///{tmp_path / 'mlflow.db'}")


def tracker_for(client: CountingClient, spec: JobSpec) -> StudyTracker:
    return StudyTracker(client.tracking_uri, spec, client=client, tags={"test": "writer"})


def epoch(spec: JobSpec, trial: Trial, n: int, **metrics: float) -> EpochResult:
    m = EpochMeasurement(
        wall_s=1.0 + n / 100, samples=256, steps=8, cpu_s=0.9, cpu_util=0.9,
        peak_rss_mb=400.0, ctx_switches=10, page_faults=2, energy_j=5.0 + n,
        energy_source="estimate", counters_source="psutil", op_mix={}, counters={},
        overhead_s=0.01, profile=Profile(dict(CONV_JOB)),
    )
    phase = Phase.PROFILE if n == 1 else Phase.TRAIN
    return EpochResult(
        trial_id=trial.trial_id, epoch=n, phase=phase, system=spec.system.default,
        train_loss=1.0 / n + trial.trial_id, metrics={"accuracy": n / 100, **metrics},
        measurement=m, checkpoint=f"/nowhere/{trial.trial_id}/{n}", batch_size=32,
        started=1_700_000_000.0 + n, finished=1_700_000_001.0 + n, worker="w",
    )


def run_epochs(tracker: StudyTracker, spec: JobSpec, trials: list[Trial],
               boom: tuple[int, int] | None = None) -> None:
    for n in range(1, EPOCHS + 1):
        for trial in trials:
            extra = {"boom": 1.0} if boom == (trial.trial_id, n) else {}
            result = epoch(spec, trial, n, **extra)
            trial.results.append(result)
            tracker.log_epoch(trial, result)


def child_runs(client: MlflowClient, tracker: StudyTracker):
    runs = client.search_runs([tracker.experiment_id],
                              f"tags.mlflow.parentRunId = '{tracker.parent_run_id}'")
    return {int(r.data.tags["pipetune.trial_id"]): r for r in runs}


def assert_epochs_recorded(client: MlflowClient, run_id: str, trial_id: int) -> None:
    losses = client.get_metric_history(run_id, "train_loss")
    assert sorted(m.step for m in losses) == list(range(1, EPOCHS + 1))
    assert all(m.value == pytest.approx(1.0 / m.step + trial_id) for m in losses)
    for key in ("accuracy", "epoch_seconds", "energy_j", "sys_interop_threads"):
        assert len(client.get_metric_history(run_id, key)) == EPOCHS, key


def test_epochs_are_batched_in_the_background_and_all_recorded(client, spec):
    tracker = tracker_for(client, spec)
    trials = [Trial(trial_id=i, params={"lr": 0.01 * (i + 1)}, seed=100 + i)
              for i in range(TRIALS)]
    before = client.log_batch_calls
    client.gate.clear()  # the writer waits: every epoch is queued first
    run_epochs(tracker, spec, trials)
    assert client.log_batch_calls == before  # nothing written on the caller's thread
    client.gate.set()
    tracker.flush()

    calls = client.log_batch_calls - before
    assert calls < EPOCHS  # 150 epochs, merged into a handful of batches
    runs = child_runs(client, tracker)
    assert sorted(runs) == list(range(TRIALS))
    for trial in trials:
        run = runs[trial.trial_id]
        assert run.info.status == "RUNNING"
        assert run.data.params == {"lr": str(0.01 * (trial.trial_id + 1)),
                                   "seed": str(trial.seed)}
        assert run.data.tags["test"] == "writer"
        assert run.data.tags["epoch.001.phase"] == "profile"
        assert run.data.tags[f"epoch.{EPOCHS:03d}.phase"] == "train"  # > 100 tags: chunked
        assert run.data.tags["energy_source"] == "estimate"
        assert_epochs_recorded(client, run.info.run_id, trial.trial_id)

    for trial in trials:
        trial.state = "completed" if trial.trial_id else "failed"
        tracker.end_trial(trial, metric="accuracy")
    tracker.flush()
    runs = child_runs(client, tracker)
    for trial in trials:
        run = runs[trial.trial_id]
        assert run.info.status == ("FINISHED" if trial.trial_id else "FAILED")
        assert run.data.tags["outcome"] == trial.state
        assert run.data.metrics["final_accuracy"] == pytest.approx(EPOCHS / 100)
        assert run.data.metrics["probe_epochs"] == 0
        names = [a.path for a in client.list_artifacts(run.info.run_id)]
        assert "profiles.csv" in names

    tracker.close()
    tracker.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        tracker.log_epoch(trials[0], trials[0].results[-1])


def test_fail_keeps_every_logged_epoch_and_ends_the_runs(client, spec):
    tracker = tracker_for(client, spec)
    trials = [Trial(trial_id=i, params={"lr": 0.05}, seed=i) for i in range(TRIALS)]
    run_epochs(tracker, spec, trials)
    trials[1].state = "completed"
    tracker.end_trial(trials[1], metric="accuracy")
    tracker.fail()  # no flush before: fail() writes what was queued

    parent = client.get_run(tracker.parent_run_id)
    assert parent.info.status == "FAILED"
    runs = child_runs(client, tracker)
    assert {i: r.info.status for i, r in runs.items()} == {
        0: "KILLED", 1: "FINISHED", 2: "KILLED"}
    for trial in trials:
        assert_epochs_recorded(client, runs[trial.trial_id].info.run_id, trial.trial_id)


def test_a_failed_background_write_is_raised_by_flush(client, spec):
    tracker = tracker_for(client, spec)
    trials = [Trial(trial_id=i, params={"lr": 0.05}, seed=i) for i in range(2)]
    client.gate.clear()
    run_epochs(tracker, spec, trials[:1], boom=(0, 3))
    client.gate.set()
    with pytest.raises(RuntimeError, match="boom"):
        tracker.flush()
    tracker.flush()  # raised once; the writer goes on

    run_epochs(tracker, spec, trials[1:])
    tracker.flush()
    runs = child_runs(client, tracker)
    assert_epochs_recorded(client, runs[1].info.run_id, 1)


def test_fail_ends_the_runs_even_after_the_writer_raised(client, spec, caplog):
    tracker = tracker_for(client, spec)
    trials = [Trial(trial_id=i, params={"lr": 0.05}, seed=i) for i in range(2)]
    for n in (1, 2):
        for trial in trials:
            tracker.log_epoch(trial, epoch(spec, trial, n))
    tracker.flush()
    tracker.log_epoch(trials[0], epoch(spec, trials[0], 3, boom=1.0))
    tracker.fail()  # logs the lost write, does not raise, does not hang

    assert "boom" in caplog.text
    assert client.get_run(tracker.parent_run_id).info.status == "FAILED"
    runs = child_runs(client, tracker)
    assert {i: r.info.status for i, r in runs.items()} == {0: "KILLED", 1: "KILLED"}
    for i in (0, 1):
        steps = [m.step for m in client.get_metric_history(runs[i].info.run_id, "train_loss")]
        assert sorted(steps) == [1, 2]


def test_batches_respect_mlflow_limits_and_keep_order():
    from mlflow.entities import Metric, Param, RunTag

    metrics = [Metric(f"m{i % 7}", float(i), 0, i) for i in range(2500)]
    params = [Param(f"p{i}", "v") for i in range(150)]
    tags = [RunTag(f"t{i}", "v") for i in range(250)]
    out = list(batches(metrics, params, tags))
    for ms, ps, ts in out:
        assert len(ms) <= MAX_METRICS_PER_BATCH
        assert len(ps) <= MAX_PARAMS_PER_BATCH and len(ts) <= MAX_TAGS_PER_BATCH
        assert len(ms) + len(ps) + len(ts) <= MAX_ENTITIES_PER_BATCH
    assert [m for ms, _, _ in out for m in ms] == metrics
    assert [p for _, ps, _ in out for p in ps] == params
    assert [t for _, _, ts in out for t in ts] == tags
    assert list(batches([], [], [])) == []


class StoreCalls(MlflowClient):
    """A real client that writes down each run creation's tag keys and each
    ``log_batch``'s sizes, and refuses ``log_text`` (which reads the whole run back from
    the store to find where its artifacts go)."""

    def __init__(self, uri: str):
        super().__init__(uri)
        self.calls: list[tuple] = []

    def create_run(self, *args, **kwargs):
        self.calls.append(("create_run", sorted(kwargs.get("tags") or {})))
        return super().create_run(*args, **kwargs)

    def log_batch(self, run_id, metrics=(), params=(), tags=(), **kwargs):
        self.calls.append(("log_batch", len(metrics), len(params), len(tags)))
        return super().log_batch(run_id, metrics=metrics, params=params, tags=tags, **kwargs)

    def log_text(self, *args, **kwargs):
        raise AssertionError("a trial run's artifact went through MlflowClient.log_text")


def test_a_trial_run_is_created_with_its_tags_and_its_artifacts_go_straight_in(tmp_path):
    """What a trial sends before its run is written goes in two store calls: the run
    with its tags, then one batch of metrics and params; its profile table is written to
    the run's artifact location without asking the store where that is."""
    import mlflow.artifacts

    from pipetune.tracking import MlflowSink

    client = StoreCalls(f"sqlite:///{tmp_path / 'mlflow.db'}")
    sink = MlflowSink(client=client, tracking_uri=client.tracking_uri,
                      tags={"pipetune.study_id": "calls"})
    sink.open_study("pipetune", "calls", {}, [], [])
    client.calls.clear()
    sink.create_child(0)
    sink.log(("trial", 0), [("train_loss", 0.5, 1, 1001)], [("lr", "0.1")],
             [("epoch.001.phase", "profile")])
    sink.log(("trial", 0), [("accuracy", 0.9, 1, 1001)], (), [("outcome", "completed")])
    sink.log_text(("trial", 0), "a,b\n1,2\n", "profiles.csv")
    sink.terminate(("trial", 0), "FINISHED", 2000)

    created = [c for c in client.calls if c[0] == "create_run"]
    assert len(created) == 1
    assert {"epoch.001.phase", "outcome", "pipetune.study_id"} <= set(created[0][1])
    assert [c for c in client.calls if c[0] == "log_batch"] == [("log_batch", 2, 1, 0)]
    run = client.get_run(sink.children()[0])
    assert run.data.tags["epoch.001.phase"] == "profile"
    assert run.data.tags["outcome"] == "completed" and run.data.params == {"lr": "0.1"}
    assert run.data.metrics == {"train_loss": 0.5, "accuracy": 0.9}
    assert run.info.status == "FINISHED"
    text = mlflow.artifacts.load_text(f"{run.info.artifact_uri}/profiles.csv")
    assert text == "a,b\n1,2\n"


def test_a_trial_run_created_already_still_gets_the_tags_sent_with_its_creation(tmp_path):
    """A creation sent again (its first answer lost, replayed from a spool) finds the
    run and still sets the tags that came with it."""
    from pipetune.tracking.runs import StudyRuns

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("again")
    parent = client.create_run(experiment).info.run_id
    runs = StudyRuns(tags={"pipetune.study_id": "again"}, experiment_id=experiment,
                     parent_run_id=parent, client=client)
    runs.create_child(0, 1000, [("first", "1")], unsure=False)
    runs.create_child(0, 1000, [("second", "2")], unsure=True)
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
    assert len(children) == 1
    assert {"first": "1", "second": "2"}.items() <= children[0].data.tags.items()


def test_the_experiment_opens_on_model_training_unless_its_kind_is_set(tmp_path):
    """pipetune's experiment says its kind (Model training) in ``mlflow.experimentKind``;
    an experiment an older pipetune made gets it on the next study, and a kind the user
    chose stays."""
    from pipetune.tracking import ensure_experiment
    from pipetune.tracking.store import EXPERIMENT_KIND_TAG

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    made = ensure_experiment(uri)
    assert client.get_experiment(made).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    older = client.create_experiment("older")
    assert ensure_experiment(uri, "older") == older
    assert client.get_experiment(older).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    mine = client.create_experiment("mine", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    assert ensure_experiment(uri, "mine") == mine
    assert client.get_experiment(mine).tags[EXPERIMENT_KIND_TAG] == "genai_development"
