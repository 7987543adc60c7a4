"""Ray's own processes around a ``ray-tune`` run: a session folder short enough for the
Unix sockets Ray opens under it, and every process Ray started stopped after the run,
so the next strategy of a bench gets the cores."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any


def ray_temp_dir(root: Path) -> str | None:
    """A folder for Ray's session files inside ``root``, or None (Ray's own default)
    where the path is too long for the Unix sockets Ray opens under it."""
    path = root / "ray"
    return str(path) if len(str(path)) <= 48 else None


def descendants() -> list[Any]:
    import psutil

    return psutil.Process().children(recursive=True)


def is_ray(proc: Any) -> bool:
    import psutil

    try:
        text = " ".join([proc.name(), *proc.cmdline()])
    except psutil.Error:
        return False
    return any(mark in text for mark in ("raylet", "gcs_server", "ray::", "/ray/"))


def shutdown(ray: Any, before: set[int], grace_s: float = 10.0) -> None:
    """``ray.shutdown()``, then wait up to ``grace_s`` for the processes Ray started
    (descendants not in ``before``: its raylet, GCS and trial workers, which otherwise
    outlive the driver by a few seconds) to end, and kill those still there: the next
    strategy gets the cores."""
    import psutil

    started = [p for p in descendants() if p.pid not in before and is_ray(p)]
    ray.shutdown()
    _, alive = psutil.wait_procs(started, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5.0)
