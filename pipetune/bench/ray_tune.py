"""Strategy ``ray-tune``: what a Ray Tune user would write instead of pipetune.

The peer of ``optuna-plain`` (:mod:`pipetune.bench.optuna_plain`): the *same* workload code a
pipetune job runs, tuned by ``ray.tune.Tuner`` with ``OptunaSearch`` (TPE seeded with
``search.seed``, the space drawn with the same ``trial.suggest_*`` calls) and
``ASHAScheduler`` (``max_t`` = ``early_stopping.max_epochs``, ``grace_period`` =
``min_epochs``, the job's ``reduction_factor``; ``policy: none`` -> no scheduler),
``num_samples`` = ``search.trials``, ``max_concurrent_trials`` = the machine's cores,
one CPU per trial (``tune.with_resources``) and one torch thread in each. As for
optuna-plain, the search is TPE whatever ``search.algorithm`` says. No Prefect, Dask,
MLflow, profiler, system tuner or checkpoints.

Each trial is a function trainable that builds its workload as optuna-plain does
(``resolve_workload(name)(**params)``, ``setup(hparams, seed)`` with the seed formula
of :mod:`pipetune.engine.study`, the trial number being Optuna's), then per epoch
``train_epoch(system)`` and ``evaluate(system)`` under ``system.default`` and
``tune.report({<metric>: value, "epoch": n})``. A trial ASHA stops before
``max_epochs`` is ``PRUNED``; one that trained them all ``COMPLETE``; one that raised
(or whose metric is not finite) ``FAIL``. System knobs are never tuned: a space holding
``system.<knob>`` entries is a :class:`ValueError`.

Ray is an optional extra (``pip install 'pipetune[peers]'``). Without it the strategy
is skipped with one line, :func:`unavailable` says so before anything starts, and the
rest of a bench runs.

Run in a fresh process for an honest whole-process time (imports, ``ray.init`` and
Ray's worker processes included)::

    python -m pipetune.bench.ray_tune JOB.yaml [--trials N] [--jobs N] [--json OUT]
                                               [--started EPOCH_SECONDS]

It prints :meth:`RayTuneResult.to_dict` as JSON on stdout: the shape of
:class:`pipetune.bench.optuna_plain.OptunaPlainResult` (``n_jobs``: trials at once), so
``pipetune.bench.result_from_optuna(result, "ray-tune")`` reads it into the bench. It
exits 3 with the one skip line on stderr when Ray Tune cannot be imported, 2 on a bad
job. :func:`run_subprocess` does all of this and reads the result back.
"""

from __future__ import annotations

import time

#: When this module started importing: ``main`` measures ``process_wall_s`` from here
#: (or from ``--started``), so heavy imports below it are part of the process time.
_MODULE_STARTED = time.time()

import contextlib  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any, ClassVar  # noqa: E402

from pipetune.bench.optuna_plain import check_space as _optuna_check_space  # noqa: E402
from pipetune.bench.optuna_plain import suggest, trial_seed  # noqa: E402
from pipetune.bench.peers import (  # noqa: E402
    PeerResult,
    PeerRunFailed,
    PeerTrialRow,
    child_arguments,
    print_result,
    run_child,
)
from pipetune.bench.peers import failure_line as _failure_line  # noqa: E402
from pipetune.bench.ray_runtime import descendants, ray_temp_dir, shutdown  # noqa: E402

if TYPE_CHECKING:
    from pipetune.spec import JobSpec

STRATEGY = "ray-tune"
#: torch intra-op threads per trial, and the CPUs Ray reserves for it.
THREADS_PER_TRIAL = 1
CPUS_PER_TRIAL = 1
#: What installs Ray Tune for pipetune (the optional extra in pyproject.toml).
INSTALL_HINT = "pip install 'pipetune[peers]'"
#: The one line a bench prints when Ray is not installed.
SKIP_LINE = f"{STRATEGY}: skipped (Ray Tune is not installed: {INSTALL_HINT})"
#: Exit status of ``main`` when Ray Tune cannot be imported (its skip line on stderr).
EXIT_UNAVAILABLE = 3
#: The config key the search space adds: Optuna's trial number (0, 1, ...).
TRIAL_NUMBER = "_trial_number"


@dataclass(frozen=True)
class RayTrialRow(PeerTrialRow):
    """One Ray Tune trial (:class:`~pipetune.bench.peers.PeerTrialRow`: ``number`` is
    Optuna's trial number), and Ray's ``trial_id``."""

    trial_id: str = ""


