"""Resume: a study stopped part-way and resumed from its journal reaches what an
uninterrupted study reaches, without running a finished epoch again. Real tiny
training in this process (the engine and the journal; the CLI's --resume is in
test_clean_stop)."""

from __future__ import annotations

from pathlib import Path

import pytest
from known import synthetic_job

from pipetune.backends import EpochOutcome, LocalBackend
from pipetune.checkpoints import CheckpointStore, flush_checkpoints
from pipetune.engine.journal import JournalError, StudyJournal, find_study
from pipetune.engine.study import Study
from pipetune.groundtruth import GroundTruth
from pipetune.spec import JobSpec
from pipetune.system.config import MachineInfo

MACHINE = MachineInfo(cores=2)
#: What the study's tuner may give one epoch: one core. With two, a trial left alone at
#: the end takes the idle core when its own wall-clock measurements say it runs faster,
#: and on these sleep-free epochs that is the machine's noise: the uninterrupted and
#: the resumed study would differ by chance, not by what resuming does.
ONE_CORE_EPOCHS = MachineInfo(cores=1)


def spec() -> JobSpec:
    job = synthetic_job("resume", seed=3, trials=4)
    # The probe's answer must not depend on the machine's load: interop_threads=1 costs
    # 0.4 s more per epoch, well past the noise of a loaded 2-core runner.
    job["workload"]["params"]["cost_by_knob"] = {"interop_threads": {"1": 0.4}}
    job["search"] = {"algorithm": "tpe", "trials": 4, "seed": 3, "max_concurrent": 2}
    job["early_stopping"] = {"policy": "asha", "max_epochs": 3, "min_epochs": 1,
                             "reduction_factor": 2}
    job["system"]["space"] = {"interop_threads": [1, 2]}
    return JobSpec.from_dict(job, machine=MACHINE)


def make(root: Path, *, journal: bool = True) -> Study:
    study_id = "s"
    return Study(
        spec(), study_id=study_id, checkpoints=CheckpointStore(root / "ck"),
        ground_truth=GroundTruth(root / "gt.json"), core_budget=2, machine=ONE_CORE_EPOCHS,
        journal=StudyJournal(root / "studies", study_id).create(job_name="resume")
        if journal else None,
    )


class Crash(KeyboardInterrupt):
    pass


