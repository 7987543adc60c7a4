"""Fault injection on a real Dask cluster of process workers: a worker frozen with
SIGSTOP in the middle of an epoch. Its heartbeats stop while its connection stays
open; the driver notices within its bound, sends the epoch again from the trial's last
checkpoint, has the nanny restart the frozen worker (as on the embedded cluster) or,
on a cluster of workers without nannies, has the scheduler drop it, and ignores what
the worker does once woken with SIGCONT."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from known import process_cluster
from test_worker_loss import ONE_CORE_WORKERS, three_trial_spec

from pipetune.checkpoints import CheckpointStore
from pipetune.engine.study import Study

pytestmark = [
    pytest.mark.slow,
]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, ended but not yet reaped by its
    parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wake_when_retired(backend, marks: Path, stop: threading.Event) -> None:
    """SIGCONT the frozen worker as soon as the driver has retired it: the worker then
    finishes its stale epoch while the resent one runs elsewhere."""
    while not stop.is_set() and not backend.retired:
        time.sleep(0.02)
    if backend.retired:
        pid = int((marks / "frozen-16").read_text().split()[0])
        os.kill(pid, signal.SIGCONT)


def _marks(tmp_path: Path, monkeypatch) -> Path:
    """Where the freezing workload leaves its marks; set before the workers start (they
    take the environment they start with)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("PIPETUNE_KILL_MARKS", str(marks))
    return marks


def _study_with_a_frozen_worker(client, tmp_path: Path, marks: Path) -> tuple:
    """Run the three-trial study whose hidden=16 trial freezes its worker in epoch 2,
    waking the worker as soon as the driver retires it; (study, backend, pid of the
    frozen worker, when it froze)."""
    from pipetune.backends import DaskBackend

    spec = three_trial_spec("frozen", "FreezingWorkload")
    study = Study(spec, study_id="frozen", checkpoints=CheckpointStore(tmp_path / "ck"),
                  core_budget=2, machine=ONE_CORE_WORKERS)
    backend = DaskBackend(client)
    stop = threading.Event()
    waker = threading.Thread(target=_wake_when_retired, args=(backend, marks, stop))
    waker.start()
    try:
        study.run(backend)
    finally:
        stop.set()
        waker.join()
        frozen = (marks / "frozen-16").read_text().split() if (
            marks / "frozen-16").exists() else None
        if frozen and _alive(int(frozen[0])):
            os.kill(int(frozen[0]), signal.SIGCONT)  # never leave a stopped process
    assert frozen is not None, "the hidden=16 trial never reached epoch 2"
    assert (marks / "woke-16").exists()  # the frozen worker woke and ran on
    return study, backend, int(frozen[0]), float(frozen[1])


