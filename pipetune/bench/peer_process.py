"""Running the ``optuna-plain`` peer as the bench does: in a fresh Python process
(:func:`run_subprocess`), its result read back, its failure as one line
(:func:`failure_line`, :class:`OptunaRunFailed`; :mod:`pipetune.bench.peers` holds what
the ``ray-tune`` peer shares)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from pipetune.bench.optuna_plain import STRATEGY, OptunaPlainResult
from pipetune.bench.peers import PeerRunFailed, failure_line, run_child

__all__ = ["OptunaRunFailed", "failure_line", "run_subprocess"]


class OptunaRunFailed(PeerRunFailed):
    """The ``optuna-plain`` child process failed (:class:`PeerRunFailed`)."""

    strategy: ClassVar[str] = STRATEGY


def run_subprocess(
    job_path: str | Path,
    *,
    trials: int | None = None,
    n_jobs: int | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> OptunaPlainResult:
    """Run :func:`~pipetune.bench.optuna_plain.main` in a fresh Python process and read
    its result back.

    ``process_wall_s`` then counts from just before the process is spawned (interpreter
    start and every import included). Raises :class:`OptunaRunFailed` (a
    :class:`RuntimeError` with the child's stderr tail and, as ``reason``, the one line
    that says what went wrong) when it fails.
    """
    proc, data = run_child("pipetune.bench.optuna_plain", job_path, trials=trials,
                           n_jobs=n_jobs, timeout=timeout, env=env)
    if proc.returncode != 0 or data is None:
        raise OptunaRunFailed(proc.returncode, proc.stderr)
    return OptunaPlainResult.from_dict(data)