@dataclass(frozen=True)
class RayTuneResult(PeerResult):
    """What a ``ray-tune`` run did (:class:`~pipetune.bench.peers.PeerResult`), and
    ``ray_version``: ``tuning_wall_s`` is ``Tuner.fit`` alone; ``process_wall_s`` ends
    after ``ray.shutdown``."""

    row_type: ClassVar[type[PeerTrialRow]] = RayTrialRow

    threads_per_trial: int = THREADS_PER_TRIAL
    strategy: str = STRATEGY
    ray_version: str = ""


class RayTuneUnavailable(ImportError):
    """Ray Tune cannot be imported here; ``line`` is the one line to print."""

    def __init__(self, line: str = SKIP_LINE):
        self.line = line
        super().__init__(line)


class RayTuneRunFailed(PeerRunFailed):
    """The ``ray-tune`` child process failed (:class:`PeerRunFailed`)."""

    strategy: ClassVar[str] = STRATEGY


# -- is it there -----------------------------------------------------------------------


def unavailable() -> str | None:
    """None when the ``ray`` package can be found, else :data:`SKIP_LINE`. Cheap: it
    imports nothing (``main`` still refuses, exit 3, when ``ray.tune`` fails to import)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else SKIP_LINE


def _import_tune() -> Any:
    """``ray.tune`` with what this strategy uses, or :class:`RayTuneUnavailable`."""
    try:
        from ray import tune
        from ray.tune.schedulers import ASHAScheduler  # noqa: F401
        from ray.tune.search.optuna import OptunaSearch  # noqa: F401
    except ImportError as e:
        if getattr(e, "name", None) == "ray":  # not installed (or blocked in sys.modules)
            raise RayTuneUnavailable() from e
        raise RayTuneUnavailable(
            f"{STRATEGY}: skipped (Ray Tune cannot be imported: {type(e).__name__}: {e}; "
            f"{INSTALL_HINT})") from e
    return tune


# -- the pieces ------------------------------------------------------------------------


def check_space(spec: JobSpec) -> None:
    """Raise :class:`ValueError` as optuna-plain does (``system.<knob>`` entries), or
    for a hyperparameter named as the trial-number key."""
    _optuna_check_space(spec)
    if TRIAL_NUMBER in spec.hyperparameters:
        raise ValueError(f"{STRATEGY}: hyperparameter name {TRIAL_NUMBER!r} is reserved")


class SearchSpace:
    """OptunaSearch's define-by-run space: one ``suggest_*`` per hyperparameter in the
    space's order, plus Optuna's trial number under :data:`TRIAL_NUMBER` (the seed).
    A class, not a closure: Tune pickles its searcher's state."""

    def __init__(self, spec: JobSpec):
        self.space = dict(spec.hyperparameters)

    def __call__(self, trial: Any) -> dict[str, Any]:
        for name, dist in self.space.items():
            suggest(trial, name, dist)
        return {TRIAL_NUMBER: trial.number}


def train_trial(config: Mapping[str, Any], job: Mapping[str, Any]) -> None:
    """The function trainable: one trial of the job (``job``: ``JobSpec.to_dict()``),
    up to ``max_epochs`` epochs, each reported to Tune with its ``epoch``."""
    import torch
    from ray import tune

    from pipetune.spec import JobSpec
    from pipetune.system.apply import applied_context
    from pipetune.workloads import resolve_workload

    # Ray gives each trial a process of its own; it trains on one thread.
    torch.set_num_threads(THREADS_PER_TRIAL)
    spec = JobSpec.from_dict(dict(job))
    metric = str(spec.objective.metric)
    params = {name: config[name] for name in spec.hyperparameters}
    seed = trial_seed(spec, int(config[TRIAL_NUMBER]))
    system = applied_context(spec.system.default)
    workload = resolve_workload(spec.workload.name)(**spec.workload.params)
    workload.setup(params, seed)
    for epoch in range(1, spec.early_stopping.max_epochs + 1):
        workload.train_epoch(system, on_step=None)
        value = float(workload.evaluate(system)[metric])
        if not math.isfinite(value):
            raise FloatingPointError(f"{metric} is {value} after epoch {epoch}")
        tune.report({metric: value, "epoch": epoch})


def make_scheduler(spec: JobSpec) -> Any:
    """ASHA from the job's settings on the ``epoch`` the trainable reports; None (Tune's
    FIFO) for ``policy: none``."""
    from ray.tune.schedulers import ASHAScheduler

    es = spec.early_stopping
    if es.policy == "none":
        return None
    return ASHAScheduler(
        time_attr="epoch",
        metric=str(spec.objective.metric),
        mode=spec.objective.mode,
        max_t=es.max_epochs,
        grace_period=es.min_epochs,
        reduction_factor=es.reduction_factor,
    )


