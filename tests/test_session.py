"""Opening a study in the library: :func:`pipetune.session.open_study` does what the
flow did before its first epoch, and :meth:`OpenedStudy.run` runs it to the summary,
with no Prefect in the process's way (a real Dask cluster, MLflow on SQLite)."""

from __future__ import annotations

import json

import pytest
from known import process_cluster, synthetic_job

from pipetune.engine.events import EpochFinished
from pipetune.errors import BrokenWorkload
from pipetune.session import StudyOptions, open_study
from pipetune.spec import JobSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with process_cluster() as cluster:
        yield cluster


def options(tmp_path, cluster, **more) -> StudyOptions:
    return StudyOptions(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                        checkpoint_root=str(tmp_path / "ck"),
                        groundtruth_path=str(tmp_path / "gt.json"),
                        dask_address=cluster.scheduler_address, core_budget=2, **more)


def test_a_study_opens_runs_and_summarises_without_prefect(tmp_path, cluster):
    from mlflow.tracking import MlflowClient

    spec = JobSpec.from_dict(synthetic_job("session", trials=2))
    opened = open_study(spec, options(tmp_path, cluster, tags={"who": "test"}))
    assert opened.journal.header()["status"] == "running"
    summary = opened.run(opened.dask_backend())
    assert summary["study_id"] == opened.study_id and summary["trials"] == 2
    assert [row["outcome"] for row in summary["trials_table"]] == ["completed", "completed"]
    assert json.dumps(summary)  # JSON-able, as a flow's result must be
    header = opened.journal.header()
    assert header["status"] == "finished" and header["parent_run_id"] == summary["parent_run_id"]
    client = MlflowClient(opened.tracking_uri)
    parent = client.get_run(summary["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["who"] == "test"
    assert parent.data.tags["pipetune.study_id"] == opened.study_id
    assert parent.data.metrics["study_trials"] == 2


def test_a_broken_workload_ends_the_record_failed_and_raises(tmp_path, cluster):
    from mlflow.tracking import MlflowClient

    job = synthetic_job("session-broken", trials=6)
    job["workload"]["params"]["fail_at_epoch"] = 1
    opened = open_study(JobSpec.from_dict(job), options(tmp_path, cluster))
    with pytest.raises(BrokenWorkload, match="planned failure"):
        opened.run(opened.dask_backend())
    header = opened.journal.header()
    assert header["status"] == "failed" and "is broken" in header["reason"]
    parent = MlflowClient(opened.tracking_uri).get_run(opened.tracker.parent_run_id)
    assert parent.info.status == "FAILED"
    assert "planned failure" in parent.data.tags["pipetune.failure"]


def test_a_stopped_study_resumes_through_the_same_door(tmp_path, cluster):
    spec = JobSpec.from_dict(synthetic_job("session-resume", trials=2))
    first = open_study(spec, options(tmp_path, cluster))

    class Stop(KeyboardInterrupt):
        pass

    def stop_after_first_epoch(event):
        if isinstance(event, EpochFinished):
            raise Stop

    with pytest.raises(Stop):
        first.run(first.dask_backend(), observers=[stop_after_first_epoch])
    assert first.journal.header()["status"] == "stopped"
    again = open_study(spec, options(tmp_path, cluster, resume=first.study_id))
    assert again.study_id == first.study_id and again.study.resumed_epochs >= 1
    summary = again.run(again.dask_backend())
    assert summary["parent_run_id"] == first.tracker.parent_run_id
    assert summary["resumed_epochs"] >= 1 and summary["trials"] == 2
