"""What this process (and its child processes) used: CPU time, context switches, faults.

The profiler and the CPU-based energy estimate both need "CPU seconds of the training
process", and training often spreads over child processes (DataLoader workers). A
:class:`UsageSnapshot` adds three parts, so that a delta between two snapshots counts
every child exactly once:

* ``getrusage(RUSAGE_SELF)``: every thread of this process;
* ``getrusage(RUSAGE_CHILDREN)``: children that have exited and been waited for (the
  usual fate of DataLoader workers at the end of an epoch);
* live descendants read from ``/proc`` (persistent workers). A live child seen in the
  first snapshot and reaped before the second has its whole life in the
  ``RUSAGE_CHILDREN`` delta, so its first reading is subtracted.

Limits: context switches of a *live* child are those of its main thread (what
``/proc/<pid>/status`` reports); a grandchild reaped by a child that is still alive is
not seen.
"""

from __future__ import annotations

import functools
import os
import resource
from dataclasses import dataclass, field

#: Clock ticks per second for ``/proc/<pid>/stat`` times.
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Usage:
    """Resource counters of a process tree, cumulative or as a delta."""

    cpu_s: float = 0.0
    ctx_voluntary: int = 0
    ctx_involuntary: int = 0
    minor_faults: int = 0
    major_faults: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.cpu_s + other.cpu_s,
            self.ctx_voluntary + other.ctx_voluntary,
            self.ctx_involuntary + other.ctx_involuntary,
            self.minor_faults + other.minor_faults,
            self.major_faults + other.major_faults,
        )

    def __sub__(self, other: Usage) -> Usage:
        return Usage(
            self.cpu_s - other.cpu_s,
            self.ctx_voluntary - other.ctx_voluntary,
            self.ctx_involuntary - other.ctx_involuntary,
            self.minor_faults - other.minor_faults,
            self.major_faults - other.major_faults,
        )

    @property
    def ctx_switches(self) -> int:
        return self.ctx_voluntary + self.ctx_involuntary

    @property
    def page_faults(self) -> int:
        return self.minor_faults + self.major_faults


@dataclass(frozen=True)
class UsageSnapshot:
    """Cumulative usage of this process, its reaped children and its live descendants."""

    own: Usage
    reaped: Usage
    live: dict[tuple[int, float], Usage] = field(default_factory=dict)

    def total(self) -> Usage:
        out = self.own + self.reaped
        for u in self.live.values():
            out = out + u
        return out


def _rusage(who: int) -> Usage:
    r = resource.getrusage(who)
    return Usage(r.ru_utime + r.ru_stime, r.ru_nvcsw, r.ru_nivcsw, r.ru_minflt, r.ru_majflt)


def _proc_usage(pid: int) -> Usage | None:
    """Usage of a live process from /proc (all its threads), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        # The command name may hold spaces and parentheses: split after the last ')'.
        rest = stat[stat.rindex(")") + 2 :].split()
        # Fields counted from 'state' (field 3 in proc(5)): minflt=10, majflt=12,
        # utime=14, stime=15.
        minflt, majflt = int(rest[7]), int(rest[9])
        cpu = (int(rest[11]) + int(rest[12])) / _TICKS
        vol = invol = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    invol = int(line.split()[1])
        return Usage(cpu, vol, invol, minflt, majflt)
    except (OSError, ValueError, IndexError):
        return None


def _proc_children() -> dict[tuple[int, float], Usage] | None:
    """Every live descendant of this process, keyed ``(pid, start time)``, from each
    thread's ``/proc/<pid>/task/<tid>/children`` (Linux 3.5+); None where the kernel
    keeps no such file. psutil's ``children`` reads the ``stat`` file of every process
    on the machine instead: measured here, 1.0 ms with 70 processes, twice per epoch,
    and more on a machine running many workers."""
    if not _children_files():
        return None
    out: dict[tuple[int, float], Usage] = {}
    stack = [os.getpid()]
    while stack:
        pid = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # ended meanwhile
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    found = f.read().split()
            except OSError:
                continue  # the thread or process ended meanwhile
            for child in map(int, found):
                stack.append(child)
                started = _start_ticks(child)
                usage = _proc_usage(child)
                if started is not None and usage is not None:
                    out[(child, started)] = usage
    return out


@functools.cache
def _children_files() -> bool:
    """Whether this kernel keeps ``/proc/<pid>/task/<tid>/children`` (asked once, so
    every snapshot of a process keys its children the same way)."""
    return os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _start_ticks(pid: int) -> float | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return float(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _live_children(exclude: frozenset[int]) -> dict[tuple[int, float], Usage]:
    fast = _proc_children()
    if fast is not None:
        return {key: u for key, u in fast.items() if key[0] not in exclude}
    import psutil

    out: dict[tuple[int, float], Usage] = {}
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return out
    for child in children:
        if child.pid in exclude:
            continue
        try:
            key = (child.pid, child.create_time())
        except psutil.Error:
            continue
        u = _proc_usage(child.pid)
        if u is None:
            try:
                t = child.cpu_times()
                c = child.num_ctx_switches()
                u = Usage(t.user + t.system, c.voluntary, c.involuntary)
            except psutil.Error:
                continue
        out[key] = u
    return out


def snapshot(exclude: frozenset[int] = frozenset()) -> UsageSnapshot:
    """Read the cumulative usage of this process tree now (a few milliseconds).

    Live children whose pid is in ``exclude`` are left out (the profiler's own ``perf``
    process); exclude only children that outlive the second snapshot, as a reaped child
    lands in ``RUSAGE_CHILDREN`` whatever it was.
    """
    return UsageSnapshot(
        own=_rusage(resource.RUSAGE_SELF),
        reaped=_rusage(resource.RUSAGE_CHILDREN),
        live=_live_children(exclude),
    )


def usage_between(before: UsageSnapshot, after: UsageSnapshot) -> Usage:
    """What the process tree used between two snapshots, each child counted once."""
    delta = (after.own - before.own) + (after.reaped - before.reaped)
    for key, u in after.live.items():
        delta = delta + (u - before.live.get(key, Usage()))
    for key, u in before.live.items():
        if key not in after.live:
            delta = delta - u
    return delta


def thread_cpu_wait_s() -> float | None:
    """Seconds this thread has spent ready to run but waiting for a CPU (Linux
    ``/proc/thread-self/schedstat``, second field, in ns); None where it is not kept.

    A delta over an epoch is the time the machine's other work took from it: on a
    shared machine an epoch's wall time is its own cost plus this wait, and the wait
    belongs to the neighbours, not to the system config under test.
    """
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def process_cpu_seconds() -> float:
    """Cumulative CPU seconds (user + system) of this process tree, as :func:`snapshot`."""
    return snapshot().total().cpu_s


# -- peak resident memory --------------------------------------------------------------
def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (Linux ``clear_refs``), so the next
    :func:`peak_rss_mb` covers only what follows. Returns False where not possible.

    This also lowers what ``getrusage(RUSAGE_SELF).ru_maxrss`` reports afterwards.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (``VmHWM``; ``ru_maxrss`` elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    # ru_maxrss is KiB on Linux, bytes on macOS.
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if os.uname().sysname == "Darwin" else maxrss / 1024
