"""The MLflow record tells the truth: a real tiny study, recorded by the real recorder
process on SQLite, read back through a tracking server's REST API. A trial's run spans
its epochs, the study's run spans its trials' runs, no study-level metric shares a name
with a per-trial one, the epoch phase is a metric, and numbers are stored unrounded."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from typing import Any

import pytest
from known import synthetic_job, wait_until_healthy

from pipetune.backends import LocalBackend
from pipetune.checkpoints import CheckpointStore
from pipetune.engine.study import Study
from pipetune.groundtruth import GroundTruth
from pipetune.net import free_port
from pipetune.spec import JobSpec
from pipetune.tracking.names import PHASE_CODES, study_metric_name
from pipetune.tracking.tracker import StudyTracker

STUDY_EXPERIMENT = "pipetune"
RESUME_EXPERIMENT = "resumed"


def _job() -> dict:
    job = synthetic_job("true-times", trials=3)
    job["profiler"] = {"perf": "off"}  # in-process epochs: perf's counts are not the point
    job["workload"]["params"]["base_seconds"] = 0.1  # epochs long enough to measure
    return job


def _run_study(root, spec: JobSpec) -> tuple[Study, str]:
    """The study as the flow runs it: the tracker built first, each epoch sent as the
    engine has it, each trial ended as it ends, the summary last."""
    tracker = StudyTracker(f"sqlite:///{root / 'mlflow.db'}", spec, tags={"test": "record"})
    study = Study(spec, study_id="true-times", checkpoints=CheckpointStore(root / "ck"),
                  ground_truth=GroundTruth(str(root / "gt.json")))
    started = time.time()

    def on_step(event) -> None:
        if event.ended:
            tracker.end_trial(event.trial, metric=study.metric)

    study.run(LocalBackend(), on_step=on_step, on_result=tracker.log_epoch)
    tracker.finish(study, wall_s=time.time() - started,
                   extra_metrics={"checkpoints_pruned": 0.0, "orchestration_share": 0.25})
    return study, tracker.parent_run_id


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(REST base URL, the study, its parent run id, the SQLite URI)."""
    root = tmp_path_factory.mktemp("record")
    spec = JobSpec.from_dict(_job())
    study, parent = _run_study(root, spec)
    port = free_port()
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
         f"sqlite:///{root / 'mlflow.db'}", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True,
        env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true",
             "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, proc, root / "server.log")
        yield url, study, parent, f"sqlite:///{root / 'mlflow.db'}"
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        log.close()


