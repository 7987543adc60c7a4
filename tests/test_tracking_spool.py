"""An MLflow tracking server that stops answering mid-study: a real ``mlflow server`` on
loopback (SQLite behind it) is SIGSTOPped or SIGKILLed while a real tiny study runs.
The study goes on (its sends never wait); what the server did not take waits in the
study's spool and is sent, in order and once, when it answers again: at once when it
comes back mid-study, or with ``pipetune tracking flush STUDY_ID`` when it came back
only after the study ended. Every metric's history holds one entry per step."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from known import synthetic_job, wait_until_healthy
from mlflow.tracking import MlflowClient

from pipetune.backends import LocalBackend
from pipetune.checkpoints import CheckpointStore
from pipetune.engine.study import Study
from pipetune.groundtruth import GroundTruth
from pipetune.net import free_port
from pipetune.spec import JobSpec
from pipetune.tracking.spool import Spool, spool_path
from pipetune.tracking.tracker import StudyTracker

EXPERIMENT = "spool"


class Server:
    """``mlflow server`` on 127.0.0.1:``port`` over ``root``/mlflow.db, in its own
    process group (signals reach its workers too); started again on the same port."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = self.root / "server.log"
        with log.open("a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                 f"sqlite:///{self.root / 'mlflow.db'}", "--host", "127.0.0.1",
                 "--port", str(self.port), "--workers", "1"],
                stdout=out, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True,
                env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true",
                     "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        wait_until_healthy(self.url, self.proc, log)

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signum)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)  # a stopped server dies too
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def migrated_store(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store, its schema made once (the server starts faster on
    a copy than on a fresh file, which it migrates first)."""
    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def server(tmp_path, migrated_store):
    shutil.copy(migrated_store, tmp_path / "mlflow.db")
    server = Server(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


def _spec(name: str) -> JobSpec:
    job = synthetic_job(name, trials=3)
    job["profiler"] = {"perf": "off"}  # in-process epochs: perf's counts are not the point
    job["workload"]["params"]["base_seconds"] = 0.1
    return JobSpec.from_dict(job)


def _run(tmp_path: Path, url: str, study_id: str, on_epoch) -> tuple[Study, StudyTracker,
                                                                       list[float], float]:
    """The study as the session runs it, over MLflow at ``url``; ``on_epoch(n)`` after
    the ``n``-th epoch was sent. Returns the study, its tracker, how long each epoch's
    send took, and how long ``finish`` took."""
    spec = _spec(study_id)
    tracker = StudyTracker(url, spec, experiment=EXPERIMENT,
                           tags={"pipetune.study_id": study_id})
    study = Study(spec, study_id=study_id, checkpoints=CheckpointStore(tmp_path / "ck"),
                  ground_truth=GroundTruth(str(tmp_path / "gt.json")))
    sends: list[float] = []

    def on_result(trial, result) -> None:
        began = time.perf_counter()
        tracker.log_epoch(trial, result)
        sends.append(time.perf_counter() - began)
        on_epoch(len(sends))

    def on_step(event) -> None:
        if event.ended:
            tracker.end_trial(event.trial, metric=study.metric)

    started = time.time()
    study.run(LocalBackend(), on_step=on_step, on_result=on_result)
    began = time.perf_counter()
    tracker.finish(study, wall_s=time.time() - started, extra_metrics={"extra": 1.0})
    return study, tracker, sends, time.perf_counter() - began


def _wait_for(path: Path, timeout_s: float = 40.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def assert_recorded_once(url: str, parent_run_id: str, study: Study) -> None:
    """Every trial's run once, with its params, tags and every epoch's metrics, each
    metric's history one entry per step; runs ended after their last metric."""
    client = MlflowClient(url)
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent_run_id}'",
                              max_results=1000)
    per_trial = Counter(int(r.data.tags["pipetune.trial_id"]) for r in runs)
    assert per_trial == Counter({t: 1 for t in study.trials}), per_trial
    for run in runs:
        trial = study.trials[int(run.data.tags["pipetune.trial_id"])]
        run_id, data = run.info.run_id, run.data
        assert run.info.status == "FINISHED"
        assert data.params["seed"] == str(trial.seed)
        assert data.tags["outcome"] == str(trial.state)
        epochs = [r.epoch for r in trial.results]
        assert epochs and all(f"epoch.{e:03d}.phase" in data.tags for e in epochs)
        latest = 0
        for key in data.metrics:
            history = client.get_metric_history(run_id, key)
            per_step = Counter(h.step for h in history)
            assert set(per_step.values()) == {1}, (trial.trial_id, key, per_step)
            if key == "train_loss":
                assert sorted(per_step) == epochs
            latest = max(latest, *(h.timestamp for h in history))
        assert run.info.end_time >= latest
        assert "profiles.csv" in {a.path for a in client.list_artifacts(run_id)}
    parent = client.get_run(parent_run_id)
    assert parent.info.status == "FINISHED"
    assert [h.step for h in client.get_metric_history(parent_run_id, "study_trials")] == [0]
    assert parent.data.metrics["study_extra"] == 1.0
    assert parent.data.tags["best_trial_run_id"] in {r.info.run_id for r in runs}
    assert {"trials.csv", "timeline.png"} <= {a.path for a in client.list_artifacts(parent_run_id)}


