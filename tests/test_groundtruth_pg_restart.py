"""The ground truth on PostgreSQL (team mode) while the server restarts: reads and writes
wait for it and then succeed, and every record is there exactly once.

The server is a real one of its own (restarted here, so not the session's), restarted
on the same port and data folder, so the URL stays valid: ``pg_ctl stop`` then start,
and a SIGKILL of the postmaster then start (crash recovery). A write whose COMMIT
landed but whose answer was lost is made with a real TCP relay that cuts the
connection after the server answered the COMMIT.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from known import CONV_JOB, noisy
from pg_server import PostgresServer
from team import skip_without_postgres

from pipetune.errors import GroundTruthError, PipetuneError
from pipetune.groundtruth import GroundTruth
from pipetune.groundtruth.sqlschema import RETRY_ENV
from pipetune.net import free_port
from pipetune.stack import _proc
from pipetune.system.config import SystemConfig

CORES2 = SystemConfig(cores=2)
WRITERS = "ab"


@pytest.fixture(scope="module")
def server():
    skip_without_postgres()
    pg = PostgresServer()
    try:
        yield pg.start()
    finally:
        pg.stop()


# -- the restart ------------------------------------------------------------------------


def _down(server: PostgresServer, how: str) -> None:
    pg = server.server
    if how == "stop":
        pg.stop()
    else:
        pid = pg.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _proc.alive(pid):
            assert time.monotonic() < deadline, "the postmaster outlived its SIGKILL"
            time.sleep(0.05)
    assert not pg.running()


def _up(server: PostgresServer) -> None:
    """Start it again on the same port and data folder. After a SIGKILL, the old backends
    take a moment to see their postmaster gone; until they exit, a new one refuses the
    shared memory they still hold, so the start is tried again for a while."""
    pg, port = server.server, server.server.port
    deadline = time.monotonic() + 30
    while True:
        try:
            pg.start()
            break
        except PipetuneError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert pg.port == port


def _write(url: str, who: str, out: str, start, stop, stamps, slot: int) -> None:
    """Record (who, 0), (who, 1), ... until ``stop``; then write down how many were
    recorded and when each ``record`` call began and returned. ``stamps``: when this
    process's last call began and ended (see :func:`_calls`)."""
    gt = GroundTruth(url)
    start.wait()
    spans = []
    while not stop.is_set():
        t0 = stamps[2 * slot] = time.time()
        gt.remember(noisy(CONV_JOB, len(spans)), 32, "time", CORES2, 0.01, job=who,
                  trial=str(len(spans)), job_key="conv")
        spans.append((t0, time.time()))
        stamps[2 * slot + 1] = spans[-1][1]
        time.sleep(0.05)
    Path(out).write_text(json.dumps(spans))


def _read(url: str, out: str, start, stop, stamps, slot: int) -> None:
    """Look up, ask for the known job and count the records until ``stop``; write down
    each round's span, count and whether both answered (``stamps`` as for writers)."""
    gt = GroundTruth(url)
    start.wait()
    reads = []
    while not stop.is_set():
        t0 = stamps[2 * slot] = time.time()
        hit = gt.lookup(noisy(CONV_JOB, 0), 32, "time").hit
        known = gt.known("conv", "time")
        hit = hit and known is not None and known.config == CORES2
        count = len(gt)  # a read too: the round ends after it
        reads.append((t0, time.time(), count, hit))
        stamps[2 * slot + 1] = reads[-1][1]
        time.sleep(0.05)
    Path(out).write_text(json.dumps(reads))


def _calls(stamps) -> list[tuple[float, float]]:
    """Each process's last call: (when it began, when it ended). A spawned process is
    scheduled late on a loaded machine, so the test waits for calls, not for seconds."""
    return [(stamps[i], stamps[i + 1]) for i in range(0, len(stamps), 2)]


