"""The ``perf stat`` counters read from the kernel itself (``perf_event_open(2)``).

:class:`KernelCounters` opens one counter per event on every thread of this process
(``inherit``: threads they start count too), reads and closes them at the epoch's end:
no ``perf`` process to start, attach and wait for. Measured on a 2-core VM: a profiled
epoch's profiler overhead went from 7.9 ms (``perf stat -p``, a process per epoch,
which also missed the epoch's first ~15 ms while it attached) to under a millisecond.

Values are given as ``perf stat`` prints them (:class:`~pipetune.profiler.perf.PerfCounts`:
``task-clock`` in milliseconds, the rest counts), so the two are interchangeable. Where
the kernel refuses kernel-side counting to this user (``perf_event_paranoid`` 2), the
counters count user space only, as ``perf stat`` then does. Linux on x86-64 and arm64;
elsewhere :func:`kernel_support` says None and the ``perf`` binary is used.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import sys

from pipetune.profiler.perf import HARDWARE_EVENTS, SOFTWARE_EVENTS, PerfCounts

#: perf_event_open's system call number by machine.
_SYSCALL = {"x86_64": 298, "amd64": 298, "aarch64": 241, "arm64": 241}
_HARDWARE, _SOFTWARE = 0, 1
#: Event name (as perf names it) -> (type, config), from linux/perf_event.h.
EVENTS: dict[str, tuple[int, int]] = {
    "cycles": (_HARDWARE, 0), "instructions": (_HARDWARE, 1), "cache-misses": (_HARDWARE, 3),
    "task-clock": (_SOFTWARE, 1), "page-faults": (_SOFTWARE, 2),
    "context-switches": (_SOFTWARE, 3), "cpu-migrations": (_SOFTWARE, 4),
}
_INHERIT, _EXCLUDE_KERNEL, _EXCLUDE_HV = 1 << 1, 1 << 5, 1 << 6
_FD_CLOEXEC = 8


class _Attr(ctypes.Structure):
    """``struct perf_event_attr`` up to ``PERF_ATTR_SIZE_VER5`` (112 bytes)."""

    _fields_ = [
        ("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32), ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64), ("config2", ctypes.c_uint64),
        ("branch_sample_type", ctypes.c_uint64), ("sample_regs_user", ctypes.c_uint64),
        ("sample_stack_user", ctypes.c_uint32), ("clockid", ctypes.c_int32),
        ("sample_regs_intr", ctypes.c_uint64), ("aux_watermark", ctypes.c_uint32),
        ("sample_max_stack", ctypes.c_uint16), ("reserved_2", ctypes.c_uint16),
    ]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _open(event: str, tid: int, flags: int) -> tuple[int, int]:
    """``(fd, 0)``, or ``(-1, errno)``."""
    libc, number = _libc(), _SYSCALL.get(platform.machine().lower())
    if libc is None or number is None:
        return -1, errno.ENOSYS
    kind, config = EVENTS[event]
    attr = _Attr(type=kind, size=ctypes.sizeof(_Attr), config=config, flags=flags)
    fd = libc.syscall(number, ctypes.byref(attr), tid, -1, -1, _FD_CLOEXEC)
    return (fd, 0) if fd >= 0 else (-1, ctypes.get_errno())


@functools.cache
def _flags() -> int:
    """The counters' flags: inherited by new threads; user space only where this user
    may not count the kernel's side (asked once, on task-clock)."""
    fd, code = _open("task-clock", 0, _INHERIT)
    if fd >= 0:
        os.close(fd)
        return _INHERIT
    refused = code in (errno.EACCES, errno.EPERM)
    return _INHERIT | (_EXCLUDE_KERNEL | _EXCLUDE_HV if refused else 0)


@functools.cache
def kernel_support() -> str | None:
    """``"hardware"`` if the kernel counts this process's hardware events for this user,
    ``"software"`` if only software events, None if it counts none (or this is not
    Linux on a machine this module knows)."""
    found = []
    for event in ("task-clock", "cycles"):
        fd, _ = _open(event, 0, _flags())
        if fd >= 0:
            os.close(fd)
            found.append(event)
    if "task-clock" not in found:
        return None
    return "hardware" if "cycles" in found else "software"


class KernelCounters:
    """The :class:`~pipetune.profiler.perf.PerfSession` interface over kernel counters
    on every thread of this process (``pid`` must be this process's)."""

    def __init__(self, pid: int, level: str) -> None:
        if level not in ("hardware", "software"):
            raise ValueError(f"level must be 'hardware' or 'software', got {level!r}")
        if pid != os.getpid():
            raise ValueError("kernel counters count this process only")
        self.level = level
        self._fds: dict[str, list[int]] = {}
        self.unsupported: set[str] = set()

    #: No process of its own (the profiler excludes a perf process from the epoch's use).
    perf_pid = None

    @property
    def events(self) -> tuple[str, ...]:
        return (HARDWARE_EVENTS if self.level == "hardware" else ()) + SOFTWARE_EVENTS

    def start(self) -> bool:
        """Open the counters on every thread now; False if none could be."""
        try:
            threads = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            return False
        for event in self.events:
            for tid in threads:
                fd, code = _open(event, tid, _flags())
                if fd >= 0:
                    self._fds.setdefault(event, []).append(fd)
                elif code != errno.ESRCH:  # a thread that ended meanwhile is no loss
                    self.unsupported.add(event)
        return bool(self._fds)

    def interrupt(self) -> None:
        """Nothing to ask: the counts are read by :meth:`stop`."""

    def stop(self) -> PerfCounts | None:
        """Every event's total over the threads, as ``perf stat`` prints it; None when
        none was counted. The counters are closed."""
        values: dict[str, float] = {}
        fds, self._fds = self._fds, {}
        for event, opened in fds.items():
            total = 0
            for fd in opened:
                try:
                    total += int.from_bytes(os.read(fd, 8), sys.byteorder)
                except OSError:
                    pass
                finally:
                    os.close(fd)
            values[event] = total / 1e6 if event == "task-clock" else float(total)
        unsupported = frozenset(self.unsupported - set(values))
        return PerfCounts(values, unsupported) if values else None

    def kill(self) -> None:
        """Close the counters unread (the epoch failed)."""
        fds, self._fds = self._fds, {}
        for opened in fds.values():
            for fd in opened:
                os.close(fd)
