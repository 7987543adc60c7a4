"""Where a machine's CPU went while something ran: every process's CPU time and its
time waiting on the run queue (Linux ``/proc/<pid>/task/<tid>/schedstat``), sampled
every 0.2 s, so processes that start and end in between are counted too.

    python benchmarks/cpu_by_process.py [SECONDS] > cpu.txt &   # stop with SIGTERM
    pipetune tune job.yaml

Prints per kind of process (Dask workers forked from the fork server are one kind) the
CPU seconds run and the seconds spent runnable but waiting for a CPU, then the busiest
processes with their threads (``name:run/wait``). Run for SECONDS (default: until
SIGTERM or Ctrl-C). Linux only; no third-party imports, so it runs with any Python.
"""

from __future__ import annotations

import os
import signal
import sys
import time

_stop = False


def _on_signal(*_args: object) -> None:
    global _stop
    _stop = True


def _scan(first: dict, last: dict, cmds: dict, baseline: bool) -> None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if pid not in cmds:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmds[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")[:100]
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    run, wait = (int(x) for x in f.read().split()[:2])
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except (OSError, ValueError):
                continue
            key = (pid, tid)
            # A thread seen at the start counts from then; one born later from zero.
            first.setdefault(key, (name, run, wait) if baseline else (name, 0, 0))
            last[key] = (name, run, wait)


def main(argv: list[str]) -> int:
    limit = float(argv[0]) if argv else float("inf")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    first: dict = {}
    last: dict = {}
    cmds: dict = {}
    _scan(first, last, cmds, baseline=True)
    started = time.monotonic()
    while not _stop and time.monotonic() - started < limit:
        time.sleep(0.2)
        _scan(first, last, cmds, baseline=False)
    per_pid: dict[str, list] = {}
    for key, (name, run, wait) in last.items():
        _, run0, wait0 = first[key]
        row = per_pid.setdefault(key[0], [0.0, 0.0, []])
        d_run, d_wait = (run - run0) / 1e9, (wait - wait0) / 1e9
        row[0] += d_run
        row[1] += d_wait
        if d_run > 0.1:
            row[2].append(f"{name}:{d_run:.2f}/{d_wait:.2f}")
    kinds: dict[str, list] = {}
    for pid, (run, wait, _threads) in per_pid.items():
        if run < 0.05:
            continue
        cmd = cmds.get(pid, "?")
        kind = "forkserver child (Dask worker, DataLoader worker)" if "forkserver" in cmd \
            else cmd[:90]
        k = kinds.setdefault(kind, [0.0, 0.0, 0])
        k[0] += run
        k[1] += wait
        k[2] += 1
    print(f"over {time.monotonic() - started:.1f} s:")
    for kind, (run, wait, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        print(f"run {run:6.2f} s  run-queue wait {wait:6.2f} s  processes {n:3d}  {kind}")
    print("busiest processes (threads as name:run/wait):")
    for pid, (run, wait, threads) in sorted(per_pid.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"  {pid} {run:.2f}/{wait:.2f} {cmds.get(pid, '?')[:60]} {threads[:6]}")
    print(f"total CPU run {sum(r for r, _, _ in per_pid.values()):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
