"""Strategy ``optuna-plain``: what a user would write instead of pipetune.

A plain, in-process Optuna study of the *same* workload code a pipetune job runs
(:class:`pipetune.spec.JobSpec`): TPE seeded with ``search.seed``, successive halving
configured from the job's ASHA settings (``early_stopping.min_epochs`` ->
``min_resource``, ``reduction_factor`` -> ``reduction_factor``; ``policy: none`` -> no
pruning), ``study.optimize(objective, n_trials=search.trials, n_jobs=<cores>)`` with
every trial training on one torch thread. No Prefect, Dask, MLflow, profiler, system
tuner or checkpoints: the model of a trial lives in its thread for all its epochs.

Each trial builds its workload the way the pipetune epoch runner does
(``resolve_workload(name)(**params)``, ``setup(hparams, seed)`` with the seed formula
of :mod:`pipetune.engine.study`), then per epoch ``train_epoch(system)`` and
``evaluate(system)`` under ``system.default``, ``trial.report(value, epoch)`` and, at
epochs below ``max_epochs`` (ASHA's rungs are strictly below it),
``trial.should_prune()``. System knobs are never tuned: a space holding
``system.<knob>`` entries is a :class:`ValueError`.

Run in a fresh process for an honest whole-process time (imports included)::

    python -m pipetune.bench.optuna_plain JOB.yaml [--trials N] [--jobs N] [--json OUT]
                                             [--started EPOCH_SECONDS]

It prints :meth:`OptunaPlainResult.to_dict` as JSON on stdout. ``JOB`` is read with
:func:`pipetune.spec.load_spec` (YAML or JSON, no extra sections such as ``bench``):
a caller holding a :class:`JobSpec` can write ``spec.to_dict()`` as JSON and pass that.
:func:`pipetune.bench.peer_process.run_subprocess` does all of this and reads the result back.
"""

from __future__ import annotations

import time

#: When this module started importing: ``main`` measures ``process_wall_s`` from here
#: (or from ``--started``), so heavy imports below it are part of the process time.
_MODULE_STARTED = time.time()

import math  # noqa: E402
import sys  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import TYPE_CHECKING, Any, ClassVar  # noqa: E402

from pipetune.bench.peers import (  # noqa: E402
    PeerResult,
    PeerTrialRow,
    child_arguments,
    print_result,
)

if TYPE_CHECKING:
    from pipetune.space import Distribution
    from pipetune.spec import JobSpec

STRATEGY = "optuna-plain"
#: torch intra-op threads per trial (the user's "1 thread x N jobs").
THREADS_PER_TRIAL = 1


@dataclass(frozen=True)
class OptunaTrialRow(PeerTrialRow):
    """One Optuna trial (:class:`~pipetune.bench.peers.PeerTrialRow`)."""


@dataclass(frozen=True)
class OptunaPlainResult(PeerResult):
    """What an ``optuna-plain`` run did (:class:`~pipetune.bench.peers.PeerResult`):
    ``tuning_wall_s`` is ``study.optimize`` alone; ``process_wall_s`` counts from the
    caller's start time (default: when :func:`run_optuna_plain` was called)."""

    row_type: ClassVar[type[PeerTrialRow]] = OptunaTrialRow

    threads_per_trial: int = THREADS_PER_TRIAL
    strategy: str = STRATEGY


# -- the pieces ------------------------------------------------------------------------


def trial_seed(spec: JobSpec, number: int) -> int:
    """The training seed of trial ``number``: the formula of :mod:`pipetune.engine.study`."""
    return spec.search.seed * 100_003 + number


def check_space(spec: JobSpec) -> None:
    """Raise :class:`ValueError` when the space holds ``system.<knob>`` entries:
    optuna-plain tunes hyperparameters only, under ``system.default``."""
    from pipetune.spec import SYSTEM_HPARAM_PREFIX

    knobs = [n for n in spec.hyperparameters if n.startswith(SYSTEM_HPARAM_PREFIX)]
    if knobs:
        raise ValueError(
            f"{STRATEGY} tunes hyperparameters only, never system knobs; job "
            f"{spec.name!r} has {', '.join(knobs)} in its hyperparameter space "
            "(remove them: every epoch runs under system.default)"
        )