def _make_recorder() -> Any:
    """A Tune callback keeping each trial's config and id, in start order."""
    from ray.tune import Callback

    class TrialRecorder(Callback):
        def __init__(self) -> None:
            self.configs: dict[str, dict[str, Any]] = {}

        def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.configs.setdefault(trial.trial_id, dict(trial.config))

    return TrialRecorder()


def _error_text(error: BaseException | None) -> str | None:
    if error is None:
        return None
    return failure_line(str(error)) or type(error).__name__


def _rows(grid: Any, configs: Mapping[str, Mapping[str, Any]], spec: JobSpec) -> list[RayTrialRow]:
    metric = str(spec.objective.metric)
    max_epochs = spec.early_stopping.max_epochs
    rows = []
    for result in grid:
        metrics = dict(result.metrics or {})
        trial_id = str(metrics.get("trial_id", ""))
        config = dict(configs.get(trial_id) or result.config or {})
        number = int(config.get(TRIAL_NUMBER, -1))
        value = metrics.get(metric)
        value = float(value) if value is not None and math.isfinite(float(value)) else None
        epochs = int(metrics.get("epoch", 0) or 0)
        if result.error is not None:
            state = "FAIL"
        elif epochs >= max_epochs:
            state = "COMPLETE"
        else:
            state = "PRUNED"
        duration = metrics.get("time_total_s")
        rows.append(RayTrialRow(
            number=number,
            params={k: config[k] for k in spec.hyperparameters if k in config},
            epochs=epochs,
            value=value,
            state=state,
            seed=trial_seed(spec, number) if number >= 0 else -1,
            duration_s=float(duration) if duration is not None else None,
            error=_error_text(result.error),
            trial_id=trial_id,
        ))
    return sorted(rows, key=lambda r: r.number)


# -- the run ---------------------------------------------------------------------------


def run_ray_tune(
    spec: JobSpec,
    *,
    n_jobs: int | None = None,
    trials: int | None = None,
    started: float | None = None,
    cores: int | None = None,
) -> RayTuneResult:
    """Tune ``spec``'s hyperparameters with Ray Tune on a local Ray instance of its own.

    ``trials`` defaults to ``search.trials``; ``cores`` to ``MachineInfo.detect().cores``;
    ``n_jobs`` (trials at once) to ``cores``. Ray is started with
    ``max(cores, n_jobs)`` CPUs on 127.0.0.1, no dashboard, and shut down before this
    returns; its results go to a temporary folder, removed after. A trial that raises
    is recorded as ``FAIL`` and the others go on. Raises :class:`RayTuneUnavailable`
    when Ray Tune cannot be imported.
    """
    import shutil
    import tempfile

    started = time.time() if started is None else started
    check_space(spec)
    trials = spec.search.trials if trials is None else trials
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if cores is None:
        from pipetune.system.config import MachineInfo

        cores = MachineInfo.detect().cores
    n_jobs = cores if n_jobs is None else n_jobs
    if n_jobs < 1:
        raise ValueError(f"n_jobs must be >= 1, got {n_jobs}")

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    tune = _import_tune()
    import optuna
    import ray
    from ray.tune.search.optuna import OptunaSearch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    metric = str(spec.objective.metric)
    searcher = OptunaSearch(
        space=SearchSpace(spec), metric=metric, mode=spec.objective.mode,
        sampler=optuna.samplers.TPESampler(seed=spec.search.seed),
    )
    recorder = _make_recorder()
    tmp = Path(tempfile.mkdtemp(prefix="pipetune-ray-"))
    # Tune prints its tables on stdout whatever its verbosity; stdout is our JSON's.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            rows, tuning_wall_s = _fit(spec, tune, ray, searcher, recorder, tmp,
                                       trials=trials, n_jobs=n_jobs, cores=cores)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _result(spec, rows, tuning_wall_s=tuning_wall_s, started=started, cores=cores,
                   n_jobs=n_jobs, ray_version=ray.__version__)


def _fit(spec: JobSpec, tune: Any, ray: Any, searcher: Any, recorder: Any, tmp: Path, *,
         trials: int, n_jobs: int, cores: int) -> tuple[list[RayTrialRow], float]:
    """Start Ray, fit, read the trials back, shut Ray down: the rows and
    ``Tuner.fit``'s seconds."""
    before = {p.pid for p in descendants()}
    ray.init(
        address="local", num_cpus=max(cores, n_jobs), include_dashboard=False,
        log_to_driver=False, configure_logging=False,
        _node_ip_address="127.0.0.1", _temp_dir=ray_temp_dir(tmp),
    )
    try:
        trainable = tune.with_resources(
            tune.with_parameters(train_trial, job=spec.to_dict()),
            {"cpu": CPUS_PER_TRIAL},
        )
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(
                search_alg=searcher, scheduler=make_scheduler(spec),
                num_samples=trials, max_concurrent_trials=n_jobs,
            ),
            run_config=tune.RunConfig(
                name=f"{STRATEGY}-{spec.name}", storage_path=str(tmp / "results"),
                verbose=0, callbacks=[recorder],
            ),
        )
        t0 = time.perf_counter()
        grid = tuner.fit()
        tuning_wall_s = time.perf_counter() - t0
        return _rows(grid, recorder.configs, spec), tuning_wall_s
    finally:
        shutdown(ray, before)


