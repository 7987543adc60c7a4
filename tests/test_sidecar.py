"""The recorder process: calls in order, off this process, errors raised where the
caller waits, and nothing sent lost when the caller dies."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipetune.sidecar import ProcessHost, SidecarError, ThreadHost

TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture
def host():
    host = ProcessHost(name="test-recorder")
    yield host
    host.stop(timeout=30)


def test_calls_run_in_order_in_another_process_and_are_batched(host, tmp_path):
    out = tmp_path / "lines.txt"
    sink = host.attach("recording_sink:FileSink", path=str(out))
    for i in range(500):
        sink.send("append", f"line {i}")
    assert sink.call("lines", timeout=60) == [f"line {i}" for i in range(500)]
    assert sink.call("pid") == host.pid != os.getpid()
    assert sink.call("idle_flushes") < 500  # sent in a burst: written in a few goes


def test_a_sink_error_is_raised_by_the_next_call_once(host, tmp_path):
    sink = host.attach("recording_sink:FileSink", path=str(tmp_path / "x.txt"))
    sink.send("fail", "first")
    sink.send("fail", "second")
    sink.send("append", "after")
    with pytest.raises(ValueError, match="first") as caught:
        sink.call("pid")
    assert "1 more call" in "".join(caught.value.__notes__)
    assert sink.call("lines") == ["after"]  # it went on after the failures
    sink.close()
    with pytest.raises(SidecarError, match="closed"):
        sink.send("append", "too late")


def test_a_sink_that_cannot_be_built_says_so(host):
    sink = host.attach("recording_sink:NoSuchSink")
    with pytest.raises(AttributeError, match="NoSuchSink"):
        sink.call("pid")
    with pytest.raises(SidecarError, match="not attached"):
        sink.call("pid")


def test_the_thread_host_runs_the_same_sink_here(tmp_path):
    from recording_sink import FileSink

    host = ThreadHost()
    sink = host.attach(FileSink(str(tmp_path / "t.txt")))
    for i in range(50):
        sink.send("append", str(i))
    assert sink.call("lines") == [str(i) for i in range(50)]
    assert sink.call("pid") == os.getpid()
    host.stop(timeout=10)


def test_what_was_sent_is_written_when_the_caller_is_killed(tmp_path):
    out = tmp_path / "lines.txt"
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(TESTS_DIR)!r})
        from pipetune.sidecar import ProcessHost
        host = ProcessHost()
        sink = host.attach("recording_sink:FileSink", path={str(out)!r})
        sink.call("pid", timeout=60)  # the child is up
        for i in range(2000):
            sink.send("append", f"line {{i}}")
        print(host.pid, flush=True)
        while not host._queue.empty():  # handed to the pipe
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr
    child = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)  # it finished and exited without its parent
    assert out.read_text().splitlines() == [f"line {i}" for i in range(2000)]


def test_a_sink_idles_with_nothing_sent_and_drains_when_its_caller_is_killed(tmp_path):
    """What a sink holds back goes out at an idle call with nothing sent meanwhile (a
    task run's Running state, held for its end), and all of it when the host stops
    with the sink still attached (its caller killed)."""
    out = tmp_path / "lines.txt"
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(TESTS_DIR)!r})
        from pipetune.sidecar import ProcessHost
        host = ProcessHost()
        sink = host.attach("recording_sink:FileSink", path={str(out)!r})
        sink.call("pid", timeout=60)  # the child is up
        sink.send("hold", "due in 0.5 s", 0.5)
        time.sleep(3)
        print(open({str(out)!r}).read().splitlines(), flush=True)
        sink.send("hold", "due in an hour", 3600.0)
        while not host._queue.empty():  # handed to the pipe
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert proc.stdout.strip() == "['due in 0.5 s']"  # written with nothing sent after it
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and out.read_text().count("\n") < 2:
        time.sleep(0.1)
    assert out.read_text().splitlines() == ["due in 0.5 s", "due in an hour"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


def test_a_spare_recorder_started_ahead_becomes_this_process_recorder(tmp_path, monkeypatch):
    """The warm service's spare (pipetune.sidecar.spare): started before the command,
    it takes the command's environment, path and folder, answers on the command's pipes
    and, once its input closes, has written everything and exits. Its folder is deeper
    than a socket address holds (a user's ``PIPETUNE_HOME`` may be)."""
    from pipetune.sidecar.spare import start_spare

    folder = tmp_path / "a-home-deeper-than-a-unix-socket-address-holds" / ("x" * 60)
    folder.mkdir(parents=True)
    sock = folder / "recorder.sock"
    assert len(str(sock)) > 108
    spare = start_spare(str(sock), str(tmp_path / "recorder.log"))
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():  # waiting only once its imports are done
            assert spare.poll() is None, (tmp_path / "recorder.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        monkeypatch.syspath_prepend(str(TESTS_DIR))  # recording_sink, from our path only
        monkeypatch.setenv("PIPETUNE_SPARE_RECORDER", str(sock))
        monkeypatch.setenv("PIPETUNE_TEST_MARK", "from the command")
        monkeypatch.chdir(tmp_path)
        host = ProcessHost(name="test-spare")
        assert host.pid == spare.pid and not sock.exists()  # taken, once
        assert "PIPETUNE_SPARE_RECORDER" not in os.environ
        sink = host.attach("recording_sink:FileSink", path="lines.txt")  # its folder: ours
        for i in range(50):
            sink.send("append", f"line {i}")
        assert sink.call("pid") == spare.pid
        assert sink.call("env", "PIPETUNE_TEST_MARK") == "from the command"
        host.stop(timeout=60)
        assert spare.wait(timeout=30) == 0
        assert (tmp_path / "lines.txt").read_text().split("\n")[:2] == ["line 0", "line 1"]
        # No spare left: the next host starts a child of its own.
        monkeypatch.setenv("PIPETUNE_SPARE_RECORDER", str(sock))
        own = ProcessHost(name="test-own")
        assert own.pid not in (spare.pid, os.getpid())
        own.stop(timeout=30)
    finally:
        if spare.poll() is None:
            spare.kill()