def suggest(trial: Any, name: str, dist: Distribution) -> Any:
    """``dist`` (a :mod:`pipetune.space` distribution) drawn with the matching
    ``trial.suggest_*``."""
    from pipetune.space import Choice, IntUniform, LogUniform, Uniform

    if isinstance(dist, Choice):
        return trial.suggest_categorical(name, list(dist.values))
    if isinstance(dist, LogUniform):
        return trial.suggest_float(name, float(dist.low), float(dist.high), log=True)
    if isinstance(dist, Uniform):
        return trial.suggest_float(name, float(dist.low), float(dist.high))
    if isinstance(dist, IntUniform):
        return trial.suggest_int(name, dist.low, dist.high, log=dist.log)
    raise TypeError(f"hyperparameter {name!r}: no Optuna equivalent for {dist!r}")


def suggest_params(trial: Any, space: Mapping[str, Distribution]) -> dict[str, Any]:
    """One value per hyperparameter of ``space``, in its order."""
    return {name: suggest(trial, name, dist) for name, dist in space.items()}


def make_pruner(spec: JobSpec) -> Any:
    """Successive halving from the job's ASHA settings, or no pruning for ``none``."""
    import optuna

    es = spec.early_stopping
    if es.policy == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.SuccessiveHalvingPruner(
        min_resource=es.min_epochs,
        reduction_factor=es.reduction_factor,
        min_early_stopping_rate=0,
    )


def make_objective(spec: JobSpec) -> Any:
    """The Optuna objective: one trial of ``spec``'s workload, up to ``max_epochs``
    epochs, pruned by the study's pruner. Records ``epochs`` and ``seed`` as user
    attributes of the trial (kept for pruned and failed trials too)."""
    import optuna
    import torch

    from pipetune.system.apply import applied_context
    from pipetune.workloads import resolve_workload

    workload_cls = resolve_workload(spec.workload.name)
    # Threads are set per trial below (not by applied_system_config, which changes them
    # for the whole process); the rest of the config reaches the workload as a context.
    system = applied_context(spec.system.default)
    metric = spec.objective.metric
    max_epochs = spec.early_stopping.max_epochs

    def objective(trial: optuna.Trial) -> float:
        # Optuna runs n_jobs trials in threads of one process; each trains on one thread.
        torch.set_num_threads(THREADS_PER_TRIAL)
        params = suggest_params(trial, spec.hyperparameters)
        seed = trial_seed(spec, trial.number)
        trial.set_user_attr("seed", seed)
        trial.set_user_attr("epochs", 0)
        workload = workload_cls(**spec.workload.params)
        workload.setup(params, seed)
        value = float("nan")
        for epoch in range(1, max_epochs + 1):
            workload.train_epoch(system, on_step=None)
            metrics = workload.evaluate(system)
            value = float(metrics[metric])
            trial.set_user_attr("epochs", epoch)
            if not math.isfinite(value):
                return value  # Optuna records a non-finite value as a failed trial
            trial.report(value, epoch)
            # ASHA's rungs lie strictly below max_epochs: a trial that reached the last
            # epoch has done all its work, and completes.
            if epoch < max_epochs and trial.should_prune():
                raise optuna.TrialPruned(f"pruned after epoch {epoch}: {metric}={value:g}")
        return value

    return objective


def _row(trial: Any) -> OptunaTrialRow:
    value: float | None = None
    if trial.value is not None:
        value = float(trial.value)
    elif trial.intermediate_values:
        value = float(trial.intermediate_values[max(trial.intermediate_values)])
    if value is not None and not math.isfinite(value):
        value = None
    duration = trial.duration.total_seconds() if trial.duration is not None else None
    return OptunaTrialRow(
        number=trial.number,
        params=dict(trial.params),
        epochs=int(trial.user_attrs.get("epochs", 0)),
        value=value,
        state=trial.state.name,
        seed=int(trial.user_attrs.get("seed", -1)),
        duration_s=duration,
        error=trial.user_attrs.get("error"),
    )


