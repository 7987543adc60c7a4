"""A recorder process started ahead of the command that will use it.

The warm service (:mod:`pipetune.service`) keeps one *spare* recorder waiting on a Unix
socket, its imports done (MLflow, Prefect's client, the sinks) and the working folder's
MLflow store opened. A ``pipetune tune`` that finds it (``$PIPETUNE_SPARE_RECORDER``)
connects and hands it the two pipes a :class:`~pipetune.sidecar.ProcessHost` would have
given a child of its own (``SCM_RIGHTS``), with its environment, ``sys.path`` and
working folder; from then on the spare is that command's recorder, exactly: it reads
the one pipe and answers on the other, and when the command closes its end (or dies)
it writes what it was sent and exits. A command that cannot connect starts its own.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from pipetune.net import unix_address

#: Environment variable naming the spare recorder's socket, for the command.
SPARE_ENV = "PIPETUNE_SPARE_RECORDER"
_SIZE = struct.Struct("!I")


class Adopted:
    """The command's handle on a spare recorder: what a :class:`subprocess.Popen` of
    its own would give :class:`~pipetune.sidecar.ProcessHost` (pipes, pid, wait)."""

    def __init__(self, pid: int, stdin: BinaryIO, stdout: BinaryIO):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not pid_alive(self.pid):
            self.returncode = 0  # not our child: its exit code is its parent's to read
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("spare recorder", timeout)
            time.sleep(0.02)
        return self.returncode or 0

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, 9)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: a zombie (exited, its parent not reaping it yet)
    does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def adopt(path: str, timeout: float = 1.0) -> Adopted | None:
    """Take the spare recorder waiting at ``path``; None if there is none (or it does
    not answer within ``timeout``)."""
    if not os.path.exists(path):
        return None
    to_child, from_us = os.pipe()  # its input
    to_us, from_child = os.pipe()  # its replies
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        with unix_address(path) as address:
            sock.connect(address)
        # its input, its replies, and this command's stderr (its warnings are ours)
        pid = send_hello(sock, command_hello(), [to_child, from_child, 2])
    except OSError:
        for fd in (to_child, from_us, to_us, from_child):
            os.close(fd)
        return None
    finally:
        sock.close()
    os.close(to_child)
    os.close(from_child)
    if pid <= 0:
        os.close(from_us)
        os.close(to_us)
        return None
    return Adopted(pid, os.fdopen(from_us, "wb"), os.fdopen(to_us, "rb"))


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("the spare recorder closed the connection")
        data += chunk
    return data


def _at_idle_priority(fn) -> None:
    """``fn()`` in a thread scheduled only when a core has nothing else to run (Linux
    ``SCHED_IDLE``, per thread): a spare warming up beside a command's epochs takes no
    CPU from them. This thread keeps its normal priority for the recorder's work later
    (an unprivileged thread cannot leave ``SCHED_IDLE`` again)."""
    import threading

    def run() -> None:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        fn()

    thread = threading.Thread(target=run, name="pipetune-spare-warm-up")
    thread.start()
    thread.join()


def listen_when_warm(path: str, warm_up: Callable[[], None]) -> socket.socket:
    """Listen at a private name beside ``path``, run ``warm_up()`` at idle priority,
    then take the name ``path``: commands find a spare only once it is warm."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    with unix_address(tmp) as address:  # a deep PIPETUNE_HOME is a long path
        listener.bind(address)
    listener.listen(1)
    _at_idle_priority(warm_up)
    os.replace(tmp, path)
    listener.settimeout(2.0)
    return listener


def accept_command(listener: socket.socket, path: str, nfds: int, parent: int,
                   reply: Callable[[dict[str, Any]], int]) -> tuple[dict, list[int], Any]:
    """The first command that connects with a hello and ``nfds`` file descriptors:
    ``(hello, fds, connection)``, after answering it ``reply(hello)`` (a number). The
    spare exits once its service (``parent``) is gone: nobody will come."""
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                os._exit(0)
            continue
        conn.settimeout(10.0)
        with contextlib.suppress(OSError):  # taken: the service starts the next spare
            os.unlink(path)
        try:
            message, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, nfds)
            if len(fds) != nfds or len(message) < _SIZE.size:
                raise OSError("not a command's hello")
            (size,) = _SIZE.unpack(message[:_SIZE.size])
            data = message[_SIZE.size:]
            while len(data) < size:
                chunk = conn.recv(size - len(data))
                if not chunk:
                    raise OSError("hello cut short")
                data += chunk
            hello: dict[str, Any] = pickle.loads(data)
            conn.sendall(_SIZE.pack(reply(hello)))
        except (OSError, pickle.UnpicklingError, EOFError, ValueError):
            conn.close()
            continue
        listener.close()
        return hello, fds, conn


def become(hello: dict[str, Any]) -> None:
    """Take the command's environment, ``sys.path`` and working folder."""
    import sys

    os.environ.clear()
    os.environ.update(hello["env"])
    os.environ.pop(SPARE_ENV, None)
    sys.path[:] = hello["path"]
    with contextlib.suppress(OSError):
        os.chdir(hello["cwd"])


def send_hello(sock: socket.socket, hello: dict[str, Any], fds: list[int]) -> int:
    """A command's side of :func:`accept_command`: the hello with ``fds``; the answer."""
    data = pickle.dumps(hello)
    socket.send_fds(sock, [_SIZE.pack(len(data)) + data], fds)
    (answer,) = _SIZE.unpack(_read_exactly(sock, _SIZE.size))
    return answer


def command_hello() -> dict[str, Any]:
    """What a spare takes of the command: environment, ``sys.path``, working folder."""
    import sys

    return {"env": dict(os.environ), "cwd": os.getcwd(),
            "path": [p or os.getcwd() for p in sys.path if isinstance(p, str)]}


def wait_for_command(path: str, warm_up: Callable[[], None]) -> tuple[BinaryIO, BinaryIO]:
    """In the spare: listen at ``path``, run ``warm_up()``, then take the first command
    that connects; become its recorder (its environment, path and folder) and return
    the pipes to read from and answer on."""
    parent = os.getppid()
    listener = listen_when_warm(path, warm_up)
    hello, fds, conn = accept_command(listener, path, 3, parent, lambda _: os.getpid())
    conn.close()
    become(hello)
    os.dup2(fds[2], 2)
    os.close(fds[2])
    return os.fdopen(fds[0], "rb"), os.fdopen(fds[1], "wb")


#: What a spare imports before it waits: the sinks a study attaches, and their libraries.
SPARE_PRELOAD = ("mlflow", "mlflow.tracking", "pandas", "pipetune.tracking.sink",
                 "prefect.client.orchestration", "prefect.context", "tasks.task_run_sink",
                 "tasks.epoch", "tasks.tuning")


def start_spare(path: str, log: str) -> Any:
    """Start a spare recorder that will wait at ``path`` (its own session: it outlives
    whoever started it while it serves a command)."""
    import subprocess
    import sys

    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "pipetune.sidecar", "--spare", path,
                                 *SPARE_PRELOAD], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, process_group=0)
