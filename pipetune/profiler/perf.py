"""Linux ``perf stat`` counters for the training process.

``perf stat -x, -e <events> -p <pid>`` runs beside the epoch and is stopped with
SIGINT; it then prints one CSV line per event. Hardware events (cycles, instructions,
cache misses) read ``<not supported>`` on many VMs; then only the software events are
used. :func:`perf_support` finds out once per process which level works.

perf takes ~15 ms to attach after it starts, so the first moments of an epoch are not
counted; an epoch shorter than that gets no perf figures (the profiler then reports
``psutil`` as its counters source).
"""

from __future__ import annotations

import functools
import shutil
import signal
import subprocess
from dataclasses import dataclass

HARDWARE_EVENTS: tuple[str, ...] = ("cycles", "instructions", "cache-misses")
SOFTWARE_EVENTS: tuple[str, ...] = ("task-clock", "context-switches", "cpu-migrations",
                                    "page-faults")

_UNCOUNTED = ("<not supported>", "<not counted>")


@dataclass(frozen=True)
class PerfCounts:
    """Parsed ``perf stat`` output: values by event name, and events perf could not count.

    Values are as perf prints them (``task-clock`` in milliseconds, the rest counts).
    """

    values: dict[str, float]
    unsupported: frozenset[str]


def parse_perf_csv(text: str) -> PerfCounts:
    """Parse ``perf stat -x,`` output (``value,unit,event,run time,percent,...``).

    Comment and blank lines are skipped; ``<not supported>`` and ``<not counted>``
    values go to ``unsupported``. Event modifiers (``cycles:u``) are dropped from names.

    >>> parse_perf_csv("12.5,msec,task-clock,125,100.00,,\\n<not supported>,,cycles,0,100.00,,")
    PerfCounts(values={'task-clock': 12.5}, unsupported=frozenset({'cycles'}))
    """
    values: dict[str, float] = {}
    unsupported: set[str] = set()
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(",")
        if len(parts) < 3:
            continue
        value, event = parts[0].strip(), parts[2].strip()
        if not event:
            continue
        event = event.split(":", 1)[0]
        if value in _UNCOUNTED:
            unsupported.add(event)
            continue
        try:
            values[event] = float(value)
        except ValueError:
            continue
    return PerfCounts(values, frozenset(unsupported))


@functools.cache
def perf_support() -> str | None:
    """``"hardware"`` if perf counts hardware events here, ``"software"`` if only
    software events, None if perf is missing or not permitted. Checked once per process
    by running ``perf stat`` on ``true``."""
    exe = shutil.which("perf")
    if exe is None:
        return None
    events = ",".join(HARDWARE_EVENTS + SOFTWARE_EVENTS)
    try:
        done = subprocess.run(
            [exe, "stat", "-x,", "-e", events, "--", "true"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, timeout=10, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    counts = parse_perf_csv(done.stderr)
    if all(e in counts.values for e in HARDWARE_EVENTS):
        return "hardware"
    if "task-clock" in counts.values:
        return "software"
    return None


class PerfSession:
    """One ``perf stat`` attached to a process, from :meth:`start` to :meth:`stop`."""

    def __init__(self, pid: int, level: str) -> None:
        if level not in ("hardware", "software"):
            raise ValueError(f"level must be 'hardware' or 'software', got {level!r}")
        self.pid = pid
        self.level = level
        self._proc: subprocess.Popen[str] | None = None

    @property
    def perf_pid(self) -> int | None:
        """The pid of the running perf process (None when not running)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def events(self) -> tuple[str, ...]:
        return (HARDWARE_EVENTS if self.level == "hardware" else ()) + SOFTWARE_EVENTS

    def start(self) -> bool:
        """Launch perf; False if it could not be started."""
        exe = shutil.which("perf")
        if exe is None:
            return False
        try:
            self._proc = subprocess.Popen(
                [exe, "stat", "-x,", "-e", ",".join(self.events), "-p", str(self.pid)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True,
            )
        except OSError:
            self._proc = None
            return False
        return True

    def interrupt(self) -> None:
        """Ask perf to stop counting and print (it finishes while the caller goes on)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signal.SIGINT)
            except OSError:
                pass

    def stop(self) -> PerfCounts | None:
        """Stop perf (if :meth:`interrupt` did not already) and return its counts, or
        None when it produced none."""
        self.interrupt()
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        try:
            _, err = proc.communicate(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            _abandon(proc)
            return None
        counts = parse_perf_csv(err or "")
        return counts if counts.values else None

    def kill(self) -> None:
        """Abandon the session (the epoch failed)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            _abandon(proc)


#: How long an epoch waits for perf to print its counts after SIGINT. perf attached to
#: a process with many threads can take seconds in the kernel to detach; the counts
#: are optional, the epoch's time is not.
STOP_WAIT_S = 2.0


def _abandon(proc: subprocess.Popen[str]) -> None:
    """Kill perf and wait briefly; one stuck in the kernel is left to exit on its own."""
    proc.kill()
    try:
        proc.communicate(timeout=1.0)
    except subprocess.TimeoutExpired:
        pass
