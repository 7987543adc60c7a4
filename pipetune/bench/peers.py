"""What the bench's peers share (``optuna-plain``, ``ray-tune``: a user's alternative to
pipetune, run on the same job): the shape of their result, running one in a fresh
Python process with its result read back, its command line, and a failed child's one
line."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from pipetune.spec import JobSpec

#: A line that names an exception: ``ValueError: ...`` or ``pkg.mod.SomeError: ...`` as
#: a traceback ends, or a bare ``KeyboardInterrupt``.
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*(?:\w*(?:Error|Exception|Interrupt|Exit|Failure)|Broken\w*)"
    r"(?::|$)")


def failure_line(stderr: str, limit: int = 300, strategy: str = "optuna-plain") -> str:
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


class PeerRunFailed(RuntimeError):
    """A peer's child process failed: ``exit_code`` (negative: killed by that signal),
    ``reason`` (one line, :func:`failure_line`), ``stderr_tail`` (its last 2000
    characters). Each peer names itself in :attr:`strategy`."""

    strategy: ClassVar[str] = "peer"

    def __init__(self, exit_code: int, stderr: str):
        self.exit_code = exit_code
        self.reason = failure_line(stderr, strategy=self.strategy)
        self.stderr_tail = stderr.strip()[-2000:]
        super().__init__(f"{self.strategy} run failed (exit {exit_code}): {self.stderr_tail}")

    def __reduce__(self):
        return (type(self), (self.exit_code, self.stderr_tail))


@dataclass(frozen=True)
class PeerTrialRow:
    """One trial of a peer: ``number`` (0, 1, ...; pipetune's ``trial_id``), its
    ``params``, ``epochs`` trained, ``value`` (the objective after its last epoch, None
    when it trained none) and ``state`` (``COMPLETE``, ``PRUNED`` or ``FAIL``)."""

    number: int
    params: dict[str, Any]
    epochs: int
    value: float | None
    state: str
    seed: int
    duration_s: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class PeerResult:
    """What a peer's run did.

    ``tuning_wall_s``: wall time of the tuning call alone. ``process_wall_s``: from the
    caller's start time (in a fresh process, its module's import or ``--started``) to
    the end, so imports count. ``best_value`` / ``best_params``: the best *completed*
    trial (None when none completed). ``epochs_run``: epochs trained, summed over
    trials. ``cores``: usable cores detected; ``n_jobs``: trials run at once.
    """

    #: The type of :attr:`rows`, read back by :meth:`from_dict`.
    row_type: ClassVar[type[PeerTrialRow]] = PeerTrialRow

    job: str
    metric: str
    mode: str
    tuning_wall_s: float
    process_wall_s: float
    best_value: float | None
    best_params: dict[str, Any] | None
    best_trial: int | None
    trials: int
    completed: int
    pruned: int
    failed: int
    epochs_run: int
    max_epochs: int
    cores: int
    n_jobs: int
    threads_per_trial: int = 1
    sampler: str = ""
    pruner: str = ""
    strategy: str = ""
    rows: list[PeerTrialRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data, ``rows`` last; :meth:`from_dict` reads it back."""
        data = asdict(self)
        data["rows"] = data.pop("rows")
        return data

    @classmethod
    def of_rows(cls, spec: JobSpec, rows: list[PeerTrialRow], *, tuning_wall_s: float,
                started: float, cores: int, n_jobs: int, best: PeerTrialRow | None = None,
                **described: Any) -> Any:
        """The result of a run of ``spec`` whose trials were ``rows``, ended now.
        ``best``: the peer's own best trial; default the best ``COMPLETE`` row (ties to
        the earlier trial, as Optuna's ``best_trial``). ``described``: ``sampler``,
        ``pruner`` and a peer's own fields."""
        states = [r.state for r in rows]
        if best is None:
            done = [r for r in rows if r.state == "COMPLETE" and r.value is not None]
            sign = 1.0 if spec.objective.mode == "max" else -1.0
            best = max(done, key=lambda r: (sign * r.value, -r.number)) if done else None
        return cls(
            job=spec.name, metric=str(spec.objective.metric), mode=spec.objective.mode,
            tuning_wall_s=tuning_wall_s, process_wall_s=time.time() - started,
            best_value=float(best.value) if best is not None and best.value is not None
            else None,
            best_params=dict(best.params) if best is not None else None,
            best_trial=best.number if best is not None else None,
            trials=len(rows), completed=states.count("COMPLETE"),
            pruned=states.count("PRUNED"), failed=states.count("FAIL"),
            epochs_run=sum(r.epochs for r in rows),
            max_epochs=spec.early_stopping.max_epochs, cores=cores, n_jobs=n_jobs,
            rows=rows, **described)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        values = dict(data)
        values["rows"] = [cls.row_type(**row) for row in values.get("rows", [])]
        return cls(**values)


def run_child(module: str, job_path: str | Path, *, trials: int | None = None,
              n_jobs: int | None = None, timeout: float | None = None,
              env: Mapping[str, str] | None = None,
              ) -> tuple[subprocess.CompletedProcess, dict[str, Any] | None]:
    """``python -m <module> JOB --json OUT ...`` in a fresh Python process, started
    now (``--started``: its ``process_wall_s`` counts interpreter start and imports);
    the finished process and the JSON it wrote (None when it wrote none)."""
    with tempfile.TemporaryDirectory(prefix=f"pipetune-{module.rsplit('.', 1)[-1]}-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", module, str(job_path), "--json", str(out)]
        if trials is not None:
            cmd += ["--trials", str(trials)]
        if n_jobs is not None:
            cmd += ["--jobs", str(n_jobs)]
        cmd += ["--started", repr(time.time())]
        proc = subprocess.run(  # noqa: S603 - our own interpreter and module
            cmd, capture_output=True, text=True, timeout=timeout,
            env=dict(os.environ if env is None else env), check=False)
        data = json.loads(out.read_text(encoding="utf-8")) if out.exists() else None
    return proc, data


def child_arguments(module: str, description: str,
                    argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line of a peer's child: ``python -m <module> JOB [--trials N]
    [--jobs N] [--json OUT] [--started EPOCH_SECONDS]``."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("job", help="job file (YAML or JSON), read with pipetune.spec.load_spec")
    parser.add_argument("--trials", type=int, default=None, help="default: search.trials")
    parser.add_argument("--jobs", type=int, default=None, help="trials at once (default: cores)")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the JSON here")
    parser.add_argument(
        "--started", type=float, default=None,
        help="time.time() stamp process_wall_s counts from (default: module import)",
    )
    return parser.parse_args(list(sys.argv[1:] if argv is None else argv))


def print_result(result: PeerResult, json_out: str | None) -> None:
    """``result`` as JSON on stdout, and in ``json_out`` when given."""
    text = json.dumps(result.to_dict(), indent=2, allow_nan=False)
    if json_out:
        Path(json_out).write_text(text + "\n", encoding="utf-8")
    print(text)
