"""Run a command for as long as its parent lives: ``python -m pipetune._watch -- CMD...``.

The parent keeps this process's stdin open; when the parent exits in any way, a
SIGKILL included, stdin reaches EOF and the command's process group is stopped
(SIGTERM, then SIGKILL after 5 s). The local Prefect server runs under it, in a session
of its own (so a Ctrl-C in the terminal reaches pipetune first, which stops it in
order), yet it never outlives the command that started it. Nor this watcher: on Linux
the command gets SIGKILL from the kernel when the watcher dies (a parent-death signal),
so a SIGKILLed watcher, which cannot stop anything, leaves no server behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -m pipetune._watch -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = subprocess.Popen(argv[1:], stdin=subprocess.DEVNULL,
                             preexec_fn=_die_with(os.getpid()))

    def stop_on(signum, _frame):
        _stop(child)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop_on)

    def watch_parent() -> None:
        while sys.stdin.buffer.read(4096):
            pass
        _stop(child)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    return child.wait()


def _die_with(parent: int):
    """In the forked child, before it runs the command: ask the kernel to SIGKILL it when
    ``parent`` (this watcher) dies, and die now if it already has. Linux only (prctl);
    elsewhere nothing. SIGKILL, not SIGTERM: nobody is left to wait for a slow exit, and
    the server's SQLite writes are transactions."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1

    def arm() -> None:
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the watcher died before the signal was armed
            os._exit(1)
    return arm


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(5)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
