"""What the team-stack tests share: skipping where PostgreSQL is missing, running
``pipetune stack``, and a stack folder that is always stopped and removed."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def skip_without_postgres(*, psycopg: bool = False) -> None:
    """Skip the test, saying why, where no PostgreSQL server can be started (or, with
    ``psycopg``, where its Python driver is missing)."""
    from pipetune.errors import PipetuneError
    from pipetune.stack.postgres import find_binary

    try:
        find_binary("initdb")
    except PipetuneError as e:
        pytest.skip(str(e))
    if psycopg and importlib.util.find_spec("psycopg") is None:
        pytest.skip("MLflow on PostgreSQL needs psycopg: pip install 'psycopg[binary]>=3.2'")


def run_stack(*args: str, timeout: float = 600,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m pipetune stack ARGS``, its output captured (in ``env``, else ours)."""
    return subprocess.run([sys.executable, "-m", "pipetune", "stack", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


@contextlib.contextmanager
def stack_folder(prefix: str) -> Iterator[Path]:
    """A fresh stack folder; whatever happens, the stack in it is stopped (by PID, with
    ``stack down``) and its data removed at the end."""
    directory = Path(tempfile.mkdtemp(prefix=prefix)) / "stack"
    try:
        yield directory
    finally:
        if directory.exists():
            run_stack("down", "--dir", str(directory), "--grace", "5", timeout=180)
            from pipetune.stack import Postgres

            Postgres(directory / "postgres").remove()
        shutil.rmtree(directory.parent, ignore_errors=True)