def test_a_server_stopped_mid_study_gets_every_write_once(tmp_path, server):
    study_id = "spool-stopped"
    spool = spool_path(study_id)

    def on_epoch(n: int) -> None:
        if n == 2:
            server.signal(signal.SIGSTOP)
        elif n == 4:  # writes went to the spool while it was stopped; it runs again
            _wait_for(spool)
            server.signal(signal.SIGCONT)

    study, tracker, sends, _ = _run(tmp_path, server.url, study_id, on_epoch)
    assert len(sends) > 4  # the study went on after the server ran again
    assert max(sends) < 0.5  # no send waited for the stopped server
    assert tracker.waiting is None and not spool.exists()
    assert_recorded_once(server.url, tracker.parent_run_id, study)


def test_a_server_gone_at_the_end_is_sent_later_by_flush(tmp_path, server):
    study_id = "spool-killed"
    spool = spool_path(study_id)

    def on_epoch(n: int) -> None:
        if n == 2:
            server.kill()

    study, tracker, sends, finish_s = _run(tmp_path, server.url, study_id, on_epoch)
    assert max(sends) < 0.5 and finish_s < 30
    note = tracker.waiting
    assert note is not None and note.count > 0 and note.path == str(spool)
    line = note.line()
    assert str(spool) in line and f"pipetune tracking flush {study_id}" in line, line
    waiting = Spool(spool).waiting()
    assert waiting == note.count

    def flush() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pipetune", "tracking", "flush", study_id],
                              capture_output=True, text=True, timeout=120)

    down = flush()  # the server is still down: nothing is sent, everything still waits
    assert down.returncode == 1 and "error: MLflow at" in down.stderr, down.stderr
    assert Spool(spool).waiting() == waiting

    server.start()  # back, on the same port and store
    sent = flush()
    assert sent.returncode == 0, sent.stderr
    assert f"{waiting} waiting MLflow write(s) sent" in sent.stdout
    assert not spool.exists()
    assert_recorded_once(server.url, tracker.parent_run_id, study)
    again = flush()  # nothing waits: nothing is written twice
    assert again.returncode == 0 and "no MLflow writes wait" in again.stdout
    assert_recorded_once(server.url, tracker.parent_run_id, study)


class AnswerLost(MlflowClient):
    """The real client, except that while ``lose`` is set, ``create_run`` and
    ``log_batch`` write and then fail as a connection that broke before the answer came
    back: the sink cannot know the write landed."""

    def __init__(self, uri: str):
        super().__init__(uri)
        self.lose = False

    def _lost(self, call: str) -> None:
        from mlflow.exceptions import MlflowException

        if self.lose:
            raise MlflowException(f"API request to http://127.0.0.1:1/api/2.0/mlflow/{call} "
                                  "failed with exception ('Connection aborted.', "
                                  "RemoteDisconnected('Remote end closed connection'))")

    def create_run(self, *args, **kwargs):
        run = super().create_run(*args, **kwargs)
        self._lost("runs/create")
        return run

    def log_batch(self, run_id, *args, **kwargs):
        super().log_batch(run_id, *args, **kwargs)
        self._lost("runs/log-batch")