def _wait_gone(pid: int, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _alive(pid)


def _assert_resent_once_and_nothing_stale(study, backend, pid: int, frozen_at: float):
    [retired] = backend.retired
    by_hidden = {t.params["hidden"]: t for t in study.trials.values()}
    assert study.done and len(by_hidden) == 3
    # Every trial ran its three epochs, each recorded exactly once.
    for hidden, trial in by_hidden.items():
        assert trial.state == "completed", (hidden, trial.error, backend.placements)
        assert [r.epoch for r in trial.results] == [1, 2, 3], (hidden, trial.results)
    victim = by_hidden[16]
    # Detected within the documented bound: FROZEN_S of silence (the last heartbeat came
    # at most 0.5 s before the freeze), plus the driver's check interval and its loop.
    took = backend.retired[retired] - frozen_at
    assert backend.FROZEN_S - 1 < took < backend.FROZEN_S + 4, took
    # Resent once, to the other worker, from epoch 1's checkpoint, writing its own file.
    assert backend.resent == [(victim.trial_id, 2)]
    assert backend.placements[(victim.trial_id, 2)][0] != retired
    second = victim.results[1]
    assert not second.reused_model  # rebuilt from the checkpoint on another worker
    assert second.checkpoint.endswith(
        f"trial-{victim.trial_id:03d}/epoch-002.attempt-2.pt"), second.checkpoint
    assert victim.results[2].checkpoint.endswith("epoch-003.pt")
    # Nothing the woken worker finished after the freeze was used.
    stale = f"{socket.gethostname()}:{pid}"
    late = [(t.trial_id, r.epoch) for t in by_hidden.values() for r in t.results
            if r.worker == stale and r.finished > frozen_at]
    assert not late, late
    return retired, victim


def test_a_frozen_worker_is_restarted_by_its_nanny_and_its_epoch_resent(
        tmp_path, monkeypatch):
    from distributed import Client

    marks = _marks(tmp_path, monkeypatch)
    with process_cluster(n_workers=2, cores=1) as cluster, \
            Client(cluster, set_as_default=False) as client:
        study, backend, pid, frozen_at = _study_with_a_frozen_worker(
            client, tmp_path, marks)
        # The nanny ended the frozen process and started a new one: two workers again,
        # the retired address gone.
        client.wait_for_workers(2, timeout=60)
        assert _wait_gone(pid), "the frozen worker process was not ended"
        retired, _ = _assert_resent_once_and_nothing_stale(study, backend, pid, frozen_at)
        assert retired not in client.scheduler_info(n_workers=-1)["workers"]


def test_a_frozen_worker_restarted_on_its_own_port_is_placed_again(tmp_path, monkeypatch):
    """One worker, its port fixed (``dask worker --worker-port``): its nanny restarts it
    at the address it had, and the study, with no other worker, goes on there."""
    from distributed import Client

    from pipetune.backends import DaskBackend
    from pipetune.net import free_port

    marks = _marks(tmp_path, monkeypatch)
    spec = three_trial_spec("frozen-port", "FreezingWorkload")
    with process_cluster(n_workers=1, cores=1, worker_port=free_port()) as cluster, \
            Client(cluster, set_as_default=False) as client:
        [address] = client.scheduler_info(n_workers=-1)["workers"]
        study = Study(spec, study_id="frozen-port", core_budget=1, machine=ONE_CORE_WORKERS,
                      checkpoints=CheckpointStore(tmp_path / "ck"))
        backend = DaskBackend(client)
        backend.NO_WORKER_S = 60.0  # the bug this guards against waited out this bound
        try:
            study.run(backend)
        finally:
            frozen = (marks / "frozen-16").read_text().split()
            if _alive(int(frozen[0])):
                os.kill(int(frozen[0]), signal.SIGCONT)
    assert list(backend.retired) == [address]
    by_hidden = {t.params["hidden"]: t for t in study.trials.values()}
    for hidden, trial in by_hidden.items():
        assert trial.state == "completed", (hidden, trial.error)
        assert [r.epoch for r in trial.results] == [1, 2, 3], (hidden, trial.results)
    victim = by_hidden[16]
    assert backend.resent == [(victim.trial_id, 2)]
    # The resent epoch ran at the same address, in the process the nanny started.
    assert backend.placements[(victim.trial_id, 2)][0] == address
    assert victim.results[1].worker != f"{socket.gethostname()}:{frozen[0]}"


@contextlib.contextmanager
def _workers_without_nannies(n: int):
    """A scheduler and ``n`` ``dask worker --no-nanny`` processes (an existing cluster
    whose workers nobody restarts), one thread and 1 core each."""
    import dask
    from distributed import LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), \
            LocalCluster(n_workers=0, processes=True, host="127.0.0.1",
                         dashboard_address="127.0.0.1:0") as cluster:
        tests_dir = str(Path(__file__).resolve().parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (tests_dir, os.environ.get("PYTHONPATH", "")) if p)}
        procs = [subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address,
             "--no-nanny", "--nthreads", "1", "--resources", "cores=1",
             "--host", "127.0.0.1", "--no-dashboard"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(n)]
        try:
            yield cluster
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def test_a_frozen_worker_without_a_nanny_is_dropped_and_leaves_when_woken(
        tmp_path, monkeypatch):
    from distributed import Client

    marks = _marks(tmp_path, monkeypatch)
    with _workers_without_nannies(2) as cluster, \
            Client(cluster, set_as_default=False) as client:
        client.wait_for_workers(2, timeout=60)
        study, backend, pid, frozen_at = _study_with_a_frozen_worker(
            client, tmp_path, marks)
        retired, victim = _assert_resent_once_and_nothing_stale(
            study, backend, pid, frozen_at)
        # Removed from the cluster, nobody to restart it: one worker left, and the woken
        # process, told by the scheduler that it is gone, closes itself.
        left = client.scheduler_info(n_workers=-1)["workers"]
        assert len(left) == 1 and retired not in left, list(left)
        assert _wait_gone(pid), "the woken worker did not leave"
    # Closing, it finished its stale epoch first: that epoch's checkpoint went to the
    # first attempt's reference, beside the one the trial went on from, not over it.
    ours = Path(victim.results[1].checkpoint)
    stale_ref = ours.with_name("epoch-002.pt")
    assert stale_ref.exists() and ours.exists()
    assert stale_ref.stat().st_mtime > frozen_at + backend.FROZEN_S - 1  # written woken


def test_an_epoch_that_freezes_every_worker_fails_only_its_trial(tmp_path, monkeypatch):
    """Frozen once, the epoch is resent; frozen again, its trial fails as ``worker
    froze`` and the study goes on (a shorter bound here, to keep the test short)."""
    from distributed import Client

    from pipetune.backends import DaskBackend

    marks = _marks(tmp_path, monkeypatch)
    spec = three_trial_spec("frozen-twice", "AlwaysFreezingWorkload")
    with process_cluster(n_workers=2, cores=1) as cluster, \
            Client(cluster, set_as_default=False) as client:
        study = Study(spec, study_id="frozen-twice",
                      checkpoints=CheckpointStore(tmp_path / "ck"),
                      core_budget=2, machine=ONE_CORE_WORKERS)
        backend = DaskBackend(client)
        backend.FROZEN_S = 5.0
        try:
            study.run(backend)
        finally:
            pids = [int(p.name.rsplit("-", 1)[1]) for p in marks.glob("frozen-8-*")]
            for pid in pids:
                if _alive(pid):
                    os.kill(pid, signal.SIGCONT)  # never leave a stopped process
        client.wait_for_workers(2, timeout=60)
    by_hidden = {t.params["hidden"]: t for t in study.trials.values()}
    wedged = by_hidden[8]
    assert wedged.state == "failed" and wedged.epochs_run == 1
    # The silence it names is the one measured, at least the bound and not much more
    # (a busy machine's scheduler sees it a poll or two late).
    silence = re.match(r"worker froze: the worker running this epoch sent no heartbeat "
                       r"for (\d+) s, after 1 other worker\(s\) that ran it were lost$",
                       wedged.error)
    assert silence and 5 <= int(silence.group(1)) <= 15, wedged.error
    assert len(pids) == 2 and len(backend.retired) == 2
    assert backend.resent == [(wedged.trial_id, 2)]
    for hidden in (16, 32):
        trial = by_hidden[hidden]
        assert trial.state == "completed", (hidden, trial.error)
        assert [r.epoch for r in trial.results] == [1, 2, 3]
