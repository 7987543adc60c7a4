"""Detached child processes: start one with its own log and PID file, tell whether it is
still the process we started, stop it by PID (signal, grace, SIGKILL).

No Prefect, MLflow or Dask here: the stack's components are their command lines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pipetune.net import port_free  # noqa: F401 - the stack's modules use it here


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, from ``/proc``), so a PID the kernel
    has given to another process since is not mistaken for ours; None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].startswith("Z")


def alive(pid: int | None, ticks: int | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, when ``ticks`` is given, is still the
    process that started then."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user (the postgres user, say)
    if _zombie(pid):
        return False
    if ticks is not None:
        now = start_ticks(pid)
        if now is not None and now != ticks:
            return False
    return True


def launch(argv: Sequence[str], *, log: Path, pid_file: Path, env: Mapping[str, str],
           cwd: Path | None = None) -> subprocess.Popen:
    """Start ``argv`` detached (a session of its own, stdin from /dev/null), its output
    appended to ``log``, its PID written to ``pid_file``; it outlives this process."""
    log.parent.mkdir(parents=True, exist_ok=True)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(env), cwd=cwd, start_new_session=True, close_fds=True,
        )
    write_pid(pid_file, proc.pid)
    return proc


def write_pid(pid_file: Path, pid: int) -> None:
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(f"{pid}\n")


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def stop(pid: int | None, *, ticks: int | None = None, sig: int = signal.SIGTERM,
         grace: float = 10.0, group: bool = True) -> bool:
    """Stop ``pid``: ``sig`` (to its whole process group when it leads one and ``group``),
    wait up to ``grace`` seconds, then SIGKILL. True if it is gone."""
    if not alive(pid, ticks):
        return True
    assert pid is not None
    leads = group and _pgid(pid) == pid

    def send(s: int) -> None:
        try:
            if leads:
                os.killpg(pid, s)
            else:
                os.kill(pid, s)
        except ProcessLookupError:
            pass

    send(sig)
    if wait_until(lambda: not alive(pid, ticks), grace):
        _kill_rest_of_group(pid if leads else None)
        return True
    send(signal.SIGKILL)
    gone = wait_until(lambda: not alive(pid, ticks), 5.0)
    _kill_rest_of_group(pid if leads else None)
    return gone


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _kill_rest_of_group(pgid: int | None) -> None:
    """The leader is gone: SIGKILL anything it left behind in its group."""
    if pgid is None:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_until(check: Callable[[], bool], timeout: float, every: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(every)


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log, for an error message."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    marker = text.rfind("\n--- ")  # where :func:`launch` started the last run
    if marker >= 0:
        text = text[marker + 1:]
    return "\n".join(text.rstrip().splitlines()[-lines:])