# -- MLflow's REST API ------------------------------------------------------------------
def rest(url: str, path: str, body: dict[str, Any] | None = None, **query: Any) -> dict:
    address = f"{url}/api/2.0/mlflow/{path}"
    if query:
        address += "?" + urllib.parse.urlencode(query)
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(address, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def runs_of(url: str, experiment: str, kind: str) -> list[dict]:
    exp = rest(url, "experiments/get-by-name", experiment_name=experiment)["experiment"]
    found = rest(url, "runs/search", {"experiment_ids": [exp["experiment_id"]],
                                      "filter": f"tags.`pipetune.kind` = '{kind}'",
                                      "max_results": 1000})
    return found.get("runs", [])


def tags(run: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


def params(run: dict) -> dict[str, str]:
    return {p["key"]: p["value"] for p in run["data"].get("params", [])}


def metrics(run: dict) -> dict[str, float]:
    """Each metric's latest value, as the run shows it."""
    return {m["key"]: m["value"] for m in run["data"].get("metrics", [])}


def history(url: str, run: dict, key: str) -> list[dict]:
    out = rest(url, "metrics/get-history", run_id=run["info"]["run_id"], metric_key=key,
               max_results=25000)
    found = [{**m, "step": int(m.get("step", 0)), "timestamp": int(m["timestamp"])}
             for m in out.get("metrics", [])]
    return sorted(found, key=lambda m: (m["step"], m["timestamp"]))


def trial_runs(url: str, parent: str, experiment: str = STUDY_EXPERIMENT) -> dict[int, dict]:
    runs = runs_of(url, experiment, "trial")
    return {int(tags(r)["pipetune.trial_id"]): r for r in runs
            if tags(r)["mlflow.parentRunId"] == parent}


# -- the record -------------------------------------------------------------------------
def test_a_trial_run_spans_its_epochs(recorded):
    url, study, parent, _ = recorded
    runs = trial_runs(url, parent)
    assert sorted(runs) == sorted(study.trials) == [0, 1, 2]
    for trial_id, run in runs.items():
        info, trial = run["info"], study.trials[trial_id]
        assert info["status"] == "FINISHED" and info["run_name"] == f"trial-{trial_id}"
        start, end = int(info["start_time"]), int(info["end_time"])
        # its first epoch's start on its worker, the workload built (ms), not when its
        # run was written nor the trial's start in the engine: what came before (a
        # worker starting, the workload's build) is the trial's startup_s
        first = trial.results[0]
        assert start == int((first.started + first.setup_s) * 1000), (trial_id, start)
        (startup,) = history(url, run, "startup_s")
        assert startup["value"] == pytest.approx(first.started + first.setup_s - trial.started)
        losses = history(url, run, "train_loss")
        assert [m["step"] for m in losses] == [1, 2, 3]
        stamps = [int(m["timestamp"]) for m in losses]
        # each epoch's metrics carry the time it finished on its worker
        assert stamps == [int(r.finished * 1000) for r in trial.results]
        assert start <= stamps[0] and end >= stamps[-1], (trial_id, start, stamps, end)
        seconds = [m["value"] for m in history(url, run, "epoch_seconds")]
        assert len(seconds) == 3 and min(seconds) >= 0.1  # the synthetic epochs sleep
        assert (end - start) / 1000 >= sum(seconds), (trial_id, end - start, seconds)
        # every metric of the trial, whenever it was written, lies inside its run
        for key in metrics(run):
            for m in history(url, run, key):
                assert start <= int(m["timestamp"]) <= end, (trial_id, key, m, start, end)


def test_the_study_run_spans_its_trial_runs(recorded):
    url, study, parent, _ = recorded
    (study_run,) = [r for r in runs_of(url, STUDY_EXPERIMENT, "study")
                    if r["info"]["run_id"] == parent]
    assert study_run["info"]["status"] == "FINISHED"
    assert study_run["info"]["run_name"] == "true-times"
    start, end = int(study_run["info"]["start_time"]), int(study_run["info"]["end_time"])
    runs = trial_runs(url, parent)
    assert runs
    for trial_id, run in runs.items():
        assert start <= int(run["info"]["start_time"]), trial_id
        assert end >= int(run["info"]["end_time"]), trial_id
    for key in metrics(study_run):
        for m in history(url, study_run, key):
            assert start <= int(m["timestamp"]) <= end, (key, m, start, end)


def test_no_metric_name_is_shared_by_the_study_and_its_trials(recorded):
    url, study, parent, _ = recorded
    (study_run,) = [r for r in runs_of(url, STUDY_EXPERIMENT, "study")
                    if r["info"]["run_id"] == parent]
    on_study = set(metrics(study_run))
    on_trials = set().union(*(metrics(r) for r in trial_runs(url, parent).values()))
    assert "energy_j" in on_trials and "probe_epochs" in on_trials
    assert on_study & on_trials == set()
    summary = study.summary()
    got = metrics(study_run)
    assert set(got) == {study_metric_name(k) for k in summary.to_metrics()} | {
        "study_tuning_wall_s", "study_checkpoints_pruned", "study_orchestration_share"}
    for key, value in summary.to_metrics().items():  # stored as computed: no rounding
        assert got[f"study_{key}"] == value, key
    assert got["study_energy_j"] == sum(r.measurement.energy_j for t in study.trials.values()
                                        for r in t.results)
    assert got["study_orchestration_share"] == 0.25 and got["study_tuning_wall_s"] > 0
    assert all(k.startswith("study_") for k in got)


def test_the_epoch_phase_is_a_metric_beside_its_tag(recorded):
    url, study, parent, _ = recorded
    seen: set[str] = set()
    for trial_id, run in trial_runs(url, parent).items():
        codes = history(url, run, "phase_code")
        trial = study.trials[trial_id]
        assert [m["step"] for m in codes] == [r.epoch for r in trial.results]
        phases = []
        for m in codes:
            phase = tags(run)[f"epoch.{m['step']:03d}.phase"]
            assert m["value"] == {"profile": 0, "probe": 1, "train": 2}[phase], (trial_id, m)
            phases.append(phase)
        assert phases == [r.phase.value for r in trial.results]
        seen.update(phases)
        # the trial's phases in one param, as runs of the same phase
        expected = []
        for phase in phases:
            if expected and expected[-1][0] == phase:
                expected[-1][1] += 1
            else:
                expected.append([phase, 1])
        assert params(run)["phases"] == ", ".join(
            p if n == 1 else f"{p} x{n}" for p, n in expected)
    assert seen == {"profile", "probe", "train"}  # trial 0 probed, so every code was checked
    assert {p.value: c for p, c in PHASE_CODES.items()} == {"profile": 0, "probe": 1,
                                                              "train": 2}


def test_numbers_are_stored_unrounded(recorded):
    url, study, parent, _ = recorded
    runs = trial_runs(url, parent)
    matched = [t for t in study.trials.values() if t.match is not None]
    assert matched  # a ground truth was asked: every trial after the profiled epoch
    assert any(math.isfinite(t.match.distance) for t in matched)  # a hit or near miss
    for trial in matched:
        got = metrics(runs[trial.trial_id])
        for name in ("distance", "bound", "cost"):
            figure = getattr(trial.match, name)
            if figure is not None and math.isfinite(figure):
                assert got[f"groundtruth_{name}"] == figure, name
            else:  # nothing to plot (an empty ground truth has no nearest cluster)
                assert f"groundtruth_{name}" not in got, name
        # the hyperparameters as params at full precision (a JSON float round-trips)
        assert float(params(runs[trial.trial_id])["lr"]) == trial.params["lr"]
    for trial in study.trials.values():
        got = metrics(runs[trial.trial_id])
        assert got[f"final_{study.metric}"] == trial.last_value(study.metric)
        loss = history(url, runs[trial.trial_id], "train_loss")
        assert [m["value"] for m in loss] == [r.train_loss for r in trial.results]
    (study_run,) = [r for r in runs_of(url, STUDY_EXPERIMENT, "study")
                    if r["info"]["run_id"] == parent]
    best = study.summary().best_params
    assert json.loads(params(study_run)["best_params"]) == best


def test_a_resumed_trial_run_keeps_its_first_start(recorded):
    """A study stopped after one epoch of trial 0 and resumed: the same runs go on, and
    start when they first started."""
    url, study, _, uri = recorded
    spec = study.spec
    first = StudyTracker(uri, spec, experiment=RESUME_EXPERIMENT, run_name="stopped")
    # trial 0 of the recorded study, as if it had started after this tracker
    done = study.trials[0]
    shift = time.time() + 0.01 - done.started
    trial = dataclasses.replace(done, started=done.started + shift, results=[
        dataclasses.replace(r, started=r.started + shift, finished=r.finished + shift)
        for r in done.results])
    first.log_epoch(trial, trial.results[0])
    first.fail(status="KILLED", reason="stopped by the test")
    stopped = trial_runs(url, first.parent_run_id, RESUME_EXPERIMENT)[0]
    assert stopped["info"]["status"] == "KILLED"
    time.sleep(0.05)  # a resumed start that moved would show
    again = StudyTracker(uri, spec, experiment=RESUME_EXPERIMENT,
                         resume_run_id=first.parent_run_id)
    again.reopen_trials([0])
    for result in trial.results[1:]:
        again.log_epoch(trial, result)
    again.end_trial(trial, metric=study.metric)
    again.finish(study, wall_s=1.0)
    (study_run,) = [r for r in runs_of(url, RESUME_EXPERIMENT, "study")
                    if r["info"]["run_id"] == first.parent_run_id]
    runs = trial_runs(url, first.parent_run_id, RESUME_EXPERIMENT)
    assert list(runs) == [0]
    run = runs[0]
    assert run["info"]["run_id"] == stopped["info"]["run_id"]
    assert run["info"]["status"] == "FINISHED"
    assert run["info"]["start_time"] == stopped["info"]["start_time"]
    assert int(run["info"]["start_time"]) == int(
        (trial.results[0].started + trial.results[0].setup_s) * 1000)
    assert int(run["info"]["end_time"]) >= int(trial.results[-1].finished * 1000)
    assert [m["step"] for m in history(url, run, "train_loss")] == [1, 2, 3]
    assert int(study_run["info"]["start_time"]) <= int(run["info"]["start_time"])
    assert study_run["info"]["status"] == "FINISHED"
    assert int(study_run["info"]["end_time"]) >= int(run["info"]["end_time"])
