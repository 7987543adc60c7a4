"""A tracker of your own, added in one file and named in the job file
(``tracking.trackers``), records a real study beside MLflow: every epoch and ended
trial as it happens, then the summary, or the failure. Nothing of the engine, the flows
or the command line is touched; MLflow's record stays whole."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from known import process_cluster, synthetic_job

from pipetune.errors import BrokenWorkload, SpecError
from pipetune.session import StudyOptions, check_study, open_study
from pipetune.spec import JobSpec

pytestmark = pytest.mark.slow

#: The whole tracker, as a user writes it: JSON lines, one per event, then the end.
JSONL_TRACKER = '''
import json

from pipetune.tracking import Tracker


class JsonLines(Tracker):
    def __init__(self, *, spec, study_id, folder):
        self.out = open(folder / "events-of-mine.jsonl", "w")
        self.study_id = study_id

    def _write(self, **line):
        self.out.write(json.dumps(line) + "\\n")
        self.out.flush()

    def __call__(self, event):
        if event.name in ("epoch_finished", "trial_ended"):
            self._write(event=event.name, trial=event.trial_id,
                        epoch=getattr(getattr(event, "result", None), "epoch", None))

    def finished(self, summary):
        self._write(event="finished", study=summary["study_id"], trials=summary["trials"])

    def failed(self, status, reason):
        self._write(event="failed", status=status, reason=reason)

    def close(self):
        self._write(event="closed")
        self.out.close()


def not_a_tracker(*, spec, study_id, folder):
    return "a string"
'''


@pytest.fixture(scope="module")
def cluster():
    with process_cluster() as cluster:
        yield cluster


@pytest.fixture
def tracker_module(tmp_path, monkeypatch):
    name = f"my_tracker_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(JSONL_TRACKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def options(tmp_path, cluster) -> StudyOptions:
    return StudyOptions(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                        checkpoint_root=str(tmp_path / "ck"),
                        groundtruth_path=str(tmp_path / "gt.json"),
                        dask_address=cluster.scheduler_address, core_budget=2)


def lines(opened) -> list[dict]:
    path = opened.journal.folder / "events-of-mine.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_tracker_of_your_own_records_the_study_beside_mlflow(tmp_path, cluster,
                                                                 tracker_module):
    from mlflow.tracking import MlflowClient

    job = synthetic_job("tracked", trials=2)
    job["tracking"] = {"trackers": [f"{tracker_module}:JsonLines"]}
    spec = JobSpec.from_dict(yaml.safe_load(yaml.safe_dump(job)))  # as a job file reads
    opened = open_study(spec, options(tmp_path, cluster))
    summary = opened.run(opened.dask_backend())
    got = lines(opened)
    epochs = [(x["trial"], x["epoch"]) for x in got if x["event"] == "epoch_finished"]
    assert sorted(epochs) == [(t, e) for t in (0, 1) for e in (1, 2, 3)]
    assert sorted(x["trial"] for x in got if x["event"] == "trial_ended") == [0, 1]
    assert got[-2:] == [{"event": "finished", "study": opened.study_id, "trials": 2},
                        {"event": "closed"}]
    # Every trial's end came after its epochs, as it happened.
    for trial in (0, 1):
        order = [x["event"] for x in got if x.get("trial") == trial]
        assert order == ["epoch_finished"] * 3 + ["trial_ended"]
    client = MlflowClient(opened.tracking_uri)
    assert client.get_run(summary["parent_run_id"]).info.status == "FINISHED"
    runs = client.search_runs([client.get_run(summary["parent_run_id"]).info.experiment_id],
                              "tags.`pipetune.kind` = 'trial'")
    assert sum(len(client.get_metric_history(r.info.run_id, "train_loss")) for r in runs) == 6


def test_a_tracker_hears_the_failure_of_a_broken_study(tmp_path, cluster, tracker_module):
    job = synthetic_job("tracked-broken", trials=6)
    job["workload"]["params"]["fail_at_epoch"] = 1
    job["tracking"] = {"trackers": [f"{tracker_module}:JsonLines"]}
    opened = open_study(JobSpec.from_dict(job), options(tmp_path, cluster))
    with pytest.raises(BrokenWorkload):
        opened.run(opened.dask_backend())
    got = lines(opened)
    assert got[-2]["event"] == "failed" and got[-2]["status"] == "FAILED"
    assert "planned failure" in got[-2]["reason"] and got[-1] == {"event": "closed"}


def test_a_tracker_that_does_not_import_or_is_no_tracker_is_refused_by_field(
        tmp_path, cluster, tracker_module):
    job = synthetic_job("tracked-bad", trials=1)
    job["tracking"] = {"trackers": ["no_such_module_here:Tracker"]}
    spec = JobSpec.from_dict(job)
    with pytest.raises(SpecError, match=r"tracking.trackers\[0\]: cannot import"):
        check_study(spec, options(tmp_path, cluster))
    job["tracking"] = {"trackers": [f"{tracker_module}:not_a_tracker"]}
    with pytest.raises(SpecError, match=r"made a str, not a pipetune.tracking.Tracker"):
        open_study(JobSpec.from_dict(job), options(tmp_path / "b", cluster))
    job["tracking"] = {"trackers": ["just-a-name"]}
    with pytest.raises(SpecError, match=r"tracking.trackers\[0\]: must be an import path"):
        JobSpec.from_dict(job)