def _wait_for(what, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_reads_and_writes_go_on_through_a_restart_and_no_record_is_lost_or_doubled(
        server, tmp_path, how):
    url = server.create_database()
    gt = GroundTruth(url)
    assert gt.check() == 0
    ctx = multiprocessing.get_context("spawn")
    start, stop = ctx.Event(), ctx.Event()
    stamps = ctx.Array("d", 2 * (len(WRITERS) + 1), lock=False)
    procs = [ctx.Process(target=_write,
                         args=(url, who, str(tmp_path / who), start, stop, stamps, i))
             for i, who in enumerate(WRITERS)]
    procs.append(ctx.Process(target=_read, args=(url, str(tmp_path / "reads"), start, stop,
                                                 stamps, len(WRITERS))))
    for p in procs:
        p.start()
    try:
        start.set()
        # every process is under way: each has ended a call
        _wait_for(lambda: len(gt) >= 6 and all(e > 0 for _, e in _calls(stamps)))
        _down(server, how)
        away = time.time()
        time.sleep(0.5)
        # every process is in a call while the server is away: it tries, fails and waits
        _wait_for(lambda: all(b > e for b, e in _calls(stamps)))
        back = time.time()  # the server is still away
        _up(server)
        # going on after the restart: each has ended a call since
        _wait_for(lambda: all(e > back for _, e in _calls(stamps)))
    finally:
        stop.set()
        for p in procs:
            p.join(120)
    assert [p.exitcode for p in procs] == [0] * len(procs)

    spans = {who: json.loads((tmp_path / who).read_text()) for who in WRITERS}
    records = gt._store.read()
    seen = Counter((r["job"], r["trial"]) for r in records)
    assert seen == Counter((who, str(i)) for who in WRITERS for i in range(len(spans[who])))
    for who in WRITERS:  # each writer had a record() under way while the server was away
        assert any(t0 < back < t1 for t0, t1 in spans[who]), who
    reads = json.loads((tmp_path / "reads").read_text())
    assert any(t0 < back < t1 and hit for t0, t1, _, hit in reads)  # it waited, then answered
    assert away < back
    counts = [n for *_, n, _ in reads]
    assert counts == sorted(counts) and counts[-1] <= len(records)


# -- a COMMIT whose answer was lost ----------------------------------------------------


class CommitCutter:
    """A TCP relay to a PostgreSQL server. Once :meth:`arm` ed, it lets the next write
    transaction's COMMIT (one that took the ground truth's table lock) through to the
    server, waits for the server's answer, and then closes the client's connection
    instead of passing that answer on: the write landed, and its writer cannot know."""

    def __init__(self, port: int) -> None:
        self.upstream = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed = threading.Event()
        self.cut = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self) -> None:
        self.armed.set()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            state = {"locked": False, "cutting": False}
            threading.Thread(target=self._to_server, args=(client, server, state),
                             daemon=True).start()
            threading.Thread(target=self._to_client, args=(server, client, state),
                             daemon=True).start()

    def _to_server(self, client: socket.socket, server: socket.socket, state: dict) -> None:
        with server:
            while data := _recv(client):
                if b"LOCK TABLE" in data:
                    state["locked"] = True
                if b"COMMIT" in data and state["locked"] and self.armed.is_set():
                    self.armed.clear()
                    state["cutting"] = True
                server.sendall(data)

    def _to_client(self, server: socket.socket, client: socket.socket, state: dict) -> None:
        with client:
            while data := _recv(server):
                if state["cutting"]:  # the server answered the COMMIT: it is written
                    self.cut += 1
                    client.shutdown(socket.SHUT_RDWR)
                    return
                client.sendall(data)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def test_a_write_whose_commit_answer_was_lost_is_not_written_twice(server, caplog):
    url = server.create_database()
    direct = GroundTruth(url)
    direct.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.5, job="before")
    relay = CommitCutter(server.server.port)
    try:
        gt = GroundTruth(url.replace(f":{server.server.port}/", f":{relay.port}/"))
        assert gt.check() == 1  # through the relay
        relay.arm()
        with caplog.at_level(logging.WARNING, logger="pipetune.groundtruth.sql"):
            gt.remember(noisy(CONV_JOB, 1), 32, "time", CORES2, 0.01, job="cut")
        assert relay.cut == 1  # the COMMIT's answer never reached the writer ...
        assert "did not answer" in caplog.text  # ... which saw the error and tried again
        gt.remember(noisy(CONV_JOB, 2), 32, "time", CORES2, 0.02, job="after")
    finally:
        relay.close()
    assert [r["job"] for r in direct._store.read()] == ["before", "cut", "after"]


# -- how long it waits ------------------------------------------------------------------


def test_a_server_that_stays_away_is_one_clear_error_after_the_budget(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "1.5")
    gt = GroundTruth(f"postgresql://alice:s3cret@127.0.0.1:{free_port()}/gt")  # no server
    began = time.monotonic()
    with pytest.raises(GroundTruthError) as info:
        gt.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    took = time.monotonic() - began
    message = str(info.value)
    assert 1.5 <= took < 10, took
    assert message.startswith("postgresql+psycopg://alice:***@127.0.0.1:")
    assert ": the database did not answer for 1.5 s (" in message
    assert "s3cret" not in message and "\n" not in message and RETRY_ENV in message


def test_a_database_that_does_not_exist_fails_at_once(server, monkeypatch):
    monkeypatch.delenv(RETRY_ENV, raising=False)  # the default: 60 s for a server away
    gt = GroundTruth(server.url("no_such_database"))
    began = time.monotonic()
    with pytest.raises(GroundTruthError, match='database "no_such_database" does not exist'):
        len(gt)
    assert time.monotonic() - began < 10


def test_how_long_it_waits_is_set_by_the_environment_and_travels_with_the_store(
        monkeypatch, tmp_path):
    monkeypatch.setenv(RETRY_ENV, "soon")
    with pytest.raises(GroundTruthError, match=f"{RETRY_ENV}='soon': give a number"):
        GroundTruth("postgresql://u@127.0.0.1:1/gt")
    assert len(GroundTruth(f"sqlite:///{tmp_path / 'gt.db'}")) == 0  # a file never waits
    monkeypatch.setenv(RETRY_ENV, "5")
    gt = GroundTruth("postgresql://u@127.0.0.1:1/gt")
    monkeypatch.delenv(RETRY_ENV)
    assert pickle.loads(pickle.dumps(gt))._store.retry_s == 5.0  # a worker waits as long
    assert GroundTruth("postgresql://u@127.0.0.1:1/gt")._store.retry_s == 60.0
