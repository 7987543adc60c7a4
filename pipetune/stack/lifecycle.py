"""``up`` and ``down`` of the team stack in one folder: in which order the components
start (side by side where nothing waits on another) and stop.

Every component is a command line started detached (a session of its own), with
``<dir>/logs/<name>.log`` and ``<dir>/run/<name>.pid``; ``<dir>/stack.json`` (mode 0600)
records what ran, where and how long it took to start. How each one is launched is
:mod:`pipetune.stack.components`; the record is :mod:`pipetune.stack.state`.
"""

from __future__ import annotations

import shlex
import signal
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipetune.errors import PipetuneError
from pipetune.stack import _proc
from pipetune.stack.components import Launcher
from pipetune.stack.doors import Doors
from pipetune.stack.state import (
    STACK_FILE,
    component_alive,
    default_dir,
    load,
    locked,
    rank,
    running,
    save,
)


def up(directory: Path | str | None = None, *, host: str = "127.0.0.1", workers: int = 2,
       cores_per_worker: int = 1, timeout: float = 180.0,
       echo: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Start the stack in ``directory`` and return its ``stack.json`` content.

    PostgreSQL first; then the Prefect server, MLflow and the Dask scheduler side by
    side; the Dask workers once the scheduler answers, the Prefect worker and the work
    pool once the Prefect server does. Each may take at most ``timeout`` seconds to
    become healthy; if one fails, those already started are stopped and a
    :class:`~pipetune.errors.PipetuneError` carries the end of its log. Refused if a
    stack already runs in ``directory``.
    """
    if workers < 1:
        raise PipetuneError("--workers must be at least 1")
    if cores_per_worker < 1:
        raise PipetuneError("--cores-per-worker must be at least 1")
    directory = Path(directory).expanduser().absolute() if directory else default_dir()
    say = echo or (lambda _m: None)
    doors = Doors.from_env()
    with locked(directory):
        old = load(directory)
        alive = running(old)
        if alive:
            names = ", ".join(f"{c['name']} (pid {c['pid']})" for c in alive)
            raise PipetuneError(
                f"a stack is already running in {directory}: {names}; stop it with "
                f"`pipetune stack down --dir {shlex.quote(str(directory))}` first")
        return _start(Launcher(directory, host, workers, cores_per_worker, timeout, say, old,
                               doors))


def _start(launcher: Launcher) -> dict[str, Any]:
    state = launcher.state
    launcher.dir.mkdir(parents=True, exist_ok=True)
    for name in ("postgres", "prefect", "mlflow", "dask-scheduler"):
        state["ports"][name] = launcher.port(name)
    t0 = time.monotonic()
    try:
        launcher.postgres()
        launcher.addresses()
        # The three servers boot side by side (each needs PostgreSQL at most).
        prefect = launcher.prefect_server()
        mlflow = launcher.mlflow()
        scheduler = launcher.dask_scheduler()
        launcher.wait(scheduler)  # the quickest
        dask_workers = launcher.dask_workers()
        launcher.wait(prefect)
        # The worker boots while the pool is created (had it been first, it would have
        # created the pool itself, and the limit is then set on it).
        prefect_worker = launcher.prefect_worker()
        launcher.work_pool()
        launcher.wait(mlflow, prefect_worker, *dask_workers)
        first = min(p.started for p in dask_workers)
        last = max(p.healthy_at or first for p in dask_workers)
        state["startup_s"]["dask-workers"] = round(last - first, 2)
    except BaseException:
        state["state"] = "failed"
        launcher.say("stopping what had started ...")
        stop_all(state, launcher.dir)
        save(launcher.dir, state)
        raise
    finally:
        launcher.close()
    state["startup_s"]["total"] = round(time.monotonic() - t0, 2)
    state["state"] = "running"
    launcher.save()
    return state


def down(directory: Path | str | None = None, *, grace: float = 10.0,
         echo: Callable[[str], None] | None = None) -> list[tuple[str, int | None, bool]]:
    """Stop every component of the stack in ``directory``, in reverse order: SIGTERM
    (SIGINT for PostgreSQL: a fast shutdown), then SIGKILL after ``grace`` seconds.
    Returns ``(name, pid, stopped)`` per component; ``stack.json`` stays, marked stopped
    (a later ``up`` reuses its ports and data)."""
    directory = Path(directory).expanduser().absolute() if directory else default_dir()
    say = echo or (lambda _m: None)
    with locked(directory):
        state = load(directory)
        if state is None:
            state = {"components": []}
        _adopt_pid_files(state, directory)
        done = stop_all(state, directory, grace=grace, say=say)
        if (directory / STACK_FILE).exists():
            state["state"] = "stopped"
            state["stopped_at"] = datetime.now(UTC).isoformat(timespec="seconds")
            save(directory, state)
        return done


def _adopt_pid_files(state: dict[str, Any], directory: Path) -> None:
    """PID files with no entry in stack.json (an ``up`` killed between the two writes)."""
    known = {c.get("pid_file") for c in state.get("components", [])}
    for pid_file in sorted((directory / "run").glob("*.pid")):
        if str(pid_file) in known:
            continue
        pid = _proc.read_pid(pid_file)
        if pid and _proc.alive(pid):
            name = pid_file.stem
            state["components"].append({
                "name": name, "pid": pid, "ticks": None, "pid_file": str(pid_file),
                "stop_signal": "SIGINT" if name == "postgres" else "SIGTERM",
                "group": name != "postgres"})


def stop_all(state: dict[str, Any], directory: Path, grace: float = 10.0,
             say: Callable[[str], None] = lambda _m: None) -> list[tuple[str, int | None, bool]]:
    """Stop in reverse start order; the components of one kind (the Dask workers) at
    once."""
    comps = list(state.get("components", []))
    results: list[tuple[str, int | None, bool]] = []
    for r in sorted({rank(c) for c in comps}, reverse=True):
        wave = [c for c in comps if rank(c) == r]
        outcome: dict[str, bool] = {}

        def stop_one(c: dict[str, Any], outcome: dict[str, bool] = outcome) -> None:
            was = component_alive(c)
            sig = getattr(signal, c.get("stop_signal") or "SIGTERM")
            t0 = time.monotonic()
            outcome[c["name"]] = _proc.stop(c.get("pid"), ticks=c.get("ticks"), sig=sig,
                                            grace=grace, group=c.get("group", True))
            if was:
                took = time.monotonic() - t0
                say(f"  stopped {c['name']} (pid {c.get('pid')}, {took:.1f} s)"
                    if outcome[c["name"]] else f"  could not stop {c['name']} (pid {c.get('pid')})")

        threads = [threading.Thread(target=stop_one, args=(c,)) for c in wave]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in wave:
            results.append((c["name"], c.get("pid"), outcome.get(c["name"], False)))
            if outcome.get(c["name"]) and c.get("pid_file"):
                Path(c["pid_file"]).unlink(missing_ok=True)
    return results