class CrashingBackend(LocalBackend):
    """A backend at the edge: the driver 'dies' when asked for its ``n``-th epoch."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def wait(self) -> EpochOutcome:
        self.n -= 1
        if self.n == 0:
            raise Crash
        return super().wait()


class CountingBackend(LocalBackend):
    def __init__(self):
        super().__init__()
        self.ran: list[tuple[int, int]] = []

    def wait(self) -> EpochOutcome:
        outcome = super().wait()
        self.ran.append((outcome.task.trial_id, outcome.task.epoch))
        return outcome


def outcome(study: Study) -> dict:
    return {
        t.trial_id: (t.params, t.state, [r.epoch for r in t.results],
                     [r.phase.value for r in t.results], [r.system.label() for r in t.results],
                     [round(r.metrics["accuracy"], 6) for r in t.results],
                     t.match.hit if t.match else None)
        for t in study.trials.values()
    }


def resume(root: Path) -> tuple[Study, CountingBackend]:
    journal = StudyJournal(root / "studies", "s")
    study = Study(spec(), study_id="s", checkpoints=CheckpointStore(root / "ck"),
                  ground_truth=GroundTruth(root / "gt.json"), core_budget=2,
                  machine=ONE_CORE_EPOCHS, journal=journal)
    study.replay(journal.events(), checkpoint_exists=CheckpointStore.exists)
    backend = CountingBackend()
    study.run(backend)
    return study, backend


@pytest.mark.parametrize("crash_at", [3, 6])
def test_a_resumed_study_ends_where_an_uninterrupted_one_does(tmp_path, crash_at):
    whole = make(tmp_path / "whole", journal=False)
    whole.run(LocalBackend())

    root = tmp_path / "broken"
    with pytest.raises(Crash):
        make(root).run(CrashingBackend(crash_at))
    flush_checkpoints()  # the writes in flight landed (the next test loses one)
    before = {(e.trial, e.data.epoch) for e in StudyJournal(root / "studies", "s").events()
              if e.kind == "result"}
    study, backend = resume(root)

    assert outcome(study) == outcome(whole)
    assert study.summary().best_value == whole.summary().best_value
    finished_before = crash_at - 1
    assert study.resumed_epochs == finished_before
    # Nothing that finished ran again: the two runs together ran each epoch once.
    assert len(backend.ran) == whole.summary().epochs_run - finished_before
    assert len(before) == finished_before and not set(backend.ran) & before


def test_an_epoch_whose_checkpoint_never_landed_runs_again(tmp_path):
    root = tmp_path / "lost"
    with pytest.raises(Crash):
        make(root).run(CrashingBackend(4))
    flush_checkpoints()
    journal = StudyJournal(root / "studies", "s")
    results = [e.data for e in journal.events() if e.kind == "result"]
    lost = results[-1]
    Path(lost.checkpoint).unlink()  # its write was still in the background at the crash

    study, backend = resume(root)
    assert study.resumed_epochs == len(results) - 1
    assert (lost.trial_id, lost.epoch) in backend.ran
    assert study.done and study.summary().epochs_run == make(tmp_path / "w", journal=False) \
        .run(LocalBackend()).summary().epochs_run


def test_a_changed_job_does_not_replay(tmp_path):
    root = tmp_path / "changed"
    with pytest.raises(Crash):
        make(root).run(CrashingBackend(3))
    other = spec().with_overrides(trials=4)
    changed = JobSpec.from_dict({**other.to_dict(), "search": {
        **other.to_dict()["search"], "seed": 4}}, machine=MACHINE)
    study = Study(changed, study_id="s", checkpoints=CheckpointStore(root / "ck"),
                  core_budget=2, machine=MACHINE)
    with pytest.raises(JournalError, match="no longer proposes trial 0"):
        study.replay(StudyJournal(root / "studies", "s").events(),
                     checkpoint_exists=CheckpointStore.exists)


def test_find_study_picks_the_newest_unfinished_of_the_job(tmp_path):
    root = tmp_path / "studies"
    StudyJournal(root, "a").create(job_name="j", flow_run_id="f-a")
    StudyJournal(root, "b").create(job_name="j", flow_run_id="f-b").update(status="finished")
    StudyJournal(root, "c").create(job_name="other")
    assert find_study(root, None, "j").study_id == "a"
    assert find_study(root, "latest", "j").study_id == "a"
    assert find_study(root, "f-b").study_id == "b"  # by flow run id, whatever its state
    with pytest.raises(JournalError, match="no unfinished study of job 'x'"):
        find_study(root, None, "x")
    with pytest.raises(JournalError, match="no study or flow run 'zz'"):
        find_study(root, "zz")


def test_a_torn_last_line_is_dropped_and_a_corrupt_middle_refused(tmp_path):
    journal = StudyJournal(tmp_path, "t").create()
    for i in range(3):
        journal.append("unconfirmed", i, f"why {i}")
    journal.close()
    text = journal.events_path.read_text()
    journal.events_path.write_text(text[:-20])  # the crash cut the last line
    assert [e.data for e in journal.events()] == ["why 0", "why 1"]
    resumed = StudyJournal(tmp_path, "t")  # a resumed study appends after the torn line
    resumed.append("unconfirmed", 3, "why 3")
    resumed.close()
    assert [(e.seq, e.data) for e in resumed.events()] == [(1, "why 0"), (2, "why 1"),
                                                           (3, "why 3")]
    lines = text.splitlines()
    journal.events_path.write_text("\n".join([lines[0], "{not json", lines[2]]) + "\n")
    with pytest.raises(JournalError, match="line 2 is corrupt"):
        journal.events()
