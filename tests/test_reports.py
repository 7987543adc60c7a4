"""The study's pictures stay bounded: the timeline of a study with more trials than
it draws keeps its size and says what it left out."""

from __future__ import annotations

from known import synthetic_job

from pipetune.checkpoints import CheckpointStore
from pipetune.reports import TIMELINE_MAX_TRIALS, timeline_figure
from pipetune.spec import JobSpec
from pipetune.study import Study, run_study_locally


def _study(tmp_path, trials: int) -> Study:
    job = synthetic_job("many", trials=trials)
    job["workload"]["params"] = {"train_samples": 16, "val_samples": 8}
    job["early_stopping"] = {"policy": "none", "max_epochs": 1}
    job["system"]["space"] = {}
    job["pipetune"] = {"enabled": False}
    # 135 in-process epochs: perf attached to this thread-heavy test process would spend
    # up to seconds detaching from each (its counts are not what this test is about).
    job["profiler"] = {"perf": "off"}
    study = Study(JobSpec.from_dict(job), study_id="many",
                  checkpoints=CheckpointStore(tmp_path / "ck"))
    return run_study_locally(study)


def test_the_timeline_of_many_trials_keeps_its_size(tmp_path):
    few = timeline_figure(_study(tmp_path / "few", TIMELINE_MAX_TRIALS))
    many_study = _study(tmp_path / "many", TIMELINE_MAX_TRIALS + 15)
    many = timeline_figure(many_study)
    assert tuple(many.get_size_inches()) == tuple(few.get_size_inches())
    (ax,) = many.axes
    assert len(ax.get_yticklabels()) == TIMELINE_MAX_TRIALS
    assert f"{TIMELINE_MAX_TRIALS} of {TIMELINE_MAX_TRIALS + 15} trials" in ax.get_title()
    assert "of" not in few.axes[0].get_title().split(":")[-1]