# -- the run ---------------------------------------------------------------------------


def run_optuna_plain(
    spec: JobSpec,
    *,
    n_jobs: int | None = None,
    trials: int | None = None,
    started: float | None = None,
    cores: int | None = None,
) -> OptunaPlainResult:
    """Tune ``spec``'s hyperparameters with a plain in-process Optuna study.

    ``trials`` defaults to ``search.trials``; ``cores`` to ``MachineInfo.detect().cores``;
    ``n_jobs`` (trials at once, threads) to ``cores``. ``started`` is a
    :func:`time.time` stamp that ``process_wall_s`` counts from (default: now). A trial
    that raises is recorded as ``FAIL`` and the study goes on.
    """
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

    import optuna

    sampler = optuna.samplers.TPESampler(seed=spec.search.seed)
    pruner = make_pruner(spec)
    direction = "maximize" if spec.objective.mode == "max" else "minimize"
    study = optuna.create_study(direction=direction, sampler=sampler, pruner=pruner)
    objective = make_objective(spec)

    def recorded(trial: optuna.Trial) -> float:
        try:
            return objective(trial)
        except optuna.TrialPruned:
            raise
        except Exception as e:  # noqa: BLE001 - recorded, then re-raised for Optuna
            trial.set_user_attr("error", f"{type(e).__name__}: {e}")
            raise

    t0 = time.perf_counter()
    study.optimize(recorded, n_trials=trials, n_jobs=n_jobs, catch=(Exception,))
    tuning_wall_s = time.perf_counter() - t0

    return _result(spec, study, tuning_wall_s, started, cores, n_jobs)


def _result(spec: JobSpec, study: Any, tuning_wall_s: float, started: float, cores: int,
            n_jobs: int) -> OptunaPlainResult:
    """What a finished Optuna ``study`` of ``spec`` ran and found."""
    import optuna

    rows = [_row(t) for t in sorted(study.trials, key=lambda t: t.number)]
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = study.best_trial if complete else None
    es = spec.early_stopping
    pruner_text = (
        "none"
        if es.policy == "none"
        else f"SuccessiveHalving(min_resource={es.min_epochs}, "
        f"reduction_factor={es.reduction_factor})"
    )
    return OptunaPlainResult.of_rows(
        spec, rows, tuning_wall_s=tuning_wall_s, started=started, cores=cores,
        n_jobs=n_jobs, sampler=f"TPE(seed={spec.search.seed})", pruner=pruner_text,
        best=None if best is None else next(r for r in rows if r.number == best.number))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipetune.bench.optuna_plain JOB [--trials N] [--jobs N] [--json OUT]``:
    run the study and print its result as JSON. Exit 2 on a bad job or arguments."""
    args = child_arguments(
        "pipetune.bench.optuna_plain", argv=argv,
        description=f"Strategy {STRATEGY}: a plain in-process Optuna study of a pipetune job.")
    started = _MODULE_STARTED if args.started is None else args.started

    from pipetune.errors import PipetuneError
    from pipetune.spec import load_spec

    try:
        spec = load_spec(args.job)
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        result = run_optuna_plain(spec, n_jobs=args.jobs, trials=args.trials, started=started)
    except (PipetuneError, ValueError) as e:
        print(f"{STRATEGY}: {e}", file=sys.stderr)
        return 2
    print_result(result, args.json_out)
    return 0


__all__ = [
    "STRATEGY",
    "OptunaPlainResult",
    "OptunaTrialRow",
    "check_space",
    "main",
    "make_objective",
    "make_pruner",
    "run_optuna_plain",
    "suggest",
    "suggest_params",
    "trial_seed",
]


if __name__ == "__main__":
    sys.exit(main())
