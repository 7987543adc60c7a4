"""``pipetune tune`` handed to a driver process the warm service started ahead of it.

A study's driver imports a great deal before and while it trains: the command line,
Prefect (for the flow run that covers the study), matplotlib and pandas (for its end).
About 3 CPU-s here, spent beside the first epochs on a machine whose cores the epochs
want. So the warm service (:mod:`pipetune.service`) keeps one *spare driver* waiting on
a Unix socket (``driver.sock`` in its folder) with those imports done, at idle priority.

A ``tune`` command that finds it hands itself over (:func:`hand_over`): it passes its
standard input, output and error (``SCM_RIGHTS``), arguments, environment, ``sys.path``,
working folder and start time; the spare takes them and runs the command exactly as the
command would have, on the same terminal. The command stays as a thin client: it
forwards the signals it gets (Ctrl-C, SIGTERM, SIGHUP, a resized terminal) and exits
with the driver's exit code once the driver has exited. A command that goes away
(killed) stops its driver as SIGTERM does. A spare whose pipetune, ``flows`` or
``tasks`` sources changed since it imported them refuses, and the command runs itself.

Nothing is handed over with ``--keep-warm 0`` or ``PIPETUNE_KEEP_WARM_S=0``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from pipetune.errors import PipetuneError
from pipetune.net import unix_address
from pipetune.sidecar.spare import (
    _SIZE,
    _read_exactly,
    accept_command,
    become,
    command_hello,
    listen_when_warm,
    pid_alive,
    send_hello,
)

#: The spare driver's socket, in the warm service's folder.
DRIVER_SOCKET = "driver.sock"
#: What the spare driver imports before it waits (what a ``tune`` command imports).
DRIVER_PRELOAD = ("pipetune.cli.tune", "pipetune.cli.tune_display", "pipetune.session",
                  "flows.first", "flows.beside", "flows.study", "prefect.flow_engine",
                  "prefect.client.orchestration",
                  "pipetune.tracking.sink", "pipetune.dask.backend", "distributed",
                  "pandas", "matplotlib.figure", "matplotlib.backends.backend_agg",
                  "matplotlib.patches", "rich.live", "rich.table")
#: Signals the thin command passes on to its driver.
FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGWINCH", "SIGUSR1", "SIGUSR2")
#: Set in a spare driver running a command: it never hands over again.
IS_DRIVER = False


def _keep_warm_off(argv: Sequence[str]) -> bool:
    """Whether ``--keep-warm`` (else ``$PIPETUNE_KEEP_WARM_S``) says 0; a bad value is
    left to the command to refuse."""
    from pipetune.service import keep_warm_s

    value = None
    for i, arg in enumerate(argv):
        if arg == "--keep-warm" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--keep-warm="):
            value = arg.split("=", 1)[1]
    try:
        return keep_warm_s(None if value is None else float(value)) == 0
    except (ValueError, PipetuneError):
        return False


def driver_socket() -> Path:
    """Where this command's spare driver waits (this interpreter, folder, settings)."""
    from pipetune.service import service_key, services_root

    return services_root() / service_key() / DRIVER_SOCKET


def hand_over(argv: Sequence[str], started: float) -> int | None:
    """Run ``pipetune tune ARGV`` in the warm service's spare driver: its exit code, or
    None when there is none to take it (the command then runs itself)."""
    if (IS_DRIVER or _keep_warm_off(argv) or os.environ.get("PREFECT_API_URL")
            or "-h" in argv or "--help" in argv):
        return None
    from pipetune.cli import quiet_defaults

    quiet_defaults()  # as ``tune`` does first: the service's key reads these settings
    try:
        path = driver_socket()
        if not path.exists():
            return None
    except (OSError, PipetuneError):  # a home it cannot use: the command says so itself
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    try:
        with unix_address(path) as address:
            sock.connect(address)
        hello = {**command_hello(), "argv": list(argv), "started": started,
                 "pid": os.getpid()}
        pid = send_hello(sock, hello, [0, 1, 2])
    except OSError:
        sock.close()
        return None
    if pid <= 0:  # it imported older code than is here now
        sock.close()
        return None
    return _follow(sock, pid)


def _follow(sock: socket.socket, pid: int) -> int:
    """Pass signals on to driver ``pid`` until it reports its exit code and exits."""
    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)

    for name in FORWARDED:
        with contextlib.suppress(AttributeError, ValueError, OSError):
            signal.signal(getattr(signal, name), forward)
    sock.settimeout(None)
    try:
        (code,) = _SIZE.unpack(_read_exactly(sock, _SIZE.size))
    except OSError:
        code = None
    with contextlib.suppress(OSError):  # its end closes when it has exited
        while sock.recv(4096):
            pass
    sock.close()
    if code is None:
        if pid_alive(pid):  # the connection broke, the driver did not
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        print("error: the study's driver (pipetune's warm service) ended without an exit "
              f"code; see {driver_socket().parent / 'driver.log'}", file=sys.stderr)
        return 1
    return code


# -- the spare's side -------------------------------------------------------------------


def sources_fingerprint() -> str:
    """The newest change to the sources a driver imports (pipetune, flows, tasks)."""
    from pipetune.service import code_fingerprint

    return code_fingerprint("flows", "tasks")


def _warm_up() -> None:
    import importlib

    for name in DRIVER_PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    with contextlib.suppress(Exception):
        import matplotlib

        matplotlib.use("Agg", force=False)


def serve(path: str) -> int:
    """The spare driver: warm up, wait for a command, run it as it would have run."""
    parent = os.getppid()
    fingerprint = sources_fingerprint()
    listener = listen_when_warm(path, _warm_up)
    hello, fds, conn = accept_command(
        listener, path, 3, parent,
        lambda _: os.getpid() if sources_fingerprint() == fingerprint else 0)
    if sources_fingerprint() != fingerprint:
        print("refused a command: pipetune's sources changed since this spare imported "
              "them", flush=True)
        return 0
    # In this spare's log, before its output becomes the command's.
    print(f"pid {os.getpid()} runs `pipetune {' '.join(hello['argv'])}` for pid "
          f"{hello.get('pid')} in {hello['cwd']}", flush=True)
    become(hello)
    for fd, target in zip(fds, (0, 1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    for stream, tty_only in ((sys.stdout, True), (sys.stderr, False)):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.reconfigure(line_buffering=os.isatty(stream.fileno()) or not tty_only)
    sys.argv = ["pipetune", *hello["argv"]]
    _stop_when_command_goes(conn)

    import pipetune.cli
    from pipetune.cli import tune_startup

    global IS_DRIVER
    IS_DRIVER = True
    tune_startup.COMMAND_STARTED = float(hello["started"])
    code = 1
    try:
        code = pipetune.cli.main(hello["argv"])
    except SystemExit as e:  # argparse's usage errors, --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        _exiting.set()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        with contextlib.suppress(OSError):
            conn.sendall(_SIZE.pack(code & 0xFF))
    return code


def _stop_when_command_goes(conn: socket.socket) -> None:
    """A command killed outright cannot pass its signal on: its connection closing
    stops the study as SIGTERM does."""
    def watch() -> None:
        conn.settimeout(None)
        with contextlib.suppress(OSError):
            while conn.recv(4096):
                pass
        if not _exiting.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="pipetune-command-watch", daemon=True).start()


_exiting = threading.Event()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m pipetune.cli.handover SOCKET", file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(sys.argv[1]))
