"""A checkpoint store that is full: the epoch whose checkpoint it refuses fails with one
line naming the file and the OS error, a study no trial of which can write stops with
one ``error:`` line, the records stay whole, and ``--resume`` finishes the study once
the store has room.

The store is a real size-limited folder: a tmpfs mounted for the test, else a
loop-mounted ext2 image (both need root, as CI runs); the test skips, saying why,
where neither can be mounted.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from known import synthetic_job

from pipetune.checkpoints import CheckpointStore
from pipetune.engine.journal import StudyJournal
from pipetune.engine.study import Study, run_study_locally
from pipetune.errors import CheckpointWriteError
from pipetune.spec import JobSpec
from pipetune.states import TrialState
from pipetune.system.config import MachineInfo

MACHINE = MachineInfo(cores=2)
#: What the store holds besides the filler: a synthetic-workload checkpoint (hidden 32)
#: is 14 kB, so one fits and the next does not.
ROOM = 20 * 1024


def _mount(args: list[str]) -> str | None:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{args[0]}: {e}"
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit {proc.returncode}")


def _size_limited_folder(where: Path) -> tuple[Path, str]:
    """A 1 MiB file system mounted at ``where/store``: a tmpfs, else an ext2 image on a
    loop device; skips the test when neither can be mounted."""
    mnt = where / "store"
    mnt.mkdir()
    why_tmpfs = _mount(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)])
    if why_tmpfs is None:
        return mnt, "tmpfs"
    image = where / "store.img"
    with open(image, "wb") as fh:
        fh.truncate(1 << 20)
    why_loop = (_mount(["mkfs.ext2", "-q", "-F", "-m", "0", str(image)])
                or _mount(["mount", "-o", "loop", str(image), str(mnt)]))
    if why_loop is None:
        return mnt, "ext2 on a loop device"
    pytest.skip("needs a size-limited folder: mounting a tmpfs failed "
                f"({why_tmpfs}) and so did a loop-mounted ext2 image ({why_loop}); "
                "run as root with loop devices, as CI does")


def _fill(folder: Path, leave: int) -> Path:
    """Fill ``folder``'s file system, then give back ``leave`` bytes; the filler's path."""
    filler = folder / "filler"
    chunk = b"\0" * 65536
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    finally:
        os.close(fd)
    return filler


@pytest.fixture
def full_store(tmp_path) -> Iterator[Path]:
    """A mounted 1 MiB folder with room for one checkpoint; unmounted afterwards."""
    mnt, _ = _size_limited_folder(tmp_path)
    try:
        _fill(mnt, ROOM)
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _job(name: str, trials: int = 3) -> dict:
    job = synthetic_job(name, trials=trials)
    job["workload"]["params"]["cost_by_knob"] = {}
    job["system"]["space"] = {"interop_threads": [1, 2]}
    job["hyperparameters"]["hidden"] = {"type": "choice", "values": [32]}
    return job


def test_a_refused_checkpoint_raises_one_line_and_leaves_nothing_half_written(full_store):
    state = {"w": bytes(64 * 1024)}  # more than the room left
    ref = str(full_store / "study" / "trial-000" / "epoch-001.pt")
    with pytest.raises(CheckpointWriteError) as caught:
        CheckpointStore.write_state(state, ref)
    message = str(caught.value)
    assert ref in message and "No space left on device" in message and "\n" not in message
    assert list((full_store / "study" / "trial-000").iterdir()) == []  # no .tmp left


def test_a_study_stops_when_the_store_refuses_trials_in_a_row_after_epochs_finished(
        tmp_path, full_store):
    """The engine alone: trial 0's first epoch fits, then every checkpoint is refused;
    two trials in a row failing on it stop the study although an epoch finished."""
    job = _job("full-engine", trials=6)
    spec = JobSpec.from_dict(job, machine=MACHINE)
    journal = StudyJournal(tmp_path / "studies", job["name"]).create(job=spec.to_dict())
    study = run_study_locally(Study(
        spec, study_id=job["name"], checkpoints=CheckpointStore(full_store), core_budget=2,
        machine=MACHINE, journal=journal))
    assert study.broken is not None and study.broken.store
    assert "No space left on device" in study.broken.line
    assert "--resume full-engine" in study.broken.line
    assert sum(len(t.results) for t in study.trials.values()) >= 1  # one epoch fitted
    failed = [t for t in study.trials.values() if t.state == TrialState.FAILED]
    assert len(failed) == 2 and len(study.trials) == 2  # no third trial started
    for trial in failed:
        assert trial.error.startswith("CheckpointWriteError: checkpoint store refused "
                                      f"{full_store}/")
        assert trial.error.endswith("No space left on device")
    # Every result the study kept has its checkpoint on storage.
    for trial in study.trials.values():
        for result in trial.results:
            assert CheckpointStore.exists(result.checkpoint)


def _tune(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PIPETUNE_HOME=str(tmp_path / "home"), PREFECT_HOME=str(tmp_path / "prefect"))
    return subprocess.run([sys.executable, "-m", "pipetune", "tune", "job.yaml", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_tune_on_a_full_store_stops_with_one_line_and_resume_finishes_it(tmp_path, full_store):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(_job("full-cli")))
    proc = _tune(tmp_path, "--checkpoints", str(full_store))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-5000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    assert "checkpoint store refuses" in errors[0] and str(full_store) in errors[0]
    assert "No space left on device" in errors[0]
    warnings = [line for line in out.splitlines() if " failed: " in line]
    assert len(warnings) == 2, out[-3000:]
    for line in warnings:
        assert f"CheckpointWriteError: checkpoint store refused {full_store}/" in line
        assert "[Errno 28] No space left on device" in line

    (folder,) = (tmp_path / "home" / "studies").iterdir()
    header = json.loads((folder / "study.json").read_text())
    assert header["status"] == "failed" and "checkpoint store refuses" in header["reason"]
    events = StudyJournal(folder.parent, folder.name).events()
    assert [e.kind for e in events].count("result") >= 1 and events[-1].kind == "broken"

    (full_store / "filler").unlink()  # the store has room again
    proc = _tune(tmp_path, "--checkpoints", str(full_store), "--resume", "latest")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "resumed study" in out and "Traceback" not in out
    header = json.loads((folder / "study.json").read_text())
    assert header["status"] == "finished"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pipetune")
    (parent,) = client.search_runs([experiment.experiment_id],
                                   "tags.`pipetune.kind` = 'study'")
    assert parent.info.status == "FINISHED"
    trials = client.search_runs([experiment.experiment_id], "tags.`pipetune.kind` = 'trial'")
    assert len(trials) == 3  # the refused trials went on in their own runs
    for run in trials:
        assert run.info.status == "FINISHED" and "error" not in run.data.tags
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "accuracy")]
        assert steps == [1, 2, 3]  # each epoch once: nothing lost, nothing twice
    # The final checkpoints are on the store.
    assert len(list(full_store.glob(f"{folder.name}/trial-*/epoch-003.pt"))) == 3