def test_a_write_whose_answer_was_lost_is_not_written_twice(tmp_path):
    """The call failed but the write landed: sent again from the spool, a trial run
    that exists is not created again, and its metrics are in the history once."""
    from pipetune.tracking import MlflowSink

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = AnswerLost(uri)
    spool = tmp_path / "study" / "mlflow-spool.jsonl"
    sink = MlflowSink(client=client, tracking_uri=uri, spool=str(spool), tags={})
    experiment, parent = sink.open_study("pipetune", "lost", {}, [], [])
    client.lose = True
    sink.create_child(0)  # created, but the sink cannot know: it waits in the spool
    sink.log(("trial", 0), [("loss", 0.5, 1, 1001), ("acc", 0.1, 1, 1001)],
             [("lr", "0.1")], [("epoch.001.phase", "train")])
    sink.idle()
    assert Spool(spool).waiting() == 2
    client.lose = False
    sink.log(("trial", 0), [("loss", 0.4, 2, 1002), ("acc", 0.2, 2, 1002)])
    assert sink.finish_study(end=True) is None and not spool.exists()
    runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
    assert [r.data.tags["pipetune.trial_id"] for r in runs] == ["0"]
    child = runs[0].info.run_id
    assert sink.children() == {0: child}
    for key, values in (("loss", [0.5, 0.4]), ("acc", [0.1, 0.2])):
        history = client.get_metric_history(child, key)
        assert sorted((m.step, m.value) for m in history) == [(1, values[0]), (2, values[1])]
    run = client.get_run(child)
    assert run.data.params == {"lr": "0.1"} and run.data.tags["epoch.001.phase"] == "train"


@pytest.mark.slow
def test_a_session_ending_with_writes_waiting_says_so_in_one_warning(tmp_path, server, caplog):
    """Through the library's own door (:func:`open_study`): the spool is the study's
    folder's, and the end says, in one notice line, where it is and how to send it."""
    import logging

    from known import process_cluster

    from pipetune.engine.events import EpochFinished
    from pipetune.engine.journal import studies_root
    from pipetune.session import NOTICE_ATTR, StudyOptions, open_study

    def kill_at_the_first_epoch(event) -> None:
        if isinstance(event, EpochFinished) and server.proc.poll() is None:
            server.kill()

    log = logging.getLogger("pipetune.study.spool-test")
    with process_cluster(n_workers=1) as cluster:
        opened = open_study(_spec("spool-session"), StudyOptions(
            tracking_uri=server.url, checkpoint_root=str(tmp_path / "ck"),
            groundtruth_path=str(tmp_path / "gt.json"),
            dask_address=cluster.scheduler_address, core_budget=2), log=log)
        with caplog.at_level(logging.INFO, logger=log.name):
            summary = opened.run(LocalBackend(), observers=[kill_at_the_first_epoch])
    spool = studies_root() / opened.study_id / "mlflow-spool.jsonl"
    assert summary["trials"] == 3 and Spool(spool).waiting() > 0
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    line = warnings[0].getMessage()
    assert getattr(warnings[0], NOTICE_ATTR) == "warning"  # the CLI prints "warning: ..."
    assert str(spool) in line and f"pipetune tracking flush {opened.study_id}" in line


class Down(MlflowClient):
    """The real client, except that while ``down`` is set every write fails as a server
    that refuses connections (nothing lands)."""

    def __init__(self, uri: str):
        super().__init__(uri)
        self.down = False

    def _refuse(self) -> None:
        from mlflow.exceptions import MlflowException

        if self.down:
            raise MlflowException("API request to http://127.0.0.1:1/api/2.0/mlflow/runs "
                                  "failed with exception ConnectionRefusedError(111)")

    def log_batch(self, *args, **kwargs):
        self._refuse()
        return super().log_batch(*args, **kwargs)

    def set_terminated(self, *args, **kwargs):
        self._refuse()
        return super().set_terminated(*args, **kwargs)

    def set_tag(self, *args, **kwargs):
        self._refuse()
        return super().set_tag(*args, **kwargs)


def test_a_resumed_study_first_sends_what_its_last_run_left_waiting(tmp_path):
    """The stopped study's last writes (its end ``KILLED`` among them) go in before the
    resumed study opens its run again, not after: the run is ``RUNNING``."""
    from pipetune.tracking import MlflowSink

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = Down(uri)
    spool = tmp_path / "study" / "mlflow-spool.jsonl"
    first = MlflowSink(client=client, tracking_uri=uri, spool=str(spool), tags={})
    _, parent = first.open_study("pipetune", "resumed", {}, [], [])
    first.create_child(0)
    first.log(("trial", 0), [("loss", 0.5, 1, 1001)])
    first.idle()
    client.down = True
    first.log(("trial", 0), [("loss", 0.4, 2, 1002)])
    first.idle()
    note = first.fail_study("KILLED", "stopped", 1500)
    assert note is not None and note.count == 2
    client.down = False
    again = MlflowSink(client=client, tracking_uri=uri, spool=str(spool), tags={})
    _, children = again.resume_study(parent)
    assert not spool.exists()
    assert client.get_run(parent).info.status == "RUNNING"
    assert client.get_run(parent).data.tags["pipetune.failure"] == "stopped"
    assert [(m.step, m.value) for m in client.get_metric_history(children[0], "loss")] == \
        [(1, 0.5), (2, 0.4)]
    assert client.get_run(children[0]).info.status == "KILLED"


