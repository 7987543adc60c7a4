"""Running the ``optuna-plain`` peer as the bench does: in a fresh Python process
(:func:`run_subprocess`), its result read back, its failure as one line
(:func:`failure_line`, :class:`OptunaRunFailed`; the ``ray-tune`` peer reads its own
child's failures the same way)."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from pipetune.bench.optuna_plain import STRATEGY, OptunaPlainResult

#: A line that names an exception: ``ValueError: ...`` or ``pkg.mod.SomeError: ...`` as
#: a traceback ends, or a bare ``KeyboardInterrupt``.
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*(?:\w*(?:Error|Exception|Interrupt|Exit|Failure)|Broken\w*)"
    r"(?::|$)")


def failure_line(stderr: str, limit: int = 300, strategy: str = STRATEGY) -> str:
    """The line of a failed child's ``stderr`` that says what went wrong: the last one
    naming an exception (how a traceback ends) or the strategy's own ``<strategy>: ...``
    refusal, else the last line; cut at ``limit`` characters.

    >>> failure_line("Traceback (most recent call last):\\n  ...\\nZeroDivisionError: x\\n")
    'ZeroDivisionError: x'
    """
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    pick = next((line for line in reversed(lines)
                 if _EXCEPTION_LINE.match(line) or line.startswith(f"{strategy}: ")),
                lines[-1] if lines else "nothing on stderr")
    return pick if len(pick) <= limit else pick[: limit - 3].rstrip() + "..."


class OptunaRunFailed(RuntimeError):
    """The ``optuna-plain`` child process failed: ``exit_code`` (negative: killed by that
    signal), ``reason`` (one line, :func:`failure_line`), ``stderr_tail`` (its last
    2000 characters)."""

    def __init__(self, exit_code: int, stderr: str):
        self.exit_code = exit_code
        self.reason = failure_line(stderr)
        self.stderr_tail = stderr.strip()[-2000:]
        super().__init__(f"{STRATEGY} run failed (exit {exit_code}): {self.stderr_tail}")

    def __reduce__(self):
        return (type(self), (self.exit_code, self.stderr_tail))



def run_subprocess(
    job_path: str | Path,
    *,
    trials: int | None = None,
    n_jobs: int | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> OptunaPlainResult:
    """Run :func:`main` in a fresh Python process and read its result back.

    ``process_wall_s`` then counts from just before the process is spawned (interpreter
    start and every import included). Raises :class:`OptunaRunFailed` (a
    :class:`RuntimeError` with the child's stderr tail and, as ``reason``, the one line
    that says what went wrong) when it fails.
    """
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pipetune-optuna-plain-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "pipetune.bench.optuna_plain", str(job_path),
               "--json", str(out)]
        if trials is not None:
            cmd += ["--trials", str(trials)]
        if n_jobs is not None:
            cmd += ["--jobs", str(n_jobs)]
        cmd += ["--started", repr(time.time())]
        proc = subprocess.run(  # noqa: S603 - our own interpreter and module
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ if env is None else env),
            check=False,
        )
        if proc.returncode != 0 or not out.exists():
            raise OptunaRunFailed(proc.returncode, proc.stderr)
        return OptunaPlainResult.from_dict(json.loads(out.read_text(encoding="utf-8")))
