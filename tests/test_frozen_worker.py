"""Fault injection on a real Dask cluster of process workers with nannies (as the
embedded cluster): a worker frozen with SIGSTOP in the middle of an epoch. Its
heartbeats stop while its connection stays open; the driver notices within its bound,
sends the epoch again from the trial's last checkpoint, has the nanny restart the
frozen worker, and ignores what the worker does once woken with SIGCONT."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from known import process_cluster
from test_worker_loss import ONE_CORE_WORKERS, three_trial_spec

from pipetune.checkpoints import CheckpointStore
from pipetune.study import Study

pytestmark = [
    pytest.mark.slow,
]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wake_when_retired(backend, marks: Path, stop: threading.Event) -> None:
    """SIGCONT the frozen worker as soon as the driver has retired it: the worker then
    finishes its stale epoch while the resent one runs elsewhere."""
    while not stop.is_set() and not backend.retired:
        time.sleep(0.02)
    if backend.retired:
        pid = int((marks / "frozen-16").read_text().split()[0])
        os.kill(pid, signal.SIGCONT)


def test_a_frozen_worker_is_retired_its_epoch_resent_and_its_late_result_ignored(
        tmp_path, monkeypatch):
    from distributed import Client

    from pipetune.backends import DaskBackend

    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("PIPETUNE_KILL_MARKS", str(marks))
    spec = three_trial_spec("frozen", "FreezingWorkload")
    stop = threading.Event()
    with process_cluster(n_workers=2, cores=1) as cluster, \
            Client(cluster, set_as_default=False) as client:
        study = Study(spec, study_id="frozen", checkpoints=CheckpointStore(tmp_path / "ck"),
                      core_budget=2, machine=ONE_CORE_WORKERS)
        backend = DaskBackend(client)
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
        pid, frozen_at = int(frozen[0]), float(frozen[1])
        # The nanny killed the frozen process and started a new one: two workers again,
        # the retired address gone.
        client.wait_for_workers(2, timeout=60)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pid), "the frozen worker process was not ended"
        [retired] = backend.retired
        assert retired not in client.scheduler_info(n_workers=-1)["workers"]
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
    # The frozen worker woke (SIGCONT) and ran on; nothing it finished after the freeze
    # was used.
    assert (marks / "woke-16").exists()
    stale = f"{socket.gethostname()}:{pid}"
    late = [(t.trial_id, r.epoch) for t in by_hidden.values() for r in t.results
            if r.worker == stale and r.finished > frozen_at]
    assert not late, late
