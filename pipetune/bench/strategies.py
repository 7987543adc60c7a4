"""The bench's strategies as job-spec transformations, and the oracle's plan.

Strategies, all with the job's hyperparameter space, trial budget and seeds:

=================  =====================================================================
``optuna-plain``   the user's alternative: a plain in-process Optuna study of the same
                   workload code (TPE + SuccessiveHalvingPruner from the job's ASHA
                   settings, ``n_jobs`` = cores, one torch thread each), in a fresh
                   process with no Prefect, Dask or MLflow (:mod:`pipetune.bench.optuna_plain`)
``ray-tune``       the other peer: Ray Tune (``Tuner`` + ``OptunaSearch`` TPE +
                   ``ASHAScheduler`` from the job's ASHA settings, one CPU and one torch
                   thread per trial, as many at once as cores) on the same workload code,
                   in a fresh process (:mod:`pipetune.bench.ray_tune`); needs the
                   ``peers`` extra, and is skipped with one line without it
``v1-default``     hyperparameters only; every epoch under the job's default config with
                   all of the machine's cores, one trial at a time (a framework default)
``v1-one-core``    hyperparameters only; one core per trial, as many trials at once as
                   the machine has cores (Ray Tune's default)
``v2``             joint tuning: each knob of ``system.space`` becomes a ``system.<knob>``
                   choice of the hyperparameter space, over :func:`system_axes` (the
                   space's values plus the default's, and for ``cores`` also 1 and all)
``pipetune-cold``  the job as written, PipeTune on, with an empty ground truth
``pipetune-warm``  the same again, with the ground truth the cold run left
``oracle``         the best hyperparameter config found, trained for the full epochs
                   under every system config of the space, one at a time
=================  =====================================================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pipetune.errors import SpecError
from pipetune.space import Choice
from pipetune.spec import SYSTEM_HPARAM_PREFIX, JobSpec
from pipetune.system.config import KNOBS, MachineInfo

#: Tuning strategies in the order the bench runs them (the oracle comes last).
STRATEGIES: tuple[str, ...] = (
    "optuna-plain",
    "optuna-compiled",
    "v1-default",
    "v1-one-core",
    "v2",
    "pipetune-cold",
    "pipetune-warm",
)
#: Strategies that run another tuning library, installed by an optional extra
#: (``pip install 'pipetune[peers]'``); :func:`peer_unavailable` says when one is not.
PEERS: tuple[str, ...] = ("ray-tune",)
ORACLE = "oracle"
#: The strategy the results' ratios are taken against.
REFERENCE = "v1-default"
#: How each strategy uses the ground truth: none, a fresh (empty) one, or the cold run's.
GROUNDTRUTH_USE: dict[str, str] = {
    "optuna-plain": "none",
    "optuna-compiled": "none",
    "ray-tune": "none",
    "v1-default": "none",
    "v1-one-core": "none",
    "v2": "none",
    "pipetune-cold": "fresh",
    "pipetune-warm": "reuse",
}


def system_axes(spec: JobSpec, machine: MachineInfo) -> dict[str, list[Any]]:
    """Per knob of the job's system space, its values with the default's first, plus
    for ``cores`` the two V1 settings (1 and all of the machine's)."""
    axes: dict[str, list[Any]] = {}
    default = spec.system.default.to_dict()
    knobs = [k for k in KNOBS if k in spec.system.space or k == "cores"]
    for knob in knobs:
        values = [default[knob], *spec.system.space.get(knob, [])]
        if knob == "cores":
            values += [1, machine.cores]
        axes[knob] = [v for i, v in enumerate(values)
                      if not any(type(v) is type(w) and v == w for w in values[:i])]
    return axes


def strategy_spec(name: str, base: JobSpec, machine: MachineInfo) -> JobSpec:
    """The job spec strategy ``name`` runs (see the module doc); ``base`` is the
    PipeTune job as written."""
    data = base.to_dict()
    default = data["system"]["default"]
    if name in ("optuna-plain", "optuna-compiled", "ray-tune"):
        data["pipetune"]["enabled"] = False
        data["search"]["max_concurrent"] = machine.cores
        if name == "optuna-compiled":  # an expert's fixed rule: compile every trial
            data["system"]["default"] = {**default, "compile": True}
    elif name == "v1-default":
        data["pipetune"]["enabled"] = False
        data["system"]["default"] = {**default, "cores": machine.cores}
        data["search"]["max_concurrent"] = 1
    elif name == "v1-one-core":
        data["pipetune"]["enabled"] = False
        data["system"]["default"] = {**default, "cores": 1}
        data["search"]["max_concurrent"] = machine.cores
    elif name == "v2":
        data["pipetune"]["enabled"] = False
        for knob, values in system_axes(base, machine).items():
            if knob == "cores" and knob not in base.system.space:
                continue
            data["hyperparameters"][f"{SYSTEM_HPARAM_PREFIX}{knob}"] = (
                Choice(tuple(values)).to_json()
            )
    elif name in ("pipetune-cold", "pipetune-warm"):
        data["pipetune"]["enabled"] = True
    else:
        raise SpecError("strategy", f"unknown strategy {name!r}; allowed: "
                        f"{', '.join(STRATEGIES + PEERS)}")
    return JobSpec.from_dict(data, machine=machine)


def peer_unavailable(name: str) -> str | None:
    """For a strategy of :data:`PEERS` whose library is not installed, the one line
    to print when skipping it; else None. Imports nothing heavy."""
    if name == "ray-tune":
        from pipetune.bench.ray_tune import unavailable

        return unavailable()
    return None


def oracle_spec(base: JobSpec, params: Mapping[str, Any], machine: MachineInfo) -> JobSpec:
    """A grid study training ``params`` (hyperparameters; ``system.*`` entries are
    dropped) under every system config of :func:`system_axes`, each for the full
    ``max_epochs``, one at a time, no early stopping, PipeTune off."""
    data = base.to_dict()
    hp = {k: Choice((v,)).to_json() for k, v in sorted(params.items())
          if not k.startswith(SYSTEM_HPARAM_PREFIX)}
    axes = system_axes(base, machine)
    for knob, values in axes.items():
        hp[f"{SYSTEM_HPARAM_PREFIX}{knob}"] = Choice(tuple(values)).to_json()
    data["hyperparameters"] = hp
    data["pipetune"]["enabled"] = False
    data["search"].update({"algorithm": "grid", "trials": math.prod(map(len, axes.values())),
                           "max_concurrent": 1})
    data["early_stopping"] = {"policy": "none", "min_epochs": 1,
                              "max_epochs": base.early_stopping.max_epochs}
    return JobSpec.from_dict(data, machine=machine)