def _result(spec: JobSpec, rows: list[RayTrialRow], *, tuning_wall_s: float,
            started: float, cores: int, n_jobs: int, ray_version: str) -> RayTuneResult:
    es = spec.early_stopping
    scheduler_text = (
        "none"
        if es.policy == "none"
        else f"ASHA(max_t={es.max_epochs}, grace_period={es.min_epochs}, "
        f"reduction_factor={es.reduction_factor})"
    )
    return RayTuneResult.of_rows(
        spec, rows, tuning_wall_s=tuning_wall_s, started=started, cores=cores,
        n_jobs=n_jobs, sampler=f"OptunaSearch(TPE(seed={spec.search.seed}))",
        pruner=scheduler_text, ray_version=ray_version)


def failure_line(stderr: str, limit: int = 300) -> str:
    """The line of a failure's text that says what went wrong (as optuna-plain's, for
    this strategy's own ``ray-tune: ...`` lines)."""
    return _failure_line(stderr, limit, STRATEGY)


def run_subprocess(
    job_path: str | Path,
    *,
    trials: int | None = None,
    n_jobs: int | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> RayTuneResult:
    """Run :func:`main` in a fresh Python process and read its result back.

    ``process_wall_s`` then counts from just before the process is spawned. Raises
    :class:`RayTuneUnavailable` (its ``line`` the child's) when the child cannot import
    Ray Tune, :class:`RayTuneRunFailed` when it fails otherwise.
    """
    proc, data = run_child("pipetune.bench.ray_tune", job_path, trials=trials,
                           n_jobs=n_jobs, timeout=timeout, env=env)
    if proc.returncode == EXIT_UNAVAILABLE:
        lines = [x for x in proc.stderr.splitlines() if x.startswith(f"{STRATEGY}: ")]
        raise RayTuneUnavailable(lines[-1] if lines else SKIP_LINE)
    if proc.returncode != 0 or data is None:
        raise RayTuneRunFailed(proc.returncode, proc.stderr)
    return RayTuneResult.from_dict(data)


def main(argv: Sequence[str] | None = None, *, imported_at: float | None = None) -> int:
    """``python -m pipetune.bench.ray_tune JOB [--trials N] [--jobs N] [--json OUT]``:
    run the study and print its result as JSON. Exit 2 on a bad job or arguments, 3
    (one line on stderr) when Ray Tune cannot be imported. Without ``--started``,
    ``process_wall_s`` counts from ``imported_at`` (default: this module's import)."""
    args = child_arguments(
        "pipetune.bench.ray_tune", argv=argv,
        description=f"Strategy {STRATEGY}: Ray Tune (OptunaSearch + ASHA) on a pipetune job.")
    started = args.started
    if started is None:
        started = _MODULE_STARTED if imported_at is None else imported_at

    from pipetune.errors import PipetuneError
    from pipetune.spec import load_spec

    try:
        spec = load_spec(args.job)
        result = run_ray_tune(spec, n_jobs=args.jobs, trials=args.trials, started=started)
    except RayTuneUnavailable as e:
        print(e.line, file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (PipetuneError, ValueError) as e:
        print(f"{STRATEGY}: {e}", file=sys.stderr)
        return 2
    print_result(result, args.json_out)
    return 0


__all__ = [
    "EXIT_UNAVAILABLE",
    "INSTALL_HINT",
    "SKIP_LINE",
    "STRATEGY",
    "RayTrialRow",
    "RayTuneResult",
    "RayTuneRunFailed",
    "RayTuneUnavailable",
    "SearchSpace",
    "check_space",
    "failure_line",
    "main",
    "make_scheduler",
    "run_ray_tune",
    "run_subprocess",
    "suggest",
    "train_trial",
    "trial_seed",
    "unavailable",
]


if __name__ == "__main__":
    # Run the importable copy of this module, not ``__main__``: Ray then sends the
    # trainable to its workers by reference (``pipetune.bench.ray_tune.train_trial``).
    from pipetune.bench import ray_tune as _importable

    sys.exit(_importable.main(imported_at=_MODULE_STARTED))
