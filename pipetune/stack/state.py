"""The stack's record, ``<dir>/stack.json``: reading and writing it, the folder's lock,
which components still run (``status``) and the environment a user exports (``env``).

No process is started here: :mod:`pipetune.stack.components` launches them,
:mod:`pipetune.stack.lifecycle` orders them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetune.dask.address import TLS_ENV
from pipetune.errors import PipetuneError
from pipetune.stack import _proc

STACK_FILE = "stack.json"
FORMAT_VERSION = 1
WORK_POOL = "pipetune"
#: Flow runs the work pool runs at once.
WORK_POOL_CONCURRENCY = 1
DATABASES = ("prefect", "mlflow", "pipetune")
#: Where studies keep their checkpoints on a stack: as artifacts of their MLflow run,
#: through the tracking server's artifact proxy (see
#: :func:`pipetune.checkpoints.resolve_checkpoint_root`).
CHECKPOINTS = "mlflow"
#: The environment a user exports to use the stack, in the order it is printed.
ENV_KEYS = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PIPETUNE_DASK_ADDRESS",
            "PIPETUNE_GROUNDTRUTH", "PIPETUNE_CHECKPOINTS")
#: Stop order is the reverse of this (Dask workers first, PostgreSQL last); stack.json
#: lists the components in this order.
ORDER = ("postgres", "prefect-server", "prefect-worker", "mlflow", "dask-scheduler",
         "dask-worker")


def default_dir() -> Path:
    """``<$PIPETUNE_HOME or ~/.pipetune>/stack``."""
    raw = os.environ.get("PIPETUNE_HOME", "").strip()
    home = Path(raw).expanduser() if raw else Path.home() / ".pipetune"
    return home / "stack"


@dataclass
class ComponentStatus:
    name: str
    pid: int | None
    alive: bool
    url: str | None
    log: str | None


def rank(c: dict[str, Any]) -> int:
    """The position of component ``c`` in :data:`ORDER`."""
    name = c["name"]
    for i, prefix in enumerate(ORDER):
        if name == prefix or name.startswith(prefix + "-"):
            return i
    return len(ORDER)


# -- reading and writing stack.json -------------------------------------------------------


def load(directory: Path | str) -> dict[str, Any] | None:
    """The stack's ``stack.json``, or None when the folder holds no stack."""
    path = Path(directory) / STACK_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise PipetuneError(f"{path} is unreadable: {e}") from None


def save(directory: Path, state: dict[str, Any]) -> None:
    """Write ``stack.json`` atomically, readable by its owner only (it may hold the
    database password)."""
    path = directory / STACK_FILE
    tmp = path.with_name(f".{STACK_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=2)
        f.write("\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold the folder's lock (one ``up`` or ``down`` at a time), or fail at once."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PipetuneError(
                f"another `pipetune stack up` or `down` is working on {directory}") from None
        yield


# -- status and env -----------------------------------------------------------------------


def component_alive(c: dict[str, Any]) -> bool:
    return _proc.alive(c.get("pid"), c.get("ticks"))


def running(state: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The components of ``state`` whose process still runs."""
    return [c for c in (state or {}).get("components", []) if component_alive(c)]


def status(directory: Path | str) -> list[ComponentStatus]:
    state = load(directory)
    if state is None:
        return []
    return [ComponentStatus(c["name"], c.get("pid"), component_alive(c), c.get("url"),
                            c.get("log"))
            for c in state.get("components", [])]


def env(state: dict[str, Any]) -> dict[str, str]:
    """What a user exports to use the stack (the TLS files' paths with TLS on Dask;
    MLflow's and Prefect's credentials are the user's own, never recorded)."""
    keys = (*ENV_KEYS, *TLS_ENV.values())
    return {k: state["env"][k] for k in keys if k in state.get("env", {})}


def env_lines(state: dict[str, Any]) -> list[str]:
    """``export X=...`` lines, for ``eval "$(pipetune stack env)"``."""
    return [f"export {k}={shlex.quote(v)}" for k, v in env(state).items()]
