"""The journal is JSON a person can read, checked field by field when read back; a
journal of the old format (pickled events) is refused, never unpickled."""

from __future__ import annotations

import base64
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from known import synthetic_job

from pipetune.backends import LocalBackend
from pipetune.checkpoints import CheckpointStore
from pipetune.engine.journal import JournalError, StudyJournal
from pipetune.engine.study import Study
from pipetune.groundtruth import GroundTruth
from pipetune.runner import EpochResult
from pipetune.spec import JobSpec
from pipetune.system.config import MachineInfo
from pipetune.tuner import TuningDecision

MACHINE = MachineInfo(cores=1)


def _study(root: Path, journal: StudyJournal | None) -> Study:
    job = synthetic_job("journal-json", seed=5, trials=2)
    job["system"]["space"] = {"interop_threads": [1, 2]}
    return Study(JobSpec.from_dict(job, machine=MACHINE), study_id="j",
                 checkpoints=CheckpointStore(root / "ck"),
                 ground_truth=GroundTruth(root / "gt.json"), core_budget=1, machine=MACHINE,
                 journal=journal)


def test_a_journal_is_plain_json_and_replays_to_the_same_study(tmp_path):
    journal = StudyJournal(tmp_path / "studies", "j").create(job_name="journal-json")
    first = _study(tmp_path, journal)
    first.run(LocalBackend())
    journal.close()
    text = journal.events_path.read_text()
    lines = [json.loads(line) for line in text.splitlines()]
    assert {line["kind"] for line in lines} >= {"start", "result", "decision", "match"}
    result = next(line["data"] for line in lines if line["kind"] == "result")
    # what a person reads: the epoch's figures by name, its config as knobs
    assert result["phase"] == "profile" and result["epoch"] == 1
    assert result["system"]["cores"] == 1 and result["measurement"]["wall_s"] > 0
    assert "gAS" not in text and "pickle" not in text  # no base64 pickles
    events = journal.events()
    assert isinstance(events[0].data, dict) and events[0].kind == "start"
    assert all(isinstance(e.data, EpochResult) for e in events if e.kind == "result")
    assert all(isinstance(e.data, TuningDecision) for e in events if e.kind == "decision")
    again = _study(tmp_path / "again", None)
    assert again.replay(events, checkpoint_exists=lambda _ref: True) == sum(
        t.epochs_run for t in first.trials.values())
    for trial in first.trials.values():
        twin = again.trials[trial.trial_id]
        assert twin.state == trial.state and twin.params == trial.params
        assert [r.metrics for r in twin.results] == [r.metrics for r in trial.results]
        assert [r.phase for r in twin.results] == [r.phase for r in trial.results]
        assert twin.match == trial.match and twin.final_system == trial.final_system


def test_a_field_of_the_wrong_type_is_refused_naming_its_line_and_path(tmp_path):
    journal = StudyJournal(tmp_path / "studies", "j").create(job_name="journal-json")
    _study(tmp_path, journal).run(LocalBackend())
    journal.close()
    lines = journal.events_path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if '"kind": "result"' in line)
    bad = json.loads(lines[at])
    bad["data"]["measurement"]["wall_s"] = "fast"
    lines[at] = json.dumps(bad)
    journal.events_path.write_text("\n".join(lines) + "\n")
    with pytest.raises(JournalError, match=rf"line {at + 1} is corrupt "
                                           r"\(result\.measurement\.wall_s: expected a number"):
        journal.events()
    bad["data"]["phase"] = "sideways"
    bad["data"]["measurement"]["wall_s"] = 1.0
    lines[at] = json.dumps(bad)
    journal.events_path.write_text("\n".join(lines) + "\n")
    with pytest.raises(JournalError, match="result.phase: 'sideways' is not one of"):
        journal.events()


class _Payload:
    """What an attacker writes into an old-format journal: unpickling it runs code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_an_old_pickled_journal_is_refused_and_never_unpickled(tmp_path, monkeypatch):
    """Through the command line, as a user resumes: one line, exit 2, nothing run."""
    home = tmp_path / "home"
    folder = home / "studies" / "old-1"
    folder.mkdir(parents=True)
    job = synthetic_job("old", seed=1, trials=1)
    marker = tmp_path / "ran"
    (folder / "study.json").write_text(json.dumps({
        "study_id": "old-1", "status": "stopped", "job": job, "job_name": "old",
        "created": 1.0}))
    payload = base64.b64encode(pickle.dumps(_Payload(marker))).decode()
    (folder / "events.jsonl").write_text(json.dumps(
        {"seq": 1, "kind": "start", "trial": 0, "data": payload}) + "\n")
    with pytest.raises(JournalError, match="old format"):
        StudyJournal(home / "studies", "old-1").events()
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    monkeypatch.setenv("PIPETUNE_HOME", str(home))
    out = subprocess.run([sys.executable, "-m", "pipetune", "tune", str(job_file),
                          "--resume", "old-1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "old format" in errors[0], out.stderr
    assert "Traceback" not in out.stderr
    assert not marker.exists()  # nothing unpickled
    assert json.loads((folder / "study.json").read_text())["status"] == "stopped"


def test_a_study_an_earlier_version_left_without_events_resumes_and_resumes_again(tmp_path):
    """Its header has no ``journal_format`` and it has no events: nothing to refuse.
    The first JSON event marks the header, so the next resume reads it."""
    folder = tmp_path / "studies" / "early-1"
    folder.mkdir(parents=True)
    (folder / "study.json").write_text(json.dumps({"study_id": "early-1",
                                                   "status": "stopped", "created": 1.0}))
    resumed = StudyJournal(tmp_path / "studies", "early-1")
    resumed.check_format()  # no events: not refused
    resumed.append("unconfirmed", 0, "model graph changed")
    resumed.close()
    again = StudyJournal(tmp_path / "studies", "early-1")
    again.check_format()
    assert [e.data for e in again.events()] == ["model graph changed"]
    assert again.header()["status"] == "stopped"  # the rest of the header kept