@pytest.mark.slow
def test_a_tune_whose_server_is_killed_exits_0_and_flush_sends_the_rest(tmp_path, server):
    """For real, through the command line: ``pipetune tune`` over a tracking server
    SIGKILLed after the second epoch exits 0 with one ``warning:`` line naming the spool
    and the command; once the server is back, that command sends the rest, each once."""
    import json

    import yaml

    root = Path(__file__).resolve().parents[1]
    job = synthetic_job("spool-cli", trials=3)
    job["workload"]["params"]["base_seconds"] = 0.5
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, "PIPETUNE_HOME": str(tmp_path / "home"),
           "PREFECT_HOME": str(tmp_path / "prefect"),
           "PYTHONPATH": os.pathsep.join(p for p in (
               str(root / "tests"), str(root), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("PREFECT_API_URL", None)
    tune = subprocess.Popen(
        [sys.executable, "-m", "pipetune", "tune", "job.yaml", "--tracking-uri", server.url],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:  # the second epoch in the journal: kill the server
            events = list((tmp_path / "home" / "studies").glob("*/events.jsonl"))
            if events and events[0].read_text(errors="replace").count('"kind": "result"') >= 2:
                break
            assert tune.poll() is None, tune.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the study never got going"
            time.sleep(0.1)
        server.kill()
        out, err = tune.communicate(timeout=300)
    finally:
        if tune.poll() is None:
            tune.kill()
    assert tune.returncode == 0, err[-3000:]
    study_id = events[0].parent.name
    spool = events[0].parent / "mlflow-spool.jsonl"
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, err[-3000:]
    assert str(spool) in warnings[0] and f"pipetune tracking flush {study_id}" in warnings[0]
    assert "Traceback" not in err, err[-3000:]
    assert spool.exists()

    server.start()
    flush = subprocess.run([sys.executable, "-m", "pipetune", "tracking", "flush", study_id],
                           env=env, capture_output=True, text=True, timeout=120)
    assert flush.returncode == 0 and "sent" in flush.stdout, flush.stderr[-3000:]
    assert not spool.exists()
    client = MlflowClient(server.url)
    parent_id = json.loads((events[0].parent / "study.json").read_text())["parent_run_id"]
    trials = client.search_runs([client.get_experiment_by_name("pipetune").experiment_id],
                                f"tags.mlflow.parentRunId = '{parent_id}'")
    assert sorted(int(r.data.tags["pipetune.trial_id"]) for r in trials) == [0, 1, 2]
    for run in trials:
        assert run.info.status == "FINISHED"
        for key in run.data.metrics:
            per_step = Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
            assert set(per_step.values()) == {1}, (key, per_step)
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
        assert sorted(steps) == [1, 2, 3]
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.metrics["study_epochs_run"] == 9


def test_a_write_after_a_line_a_crash_tore_is_kept_and_the_spool_still_reads(tmp_path):
    """The recorder killed mid-write leaves a torn last line: the next write starts a
    line of its own (not lost inside the torn one), and every later read works."""
    from pipetune.tracking.spool import Spool

    path = tmp_path / "mlflow-spool.jsonl"
    first = Spool(path)
    first.append("log", ("run-1", [("m", 1.0, 1, 10)], [], []), {"tracking_uri": "x"})
    first.append("log", ("run-1", [("m", 2.0, 2, 20)], [], []), {"tracking_uri": "x"})
    with open(path, "a") as f:
        f.write('{"seq":2,"op":"log_te')  # the crash cut this write short
    again = Spool(path)  # the next process
    again.append("terminate", ("run-1", "FINISHED", 30), {"tracking_uri": "x"})
    again.append("terminate", ("run-2", "FINISHED", 40), {"tracking_uri": "x"})
    with again.locked():
        header, writes = again.read()
    assert header == {"tracking_uri": "x"}
    assert [w["op"] for w in writes] == ["log", "log", "terminate", "terminate"]
    assert [w["seq"] for w in writes] == [0, 1, 2, 3]
    assert all(line.startswith("{") and line.endswith("}")
               for line in path.read_text().splitlines())


class Partly(Down):
    """:class:`Down`, per run: writes to a run in ``down_runs`` fail as a store that
    does not answer; writes to one in ``refused_runs`` are refused (a bad value)."""

    def __init__(self, uri: str):
        super().__init__(uri)
        self.down_runs: set[str] = set()
        self.refused_runs: set[str] = set()

    def log_batch(self, run_id, *args, **kwargs):
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

        if run_id in self.refused_runs:
            raise MlflowException("Invalid value for metric 'loss'",
                                  error_code=INVALID_PARAMETER_VALUE)
        if run_id in self.down_runs:
            self.down = True
            try:
                self._refuse()
            finally:
                self.down = False
        return super().log_batch(run_id, *args, **kwargs)


def test_a_failing_study_whose_waiting_write_was_refused_still_says_what_waits(
        tmp_path, monkeypatch):
    """The store refuses one waiting write and still does not answer for the rest: the
    study's failure raises that refusal, and what waits in the spool (the rest, and the
    study's end) is still said, not dropped with the error."""
    from mlflow.exceptions import MlflowException

    from pipetune.tracking import MlflowSink, sink

    monkeypatch.setattr(sink, "RETRY_S", 0.0)  # every pass tries what waits
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = Partly(uri)
    spool = tmp_path / "study" / "mlflow-spool.jsonl"
    writer = MlflowSink(client=client, tracking_uri=uri, spool=str(spool), tags={})
    writer.open_study("pipetune", "refused", {}, [], [])
    writer.create_child(0)
    writer.create_child(1)
    children = writer.children()
    client.down = True
    writer.log(("trial", 0), [("loss", 0.5, 1, 1001)])
    writer.log(("trial", 1), [("loss", 0.6, 1, 1001)])
    writer.idle()
    assert Spool(spool).waiting() == 2
    client.down = False
    client.refused_runs, client.down_runs = {children[0]}, {children[1]}
    with pytest.raises(MlflowException, match="Invalid value") as raised:
        writer.fail_study("FAILED", "broken", 1500)
    note = raised.value.spool_note
    assert note is not None and note.count == 2  # trial 1's write, then the study's end
    assert note.path == str(spool) and Spool(spool).waiting() == 2


@pytest.mark.slow
def test_a_tracking_server_down_at_the_start_is_waited_for_then_refused_in_one_line(
        tmp_path, migrated_store):
    """A nightly study starting while its tracking server restarts: ``pipetune tune``
    waits for it (``PIPETUNE_MLFLOW_START_WAIT_S``) and runs once it answers; a server
    that stays down ends the command in one ``error:`` line, exit 1, no traceback."""
    import yaml
    from known import tune_env

    job = synthetic_job("late-store", trials=2)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    shutil.copy(migrated_store, tmp_path / "mlflow.db")
    server = Server(tmp_path)
    env = {**tune_env(tmp_path), "PIPETUNE_MLFLOW_START_WAIT_S": "90"}
    tune = subprocess.Popen(
        [sys.executable, "-m", "pipetune", "tune", "job.yaml", "--tracking-uri", server.url],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(8)  # the command is up and asking; the server is not
        assert tune.poll() is None, tune.communicate()[1][-3000:]
        server.start()
        out, err = tune.communicate(timeout=300)
    finally:
        if tune.poll() is None:
            tune.kill()
        server.kill()
    assert tune.returncode == 0, err[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("pipetune").experiment_id])
    assert sorted(r.data.tags.get("pipetune.kind") for r in runs) == ["study", "trial", "trial"]

    env["PIPETUNE_MLFLOW_START_WAIT_S"] = "3"
    started = time.monotonic()
    down = subprocess.run(
        [sys.executable, "-m", "pipetune", "tune", "job.yaml", "--tracking-uri", server.url],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert down.returncode == 1, down.stderr[-3000:]
    errors = [line for line in down.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and server.url in errors[0] and "after 3 s" in errors[0], \
        down.stderr[-3000:]
    assert "Traceback" not in down.stderr, down.stderr[-3000:]
    assert time.monotonic() - started < 60
